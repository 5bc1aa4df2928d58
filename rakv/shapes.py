"""Random-weight pairs of real model shapes, for timing where the real weights cannot be moved.

Timing depends on (model shapes, dtype, hardware, lengths) and not on the weights' values
(DESIGN.md section 2), so a GPU machine with no network can record the ops table of a real
pair from these; acceptance then comes from another trace of the same pair made with the
real weights. The configs are embedded here (no files, no hub).

Pairs (``SHAPE_PAIRS``):
- ``gpt2``, ``gpt2-medium``, ``gpt2-large``: that GPT-2 as target, ``distilgpt2`` as draft
  (``gpt2``/``distilgpt2`` is the paper's pair);
- ``smollm2``: SmolLM2-135M as target, its first 4 layers as draft (``layer_prefix_draft``);
- ``qwen-coder``: Qwen2.5-Coder-1.5B target, Qwen2.5-Coder-0.5B draft.

The Qwen and SmolLM2 values are those of the models the engine loads from the GGUF files
(``rakv.models``): the Qwen GGUFs carry a separate ``output.weight``, so as loaded they
have untied embeddings (the upstream HF configs tie them; the step's compute is the same).

Weights are built without the default initialisation and filled, per tensor, with a
seeded N(0, 0.02) block tiled over the tensor (norm weights 1, biases 0): finite, seeded,
the same on every device, and seconds even for the 1.5B model on a CPU.
"""
from __future__ import annotations

import copy
import hashlib

from rakv.models import (ModelPair, PairError, context_limit, eos_ids_of, layer_prefix_draft,
                         model_fingerprint)

_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, bos_token_id=50256,
             eos_token_id=50256, tie_word_embeddings=True)
_QWEN = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768,
             rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
             hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
             max_window_layers=28, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)

MODEL_CONFIGS: dict[str, dict] = {
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768),
    "distilgpt2": dict(_GPT2, n_layer=6, n_head=12, n_embd=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
        max_position_embeddings=8192, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen2.5-coder-1.5b": dict(_QWEN, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, intermediate_size=8960),
    "qwen2.5-coder-0.5b": dict(_QWEN, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, intermediate_size=4864),
}

# pair name -> (target model, draft model or ("layers", N) for a layer-prefix draft)
_PAIRS: dict[str, tuple[str, str | int]] = {
    "gpt2": ("gpt2", "distilgpt2"),
    "gpt2-medium": ("gpt2-medium", "distilgpt2"),
    "gpt2-large": ("gpt2-large", "distilgpt2"),
    "smollm2": ("smollm2-135m", 4),
    "qwen-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
}
SHAPE_PAIRS = tuple(_PAIRS)
INIT_STD = 0.02
_BLOCK = 65521  # prime, so the tiled block does not line up with rows of any width here


class NoTokenizer:
    """Random-weight pairs have no tokenizer: they time shapes, with token ids as input."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise PairError("random-weight pairs time shapes only; they have no tokenizer")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{int(t)}>" for t in token_ids)


def shape_config(model: str):
    """The transformers config of one embedded model shape (sdpa attention)."""
    from transformers import AutoConfig
    if model not in MODEL_CONFIGS:
        raise PairError(f"unknown model shape {model!r}; choose one of {', '.join(MODEL_CONFIGS)}")
    values = copy.deepcopy(MODEL_CONFIGS[model])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    return config


def pair_models(name: str) -> tuple[str, str | int]:
    """(target shape, draft shape or number of prefix layers) of a pair; PairError if unknown."""
    if name not in _PAIRS:
        raise PairError(f"unknown random-weight pair {name!r}; choose one of {', '.join(SHAPE_PAIRS)}")
    return _PAIRS[name]


def _torch_dtype(dtype):
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise PairError(f"dtype must be a floating-point torch dtype such as float16, got {dtype!r}")
    return value


def _fill(model, seed_key: str) -> None:
    """Seeded values in every parameter: tiled N(0, INIT_STD) blocks, norm weights 1, biases 0."""
    import torch
    seed = int.from_bytes(hashlib.blake2b(seed_key.encode(), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied tensors appear once
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                flat = param.view(-1)
                n = flat.numel()
                size = min(n, _BLOCK)
                block = (torch.randn(size, generator=generator) * INIT_STD).to(param.device, param.dtype)
                whole = n // size
                flat[: whole * size].view(whole, size).copy_(block.expand(whole, size))
                flat[whole * size:].copy_(block[: n - whole * size])


def build_model(model: str, dtype="float16", device: str = "cpu", seed: int = 0):
    """One random-weight model of an embedded shape, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    config = shape_config(model)
    with torch.device(device), no_init_weights():
        built = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype), attn_implementation="sdpa")
    built.tie_weights()  # no_init_weights also skips the tying that init_weights does
    _fill(built, f"{model}:{seed}")
    return built.eval()


def random_pair(name: str, dtype="float16", device: str = "cpu", seed: int = 0,
                max_context: int | None = None) -> ModelPair:
    """A random-weight pair of the named real shapes (``SHAPE_PAIRS``). Raises PairError."""
    target_name, draft_spec = pair_models(name)
    try:
        target = build_model(target_name, dtype, device, seed)
        if isinstance(draft_spec, int):
            draft, draft_source = layer_prefix_draft(target, draft_spec), f"random:{target_name}:{seed}[:{draft_spec} layers]"
        else:
            draft, draft_source = build_model(draft_spec, dtype, device, seed), f"random:{draft_spec}:{seed}"
    except RuntimeError as exc:  # e.g. an unavailable device or out of memory
        raise PairError(f"cannot build random-weight pair {name!r} on {device}: {str(exc).splitlines()[0]}") from None
    return ModelPair(
        name=name, target=target, draft=draft, tokenizer=NoTokenizer(target.config.vocab_size),
        target_fingerprint=model_fingerprint(target, f"random:{target_name}:{seed}"),
        draft_fingerprint=model_fingerprint(draft, draft_source),
        max_positions=context_limit(target, draft, max_context), eos_token_ids=eos_ids_of(target))
