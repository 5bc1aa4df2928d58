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
