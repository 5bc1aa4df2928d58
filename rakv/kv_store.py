"""KV prefix store: the torch tensors behind a ``StoreModel``.

The store model (``rakv.store_model``, torch-free) decides every hit, reuse, insert and
eviction over token ids and byte sizes; this class only copies tensors in and out as it
says. An entry's tensors: the KV of every position, per layer, and the next-token logits
at the prefix lengths the model keeps (the prompt's end and the sequence's end), so that
an exact repeat runs no prefill.

Invariants:
- An entry's tensors take exactly the bytes the model counts for it (checked on every
  insert), and no entry tensor is a view into a larger storage (that storage would be
  held but not counted).
- Entries are never mutated and never aliased by a working cache: ``restore`` copies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from rakv.decoding import forward
from rakv.kv_cache import GrowingCache
from rakv.prefix_index import Entry, prefix_digest
from rakv.store_model import ModelSizes, PrefixMatch, StoreConfig, StoreModel


@dataclass(frozen=True)
class StoredKV:
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (K, V): [1, kv_heads, T, head_dim]
    logits_by_len: tuple[tuple[int, torch.Tensor], ...]  # (prefix length n, logits [vocab] after n tokens)

    def logits_at(self, num_tokens: int) -> torch.Tensor | None:
        return next((lg for n, lg in self.logits_by_len if n == num_tokens), None)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns its whole storage, else a compact copy."""
    if t.untyped_storage().nbytes() == tensor_bytes(t) and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def stored_bytes(token_ids: np.ndarray, kv: StoredKV) -> int:
    total = token_ids.nbytes
    total += sum(tensor_bytes(k) + tensor_bytes(v) for k, v in kv.layers)
    total += sum(tensor_bytes(lg) for _, lg in kv.logits_by_len)
    return total


def model_sizes(cache: DynamicCache, logits: torch.Tensor | None) -> ModelSizes:
    """A model's ``ModelSizes`` from a cache it filled and one row of its logits [vocab]."""
    kv_bytes = sum(tensor_bytes(layer.keys) + tensor_bytes(layer.values) for layer in cache.layers)
    return ModelSizes(kv_bytes // cache.get_seq_length(), 0 if logits is None else tensor_bytes(logits))


def measure_sizes(model) -> ModelSizes:
    """A model's ``ModelSizes``, from a one-token forward."""
    cache = GrowingCache()
    return model_sizes(cache, forward(model, cache, [0])[0])


def tensors_of(entry: Entry) -> StoredKV:
    return entry.payload.tensors


class KVStore:
    """Byte-budgeted LRU store of KV prefixes for any number of models."""

    def __init__(self, config: StoreConfig = StoreConfig(),
                 digest: Callable[[np.ndarray], bytes] = prefix_digest):
        self.model = StoreModel(config, digest)
        self.clone_s = 0.0  # cumulative seconds spent copying tensors in and out

    @property
    def index(self):
        return self.model.index

    @property
    def total_bytes(self) -> int:
        return self.model.total_bytes

    @property
    def budget_bytes(self) -> int:
        return self.model.index.budget_bytes

    def stored_logits(self, match: PrefixMatch) -> torch.Tensor | None:
        """The logits after the whole prompt, held by an exact repeat's entry."""
        return tensors_of(match.entry).logits_at(match.num_prompt_tokens) if match.has_logits else None

    def restore(self, entry: Entry, num_positions: int) -> DynamicCache:
        """A fresh cache holding copies of the entry's first ``num_positions`` positions
        (``StoreModel.start`` decided them, and touched the entry)."""
        if not 0 < num_positions <= entry.num_tokens:
            raise ValueError(f"cannot restore {num_positions} positions from a {entry.num_tokens}-token entry")
        start = time.perf_counter()
        cache = GrowingCache([  # copied into the cache's own buffers
            (k[:, :, :num_positions], v[:, :, :num_positions]) for k, v in tensors_of(entry).layers])
        self.clone_s += time.perf_counter() - start
        return cache

    def insert(self, namespace: str, token_ids: list[int], cache: DynamicCache,
               logits_by_len: dict[int, torch.Tensor], in_use: bool = False) -> bool:
        """Store the first len(token_ids) positions of ``cache`` with the given logits rows,
        as the store model plans it. Returns False if the entry alone exceeds the budget.
        The caller must not use ``cache`` afterwards, unless ``in_use``: then the entry
        copies its positions (a running request's prompt, ``StoreModel.keep_prompt``)."""
        num = len(token_ids)
        if num == 0 or cache.get_seq_length() < num:
            raise ValueError(f"cache holds {cache.get_seq_length()} positions, cannot store {num}")
        sizes = model_sizes(cache, next(iter(logits_by_len.values()), None))
        plan = self.model.plan_insert(namespace, token_ids, tuple(logits_by_len), sizes)
        if plan.kind == "touch":
            return self.model.commit(plan)
        base = tensors_of(plan.base) if plan.base is not None else None
        if plan.kind == "merge":
            layers = base.layers
        else:
            start = time.perf_counter()
            own = (lambda t: t.clone(memory_format=torch.contiguous_format)) if in_use else owned
            layers = tuple((own(layer.keys[:, :, :num]), own(layer.values[:, :, :num])) for layer in cache.layers)
            self.clone_s += time.perf_counter() - start
        logits = tuple((n, owned(logits_by_len[n].detach()) if n in logits_by_len else base.logits_at(n))
                       for n in plan.logits_lengths)
        kv = StoredKV(layers, logits)
        if stored_bytes(plan.token_ids, kv) != plan.num_bytes:
            raise AssertionError(f"store model counts {plan.num_bytes} bytes, the tensors take "
                                 f"{stored_bytes(plan.token_ids, kv)}")
        return self.model.commit(plan, kv)
