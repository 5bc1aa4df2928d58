"""The built-in ``tiny`` pair: a random Llama-shaped target and a draft derived from it.

Built in code in well under a second, no files, no hub. The draft is the target's weights
plus Gaussian noise of relative size ``noise`` per tensor: it agrees with the target on
part of the tokens, like a real smaller model, and its agreement is tunable. Text goes
through a byte-level tokenizer (256 byte ids, then BOS and EOS).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257


@dataclass(frozen=True)
class TinyConfig:
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 256
    init_std: float = 0.2  # large enough that greedy output does not collapse to one token
    draft_noise: float = 0.03  # draft = target + noise * std(tensor) * N(0, 1): about 60% agreement
    seed: int = 0


class ByteTokenizer:
    """UTF-8 bytes as token ids; BOS is prepended, EOS ends generation."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        return [BOS_ID] + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < NUM_BYTES).decode("utf-8", errors="replace")


def tiny_models(config: TinyConfig = TinyConfig(), dtype: torch.dtype = torch.float64):
    """(target, draft) in eval mode, deterministic for a given config."""
    model_config = LlamaConfig(
        vocab_size=NUM_BYTES + 2, hidden_size=config.hidden_size,
        intermediate_size=2 * config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_positions, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, tie_word_embeddings=False, initializer_range=config.init_std,
        attn_implementation="eager")  # CPU SDPA has no fast float64 kernel (6 ms a call)
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)  # LlamaForCausalLM's init draws from the global generator
    target = LlamaForCausalLM(model_config).to(dtype).eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for param in draft.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(dtype)
            param.add_(noise * config.draft_noise * param.float().std().to(dtype))
    for model in (target, draft):
        model.generation_config = GenerationConfig(
            eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=BOS_ID, do_sample=False)
    return target, draft
