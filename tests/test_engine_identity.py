"""Every policy gives the target's plain greedy output, and every speculation round accepts
exactly min(k, m_t) tokens, on a prompt mix of cold starts, partial hits, exact repeats,
short prompts and near-maximum prompts. Tiny pair (float64) here; SmolLM2 in
test_smollm2.py."""
from __future__ import annotations

import pytest

from conftest import ALL_POLICIES, hf_greedy, policy_for
from prompt_mix import prompt_mix
from engine_checks import assert_rounds_replay, run_mix
from rakv.engine import Engine
from rakv.settings import EngineConfig
from rakv.store_model import StoreConfig
from rakv.kv_store import KVStore

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def mix(tiny_pair):
    prompts = prompt_mix(tiny_pair.encode, tiny_pair.max_positions)
    return prompts, [hf_greedy(tiny_pair, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("policy_name", ALL_POLICIES)
def test_policy_matches_hf_greedy(tiny_pair, mix, policy_name):
    prompts, oracle = mix
    assert len(prompts) >= 50
    results, planners = run_mix(tiny_pair, policy_name, prompts, MAX_NEW_TOKENS)
    for i, (result, expected) in enumerate(zip(results, oracle)):
        assert list(result.output_ids) == expected, f"prompt {i} ({result.hit_kind}, {result.action})"
    kinds = {r.hit_kind for r in results}
    if results[0].action.r == 1 and policy_name != "rakv":
        assert {"miss", "partial", "exact"} <= kinds
        short_hits = [r for r in results if r.num_prompt_tokens < 16 and r.hit_tokens == r.num_prompt_tokens]
        assert short_hits, "a prompt under 16 tokens should hit the stored sequence it prefixes"
    rounds = assert_rounds_replay(tiny_pair, prompts, results, planners, MAX_NEW_TOKENS)
    if results[0].action.k > 0 and policy_name != "rakv":
        assert rounds > len(prompts)
        assert 0 < sum(sum(r.accepted_per_round) for r in results) < sum(r.k for res in results for r in res.rounds)


def test_constant_digest_collides_everywhere_yet_outputs_match(tiny_pair, mix, monkeypatch):
    prompts, oracle = mix
    store = KVStore(digest=lambda token_ids: b"\0" * 12)
    seen = []
    lookup = store.index.lookup

    def checked_lookup(fingerprint, token_ids, touch=True):
        hit = lookup(fingerprint, token_ids, touch)
        if hit is not None:  # a hit is only ever a true prefix of the query
            assert list(hit.entry.token_ids[: hit.num_tokens]) == list(token_ids[: hit.num_tokens])
            seen.append(hit.num_tokens)
        return hit

    monkeypatch.setattr(store.index, "lookup", checked_lookup)
    for policy_name in ("kv-only", "joint-k4"):
        results, planners = run_mix(tiny_pair, policy_name, prompts, MAX_NEW_TOKENS, store=store)
        assert [list(r.output_ids) for r in results] == oracle
    assert len(store.index._buckets) <= 2  # one bucket per model namespace
    assert len(seen) > len(prompts)


def test_store_prompt_mode_matches(tiny_pair, mix):
    prompts, oracle = mix
    results, planners = run_mix(tiny_pair, "joint-k2", prompts, MAX_NEW_TOKENS, config=EngineConfig(StoreConfig(mode="prompt")))
    assert [list(r.output_ids) for r in results] == oracle
    assert any(r.hit_kind == "exact" for r in results)


def test_small_budget_evicts_and_stays_identical(tiny_pair, mix):
    prompts, oracle = mix
    budget = 96 * 1024
    engine = Engine(tiny_pair, policy_for("joint-k4", tiny_pair), EngineConfig(StoreConfig(budget_bytes=budget)))
    for prompt, expected in zip(prompts, oracle):
        assert list(engine.generate(prompt, MAX_NEW_TOKENS).output_ids) == expected
        assert engine.store.total_bytes <= budget
    assert engine.store.index.num_evictions > 0


def test_confidence_stops_and_long_rounds_replay_exactly(tiny_pair, mix):
    """rakv drafting rounds of up to 16 with the draft model, stopping each proposal after
    a token the draft gives less than its threshold, which each request then learns:
    outputs stay greedy, and ``replay_request`` over teacher-forced run lengths and top-1
    probabilities gives the engine's rounds (where each stopped, what it accepted) and
    the same learned thresholds."""
    from rakv.controller import ControllerConfig, make_policy
    from rakv.cost_model import ModelTimings, PairTimings
    from rakv.round_planner import PlannerConfig

    def model(step_s):  # flat verification, so a long round costs what a short one does
        return ModelTimings(prefill_fixed_s=1e-3, prefill_per_token_s=1e-5, prefill_per_token_context_s=0.0,
                            step_fixed_s=step_s, step_per_context_s=0.0, verify_per_token_s=0.0,
                            kv_bytes_per_token=1024)
    timings = PairTimings(model(1e-2), model(1e-5), clone_s_per_byte=1e-12, lookup_s=1e-6,
                          acceptance_prior=0.9, ngram_lookup_s=1e-6, ngram_acceptance_prior=0.0)
    # the tiny draft's top-1 probabilities are 0.06-0.2 (10th-90th percentile): a stop at
    # 0.07 ends about a fifth of the proposals early
    policy = make_policy("rakv", timings, ControllerConfig(rounds=PlannerConfig(draft_confidence=0.07)))
    prompts, max_new = mix[0][:12], 40
    results, planners = run_mix(tiny_pair, policy, prompts, max_new)
    for prompt, result in zip(prompts, results):
        assert list(result.output_ids) == hf_greedy(tiny_pair, prompt, max_new)
    rounds = [r for result in results for r in result.rounds if r.drafter == "draft"]
    assert any(r.k > 8 and r.num_proposed > 8 for r in rounds), "no round drafted more than 8"
    assert any(r.num_proposed < r.k for r in rounds), "no proposal stopped on low confidence"
    assert assert_rounds_replay(tiny_pair, prompts, results, planners, max_new) >= len(rounds)
    assert any(p.confidence != 0.07 for p in planners), "no request learned its own threshold"  # replayed planners
