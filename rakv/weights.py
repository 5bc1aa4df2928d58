"""A pair's weights mode: its Linear layers in float32 or in int8, and exact in both.

A CPU decode step streams every weight once, so its time is its bytes over the memory
bandwidth: float32 Qwen2.5-Coder-1.5B streams 6.2 GB a step. ``int8`` holds each Linear's
weight as int8 with one scale per output channel (symmetric: scale = max|w| / 127) and
runs it on oneDNN's int8 inner product, packed once (AMX or VNNI where the CPU has them).
Each forward quantizes its input per row (symmetric, dynamic: the row's own max|x| / 127),
so the kernel multiplies int8 by int8 into int32 sums.

Invariants:
- **Rows never mix, bit for bit.** A row's int32 sums are exact whatever order the kernel
  adds in, and everything after them (the channel scale, the row scale, the bias) is
  elementwise. So a row's result does not depend on how many rows come with it: a forward
  over T tokens gives each token the bits a one-token forward gives it, which is what
  exact speculation needs, on any CPU and any oneDNN path.
- **A mode is a model.** Outputs in int8 are another model's than in float32: the mode's
  format tag (``FORMATS``) goes into both fingerprints, so traces, stored KV, calibrations
  and learned policies of one mode never serve another. float32 fingerprints are those of
  the weights alone, as before modes existed.
- **Attention rows never mix either** (``rakv.row_attention``): int8 rounds every Linear's
  input, so the last-bit differences that float32 attention leaves between a forward over
  T tokens and T one-token forwards would now and then flip a rounding, and a greedy token.
  float32 keeps PyTorch's attention: there those differences stay at 1e-7 and have never
  flipped a token in the test suite, and its shipped traces were timed with it.
- **No float32 copy.** A quantized Linear's float32 weight is dropped (its parameter is
  set to None); a weight tied to an embedding stays, as the embedding's. The quantized
  layer is a forward set on the module instance, as ``rakv.cpu_linear``'s packed one is,
  so Hugging Face's own ``generate`` runs the same layers (the reference for outputs).
- Inference only, on the CPU. Importing this module loads no torch (the command lines take
  ``WEIGHTS`` from here before parsing).

``auto`` follows the checkpoint: a GGUF file with quantized tensors (4, 5, 6 or 8 bits)
runs as int8, anything else as float32. Its 4-bit tensors run as int8 too: per-channel
int8 re-quantizes them (another model again), and an int4 kernel whose rows stay exact
and whose cost stays flat over a few rows does not exist in torch 2.13 (issue 18).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO, FP32, INT8 = "auto", "fp32", "int8"
WEIGHTS = (AUTO, FP32, INT8)  # the choices of --weights
# A change in how a mode quantizes is a new model: bump its tag and every fingerprint moves.
FORMATS = {INT8: "int8: per-channel symmetric weights, per-row dynamic symmetric activations, v1"}
WEIGHTS_HELP = ("precision of the Linear layers: int8 streams a quarter of float32's bytes a step (per-channel "
                "int8 weights, per-row int8 activations; rows stay exact, outputs are int8's own); fp32 as "
                "loaded; auto: int8 for a quantized GGUF, fp32 otherwise (default: fp32, the mode the shipped "
                "traces and policies were recorded in)")
DEFAULT_WEIGHTS = FP32
QMAX = 127  # symmetric: -127..127, so negating a value never overflows
TINY = 1e-30  # the scale of an all-zero row or channel: its integers are all 0 anyway
# oneDNN's int8 inner product falls back to a slow path for 64 or fewer output channels
# (0.3-5 ms where 96 take 0.03): narrower layers get zero channels, sliced off after.
MIN_COLUMNS = 128
MIN_ROWS = 4  # fewer rows take a slow oneDNN path for narrow layers: 896->128 cost 8-10 ms at 1-2 rows, 0.2 at 4


def add_precision_arguments(parser) -> None:
    """``--weights`` and ``--linear-kernels``, for every command line that loads a pair."""
    from rakv.cpu_linear import LINEAR_KERNELS, LINEAR_KERNELS_HELP
    parser.add_argument("--weights", choices=WEIGHTS, default=DEFAULT_WEIGHTS, help=WEIGHTS_HELP)
    parser.add_argument("--linear-kernels", choices=LINEAR_KERNELS, default="auto", help=LINEAR_KERNELS_HELP)


class Int8Forward:
    """A Linear's forward on int8 weights: x [..., in] -> [..., out] in x's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        import torch
        weight = linear.weight.detach().to(torch.float32)  # [out, in]
        scale = weight.abs().amax(dim=1).clamp_min(TINY) / QMAX  # [out]
        quantized = torch.round(weight / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)  # [out, in]
        if weight.shape[0] < MIN_COLUMNS:
            quantized = torch.cat([quantized, quantized.new_zeros(MIN_COLUMNS - weight.shape[0], weight.shape[1])])
            scale = torch.cat([scale, scale.new_ones(MIN_COLUMNS - weight.shape[0])])
        self.weight = torch.ops.onednn.qlinear_prepack(quantized, None)  # [max(out, MIN_COLUMNS), in], packed
        self.scale = scale
        self.zero_points = torch.zeros(scale.shape[0], dtype=torch.int64)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.float32)  # [out]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch  # already loaded (a quantized model exists): a dictionary lookup
        rows = x.shape[:-1].numel()
        flat = x.reshape(rows, self.in_features).to(torch.float32)  # [rows, in]
        row_scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(TINY) / QMAX  # [rows, 1]
        quantized = torch.round(flat / row_scale).clamp(-QMAX, QMAX).to(torch.int8)  # [rows, in]
        if rows < MIN_ROWS:  # zero rows: rows never mix, so padding changes no row's bits
            quantized = torch.cat([quantized, quantized.new_zeros(MIN_ROWS - rows, self.in_features)])
        # x's scale is passed as 1 and applied per row below: oneDNN takes one scale a tensor.
        out = torch.ops.onednn.qlinear_pointwise(quantized, 1.0, 0, self.weight, self.scale, self.zero_points,
                                                 None, 1.0, 0, torch.float32, "none", [], "")  # [rows, out]
        out = out[:rows, :self.out_features] * row_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantizable(model) -> bool:
    """Whether ``model`` can run int8 here: float weights on a CPU with oneDNN."""
    import torch
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.float64)
            and torch.backends.mkldnn.is_available())


def quantize_linears(model) -> None:
    """Give every Linear of ``model`` an int8 forward and drop its float32 weight (once:
    modules shared with another model, like a layer-prefix draft's, are quantized once)."""
    import torch
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and "_rakv_int8" not in vars(module):
                module.forward = module._rakv_int8 = Int8Forward(module)
                module.register_parameter("weight", None)
                module.register_parameter("bias", None)


def gguf_is_quantized(path: Path) -> bool:
    """Whether a GGUF file holds quantized tensors (anything but F32, F16, BF16)."""
    import gguf
    plain = {"F32", "F16", "BF16", "F64"}
    return any(t.tensor_type.name not in plain for t in gguf.GGUFReader(str(path)).tensors)


def choose_weights(choice: str, quantized_source: bool, models) -> str:
    """The mode ``choice`` means for these models; raises ValueError (one line) where it
    cannot run. ``quantized_source``: the checkpoint is a quantized GGUF."""
    if choice not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {choice!r}")
    mode = (INT8 if quantized_source else FP32) if choice == AUTO else choice
    if mode == INT8 and not all(quantizable(m) for m in models if m is not None):
        raise ValueError("--weights int8 needs float32 or float64 models on a CPU with oneDNN")
    return mode


def tagged(fingerprint: str | None, mode: str) -> str | None:
    """The fingerprint of a model in ``mode``, from its float32 fingerprint."""
    if fingerprint is None or mode == FP32:
        return fingerprint
    return hashlib.blake2b(f"{fingerprint}|{FORMATS[mode]}".encode(), digest_size=16).hexdigest()


def with_weights(pair, choice: str, quantized_source: bool = False):
    """``pair`` (a ``rakv.models.ModelPair``) in the mode ``choose_weights`` picks: its
    Linear layers quantized in place, its fingerprints tagged with the mode."""
    mode = choose_weights(choice, quantized_source, (pair.target, pair.draft))
    if mode == INT8:
        from rakv.row_attention import use_row_exact_attention
        for model in (pair.target, pair.draft):
            if model is not None:
                quantize_linears(model)
                use_row_exact_attention(model)
    return dataclasses.replace(pair, weights=mode, target_fingerprint=tagged(pair.target_fingerprint, mode),
                               draft_fingerprint=tagged(pair.draft_fingerprint, mode))
