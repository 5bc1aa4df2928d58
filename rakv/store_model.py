"""The prefix store's rules over token ids and byte sizes alone. Imports no torch.

The engine's tensor store (``rakv.kv_store.KVStore``) asks this model what to reuse, what
to keep and what to evict, and only moves tensors; the simulator runs the same model fed
token ids and sizes. So a replay sees the hits, reuses, evictions and bytes the engine saw.

Rules, per model namespace (one per model fingerprint):
- **Hits.** A prompt of n tokens matches the stored entry with the longest exact common
  prefix q (``PrefixIndex``). An exact repeat (q = n and logits stored after exactly n
  tokens) reuses all n positions and runs no prefill; otherwise min(q, n - 1) positions
  are reused (``reused_positions``). Hit kinds: ``exact``, ``partial`` (some positions
  reused), ``miss``. The draft model reuses min(q, n) positions: it computes no logits
  from the prompt, so it needs no boundary token. Reusing touches the entry (LRU).
- **What is kept.** Mode ``full`` keeps the sequence minus its last token (whose KV was
  never computed), so a conversation's next turn hits it; ``prompt`` keeps the prompt
  only (the paper's behaviour); ``off`` keeps nothing. The target keeps logits after the
  prompt and after the kept sequence; the draft keeps the positions its cache holds
  (``rakv.rounds.draft_cache_positions``), at most the target's.
- **When.** At a request's finish; and, under batching (``keep_prompt``, with
  ``StoreConfig.early_prompts``), its target's prompt and the logits after it as soon as
  its prefill ends, so a request arriving while it runs hits it as a finished one would
  (vLLM's prefix caching shares a prompt's blocks once they are computed). Its finish
  then extends that entry (a ``new`` entry replacing it) or touches it.
- **Inserts.** A sequence already held inside a stored one with every logits row it
  brings is only touched; one held inside a stored one that lacks some of those rows
  replaces it with the stored tokens and KV plus the merged rows (``merge``); a new
  sequence that extends a stored one replaces it, taking over its rows (``new``).
- **Bytes.** An entry of T tokens with L logits rows holds
  T x (8 + KV bytes per token) + L x logits-row bytes (``entry_bytes``); the budget and
  LRU eviction are the index's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from rakv.prefix_index import Entry, PrefixIndex, as_token_array, prefix_digest
from rakv.rounds import draft_cache_positions
from rakv.sequence_index import SequenceIndex

DEFAULT_BUDGET_BYTES = 512 * 2**20
STORE_MODES = ("full", "prompt", "off")
TOKEN_ID_BYTES = 8  # token ids are kept as int64
HIT_KINDS = ("miss", "partial", "exact")


@dataclass(frozen=True)
class StoreConfig:
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    mode: str = "full"  # full: prompt and output; prompt: the paper's; off: store nothing
    # The batching engine keeps a request's prompt when its prefill ends, not only at its
    # finish: kept only at the finish, a repeat arriving while it ran missed and prefilled
    # it again, seconds of steps under load (Qwen code replayed at 0.6 req/s, 400 requests
    # over 16 prompts: rakv prefilled 32 of them, kv-only 22). Batch 1 has nothing
    # beside a request to hit it, and keeps at the finish alone. Off: as engines before it.
    early_prompts: bool = field(default=True, metadata={"before": False})

    def __post_init__(self):
        if self.budget_bytes <= 0:
            raise ValueError(f"store budget must be positive, got {self.budget_bytes} bytes")
        if self.mode not in STORE_MODES:
            raise ValueError(f"store mode must be one of {', '.join(STORE_MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class ModelSizes:
    """What one model's entries hold per stored position and per stored logits row."""

    kv_bytes_per_token: int  # K and V of every layer
    logits_bytes: int  # one row of next-token logits


def entry_bytes(num_tokens: int, num_logits: int, sizes: ModelSizes) -> int:
    return num_tokens * (TOKEN_ID_BYTES + sizes.kv_bytes_per_token) + num_logits * sizes.logits_bytes


def reused_positions(num_prompt_tokens: int, hit_tokens: int, has_logits: bool) -> int:
    """Target KV positions taken from a stored entry whose exact common prefix with the
    prompt is ``hit_tokens`` long.

    An exact repeat (the whole prompt stored together with its next-token logits) reuses
    every position and runs no prefill. Otherwise at least one prompt token must be fed to
    get fresh logits, so at most n - 1 positions are reused: a hit covering the whole
    prompt without stored logits recomputes the boundary token; a shorter hit q reuses all
    q positions, since the KV of a position depends only on the tokens up to it.
    """
    if hit_tokens >= num_prompt_tokens and has_logits:
        return num_prompt_tokens
    reused = min(hit_tokens, num_prompt_tokens - 1)
    return reused if reused >= 1 else 0


@dataclass
class Stored:
    """What the index holds per entry: the logits rows' prefix lengths (sorted) and the
    tensors behind them (``KVStore``'s; None in a replay)."""

    logits_lengths: tuple[int, ...]
    tensors: object = None


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class PrefixMatch:
    """A prompt's longest stored prefix in one namespace (not yet touched)."""

    entry: Entry | None
    num_prompt_tokens: int
    hit_tokens: int  # exact common prefix, 0 on a miss
    has_logits: bool  # the entry holds logits after exactly the whole prompt

    @property
    def exact_repeat(self) -> bool:
        return self.has_logits


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class Reuse:
    reused_tokens: int
    hit_kind: str  # one of HIT_KINDS


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class InsertPlan:
    """What an insert does (see the module docstring): ``touch`` the held entry ``base``;
    ``merge`` into ``base`` (its tokens and KV, the merged logits rows); or a ``new`` entry
    of the inserted tokens, replacing ``base`` (the stored sequence it extends) if any."""

    kind: str
    namespace: str
    base: Entry | None
    token_ids: np.ndarray  # [T] the entry's tokens
    logits_lengths: tuple[int, ...]  # every row the entry will hold, sorted
    num_bytes: int


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class StoreOutcome:
    """What one request did to the store."""

    reuse: Reuse
    draft_reused_tokens: int
    kept_tokens: int  # target positions handed to the store (0: nothing kept)
    kept_draft_tokens: int


class StoreModel:
    """Budgeted LRU prefix store of any number of models, over token ids and sizes."""

    def __init__(self, config: StoreConfig = StoreConfig(),
                 digest: Callable[[np.ndarray], bytes] = prefix_digest):
        self.config = config
        self.index = PrefixIndex(config.budget_bytes, digest)
        self._sequences: dict[tuple[str, int], SequenceIndex] = {}

    def sequences(self, namespace: str, key_tokens: int) -> SequenceIndex:
        """The namespace's stored sequences, filed for the store drafter
        (``rakv.suffix_drafter``). Built on first use from the entries held, in insertion
        order (``SequenceIndex.holding``), then kept by the index's every change."""
        key = (namespace, key_tokens)
        found = self._sequences.get(key)
        if found is None:
            found = self._sequences[key] = SequenceIndex.holding(namespace, key_tokens, self.index.entries())
            self.index.listeners.append(found)
        return found

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def num_evictions(self) -> int:
        return self.index.num_evictions

    # -- a request's hits --------------------------------------------------------
    def match(self, namespace: str | None, prompt_ids: np.ndarray) -> PrefixMatch:
        """The longest stored prefix of the prompt (``namespace`` None: no such model)."""
        n = len(prompt_ids)
        hit = None if namespace is None else self.index.lookup(namespace, prompt_ids, touch=False)
        if hit is None:
            return PrefixMatch(None, n, 0, False)
        has_logits = hit.num_tokens == n and n in hit.entry.payload.logits_lengths
        return PrefixMatch(hit.entry, n, hit.num_tokens, has_logits)

    def start(self, target: PrefixMatch, draft: PrefixMatch | None, r: int) -> tuple[Reuse, int]:
        """What a request reuses under r: the target's positions and hit kind, then the
        draft's positions (``draft`` None: the request did not ready the draft model).
        Each entry reused is touched, the target's first."""
        reuse, draft_reused = self.reuse_of(target, draft, r)
        if reuse.reused_tokens:
            self.index.touch(target.entry)
        if draft_reused:
            self.index.touch(draft.entry)
        return reuse, draft_reused

    @staticmethod
    def reuse_of(target: PrefixMatch, draft: PrefixMatch | None, r: int) -> tuple[Reuse, int]:
        """``start``'s answer, touching nothing."""
        n = target.num_prompt_tokens
        reuse = Reuse(0, "miss")
        if r and target.entry is not None:
            reused = reused_positions(n, target.hit_tokens, target.has_logits)
            reuse = Reuse(reused, "exact" if reused == n else "partial" if reused else "miss")
        # the draft computes no logits from the prompt, so it needs no boundary token
        draft_reused = min(draft.hit_tokens, n) if r and draft is not None and draft.entry is not None else 0
        return reuse, draft_reused

    # -- what a request leaves ---------------------------------------------------
    def keeps_prompts_early(self) -> bool:
        """Whether a batched request's prompt is kept when its prefill ends (``keep_prompt``)."""
        return self.config.early_prompts and self.config.mode != "off"

    def keep_prompt(self, prompt_ids: Sequence[int], target: tuple[str, ModelSizes]) -> None:
        """A batched request's prompt, kept as the engine keeps it when its prefill ends
        (``BatchEngine``, without tensors): the target's positions and the logits after
        them; ``target`` is (namespace, sizes). Only where ``keeps_prompts_early``."""
        self.commit(self.plan_insert(target[0], prompt_ids, (len(prompt_ids),), target[1]))

    def kept_lengths(self, num_prompt: int, num_seq: int, draft_reused: int | None,
                     rounds: Sequence) -> tuple[int, int]:
        """(target, draft) positions kept of a finished sequence of ``num_seq`` tokens; 0:
        none. ``draft_reused`` None: the request did not ready the draft model."""
        if self.config.mode == "off":
            return 0, 0
        kept = num_seq - 1 if self.config.mode == "full" else num_prompt
        if draft_reused is None:
            return kept, 0
        return kept, min(draft_cache_positions(num_prompt, draft_reused, rounds, num_seq - num_prompt), kept)

    @staticmethod
    def kept_logits(num_prompt: int, num_seq: int, kept: int) -> tuple[int, ...]:
        """The target's logits rows kept: after the prompt and after the kept sequence's
        last computed position, those within the kept positions."""
        return tuple(sorted({n for n in (num_prompt, num_seq - 1) if n <= kept}))

    def plan_insert(self, namespace: str, token_ids: Sequence[int] | np.ndarray,
                    logits_lengths: Sequence[int], sizes: ModelSizes) -> InsertPlan:
        tokens = as_token_array(token_ids)
        num = len(tokens)
        lengths = set(logits_lengths)
        hit = self.index.lookup(namespace, tokens, touch=False)
        if hit is not None and hit.num_tokens == num:  # held inside a stored sequence
            held = hit.entry.payload.logits_lengths
            if lengths <= set(held):
                return InsertPlan("touch", namespace, hit.entry, hit.entry.token_ids, held, hit.entry.num_bytes)
            merged = tuple(sorted(lengths | set(held)))
            return InsertPlan("merge", namespace, hit.entry, hit.entry.token_ids, merged,
                              entry_bytes(hit.entry.num_tokens, len(merged), sizes))
        base = None
        if hit is not None and hit.num_tokens == hit.entry.num_tokens:  # extends a stored one
            base = hit.entry
            lengths |= set(base.payload.logits_lengths)
        merged = tuple(sorted(lengths))
        return InsertPlan("new", namespace, base, tokens, merged, entry_bytes(num, len(merged), sizes))

    def commit(self, plan: InsertPlan, tensors: object = None) -> bool:
        """Carry out ``plan``; False when the entry alone exceeds the budget (then the entry
        it replaces is gone too, as its tensors were handed over)."""
        if plan.kind == "touch":
            self.index.touch(plan.base)
            return True
        if plan.base is not None:
            self.index.remove(plan.base)
        return self.index.insert(plan.namespace, plan.token_ids, plan.num_bytes,
                                 Stored(plan.logits_lengths, tensors)) is not None

    def preview(self, seq: Sequence[int], num_prompt: int, target: PrefixMatch, draft: PrefixMatch | None,
                r: int, rounds: Sequence) -> StoreOutcome:
        """What ``serve`` would reuse and keep, changing nothing."""
        reuse, draft_reused = self.reuse_of(target, draft, r)
        kept, kept_draft = self.kept_lengths(num_prompt, len(seq), None if draft is None else draft_reused, rounds)
        return StoreOutcome(reuse, draft_reused, kept, kept_draft)

    # -- a whole request, as the engine runs it, without tensors ------------------
    def serve(self, seq: Sequence[int], num_prompt: int, target: tuple[str, PrefixMatch, ModelSizes],
              draft: tuple[str, PrefixMatch, ModelSizes] | None, r: int, rounds: Sequence) -> StoreOutcome:
        """One request's effect on the store, in the engine's order: ``start``, decode
        (``rounds``), then insert the target's entry and the draft's. ``seq`` is prompt +
        output; each side is (namespace, its match, its sizes); ``draft`` is None unless
        the request readied the draft model."""
        reuse, draft_reused = self.start(target[1], None if draft is None else draft[1], r)
        kept, kept_draft = self.keep(seq, num_prompt, (target[0], target[2]),
                                     None if draft is None else (draft[0], draft[2]),
                                     None if draft is None else draft_reused, rounds)
        return StoreOutcome(reuse, draft_reused, kept, kept_draft)

    def keep(self, seq: Sequence[int], num_prompt: int, target: tuple[str, ModelSizes],
             draft: tuple[str, ModelSizes] | None, draft_reused: int | None, rounds: Sequence) -> tuple[int, int]:
        """What a finished request leaves, inserted as the engine inserts it (``Engine._store``,
        without tensors): its target's kept positions and logits, then its draft's; each side
        (namespace, sizes), ``draft`` and ``draft_reused`` None where it did not ready the
        draft model. Returns the (target, draft) positions kept."""
        kept, kept_draft = self.kept_lengths(num_prompt, len(seq), draft_reused, rounds)
        if kept:
            logits = self.kept_logits(num_prompt, len(seq), kept)
            self.commit(self.plan_insert(target[0], seq[:kept], logits, target[1]))
        if kept_draft:
            self.commit(self.plan_insert(draft[0], seq[:kept_draft], (), draft[1]))
        return kept, kept_draft
