"""Checks shared by the engine tests of every pair."""
from __future__ import annotations

import copy
from dataclasses import replace

from conftest import policy_for
from rakv.acceptance import comparable_rounds, replay_request, run_lengths
from rakv.decoding import draft_predictions
from rakv.round_planner import MAX_DRAFT_LENGTH
from rakv.drafters import NGRAM, RunLengths, ngram_run_lengths
from rakv.engine import Engine
from rakv.sequence_index import SequenceIndex
from rakv.settings import EngineConfig
from rakv.suffix_drafter import SUFFIX, SuffixColumns, SuffixDrafter


def run_mix(pair, policy_name, prompts, max_new_tokens, store=None, config=EngineConfig()):
    """The results, and a copy of each request's round planner as it started.
    ``policy_name`` may also be a policy object."""
    policy = policy_for(policy_name, pair) if isinstance(policy_name, str) else policy_name
    planners, make_planner = [], policy.planner

    def recorded(features, action):
        planner = make_planner(features, action)
        started = copy.deepcopy(planner)
        # the store as the request's store drafter sees it (the store changes only between requests)
        started.store_view = SequenceIndex.holding(pair.target_fingerprint, config.suffix.key_tokens,
                                                   engine.store.model.index.entries())
        planners.append(started)
        return planner

    policy.planner = recorded
    engine = Engine(pair, policy, config, store)
    return [engine.generate(p, max_new_tokens) for p in prompts], planners


def drafter_run_lengths(pair, drafter: str, prompt, output, config=EngineConfig(), store_view=None) -> RunLengths:
    """m_t, proposal lengths, signals and (draft model) top-1 probabilities from one
    teacher-forced pass of the drafter (the store drafter: over ``store_view``, the
    store's sequences as the request saw them)."""
    max_k = MAX_DRAFT_LENGTH
    if drafter == NGRAM:
        return ngram_run_lengths(prompt, output, max_k, config.ngram)
    if drafter == SUFFIX:
        tokens = list(prompt) + list(output)
        return SuffixColumns(SuffixDrafter(store_view, config.suffix, max_k), tokens, len(prompt), len(output), output)
    agree, probs = draft_predictions(pair.draft, prompt, output)
    return RunLengths(run_lengths(agree, max_k), [max_k] * len(output), [0] * len(output), probs)


def assert_rounds_replay(pair, prompts, results, planners, max_new_tokens, config=EngineConfig()) -> int:
    """Engine rounds == the planner replayed over min(k, m_t) from one teacher-forced pass
    of each drafter: the drafter, k, proposed and accepted count of every round."""
    checked = 0
    for prompt, result, planner in zip(prompts, results, planners):
        names = set(planner.drafters) | set(planner.shadowed)
        if not names:
            assert result.rounds == ()
            continue
        output = list(result.output_ids)
        lengths = {d: drafter_run_lengths(pair, d, prompt, output, config, getattr(planner, "store_view", None))
                   for d in names}
        max_new = min(max_new_tokens, pair.max_positions - len(prompt))
        expected = replay_request(planner, lengths, len(output), max_new)
        recorded, replayed = comparable_rounds(
            [(r.start, r.drafter, r.k, r.num_proposed, r.accepted) for r in result.rounds], expected)
        assert recorded == replayed
        checked += len(expected)
    return checked


def machine_free_prices(calibrated, verify_per_row_s: float):
    """A pair's calibration with prices that do not turn on the machine: a target step of
    1 ms at any context, ``verify_per_row_s`` for each further row, a draft step of 0.1 ms,
    lookups and copies of 10 us (the acceptance priors, functions of the models, stay).
    The tiny draft costs about what its target does, so at the machine's own prices
    whether a round pays, and so which rounds a test sees, would turn on the machine."""
    return replace(calibrated,
                   target=replace(calibrated.target, step_fixed_s=1e-3, step_per_context_s=0.0, verify_fixed_s=0.0,
                                  verify_per_token_s=verify_per_row_s, verify_tokens=(), verify_extra_s=()),
                   draft=replace(calibrated.draft, step_fixed_s=1e-4, step_per_context_s=0.0),
                   clone_s_per_byte=1e-11, lookup_s=1e-5, ngram_lookup_s=1e-5)
