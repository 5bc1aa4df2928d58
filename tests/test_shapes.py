"""Random-weight pairs of real shapes (rakv.shapes): the documented shapes, a real build of
the small pairs on the CPU, seeding, and the errors."""
from __future__ import annotations

import pytest
import torch

from rakv.models import PairError, model_fingerprint
from rakv.shapes import SHAPE_PAIRS, build_model, pair_models, random_pair, shape_config

# model -> (layers, hidden size, attention heads, parameters in millions)
DOCUMENTED = {
    "gpt2": (12, 768, 12, 124.4),
    "distilgpt2": (6, 768, 12, 81.9),
    "gpt2-medium": (24, 1024, 16, 354.8),
    "gpt2-large": (36, 1280, 20, 774.0),
    "smollm2-135m": (30, 576, 9, 134.5),
    "qwen2.5-coder-1.5b": (28, 1536, 12, 1777.1),  # untied head, as loaded from the GGUF
    "qwen2.5-coder-0.5b": (24, 896, 14, 630.2),
}
PAIRS = {"gpt2": ("gpt2", "distilgpt2"), "gpt2-medium": ("gpt2-medium", "distilgpt2"),
         "gpt2-large": ("gpt2-large", "distilgpt2"), "smollm2": ("smollm2-135m", 4),
         "qwen-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


def test_pair_names():
    assert SHAPE_PAIRS == tuple(PAIRS)
    for name, models in PAIRS.items():
        assert pair_models(name) == models


@pytest.mark.parametrize("model", sorted(DOCUMENTED))
def test_shapes_build_on_meta(model):
    from transformers import AutoModelForCausalLM
    layers, hidden, heads, millions = DOCUMENTED[model]
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(shape_config(model))
    cfg = built.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (layers, hidden, heads)
    assert cfg._attn_implementation == "sdpa"
    assert sum(p.numel() for p in built.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)


def test_gpt2_pair_builds_and_runs():
    pair = random_pair("gpt2", dtype="float32")
    assert pair.name == "gpt2" and pair.max_positions == 1024 and pair.eos_token_ids == {50256}
    assert pair.target.config.num_hidden_layers == 12 and pair.draft.config.num_hidden_layers == 6
    assert pair.target.dtype == torch.float32
    assert pair.target_fingerprint != pair.draft_fingerprint
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for model in (pair.target, pair.draft):
            logits = model(ids).logits
            assert logits.shape == (1, 8, 50257)
            assert torch.isfinite(logits).all()
    with pytest.raises(PairError, match="no tokenizer"):
        pair.encode("hello")


def test_smollm2_pair_draft_is_prefix():
    pair = random_pair("smollm2", "float32", max_context=320)
    assert pair.target.config.num_hidden_layers == 30 and pair.draft.config.num_hidden_layers == 4
    assert pair.draft.model.layers[0] is pair.target.model.layers[0]
    assert pair.max_positions == 320 and pair.eos_token_ids == {2}
    assert pair.target_fingerprint != pair.draft_fingerprint
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        assert torch.isfinite(pair.draft(ids).logits).all()


def test_weights_are_seeded():
    first, again, other = (build_model("distilgpt2", "float32", seed=s) for s in (0, 0, 1))
    assert torch.equal(first.transformer.h[0].mlp.c_fc.weight, again.transformer.h[0].mlp.c_fc.weight)
    assert model_fingerprint(first, "x") == model_fingerprint(again, "x") != model_fingerprint(other, "x")
    assert first.lm_head.weight is first.transformer.wte.weight  # tied, as in GPT-2
    assert all(torch.isfinite(p).all() for p in first.parameters())


def test_unknown_names():
    with pytest.raises(PairError, match="gpt2, gpt2-medium, gpt2-large, smollm2, qwen-coder"):
        random_pair("llama-70b")
    with pytest.raises(PairError, match="dtype"):
        random_pair("gpt2", dtype="int8")
