"""Exact acceptance replay from run lengths (DESIGN section 2). Imports no torch.

Under greedy decoding the target's output is fixed whatever the policy does, and so is a
deterministic drafter's proposal at every position given the true prefix. With m_t the
number of consecutive positions from output position t where the drafter agrees with the
target, a round starting at t with draft length k accepts exactly min(k, m_t) tokens.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from rakv.drafters import RunLengths
from rakv.round_planner import SHADOW_LENGTH


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


class ReplayedRound(NamedTuple):  # a tuple: built on every replayed round, cheaply
    start: int  # output position of the round's first drafted token
    drafter: str
    k: int
    num_proposed: int
    accepted: int


def replay_request(planner, lengths: Mapping[str, RunLengths], num_output: int,
                   max_new_tokens: int) -> list[ReplayedRound]:
    """The speculation rounds of a request whose greedy output has ``num_output`` tokens,
    as the engine runs them under ``planner`` (``rakv.round_planner``), from each of its
    drafters' ``rakv.drafters.RunLengths`` (m_t, proposal length and signal at every t).
    The first token comes from the prefill; a round whose clipped draft length is 0 is a
    plain target step. A round appends its accepted tokens and the target's own, except
    at the output's end, where an accepted EOS ends it. After each round, a shadowed
    drafter is told how much of its proposal (its first ``SHADOW_LENGTH`` tokens) the
    appended tokens confirm, as the engine tells it."""
    rounds: list[ReplayedRound] = []
    if not planner.drafters:
        return rounds  # plain steps only, and nothing to observe
    signal_lists = [(d, lengths[d].signals) for d in planner.drafters]
    by_drafter = {d: (lengths[d].proposed, lengths[d].runs, lengths[d].signals) for d in planner.drafters}
    shadows = [(d, *by_drafter[d]) for d in planner.shadowed]
    plan, observe = planner.plan, planner.observe  # called on every step
    signals: dict[str, int] = {}
    last = min(num_output, max_new_tokens - 1)  # from here on a round could draft nothing
    t = 1
    while t < num_output:
        for d, by_position in signal_lists:
            signals[d] = by_position[t]
        # round_draft_length, inlined: this loop is the simulator's hot path
        drafter, k = plan(signals) if t < last else (None, 0)
        if k > max_new_tokens - t - 1:
            k = max_new_tokens - t - 1
        appended = 1
        if k > 0:
            proposed, runs, drafter_signals = by_drafter[drafter]
            num_proposed, accepted = min(k, proposed[t]), min(k, runs[t])
            rounds.append(ReplayedRound(t, drafter, k, num_proposed, accepted))
            observe(drafter, drafter_signals[t], num_proposed, accepted)
            appended = min(accepted + 1, num_output - t)
        for shadow, proposed, runs, shadow_signals in shadows:
            if proposed[t] and (k == 0 or shadow != drafter):  # an empty proposal teaches nothing
                checked = min(proposed[t], SHADOW_LENGTH, appended)
                observe(shadow, shadow_signals[t], checked, min(runs[t], checked))
        t += appended
    return rounds
