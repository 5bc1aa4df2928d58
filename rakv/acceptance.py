"""Exact acceptance replay from run lengths (DESIGN section 2). Imports no torch.

Under greedy decoding the target's output is fixed whatever the policy does, and so is a
deterministic drafter's proposal at every position given the true prefix. With m_t the
number of consecutive positions from output position t where the drafter agrees with the
target, a round starting at t with draft length k accepts exactly min(k, m_t) tokens.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence, cast

from rakv.drafters import DRAFT_MODEL, Columns, RunLengths
from rakv.round_planner import MAX_DRAFT_LENGTH
from rakv.rounds import PlannedRounds, walk
from rakv.suffix_drafter import SUFFIX, SuffixColumns, SuffixConfig, SuffixDrafter


def run_lengths(agree: Sequence[bool], max_k: int) -> list[int]:
    """m_t for every output position t: consecutive agreements from t, capped at max_k."""
    lengths = [0] * len(agree)
    run = 0
    for t in range(len(agree) - 1, -1, -1):
        run = run + 1 if agree[t] else 0
        lengths[t] = min(run, max_k)
    return lengths


class ReplayedRound(NamedTuple):  # a tuple: built on every replayed round, cheaply
    start: int  # output position of the round's first drafted token
    drafter: str
    k: int
    num_proposed: int
    accepted: int
    # None: num_proposed is exact. Else a confidence stop fell past the tokens whose
    # probabilities the trace holds as the engine computed them (those up to the first
    # wrong one, and within the output): num_proposed is the teacher-forced probabilities'
    # guess, and only num_proposed >= proposed_known is exact
    proposed_known: int | None = None

    @property
    def proposed_exact(self) -> bool:
        return self.proposed_known is None


def with_store_drafter(lengths: Mapping[str, Columns], drafters: Sequence[str], store, namespace: str,
                       config: SuffixConfig, tokens: Sequence[int], num_prompt: int,
                       num_output: int) -> Mapping[str, Columns]:
    """A trace's run lengths of a request, with the store drafter's where ``drafters`` ready
    it: those are not in the trace, as they depend on what the store holds (``store``, a
    ``rakv.store_model.StoreModel``, replayed), and are looked up as the engine looks them
    up, each position when its round is planned."""
    if SUFFIX not in drafters:
        return lengths
    drafter = SuffixDrafter.over(store, namespace, config, MAX_DRAFT_LENGTH)
    output = tokens[num_prompt:num_prompt + num_output]
    return {**lengths, SUFFIX: SuffixColumns(drafter, tokens, num_prompt, num_output, output)}


def replay_request(planner, lengths: Mapping[str, Columns], num_output: int,
                   max_new_tokens: int, tokens: Sequence[int] = ()) -> list[ReplayedRound]:
    """The speculation rounds of a request whose greedy output has ``num_output`` tokens,
    as the engine makes them under ``planner`` (``rakv.rounds.PlannedRounds``; ``tokens``:
    the request's prompt and output, for a planner that reads them), from each
    of its drafters' ``rakv.drafters.RunLengths`` (m_t, proposal length and signal at
    every t): a round from t with draft length k proposes min(k, proposal length) tokens
    and accepts min(k, m_t).

    A draft model under a confidence threshold (``planner.confidence`` > 0) stops after
    the first token whose teacher-forced top-1 probability is below it
    (``RunLengths.top1_probs``); up to the first wrong token that probability is the one
    the engine computed, so where the round stops, what it accepts, and what the planner
    learns are exact."""
    if not planner.drafters:
        return []  # plain steps only, and nothing to observe
    # the draft cache's positions, which a replay does not need, are counted from the prompt's end
    return walk(RunLengthRounds(planner, lengths, num_output, max_new_tokens, tokens), 0)


class RunLengthRounds(PlannedRounds):
    """A planner's rounds over a trace's run lengths (the target's plain steps need nothing):
    walked whole at batch 1 (``replay_request``), or move by move under the batching
    scheduler (``simulator.batch_replay``)."""

    def __init__(self, planner, lengths: Mapping[str, Columns], num_output: int, max_new_tokens: int,
                 tokens: Sequence[int]):
        super().__init__(planner, lengths, max_new_tokens, num_output, tokens)
        self._lists = {d: (lengths[d].proposed, lengths[d].runs) for d in planner.drafters}
        self._top1_probs = cast(RunLengths, lengths[DRAFT_MODEL]).top1_probs if DRAFT_MODEL in lengths else None

    def propose(self, t: int, drafter: str, k: int, stop_below: float,
                draft_seen: int) -> tuple[ReplayedRound, Sequence]:
        proposed, runs = self._lists[drafter]
        if stop_below > 0:
            rnd = _confident_round(t, k, runs[t], self._top1_probs, stop_below, self.end)
            return rnd, self._top1_probs[t:t + rnd.num_proposed]
        return ReplayedRound(t, drafter, k, min(k, proposed[t]), min(k, runs[t])), ()


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
    # the tokens whose probabilities are the engine's: up to the first wrong one, within the
    # output; the draft went on past every one of them it was sure of
    sure = min(run + 1, num_output - t)
    exact = stop <= sure or k <= sure + 1
    return ReplayedRound(t, DRAFT_MODEL, k, stop, min(stop, run), None if exact else sure + 1)


def comparable_rounds(recorded: Sequence[tuple], replayed: Sequence[ReplayedRound]) -> tuple[list, list]:
    """Recorded rounds (start, drafter, k, proposed, accepted) and replayed ones as lists
    that are equal exactly when the replay reproduces the recording: where the replay
    knows only that a confidence-stopped proposal ran past its first wrong token or the
    output's end (``proposed_known`` given), both proposed counts are cut to it."""
    cut = {i: r.proposed_known for i, r in enumerate(replayed) if not r.proposed_exact}
    def rows(rounds):
        return [(*r[:3], min(r[3], cut[i]) if i in cut else r[3], r[4]) for i, r in enumerate(rounds)]
    return rows([tuple(r) for r in recorded]), rows([tuple(r[:5]) for r in replayed])
