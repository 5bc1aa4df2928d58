"""The prefix store inside the engine: exact hit lengths, what is reused, byte accounting,
model isolation."""
from __future__ import annotations

import dataclasses

import torch

from conftest import hf_greedy, policy_for
from rakv.engine import Engine
from rakv.settings import EngineConfig
from rakv.store_model import StoreConfig
from rakv.kv_store import KVStore, stored_bytes, tensor_bytes
from rakv.models import model_fingerprint
from rakv.tiny import TinyConfig, tiny_models

PROMPT = "System: be brief.\nUser: what is a cache?"


def engine(pair, policy="joint-k2", **config):
    return Engine(pair, policy_for(policy, pair), EngineConfig(StoreConfig(**config)))


def test_conversation_turn_hits_the_whole_previous_sequence(tiny_pair):
    eng = engine(tiny_pair)
    first = tiny_pair.encode(PROMPT)
    r1 = eng.generate(first, 10)
    assert r1.hit_kind == "miss" and r1.reused_tokens == 0
    second = first + list(r1.output_ids) + tiny_pair.encode("\nUser: and a draft?")[1:]
    r2 = eng.generate(second, 10)
    # stored: prompt + output minus its last token (whose KV was never computed)
    assert r2.hit_tokens == len(first) + len(r1.output_ids) - 1
    assert r2.reused_tokens == r2.hit_tokens and r2.hit_kind == "partial"
    assert r2.draft_reused_tokens > 0
    assert list(r2.output_ids) == hf_greedy(tiny_pair, second, 10)
    # the second turn's entry extends the first one and replaced it: one entry per model
    assert len(eng.store.index) == 2


def test_prompt_store_mode_hits_only_the_prompt(tiny_pair):
    eng = engine(tiny_pair, mode="prompt")
    first = tiny_pair.encode(PROMPT)
    r1 = eng.generate(first, 10)
    second = first + list(r1.output_ids)
    r2 = eng.generate(second, 10)
    assert r2.hit_tokens == len(first) and r2.reused_tokens == len(first)


def test_exact_repeat_reuses_logits_without_prefill(tiny_pair):
    eng = engine(tiny_pair, policy="kv-only")
    prompt = tiny_pair.encode(PROMPT)
    r1 = eng.generate(prompt, 8)
    calls = []
    original = tiny_pair.target.forward
    # a forward set on the instance sees every call (rakv.direct_forward steps aside for it)
    tiny_pair.target.forward = lambda *a, **k: calls.append(k["input_ids"].shape[1]) or original(*a, **k)
    try:
        r2 = eng.generate(prompt, 8)
    finally:
        del tiny_pair.target.forward  # not monkeypatch: its undo would leave the bound method on the instance
    assert r2.hit_kind == "exact" and r2.reused_tokens == len(prompt)
    assert r2.output_ids == r1.output_ids
    assert calls == [1] * 7  # seven decode steps, no prefill: the first token came from stored logits


def test_short_prompt_recomputes_only_the_boundary(tiny_pair):
    eng = engine(tiny_pair, policy="kv-only")
    prompt = tiny_pair.encode(PROMPT)
    eng.generate(prompt, 4)
    short = prompt[:10]
    r = eng.generate(short, 4)
    assert r.hit_tokens == 10 and r.reused_tokens == 9 and r.hit_kind == "partial"
    assert list(r.output_ids) == hf_greedy(tiny_pair, short, 4)


def test_bytes_count_every_tensor_held(tiny_pair):
    eng = engine(tiny_pair, budget_bytes=10**7)
    for text in ("alpha beta gamma delta epsilon", "one two three four five six", PROMPT):
        eng.generate(tiny_pair.encode(text), 12)
    total = 0
    for entry in eng.store.index.entries():
        kv = entry.payload.tensors
        tensors = [t for layer in kv.layers for t in layer] + [lg for _, lg in kv.logits_by_len]
        for t in tensors:  # no entry tensor keeps a larger storage alive
            assert t.untyped_storage().nbytes() == tensor_bytes(t)
        assert entry.num_bytes == stored_bytes(entry.token_ids, kv)
        assert all(t.shape[2] == entry.num_tokens for layer in kv.layers for t in layer)
        total += entry.num_bytes
    assert total == eng.store.total_bytes


def test_one_models_entries_never_serve_another(tiny_pair):
    target, draft = tiny_models(TinyConfig(seed=1))
    other = dataclasses.replace(
        tiny_pair, target=target, draft=draft,
        target_fingerprint=model_fingerprint(target, "tiny-seed1-target"),
        draft_fingerprint=model_fingerprint(draft, "tiny-seed1-draft"))
    fingerprints = {tiny_pair.target_fingerprint, tiny_pair.draft_fingerprint,
                    other.target_fingerprint, other.draft_fingerprint}
    assert len(fingerprints) == 4
    store = KVStore()
    prompt = tiny_pair.encode(PROMPT)
    first = Engine(tiny_pair, policy_for("joint-k4", tiny_pair), store=store).generate(prompt, 8)
    second = Engine(other, policy_for("joint-k4", other), store=store).generate(prompt, 8)
    assert second.hit_tokens == 0 and second.draft_reused_tokens == 0
    assert list(second.output_ids) == hf_greedy(other, prompt, 8)
    assert second.output_ids != first.output_ids
    assert {e.namespace for e in store.index.entries()} == fingerprints


def test_fingerprint_changes_with_weights_dtype(tiny_pair):
    target, _ = tiny_models()
    assert model_fingerprint(target, "tiny-target") == tiny_pair.target_fingerprint
    with torch.no_grad():
        target.lm_head.weight[0, 0] += 1.0
    assert model_fingerprint(target, "tiny-target") != tiny_pair.target_fingerprint
    assert model_fingerprint(target.to(torch.float32), "tiny-target") != tiny_pair.target_fingerprint
