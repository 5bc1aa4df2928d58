"""Exact acceptance replay from run lengths (DESIGN section 2). Imports no torch.

Under greedy decoding the target's output is fixed whatever the policy does, and so is a
deterministic drafter's proposal at every position given the true prefix. With m_t the
number of consecutive positions from output position t where the drafter agrees with the
target, a round starting at t with draft length k accepts exactly min(k, m_t) tokens.
"""
from __future__ import annotations

from typing import Sequence


def run_lengths(agree: Sequence[bool], max_k: int) -> list[int]:
    """m_t for every output position t: consecutive agreements from t, capped at max_k."""
    lengths = [0] * len(agree)
    run = 0
    for t in range(len(agree) - 1, -1, -1):
        run = run + 1 if agree[t] else 0
        lengths[t] = min(run, max_k)
    return lengths


def round_draft_length(k: int, num_generated: int, max_new_tokens: int) -> int:
    """Draft length of a round starting after ``num_generated`` tokens: k, clipped so a
    round never drafts past max_new_tokens (the round's own target token included)."""
    return max(0, min(k, max_new_tokens - num_generated - 1))


def replay_rounds(lengths: Sequence[int], k: int, num_output: int, max_new_tokens: int) -> list[tuple[int, int, int]]:
    """(start, draft length, accepted) of every speculation round of a request whose greedy
    output has ``num_output`` tokens, as the engine runs it. The first token comes from
    the prefill; a position where the clipped draft length is 0 is a plain target step."""
    rounds = []
    t = 1
    while t < num_output:
        k_round = round_draft_length(k, t, max_new_tokens)
        if k_round == 0:
            t += 1
            continue
        accepted = min(k_round, lengths[t])
        rounds.append((t, k_round, accepted))
        t += accepted + 1
    return rounds
