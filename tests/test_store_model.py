"""The torch-free store model: the engine's tensor store and a replay fed token ids and
sizes alone agree at every request on hits, reuse, hit kinds, evictions and bytes."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import policy_for
from engine_checks import drafter_run_lengths
from rakv.round_planner import MAX_DRAFT_LENGTH
from prompt_mix import prompt_mix
from rakv.calibrate import load_or_calibrate
from rakv.controller import ControllerConfig
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.engine import Engine
from rakv.kv_store import measure_sizes
from rakv.settings import DecisionInputs, EngineConfig
from rakv.store_model import ModelSizes, StoreConfig, StoreModel, entry_bytes
from simulator.session import Session
from simulator.trace import RecordedRequest

MAX_NEW_TOKENS = 12
SIZES = ModelSizes(kv_bytes_per_token=100, logits_bytes=40)


def recorded(pair, request_id: int, prompt: list[int], output: list[int]) -> RecordedRequest:
    """What a trace would hold of one request: tokens and each drafter's run lengths."""
    lengths = {d: drafter_run_lengths(pair, d, prompt, output) for d in (DRAFT_MODEL, NGRAM)}
    return RecordedRequest(request_id, "g", 0, 0.0, tuple(prompt), tuple(output), MAX_NEW_TOKENS, lengths,
                           MAX_DRAFT_LENGTH, tuple(lengths[DRAFT_MODEL].top1_probs),
                           np.array(prompt + output, dtype=np.int64))


@pytest.mark.parametrize("policy_name, mode, budget_bytes", [
    ("joint-k4", "full", 96 * 1024),  # evicts
    ("kv-only", "prompt", 10**8),
    ("rakv", "full", 160 * 1024),
    ("joint-ngram-k2", "off", 10**8),
])
def test_engine_and_store_model_agree_at_every_request(tiny_pair, policy_name, mode, budget_bytes):
    config = EngineConfig(StoreConfig(budget_bytes, mode))
    engine = Engine(tiny_pair, policy_for(policy_name, tiny_pair), config)
    timings = load_or_calibrate(tiny_pair) if policy_name == "rakv" else None
    inputs = DecisionInputs(config, ControllerConfig(), timings, measure_sizes(tiny_pair.target),
                            measure_sizes(tiny_pair.draft), tiny_pair.max_positions)
    session = Session.for_policy(policy_name, inputs, tiny_pair.target_fingerprint, tiny_pair.draft_fingerprint)
    kinds = []
    plan = session.store.plan_insert
    session.store.plan_insert = lambda *a: kinds.append(plan(*a).kind) or plan(*a)
    prompts = prompt_mix(tiny_pair.encode, tiny_pair.max_positions)
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt, MAX_NEW_TOKENS)
        replayed = session.run(recorded(tiny_pair, i, prompt, list(result.output_ids)), MAX_NEW_TOKENS)
        assert (replayed.action, replayed.hit_tokens, replayed.store.reuse.reused_tokens,
                replayed.store.reuse.hit_kind, replayed.store.draft_reused_tokens) == (
            result.action, result.hit_tokens, result.reused_tokens, result.hit_kind, result.draft_reused_tokens), i
        assert session.store.num_evictions == engine.store.model.num_evictions, i
        assert session.store.total_bytes == engine.store.total_bytes <= budget_bytes, i
        assert ([(e.namespace, e.token_ids.tolist(), e.num_bytes) for e in session.store.index.entries()]
                == [(e.namespace, e.token_ids.tolist(), e.num_bytes) for e in engine.store.index.entries()]), i
    expected = {"off": set(), "full": {"new"}, "prompt": {"new", "touch", "merge"}}[mode]
    assert set(kinds) == expected  # the insert plans this mix exercises
    if budget_bytes < 10**6:
        assert engine.store.model.num_evictions > 0


def test_insert_plans_touch_merge_and_replace():
    model = StoreModel(StoreConfig(10**6))
    seq = np.arange(1, 41)
    assert model.plan_insert("m", seq[:20], (10, 19), SIZES).kind == "new"
    model.commit(model.plan_insert("m", seq[:20], (10, 19), SIZES))
    extend = model.plan_insert("m", seq, (39,), SIZES)  # extends the stored 20 tokens: replaces them
    assert extend.kind == "new" and extend.base is not None and extend.logits_lengths == (10, 19, 39)
    model.commit(extend)
    assert len(model.index) == 1 and model.total_bytes == entry_bytes(40, 3, SIZES)
    assert model.plan_insert("m", seq[:10], (10,), SIZES).kind == "touch"  # held, with its logits row
    merge = model.plan_insert("m", seq[:15], (15,), SIZES)  # held, but lacks the row after 15 tokens
    assert merge.kind == "merge" and len(merge.token_ids) == 40 and merge.logits_lengths == (10, 15, 19, 39)
    model.commit(merge)
    assert len(model.index) == 1 and model.total_bytes == entry_bytes(40, 4, SIZES) == 40 * 108 + 4 * 40
    match = model.match("m", seq[:15].copy())
    assert match.hit_tokens == 15 and match.exact_repeat
    assert model.start(match, None, r=1)[0].hit_kind == "exact"
    assert model.match("other", seq[:15].copy()).hit_tokens == 0


def test_kept_lengths_follow_the_mode_and_the_draft_cache():
    class Round:
        def __init__(self, start, drafter, num_proposed, accepted):
            self.start, self.drafter, self.num_proposed, self.accepted = start, drafter, num_proposed, accepted

    # 10-token prompt, 8 outputs: a draft round at t=1 proposing 4, accepting 4 (appends 5),
    # then an ngram round (the draft cache does not move)
    rounds = [Round(1, DRAFT_MODEL, 4, 4), Round(6, NGRAM, 2, 1)]
    assert StoreModel(StoreConfig(mode="full")).kept_lengths(10, 18, 3, rounds) == (17, 10 + 1 + 4 - 1)
    assert StoreModel(StoreConfig(mode="prompt")).kept_lengths(10, 18, 3, rounds) == (10, 10)
    assert StoreModel(StoreConfig(mode="off")).kept_lengths(10, 18, 3, rounds) == (0, 0)
    assert StoreModel().kept_lengths(10, 18, None, rounds) == (17, 0)  # the draft model was not readied
    assert StoreModel().kept_lengths(10, 18, 3, []) == (17, 3)  # it never drafted: what it reused
    # a round that ends on an accepted EOS at the output's end appends only what it accepted
    assert StoreModel().kept_lengths(10, 15, 0, [Round(1, DRAFT_MODEL, 8, 4)]) == (14, 10 + 1 + 4 - 1)
