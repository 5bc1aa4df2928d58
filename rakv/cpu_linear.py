"""Linear layers on oneDNN with weights packed once: on a CPU, a forward over a few tokens
costs what a forward over one token costs, which is what speculation needs.

With one thread, PyTorch's default CPU matmul (MKL sgemm) re-reads a Linear's weight for
every row when it has 2 or 3 rows: on Qwen2.5-Coder-1.5B a forward over 2 tokens took
2.1 one-token steps and over 3 tokens 3.0, so verifying a draft cost almost what decoding
its tokens one by one would. oneDNN's inner product over a weight reordered once into its
blocked layout streams that weight once for up to about 6 rows, and is fastest at 4 to 6
rows; forwards with fewer rows are padded with zero rows to ``MIN_ROWS``. Measured with
``python -m bench.cpu_linear`` (one thread; the figures are in the README).

Invariants:
- Packing changes no module structure and no parameter: each ``nn.Linear`` keeps its
  weight (tied embeddings, state dicts and fingerprints are untouched) and only gains an
  instance ``forward``; ``stock_linears`` removes it for a while (HF's own numbers).
- Results equal the stock layer's up to float rounding; rows never mix (each output row
  depends on its input row only), so padding changes no row's bits.
- Inference only: no gradient flows through a packed layer.
- Only float32 weights on the CPU are packed (oneDNN has no float64 inner product, and
  bfloat16 needs CPU support we do not check for); anything else keeps the stock kernels.
- Importing this module loads no torch (each function imports it): the command lines that
  offer ``--linear-kernels`` take ``LINEAR_KERNELS`` from here and parse their arguments
  without loading torch. ``rakv.models`` imports this module, never the reverse.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rakv.weights import FP32

if TYPE_CHECKING:
    import torch

ONEDNN, STOCK = "onednn", "stock"
LINEAR_KERNELS = ("auto", ONEDNN, STOCK)  # the choices of --linear-kernels
LINEAR_KERNELS_HELP = ("Linear layers on the CPU: onednn runs them on weights packed once, so a forward over a few "
                       "tokens costs about one step (speculation pays; one more copy of the weights in memory); "
                       "stock is PyTorch's default; auto: onednn for float32 on a CPU (default: auto)")
MIN_ROWS = 4  # fewer rows take a slower oneDNN path: 1 token cost 1.25x 4 on the Qwen 1.5B model
LAYOUT_ROWS = 8  # the row count oneDNN picks its blocked weight layout for


class PackedForward:
    """A Linear's forward on its oneDNN-packed weight: x [..., in] -> [..., out]."""

    def __init__(self, linear: torch.nn.Linear):
        import torch
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), LAYOUT_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch  # already loaded (a packed model exists): a dictionary lookup
        rows = x.shape[:-1].numel()
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        if rows < MIN_ROWS:
            flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def packable(model) -> bool:
    """Whether ``model``'s Linear layers can run on packed oneDNN weights here."""
    import torch
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def choose_kernels(choice: str, models) -> str:
    """``auto``: oneDNN where every model is packable, else stock. Raises ValueError when
    ``onednn`` is asked for models it cannot run."""
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"linear kernels must be one of {', '.join(LINEAR_KERNELS)}, got {choice!r}")
    if choice == STOCK:
        return STOCK
    fits = all(packable(m) for m in models if m is not None)
    if choice == ONEDNN and not fits:
        raise ValueError("--linear-kernels onednn needs float32 models on a CPU with oneDNN")
    return ONEDNN if fits else STOCK


def with_kernels(pair, choice: str):
    """``pair`` (a ``rakv.models.ModelPair``) on the kernels ``choose_kernels`` picks:
    its models' float32 Linear layers packed in place for oneDNN (quantized ones, which
    ``rakv.weights`` gave a forward of their own, are left as they are)."""
    if pair.weights != FP32 and choice == STOCK:
        raise ValueError(f"--linear-kernels stock is for fp32 weights; {pair.weights} weights run on oneDNN")
    kernels = choose_kernels(choice, (pair.target, pair.draft))
    if kernels == ONEDNN:
        for model in (pair.target, pair.draft):
            if model is not None:
                pack_linears(model)
    return dataclasses.replace(pair, linear_kernels=kernels)


def pack_linears(model) -> None:
    """Give every Linear of ``model`` a packed forward (once: modules shared with another
    model, like a layer-prefix draft's, are packed once, and so is a module whose packed
    forward ``stock_linears`` has taken away for a while). A forward another library set
    on the instance (a hook) is left alone."""
    import torch
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and not {"forward", "_rakv_packed"} & vars(module).keys():
                module.forward = module._rakv_packed = PackedForward(module)


@contextmanager
def stock_linears(*models):
    """The stock forwards of ``models``' packed Linear layers while the block runs."""
    # dict: a module shared by two models (a layer-prefix draft's) is switched once
    packed = list({id(m): m for model in models if model is not None
                   for m in model.modules() if "_rakv_packed" in vars(m)}.values())
    for module in packed:
        del module.forward
    try:
        yield
    finally:
        for module in packed:
            module.forward = module._rakv_packed
