"""Drafters: what proposes the tokens a speculation round verifies.

- ``draft``: a draft model, greedy, with its own KV cache (stored and reused like the
  target's).
- ``ngram``: prompt lookup. The longest recent n-gram of the sequence (prompt and output
  so far) is searched for at its most recent earlier occurrence; the tokens that
  followed it are proposed. No model, microseconds per round.
- ``suffix``: the store drafter (``rakv.suffix_drafter``): the longest match among the
  sequences the prefix store holds and the request's own, with its continuation's
  frequency. No model, microseconds per round; its proposals also depend on what the
  store holds when they are made.

Both are deterministic functions of the true prefix, so each has run lengths: m_t, the
number of leading proposed tokens at output position t that equal the target's output,
and a round starting at t with draft length k accepts exactly min(k, m_t). For ``ngram``
the proposal can be shorter than k, or empty (no earlier occurrence): ``proposal_lengths``
records its length at each position, and a round with an empty proposal is one plain
target step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

DRAFT_MODEL = "draft"
NGRAM = "ngram"
SUFFIX = "suffix"
DRAFTERS = (DRAFT_MODEL, NGRAM, SUFFIX)
MODEL_FREE = (NGRAM, SUFFIX)  # drafters that cost a lookup, not a model: shadowed, and priced as a verification


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3  # longest suffix n-gram searched first
    min_ngram: int = 1  # shortest one tried before giving up

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


# Per-token acceptance of prompt lookup after an n-gram match of each length, before a
# request has shown its own: the first proposed token's agreement with the greedy output
# on the shipped traces (SmolLM2 HumanEval and ShareGPT: 0.19-0.23, 0.53-0.59, 0.85;
# Qwen2.5-Coder-1.5B HumanEval: 0.20, 0.44, 0.69). Longer matches count as 3.
NGRAM_PRIOR_BY_ORDER = {1: 0.2, 2: 0.5, 3: 0.75}


def ngram_prior(order: int) -> float:
    """Starting acceptance estimate after a match of ``order`` tokens (0: no proposal)."""
    return NGRAM_PRIOR_BY_ORDER[min(order, 3)] if order > 0 else 0.0


def ngram_propose(seq: Sequence[int] | np.ndarray, k: int, config: NgramConfig = NgramConfig()) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's
    longest matching suffix n-gram (n from max_ngram down to min_ngram); [] if none."""
    return ngram_match(seq, k, config)[0]


def ngram_match(seq: Sequence[int] | np.ndarray, k: int, config: NgramConfig = NgramConfig()) -> tuple[list[int], int]:
    """(``ngram_propose``'s proposal, the length n of the n-gram it matched; 0 if none).
    A longer match is a far better guess (``NGRAM_PRIOR_BY_ORDER``)."""
    return ngram_lookup(seq, k, config)[:2]


MAX_EXTENT = 64  # a match extended backwards is counted up to this many tokens


def ngram_lookup(seq: Sequence[int] | np.ndarray, k: int,
                 config: NgramConfig = NgramConfig()) -> tuple[list[int], int, int]:
    """``ngram_match``'s (proposal, n), and the match extended backwards: how many tokens
    before the proposal's start equal those at the sequence's end (n at least, at most
    ``MAX_EXTENT``; 0 if no match). A match that extends far is a copy in progress."""
    tokens = np.asarray(seq, dtype=np.int64)
    length = len(tokens)
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        # candidate starts i in [0, length - n - 1]: the n-gram at i has a continuation
        num_starts = length - n
        match = tokens[:num_starts] == tokens[length - n]
        for j in range(1, n):
            match &= tokens[j:num_starts + j] == tokens[length - n + j]
        starts = np.flatnonzero(match)
        if starts.size:
            begin = int(starts[-1]) + n
            reach = min(begin, MAX_EXTENT)
            before, end = tokens[begin - reach:begin][::-1], tokens[length - reach:][::-1]
            differ = np.flatnonzero(before != end)
            return tokens[begin:begin + k].tolist(), n, int(differ[0]) if differ.size else reach
    return [], 0, 0


class Drafter(Protocol):
    name: str

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """At most k tokens to follow ``seq`` (the true sequence so far)."""

    def signal(self, seq: Sequence[int]) -> int:
        """What the drafter knows of its next proposal's quality before making it (ngram:
        the matched n-gram length, 0 when it has no proposal; a draft model: always 0)."""

    def rollback(self, num_valid: int) -> None:
        """Only the first ``num_valid`` tokens of the last proposal's context stand."""


@dataclass
class NgramDrafter:
    """Prompt lookup over one request's sequence. The sequence only grows, so the match
    at a given length is computed once, however many times it is asked for."""

    config: NgramConfig = NgramConfig()
    name: str = NGRAM
    max_k: int = 8  # proposal length computed per match (the engine's longest round); a longer k recomputes
    _memo: tuple[int, list[int], int, int] = field(default=(-1, [], 0, 0), init=False, repr=False)
    # (length, proposal, n, extent)

    def match(self, seq: Sequence[int], k: int) -> tuple[list[int], int]:
        if self._memo[0] != len(seq) or k > self.max_k:
            self._memo = (len(seq), *ngram_lookup(seq, max(k, self.max_k), self.config))
        return self._memo[1][:k], self._memo[2]

    def extent(self, seq: Sequence[int]) -> int:
        """The match extended backwards (``ngram_lookup``)."""
        self.match(seq, self.max_k)
        return self._memo[3]

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        return self.match(seq, k)[0]

    def signal(self, seq: Sequence[int]) -> int:
        return self.match(seq, self.max_k)[1]

    def rollback(self, num_valid: int) -> None:
        pass  # the true sequence of a given length never changes, so the memo stays valid


def matching_prefix_length(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """How many leading tokens of ``proposal`` equal those of ``actual``."""
    n = min(len(proposal), len(actual))
    if isinstance(proposal, list) and isinstance(actual, list) and proposal[:n] == actual[:n]:
        return n  # a whole match, the common case, compared at once
    run = 0
    for drafted, wanted in zip(proposal, actual):
        if drafted != wanted:
            break
        run += 1
    return run


class Columns(Protocol):
    """A drafter's per-position columns over one request, as planners and replays read
    them: ``RunLengths``, or columns looked up on demand
    (``rakv.suffix_drafter.SuffixColumns``)."""

    @property
    def runs(self) -> Sequence[int]: ...

    @property
    def proposed(self) -> Sequence[int]: ...

    @property
    def signals(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class RunLengths:
    """A drafter's behaviour at every output position t of a greedy output."""

    runs: list[int]  # m_t: leading proposed tokens that equal the output from t, at most max_k
    proposed: list[int]  # proposal length at t
    signals: list[int]  # Drafter.signal at t
    top1_probs: Sequence[float] | None = None  # a draft model's: its teacher-forced top-1 probability at t
    extents: Sequence[int] | None = None  # prompt lookup's: its match at t extended backwards (``ngram_lookup``)


def ngram_run_lengths(prompt_ids: Sequence[int], output_ids: Sequence[int], max_k: int,
                      config: NgramConfig = NgramConfig()) -> RunLengths:
    """Prompt lookup's run lengths over a greedy output."""
    seq = np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64)
    n = len(prompt_ids)
    lengths, proposed, signals, extents = [], [], [], []
    for t in range(len(output_ids)):
        proposal, order, extent = ngram_lookup(seq[:n + t], max_k, config)
        lengths.append(matching_prefix_length(proposal, output_ids[t:]))
        proposed.append(len(proposal))
        signals.append(order)
        extents.append(extent)
    return RunLengths(lengths, proposed, signals, extents=extents)
