"""The torch-free controller: E_k, the cost model's choices, memory limits, EWMA."""
from __future__ import annotations

import pytest

from rakv.acceptance import replay_rounds, run_lengths
from rakv.controller import (ControllerConfig, CostModelPolicy, RequestOutcome, acceptance_from_rounds,
                             fixed_action, make_policy)
from rakv.cost_model import Action, ModelTimings, PairTimings, RequestFeatures, action_bytes, expected_progress


def timings(draft_step_s: float, prior: float = 0.5, ngram_prior: float = 0.0) -> PairTimings:
    target = ModelTimings(prefill_fixed_s=0.02, prefill_per_token_s=0.001, prefill_per_token_context_s=0.0,
                          step_fixed_s=0.04, step_per_context_s=0.0, verify_per_token_s=0.004,
                          kv_bytes_per_token=1000)
    draft = ModelTimings(prefill_fixed_s=0.005, prefill_per_token_s=0.0002, prefill_per_token_context_s=0.0,
                         step_fixed_s=draft_step_s, step_per_context_s=0.0, verify_per_token_s=0.001,
                         kv_bytes_per_token=250)
    return PairTimings(target, draft, clone_s_per_byte=1e-10, lookup_s=2e-5, acceptance_prior=prior,
                       ngram_lookup_s=2e-5, ngram_acceptance_prior=ngram_prior)


def features(hit=0, exact=False, n=200, new=64) -> RequestFeatures:
    return RequestFeatures(num_prompt_tokens=n, num_new_tokens=new, target_hit_tokens=hit,
                           draft_hit_tokens=hit, exact_repeat=exact, acceptance=0.0)


def test_expected_progress():
    assert expected_progress(0.5, 0) == 1.0
    assert expected_progress(0.0, 8) == 1.0
    assert expected_progress(1.0, 4) == 5.0
    assert expected_progress(0.5, 2) == pytest.approx(1.75)


def test_fixed_policy_names():
    assert fixed_action("ar") == Action(0, 0)
    assert fixed_action("kv-only") == Action(1, 0)
    assert fixed_action("spec-k6") == Action(0, 6)
    assert fixed_action("joint-k8") == Action(1, 8)
    assert fixed_action("ngram-k4") == Action(0, 4, "ngram")
    assert fixed_action("joint-ngram-k2") == Action(1, 2, "ngram")
    assert fixed_action("spec-k3") is None
    assert Action(1, 0, "ngram") == Action(1, 0)
    with pytest.raises(ValueError, match="unknown policy 'x'"):
        make_policy("x")
    with pytest.raises(ValueError, match="needs timing statistics"):
        make_policy("rakv")


def test_rakv_speculates_only_when_it_pays():
    cheap_draft = CostModelPolicy(timings(draft_step_s=0.004, prior=0.9))
    assert cheap_draft.decide(features()).k >= 4
    poor_draft = CostModelPolicy(timings(draft_step_s=0.030, prior=0.1))
    assert poor_draft.decide(features()).k == 0


def test_rakv_reuses_a_long_hit():
    policy = CostModelPolicy(timings(draft_step_s=0.03, prior=0.1))
    assert policy.decide(features(hit=190)).r == 1
    assert policy.decide(features(hit=200, exact=True)).r == 1
    assert policy.decide(features(hit=0)) == Action(0, 0)  # no hit: reuse would only add a lookup


def test_memory_limit_drops_actions():
    t = timings(draft_step_s=0.004, prior=0.9)
    feats = features()
    limit = action_bytes(Action(0, 0), feats, t)
    policy = CostModelPolicy(t, ControllerConfig(memory_limit_bytes=limit))
    assert all(action_bytes(a, feats, t) <= limit for _, a in policy.rank(feats))
    assert policy.decide(feats).k == 0
    with pytest.raises(ValueError, match="no action fits"):
        CostModelPolicy(t, ControllerConfig(memory_limit_bytes=limit - 1)).decide(feats)


def test_ewma_follows_measured_acceptance():
    policy = CostModelPolicy(timings(draft_step_s=0.004, prior=0.9), ControllerConfig(ewma_decay=0.5))
    policy.observe(RequestOutcome(Action(0, 4), accepted_per_round=(0, 0, 0, 0), k_per_round=(4, 4, 4, 4)))
    assert policy.acceptance["draft"] == pytest.approx(0.45)
    for _ in range(10):
        policy.observe(RequestOutcome(Action(0, 4), (0, 0, 0, 0), (4, 4, 4, 4)))
    assert policy.decide(features()).k == 0


def test_acceptance_mle():
    assert acceptance_from_rounds((4, 4), (4, 4)) == 1.0
    assert acceptance_from_rounds((1, 0), (4, 4)) == pytest.approx(1 / 3)
    assert acceptance_from_rounds((), ()) is None


def test_replay_rounds():
    agree = [True, True, False, True, True, True, True, False, True, True]
    lengths = run_lengths(agree, max_k=3)
    assert lengths == [2, 1, 0, 3, 3, 2, 1, 0, 2, 1]
    # k=2, 10 outputs, max_new 10: rounds start at 1 (accept min(2,1)=1 -> t=3), ...
    assert replay_rounds(lengths, 2, 10, 10) == [(1, 2, 1), (3, 2, 2), (6, 2, 1), (8, 1, 1)]


def test_rakv_prefers_a_free_drafter_when_text_repeats():
    repetitive = CostModelPolicy(timings(draft_step_s=0.03, prior=0.1, ngram_prior=0.7))
    action = repetitive.decide(features())
    assert action.drafter == "ngram" and action.k >= 2
    prose = CostModelPolicy(timings(draft_step_s=0.03, prior=0.1, ngram_prior=0.05))
    assert prose.decide(features()).k == 0


def test_ngram_acceptance_is_tracked_separately():
    policy = CostModelPolicy(timings(draft_step_s=0.004, prior=0.9, ngram_prior=0.5), ControllerConfig(ewma_decay=1.0))
    policy.observe(RequestOutcome(Action(0, 4, "ngram"), (4, 4), (4, 4)))
    assert policy.acceptance == {"draft": 0.9, "ngram": 1.0}
