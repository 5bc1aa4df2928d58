"""rakv.direct_forward: Hugging Face's logits and cache, bit for bit, in every kernel mode."""
from __future__ import annotations

import pytest
import torch

from rakv import direct_forward
from rakv.kv_cache import GrowingCache
from rakv.weights import INT8

CHUNKS = (30, 1, 5, 1, 3)  # a prefill, steps and verification-sized forwards, each after the last


def assert_same_as_hf(model, vocab_size: int) -> None:
    plan = direct_forward.plan_of(model)
    assert plan is not None
    ids = [(7 * i + 3) % vocab_size for i in range(sum(CHUNKS))]
    hf_cache, direct_cache = GrowingCache(), GrowingCache()
    start = 0
    with torch.inference_mode():
        for size in CHUNKS:
            chunk = torch.tensor([ids[start:start + size]])
            start += size
            want = model(input_ids=chunk, use_cache=True, logits_to_keep=size, cache=hf_cache).logits
            got = direct_forward.logits(plan, model, direct_cache, chunk, size)
            assert torch.equal(got, want), f"logits differ after {start} tokens"
    for hf_layer, direct_layer in zip(hf_cache.layers, direct_cache.layers):
        assert torch.equal(hf_layer.keys, direct_layer.keys) and torch.equal(hf_layer.values, direct_layer.values)


def test_tiny_pair_float64_eager_attention(tiny_pair):
    assert_same_as_hf(tiny_pair.target, tiny_pair.target.config.vocab_size)
    assert_same_as_hf(tiny_pair.draft, tiny_pair.draft.config.vocab_size)


def test_tiny_int8_row_exact_attention():
    from rakv.models import load_pair
    pair = load_pair("tiny", dtype="float32", weights_mode=INT8)
    assert_same_as_hf(pair.target, pair.target.config.vocab_size)


def test_smollm2_packed_float32(smollm2_pair):
    assert_same_as_hf(smollm2_pair.target, smollm2_pair.target.config.vocab_size)


def test_a_kernel_swapped_in_later_is_the_one_that_runs(tiny_pair):
    model = tiny_pair.target
    plan = direct_forward.plan_of(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    calls = []

    def counted(x):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, q_proj.weight, q_proj.bias)

    q_proj.forward = counted
    try:
        with torch.inference_mode():
            direct_forward.logits(plan, model, GrowingCache(), torch.tensor([[1, 2, 3]]), 1)
    finally:
        del q_proj.forward  # back to the class's forward
    assert calls == [torch.Size([1, 3, model.config.hidden_size])]


def test_other_architectures_and_training_run_hugging_faces_forward(tiny_pair):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)).eval()
    assert direct_forward.plan_of(gpt2) is None
    target = tiny_pair.target
    assert direct_forward.plan_of(target) is not None
    target.train()
    try:
        assert direct_forward.plan_of(target) is None
    finally:
        target.eval()


def test_a_wrapped_forward_runs_as_under_hugging_faces_call(tiny_pair):
    """A forward set on the instance or a hook would be skipped by plain calls: such a
    model runs HF's forward, so the wrapper sees every call."""
    model = tiny_pair.target
    handle = model.register_forward_hook(lambda *args: None)
    try:
        assert direct_forward.plan_of(model) is None
    finally:
        handle.remove()
    assert direct_forward.plan_of(model) is not None
    model.forward = model.forward
    try:
        assert direct_forward.plan_of(model) is None
    finally:
        del model.forward  # back to the class's (monkeypatch would leave the bound method on the instance)


@pytest.mark.parametrize("size", [0, 1])
def test_logits_to_keep_matches_hf_at_the_edges(tiny_pair, size):
    """HF keeps every position for logits_to_keep=0; so does ``logits``."""
    model = tiny_pair.target
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=True, logits_to_keep=size, cache=GrowingCache()).logits
        got = direct_forward.logits(direct_forward.plan_of(model), model, GrowingCache(), ids, size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", [INT8, "int4"])
def test_a_batched_forward_runs_one_attention_call_a_layer_with_each_requests_own_bits(mode, monkeypatch):
    """The batched forward's attention (``row_attention.ManyRequests``: each request's cache
    update and row-exact attention, every request in one kernel call a layer) gives each
    request its own forward's logits and cache, bit for bit: a new request (an empty
    cache), one whose rows fill its cache's buffer to the edge and one that outgrows it."""
    from rakv.kv_cache import MIN_CAPACITY
    from rakv.models import load_pair
    from rakv.row_attention import ManyRequests
    model = load_pair("tiny", dtype="float32", weights_mode=mode).target
    plan = direct_forward.plan_of(model)
    vocab = model.config.vocab_size
    calls = []
    monkeypatch.setattr(ManyRequests, "attend", lambda self, *args, _attend=ManyRequests.attend:
                        calls.append(len(self.parts)) or _attend(self, *args))
    # (cached, new rows) per request: empty, to the buffer's edge, past it, a step
    shapes = [(0, 7), (MIN_CAPACITY - 3, 3), (MIN_CAPACITY - 2, 5), (20, 1)]
    ids = [[(11 * r + 5 * i + 1) % vocab for i in range(cached + new)] for r, (cached, new) in enumerate(shapes)]
    with torch.inference_mode():
        alone, batched = [], []
        for seq, (cached, _) in zip(ids, shapes):
            cache = GrowingCache()
            if cached:
                direct_forward.logits(plan, model, cache, torch.tensor([seq[:cached]]), 1)
            batched.append(cache)
            alone.append(GrowingCache([(layer.keys, layer.values) for layer in cache.layers]) if cached
                         else GrowingCache())
        want = [direct_forward.logits(plan, model, cache, torch.tensor([seq[cached:]]), len(seq) - cached)[0]
                for cache, seq, (cached, _) in zip(alone, ids, shapes)]
        calls.clear()
        got = direct_forward.batched_logits(plan, model, batched, [seq[cached:] for seq, (cached, _) in
                                                                   zip(ids, shapes)], [new for _, new in shapes])
    assert calls == [len(shapes)] * model.config.num_hidden_layers  # one call a layer, every request in it
    for request, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"request {request}: logits differ"
    for a, b in zip(alone, batched):
        assert a.get_seq_length() == b.get_seq_length()
        for x, y in zip(a.layers, b.layers):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
