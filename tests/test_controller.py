"""The torch-free controller: E_k, the cost model's choices, memory limits, EWMA, and the
round planners."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from rakv.suffix_drafter import suffix_prior
from rakv.acceptance import replay_request, run_lengths
from rakv.controller import ControllerConfig, CostModelPolicy, RequestOutcome, fixed_action, make_policy
from rakv.drafters import RunLengths
from rakv.round_planner import AcceptanceCount, FixedRounds, PlannerConfig
from rakv.cost_model import (Action, ModelTimings, PairTimings, RequestFeatures, action_bytes, expected_progress,
                             progress_by_k)


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


def test_progress_by_k_is_expected_progress_bit_for_bit():
    for a in [i / 97 for i in range(-3, 101)] + [1 - 1e-13, 0.9999999]:
        assert progress_by_k(a, 32) == [expected_progress(a, k) for k in range(33)]


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
    policy.observe(RequestOutcome(Action(0, 4), (AcceptanceCount("draft", 0, 0, 4),)))
    assert policy.acceptance["draft"] == pytest.approx(0.45)
    for _ in range(10):
        policy.observe(RequestOutcome(Action(0, 4), (AcceptanceCount("draft", 0, 0, 4),)))
    assert policy.decide(features()).k == 0


def test_acceptance_counts_are_geometric_trials():
    rounds = FixedRounds("ngram", 4)
    rounds.observe("ngram", 3, 4, 4)  # four successes, no failure seen
    rounds.observe("ngram", 3, 2, 2)  # a short proposal fully accepted: censored, not a failure
    rounds.observe("ngram", 3, 4, 1)  # one success, then the failure that ended it
    rounds.observe("ngram", 1, 4, 0)
    assert rounds.counts() == (AcceptanceCount("ngram", 1, 0, 1), AcceptanceCount("ngram", 3, 7, 1))
    assert rounds.counts()[1].rate == pytest.approx(7 / 8)
    assert AcceptanceCount("draft", 0, 0, 0).rate is None


def test_replay_rounds():
    agree = [True, True, False, True, True, True, True, False, True, True]
    lengths = run_lengths(agree, max_k=3)
    assert lengths == [2, 1, 0, 3, 3, 2, 1, 0, 2, 1]
    # k=2, 10 outputs, max_new 10: rounds start at 1 (accept min(2,1)=1 -> t=3), ...
    rounds = replay_request(FixedRounds("draft", 2), {"draft": RunLengths(lengths, [3] * 10, [0] * 10)}, 10, 10)
    assert [(r.start, r.k, r.accepted) for r in rounds] == [(1, 2, 1), (3, 2, 2), (6, 2, 1), (8, 1, 1)]
    assert {r.drafter for r in rounds} == {"draft"}


def test_rakv_prefers_a_free_drafter_when_text_repeats():
    repetitive = CostModelPolicy(timings(draft_step_s=0.03, prior=0.1, ngram_prior=0.7))
    action = repetitive.decide(features())
    assert action.drafter == "ngram" and action.k >= 2
    prose = CostModelPolicy(timings(draft_step_s=0.03, prior=0.1, ngram_prior=0.05))
    assert prose.decide(features()).k == 0


def test_ngram_acceptance_is_tracked_separately():
    policy = CostModelPolicy(timings(draft_step_s=0.004, prior=0.9, ngram_prior=0.5), ControllerConfig(ewma_decay=1.0))
    policy.observe(RequestOutcome(Action(0, 4, "ngram"), (AcceptanceCount("ngram", 3, 8, 0),
                                                          AcceptanceCount("ngram", 1, 0, 8))))
    assert policy.acceptance == {"draft": 0.9, "ngram": 0.5, "suffix": suffix_prior(1)}  # the store drafter untouched
    assert policy.signal_acceptance == {("ngram", 3): 1.0, ("ngram", 1): 0.0}


def cpu_timings() -> PairTimings:
    """CPU-like: any multi-token forward costs 1.75 steps, each further token 0.1 step more."""
    t = timings(draft_step_s=0.03, prior=0.1, ngram_prior=0.05)
    return dataclasses.replace(t, target=dataclasses.replace(t.target, verify_fixed_s=0.03))


def test_adaptive_rounds_follow_the_request_not_the_prior():
    policy = CostModelPolicy(cpu_timings())
    action = policy.decide(features())
    assert action.k == 0  # the overall prior says prompt lookup does not pay here
    planner = policy.planner(features(), action)
    assert planner.drafters == planner.shadowed == ("ngram", "suffix")  # the store drafter, here with no match
    assert planner.plan({"ngram": 0, "suffix": 0}) == ("ngram", 0)  # no match: nothing to propose
    assert planner.plan({"ngram": 1, "suffix": 0})[1] == 0  # a 1-gram match is a poor guess (prior 0.2)
    assert planner.plan({"ngram": 3, "suffix": 0})[1] >= 4  # a 3-gram match a good one (prior 0.75)
    for _ in range(12):  # shadowed 1-gram proposals confirmed by plain steps: this request copies
        planner.observe("ngram", 1, 1, 1)
    assert planner.plan({"ngram": 1, "suffix": 0})[1] >= 4
    for _ in range(6):  # 3-gram proposals keep failing in this request
        planner.observe("ngram", 3, 8, 0)
    assert planner.plan({"ngram": 3, "suffix": 0})[1] == 0
    assert policy.acceptance["ngram"] == 0.05  # the policy's estimates move only per request
    policy.observe(RequestOutcome(action, planner.counts()))
    assert policy.signal_acceptance[("ngram", 1)] > 0.2 and policy.signal_acceptance[("ngram", 3)] < 0.75


def test_planner_readies_the_draft_model_only_when_the_action_uses_it():
    policy = CostModelPolicy(timings(draft_step_s=0.004, prior=0.9))
    action = policy.decide(features())
    assert action.drafter == "draft" and action.k > 0
    assert policy.planner(features(), action).drafters == ("draft", "ngram", "suffix")
    assert policy.planner(features(), Action(0, 0)).drafters == ("ngram", "suffix")
    without = CostModelPolicy(policy.timings, ControllerConfig(store_drafter=False))
    assert without.planner(features(), Action(0, 0)).drafters == ("ngram",)
    limit = action_bytes(Action(0, 2, "ngram"), features(), policy.timings)  # the working KV of k = 2
    capped = CostModelPolicy(policy.timings, ControllerConfig(memory_limit_bytes=limit))
    assert capped.planner(features(), Action(0, 0)).config == PlannerConfig(max_k=2)


def test_adaptive_replay_is_deterministic_and_waits_for_the_copy():
    policy = CostModelPolicy(cpu_timings())
    planner = policy.planner(features(), Action(0, 0))
    # prompt lookup matches only 1-grams, yet agrees from output position 10 on (a copied
    # stretch), never before
    agree = [False] * 10 + [True] * 40
    lengths = {"ngram": RunLengths(run_lengths(agree, 8), [8] * 50, [1] * 50),
               "suffix": RunLengths([0] * 50, [0] * 50, [0] * 50)}  # the store drafter finds nothing
    first = replay_request(copy.deepcopy(planner), lengths, 50, 50)
    assert first == replay_request(copy.deepcopy(planner), lengths, 50, 50)
    assert first[0].start >= 10 and sum(r.accepted for r in first) >= 20


def test_fit_prices_the_jump_from_one_token_to_several():
    """A CPU verify of 2 tokens costs about 1.7 steps and one of 9 about 2.8: a fixed jump
    plus a per-token slope, which a line through the origin would misprice."""
    from profiler.schema import OpRow
    from rakv.cost_model import fit_timings
    rows = []
    for model in ("target", "draft"):
        rows += [OpRow(model, "prefill", n, c, 0, 1000 * n, 0, 0.01 + 0.001 * n) for n in (8, 32) for c in (0, 64)]
        rows += [OpRow(model, "decode", 1, c, 0, 1000, 0, 0.09) for c in (16, 256)]
        rows += [OpRow(model, "verify", k + 1, 16, k, 1000, 0, 0.09 + 0.06 + 0.012 * k) for k in (1, 4, 8)]
    target = fit_timings(rows).target
    assert target.verify_fixed_s == pytest.approx(0.06)
    assert target.verify_per_token_s == pytest.approx(0.012)
    assert target.verify_s(2, 16) == pytest.approx(0.09 + 0.06 + 0.012)
    assert target.verify_s(1, 16) == target.step_s(16)


def test_verify_prices_follow_the_measured_sizes_not_a_line():
    """The cost model interpolates the measured extra seconds per size, so a 16-token round
    is priced as measured; sizes whose medians fall below a smaller size's (the machine's
    noise: no kernel the engine uses by default costs less for more rows) are pooled."""
    from profiler.schema import OpRow
    from rakv.cost_model import fit_timings
    step = 0.41
    measured = {2: 0.90, 3: 1.29, 5: 0.92, 9: 1.06, 17: 1.34}  # seconds of a forward of T tokens at context 16
    rows = []
    for model in ("target", "draft"):
        rows += [OpRow(model, "prefill", n, c, 0, 1000 * n, 0, 0.01 + 0.001 * n) for n in (8, 32) for c in (0, 64)]
        rows += [OpRow(model, "decode", 1, c, 0, 1000, r, step) for c in (16, 256) for r in range(3)]
        rows += [OpRow(model, "verify", t, 16, t - 1, 1000, r, s + 0.001 * (r - 1)) for t, s in measured.items()
                 for r in range(3)]  # three repeats: the median is kept
    target = fit_timings(rows).target
    assert target.verify_tokens == (2, 3, 5, 9, 17)
    pooled = (1.29 + 0.92 + 1.06) / 3  # 3, 5 and 9 tokens: one mean, the least-squares non-decreasing fit
    for t, seconds in {2: 0.90, 3: pooled, 5: pooled, 9: pooled, 17: 1.34}.items():
        assert target.verify_s(t, 16) == pytest.approx(seconds)
    assert target.verify_s(13, 16) == pytest.approx((pooled + 1.34) / 2)  # between measured sizes
    assert target.verify_s(25, 16) == pytest.approx(1.34 + (1.34 - pooled))  # past the last: its slope
    assert target.verify_s(1, 16) == target.step_s(16)


def test_verify_rows_are_priced_against_the_step_of_their_own_pass():
    """The grid is timed in passes of one repeat; a pass that ran at half the machine's
    speed doubles its step and its verify times alike, and leaves the extra cost of
    verifying unmoved (against the step of all passes it read 0.033 s low)."""
    from profiler.schema import OpRow
    from rakv.cost_model import fit_timings
    speed = [1.0, 2.0, 1.0]  # seconds per unit of work, per pass
    extra = {2: 0.01, 5: 0.03, 9: 0.05}
    rows = []
    for model in ("target", "draft"):
        rows += [OpRow(model, "prefill", n, 0, 0, 1000 * n, 0, 0.01 + 0.001 * n) for n in (8, 32)]
        rows += [OpRow(model, "decode", 1, c, 0, 1000, r, 0.1 * s) for c in (16, 256) for r, s in enumerate(speed)]
        rows += [OpRow(model, "verify", t, 16, t - 1, 1000, r, (0.1 + e) * s) for t, e in extra.items()
                 for r, s in enumerate(speed)]
    target = fit_timings(rows).target
    assert target.verify_extra_s == pytest.approx(tuple(extra.values()))


def test_nondecreasing_is_the_pooled_least_squares_fit():
    from rakv.cost_model import nondecreasing
    assert nondecreasing([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)
    assert nondecreasing([3.0, 1.0, 2.0]) == pytest.approx((2.0, 2.0, 2.0))
    assert nondecreasing([1.0, 4.0, 2.0, 0.0, 5.0]) == pytest.approx((1.0, 2.0, 2.0, 2.0, 5.0))
    assert nondecreasing([]) == ()


def test_confidence_threshold_follows_the_request_by_hfs_rule():
    """Among the observed probabilities, the threshold minimising false continues per
    wrong token + 3 false stops per right token; the start value until 6 samples of both
    outcomes; kept within CONFIDENCE_RANGE."""
    from rakv.round_yield import confidence_threshold
    right = [(0.9, True), (0.8, True), (0.7, True), (0.35, True)]
    wrong = [(0.3, False), (0.2, False), (0.6, False)]
    assert confidence_threshold(right[:3] + wrong[:2], 0.4) == 0.4  # 5 samples
    assert confidence_threshold(right, 0.4) == 0.4  # no wrong token yet
    # continuing from 0.35 keeps every right token and lets one wrong one (0.6) through:
    # 1/3 + 0; from 0.7 it stops one right token: 0 + 3/4
    assert confidence_threshold(right + wrong, 0.4) == 0.35
    assert confidence_threshold([(0.99, True)] * 6 + [(0.5, False)], 0.4) == 0.9  # capped


def test_stopped_rounds_price_a_threshold_that_stops_wrong_tokens():
    from rakv.round_yield import stop_shares, stopped_rounds
    costs = [1.0] + [2.0 + 0.25 * k for k in range(1, 17)]
    progress, same = stopped_rounds(0.9, 0.0, 0.0, costs, 16)
    assert progress == pytest.approx(progress_by_k(0.9, 16)) and same == pytest.approx(costs)
    progress, cheaper = stopped_rounds(0.9, 0.05, 0.8, costs, 16)
    assert progress[16] < progress_by_k(0.9, 16)[16]  # some right tokens are stopped
    assert cheaper[16] < costs[16] - 0.25 * 6  # but most of the wasted drafting is gone
    assert progress[16] / cheaper[16] > progress_by_k(0.9, 16)[16] / costs[16]
    assert stop_shares([(0.9, True), (0.3, True), (0.2, False), (0.6, False)], 0.4) == (0.5, 0.5)


def test_rakv_probes_an_unseen_draft_model_then_trusts_what_it_measured():
    """A prior just too low to speculate (a 10 % loss predicted): with probe_margin the
    first request readies the draft model; once its acceptance is measured (here poor),
    the policy decides on the measurement alone. probe_margin 0 (traces written before
    it existed) never probes."""
    for prior in [x / 100 for x in range(30, 95)]:
        ranked = CostModelPolicy(timings(draft_step_s=0.012, prior=prior)).rank(features())
        if ranked[0][1].k == 0 and any(a.k and c <= ranked[0][0] * 1.1 for c, a in ranked):
            break
    policy = CostModelPolicy(timings(draft_step_s=0.012, prior=prior))
    probe = policy.decide(features())
    assert probe.k > 0 and probe.drafter == "draft"
    planner = policy.planner(features(), probe)
    signals = {"draft": 0, "ngram": 0, "suffix": 0}
    first, second = planner.plan(signals), planner.plan(signals)
    assert first[0] == "draft" and first[1] > 0 and second[1] == 0  # one probing round, then the margin rules
    assert CostModelPolicy(timings(draft_step_s=0.012, prior=prior),
                           ControllerConfig(probe_margin=0.0)).decide(features()).k == 0
    policy.observe(RequestOutcome(probe, (AcceptanceCount("draft", 0, 2, 8),)))
    assert policy.seen == {"draft"} and policy.decide(features()).k == 0


def test_settings_written_before_a_field_existed_are_refused_naming_it():
    """No setting is guessed: one a file lacks is an error that names it (a replay then
    runs today's settings, see test_simulator)."""
    from rakv.settings import settings_from_json, settings_to_json
    with pytest.raises(ValueError, match="'probe_margin' is missing"):
        settings_from_json(ControllerConfig, {"ewma_decay": 0.3, "memory_limit_bytes": None, "rounds": {
            "recency": 0.1, "max_k": 8, "min_gain": 0.25}})
    assert settings_from_json(ControllerConfig, settings_to_json(ControllerConfig())) == ControllerConfig()


def test_override_sets_any_setting_by_section_or_path_and_refuses_bad_ones():
    from rakv.settings import Settings, differences, override, overrides_from_json
    settings = override(Settings(), "planner.min_gain=0.2")
    settings = override(settings, "store.mode=prompt")
    settings = override(settings, "controller.rounds.max_k=8")
    settings = override(settings, "controller.memory_limit_bytes=null")
    assert (settings.controller.rounds.min_gain, settings.engine.store.mode, settings.controller.rounds.max_k) == (
        0.2, "prompt", 8)
    assert differences(settings, Settings()) == ["store.mode=\"prompt\"", "planner.max_k=8", "planner.min_gain=0.2"]
    assert overrides_from_json({"planner": {"min_gain": 0.3}, "ngram": {"max_ngram": 4}}) == [
        "planner.min_gain=0.3", "ngram.max_ngram=4"]
    for bad, message in (("planner.min_gian=1", "no such setting"), ("planner.max_k=99", "max_k"),
                         ("planner.min_gain=fast", "expected float"), ("store.budget_bytes=1.5", "expected int"),
                         ("planner.max_catch_up_beside_prefill=None", "expected int or null"),
                         ("min_gain", "SECTION.KEY=VALUE"), ("planner=1", "no such setting")):
        with pytest.raises(ValueError, match=message):
            override(Settings(), bad)


def test_a_confidence_stop_is_exact_only_where_the_trace_holds_the_engines_probabilities():
    """A replayed draft-model round that stops on confidence: exact where it stops at a
    token up to the first wrong one and within the output; past either, only a floor."""
    from rakv.acceptance import _confident_round
    probs = [0.9, 0.9, 0.2, 0.9, 0.9, 0.1]  # per output position
    stopped = _confident_round(0, 4, 3, probs, 0.5, 6)  # stops after position 2, before the first wrong (3)
    assert (stopped.num_proposed, stopped.accepted, stopped.proposed_exact) == (3, 3, True)
    guessed = _confident_round(3, 4, 0, probs, 0.5, 6)  # position 3 wrong: the stop at 5 is a guess
    assert (guessed.num_proposed, guessed.accepted, guessed.proposed_known) == (3, 0, 2)
    # two tokens left, both right: the draft's third token is past the output, its stop unknown
    at_end = _confident_round(4, 4, 2, [0.9] * 6, 0.5, 6)
    assert (at_end.num_proposed, at_end.accepted, at_end.proposed_known) == (4, 2, 3)
    assert _confident_round(4, 3, 2, [0.9] * 6, 0.5, 6).proposed_exact  # k = 3: proposes all 3
