"""Drafters: what proposes the tokens a speculation round verifies.

- ``draft``: a draft model, greedy, with its own KV cache (stored and reused like the
  target's).
- ``ngram``: prompt lookup. The longest recent n-gram of the sequence (prompt and output
  so far) is searched for at its most recent earlier occurrence; the tokens that
  followed it are proposed. No model, microseconds per round.

Both are deterministic functions of the true prefix, so each has run lengths: m_t, the
number of leading proposed tokens at output position t that equal the target's output,
and a round starting at t with draft length k accepts exactly min(k, m_t). For ``ngram``
the proposal can be shorter than k, or empty (no earlier occurrence): ``proposal_lengths``
records its length at each position, and a round with an empty proposal is one plain
target step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

DRAFT_MODEL = "draft"
NGRAM = "ngram"
DRAFTERS = (DRAFT_MODEL, NGRAM)


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3  # longest suffix n-gram searched first
    min_ngram: int = 1  # shortest one tried before giving up

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


def ngram_propose(seq: Sequence[int] | np.ndarray, k: int, config: NgramConfig = NgramConfig()) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's
    longest matching suffix n-gram (n from max_ngram down to min_ngram); [] if none."""
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
            return tokens[begin:begin + k].tolist()
    return []


class Drafter(Protocol):
    name: str

    def propose(self, seq: list[int], k: int) -> list[int]:
        """At most k tokens to follow ``seq`` (the true sequence so far)."""

    def rollback(self, num_valid: int) -> None:
        """Only the first ``num_valid`` tokens of the last proposal's context stand."""


@dataclass
class NgramDrafter:
    config: NgramConfig = NgramConfig()
    name: str = NGRAM

    def propose(self, seq: list[int], k: int) -> list[int]:
        return ngram_propose(seq, k, self.config)

    def rollback(self, num_valid: int) -> None:
        pass  # stateless: it reads the sequence afresh every round


def ngram_run_lengths(prompt_ids: list[int], output_ids: list[int], max_k: int,
                      config: NgramConfig = NgramConfig()) -> tuple[list[int], list[int]]:
    """(m_t, proposal length at t) for every output position t of a greedy output."""
    seq = np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64)
    n = len(prompt_ids)
    lengths, proposed = [], []
    for t in range(len(output_ids)):
        proposal = ngram_propose(seq[:n + t], max_k, config)
        run = 0
        for drafted, wanted in zip(proposal, output_ids[t:]):
            if drafted != wanted:
                break
            run += 1
        lengths.append(run)
        proposed.append(len(proposal))
    return lengths, proposed
