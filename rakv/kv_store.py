"""KV prefix store: the torch tensors behind a ``PrefixIndex``.

Each model (by fingerprint) is its own namespace. An entry holds, for a token sequence:
the KV of every position, per layer, and the next-token logits at some prefix lengths
(the prompt's end and the sequence's end), so that an exact repeat runs no prefill.

Invariants:
- Every tensor an entry holds is counted in its bytes, and no entry tensor is a view
  into a larger storage (that storage would be held but not counted).
- Entries are never mutated and never aliased by a working cache: ``restore`` copies.
- A new entry that extends a stored one replaces it (keeping its logits), so a
  conversation's turns are held once, not once per turn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from rakv.prefix_index import Entry, PrefixIndex, prefix_digest

DEFAULT_BUDGET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class StoredKV:
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (K, V): [1, kv_heads, T, head_dim]
    logits_by_len: tuple[tuple[int, torch.Tensor], ...]  # (prefix length n, logits [vocab] after n tokens)

    def logits_at(self, num_tokens: int) -> torch.Tensor | None:
        return next((lg for n, lg in self.logits_by_len if n == num_tokens), None)


@dataclass(frozen=True)
class StoreHit:
    entry: Entry
    num_tokens: int  # exact common prefix with the query

    @property
    def payload(self) -> StoredKV:
        return self.entry.payload


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


class KVStore:
    """Byte-budgeted LRU store of KV prefixes for any number of models."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 digest: Callable[[np.ndarray], bytes] = prefix_digest):
        self.index = PrefixIndex(budget_bytes, digest)
        self.clone_s = 0.0  # cumulative seconds spent copying tensors in and out

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def budget_bytes(self) -> int:
        return self.index.budget_bytes

    def lookup(self, fingerprint: str, token_ids: list[int], touch: bool = False) -> StoreHit | None:
        hit = self.index.lookup(fingerprint, token_ids, touch=touch)
        return None if hit is None else StoreHit(hit.entry, hit.num_tokens)

    def touch(self, hit: StoreHit) -> None:
        self.index.touch(hit.entry)

    def restore(self, hit: StoreHit, num_positions: int) -> DynamicCache:
        """A fresh cache holding copies of the entry's first ``num_positions`` positions."""
        if not 0 < num_positions <= hit.num_tokens:
            raise ValueError(f"cannot restore {num_positions} positions from a {hit.num_tokens}-token hit")
        start = time.perf_counter()
        cache = DynamicCache(ddp_cache_data=[  # DynamicLayer.update concatenates: a copy
            (k[:, :, :num_positions], v[:, :, :num_positions]) for k, v in hit.payload.layers])
        self.clone_s += time.perf_counter() - start
        self.touch(hit)
        return cache

    def insert(self, fingerprint: str, token_ids: list[int], cache: DynamicCache,
               logits_by_len: dict[int, torch.Tensor]) -> bool:
        """Store the first len(token_ids) positions of ``cache``. Returns False if the entry
        alone exceeds the budget. The caller must not use ``cache`` afterwards."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = len(tokens)
        if num == 0 or cache.get_seq_length() < num:
            raise ValueError(f"cache holds {cache.get_seq_length()} positions, cannot store {num}")
        logits = dict(logits_by_len)
        existing = self.lookup(fingerprint, tokens)
        if existing is not None and existing.num_tokens == num and existing.entry.num_tokens >= num:
            # Already held inside a stored sequence: only new logits can be worth adding.
            old = existing.payload
            if all(old.logits_at(n) is not None for n in logits):
                self.index.touch(existing.entry)
                return True
            logits = {**logits, **dict(old.logits_by_len)}
            tokens, layers = existing.entry.token_ids, old.layers
            self.index.remove(existing.entry)
        else:
            start = time.perf_counter()
            layers = tuple((owned(layer.keys[:, :, :num]), owned(layer.values[:, :, :num]))
                           for layer in cache.layers)
            self.clone_s += time.perf_counter() - start
            if existing is not None and existing.num_tokens == existing.entry.num_tokens:
                # The new sequence extends a stored one: take its logits and replace it.
                logits = {**dict(existing.payload.logits_by_len), **logits}
                self.index.remove(existing.entry)
        kv = StoredKV(layers, tuple(sorted((n, owned(lg.detach())) for n, lg in logits.items())))
        return self.index.insert(fingerprint, tokens, stored_bytes(tokens, kv), kv) is not None
