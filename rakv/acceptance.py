"""Exact acceptance replay from run lengths (DESIGN section 2). Imports no torch.

Under greedy decoding the target's output is fixed whatever the policy does, and so is a
deterministic drafter's proposal at every position given the true prefix. With m_t the
number of consecutive positions from output position t where the drafter agrees with the
target, a round starting at t with draft length k accepts exactly min(k, m_t) tokens.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from rakv.drafters import DRAFT_MODEL, RunLengths


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
    # False: a confidence stop fell past the first wrong token, where the draft ran on its
    # own wrong prefix; num_proposed is then the teacher-forced probabilities' guess, and
    # only num_proposed >= accepted + 2 is exact
    proposed_exact: bool = True


def replay_request(planner, lengths: Mapping[str, RunLengths], num_output: int,
                   max_new_tokens: int) -> list[ReplayedRound]:
    """The speculation rounds of a request whose greedy output has ``num_output`` tokens,
    as the engine runs them under ``planner`` (``rakv.round_planner``), from each of its
    drafters' ``rakv.drafters.RunLengths`` (m_t, proposal length and signal at every t).
    The first token comes from the prefill; a round whose clipped draft length is 0 is a
    plain target step. A round appends its accepted tokens and the target's own, except
    at the output's end, where an accepted EOS ends it. After each round, a shadowed
    drafter is told how much of its proposal (its first ``planner.shadow_length``
    tokens) the appended tokens confirm, as the engine tells it.

    A draft model under a confidence threshold (``planner.confidence`` > 0) stops after
    the first token whose teacher-forced top-1 probability is below it
    (``RunLengths.top1_probs``); up to the first wrong token that probability is the one
    the engine computed, so where the round stops, what it accepts, and what the planner
    learns are exact."""
    rounds: list[ReplayedRound] = []
    if not planner.drafters:
        return rounds  # plain steps only, and nothing to observe
    by_drafter = {d: (lengths[d].proposed, lengths[d].runs, lengths[d].signals) for d in planner.drafters}
    signal_lists = [(d, signals_of_d) for d, (_, _, signals_of_d) in by_drafter.items()]
    shadows = [(d, *by_drafter[d]) for d in planner.shadowed]
    shadow_length = planner.shadow_length if shadows else 0
    top1_probs = lengths[DRAFT_MODEL].top1_probs if DRAFT_MODEL in lengths else None
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
            threshold = planner.confidence if drafter == DRAFT_MODEL else 0.0
            rnd = (_confident_round(t, k, runs[t], top1_probs, threshold, num_output) if threshold > 0
                   else ReplayedRound(t, drafter, k, min(k, proposed[t]), min(k, runs[t])))
            rounds.append(rnd)
            appended = min(rnd.accepted + 1, num_output - t)
            # the engine reports the probabilities of the output positions the round covers
            probs = top1_probs[t:t + min(rnd.num_proposed, appended)] if threshold > 0 else ()
            observe(drafter, drafter_signals[t], rnd.num_proposed, rnd.accepted, probs)
        for shadow, proposed, runs, shadow_signals in shadows:
            if proposed[t] and (k == 0 or shadow != drafter):  # an empty proposal teaches nothing
                checked = min(proposed[t], shadow_length, appended)
                observe(shadow, shadow_signals[t], checked, min(runs[t], checked))
        t += appended
    return rounds


def _confident_round(t: int, k: int, run: int, top1_probs, threshold: float, num_output: int) -> ReplayedRound:
    """A draft-model round from t with cap k that stops after a token of probability
    below ``threshold``; ``run`` is m_t. Past the output's end nothing is known, and the
    draft is taken to go on."""
    if top1_probs is None:
        raise ValueError("the trace holds no draft probabilities: a confidence stop cannot be replayed")
    stop = k
    for j in range(min(k, num_output - t)):
        if top1_probs[t + j] < threshold:
            stop = j + 1
            break
    return ReplayedRound(t, DRAFT_MODEL, k, stop, min(stop, run), stop <= run + 1)


def comparable_rounds(recorded: Sequence[tuple], replayed: Sequence[ReplayedRound]) -> tuple[list, list]:
    """Recorded rounds (start, drafter, k, proposed, accepted) and replayed ones as lists
    that are equal exactly when the replay reproduces the recording: where the replay
    knows only that a confidence-stopped proposal ran past its first wrong token
    (``proposed_exact`` False), both proposed counts are cut to accepted + 2."""
    cut = {i for i, r in enumerate(replayed) if not r.proposed_exact}
    def rows(rounds):
        return [(*r[:3], min(r[3], r[4] + 2) if i in cut else r[3], r[4]) for i, r in enumerate(rounds)]
    return rows([tuple(r) for r in recorded]), rows([tuple(r[:5]) for r in replayed])
