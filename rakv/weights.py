"""A pair's weights mode: its Linear layers in float32 or in int8, and exact in both.

A CPU decode step streams every weight once, so its time is its bytes over the memory
bandwidth: float32 Qwen2.5-Coder-1.5B streams 6.2 GB a step. ``int8`` holds each Linear's
weight as int8 with one scale per output channel (symmetric: scale = max|w| / 127) and
runs it on the project's C kernel (``rakv/int8_kernel.c``, in the library ``rakv.kernels``
builds: AVX2, 256-bit VNNI, AVX-512 VNNI or AMX tiles, whichever is fastest on the CPU at
hand, the same bits on each). Each forward quantizes its input per row (symmetric,
dynamic: the row's own max|x| / 127), so the kernel multiplies int8 by int8 into int32
sums, in one call per layer, the weights prefetched. Where the library cannot be built,
int8 is not offered: oneDNN's int8 inner product, its fallback until then, gave other bits
than the kernel on an AVX2 CPU, and whether its rows stay exact there was never shown.

Invariants:
- **Rows never mix, bit for bit.** A row's int32 sums are exact whatever order the kernel
  adds in, and everything after them (the channel scale, the row scale, the bias) is
  elementwise. So a row's result does not depend on how many rows come with it: a forward
  over T tokens gives each token the bits a one-token forward gives it, which is what
  exact speculation needs, on every CPU and every path of the kernel.
- **A mode is a model.** Outputs in int8 are another model's than in float32: the mode's
  format tag (``FORMATS``) goes into both fingerprints, so traces, stored KV, calibrations
  and learned policies of one mode never serve another. float32 fingerprints are those of
  the weights alone, as before modes existed.
- **Attention rows never mix either** (``rakv.row_attention``): int8 rounds every Linear's
  input, so the last-bit differences that float32 attention leaves between a forward over
  T tokens and T one-token forwards would now and then flip a rounding, and a greedy token.
  The quantized modes run it, and their RMSNorm, on the library's kernels (torch's SDPA
  row by row and HF's norm for a float64 model, whose norms the kernel does not take:
  another model, so ``tagged`` names which).
  float32 keeps PyTorch's attention: there those differences stay at 1e-7 and have never
  flipped a token in the test suite, and its shipped traces were timed with it.
- **No float32 copy.** In int4, an embedding the GGUF stores quantized keeps the file's
  rows (``gguf_groups.StoredRows``: the same bits in the file's bytes).
  A quantized Linear's float32 weight is dropped (its parameter is
  set to None); a weight tied to an embedding stays, as the embedding's. The quantized
  layer is a forward set on the module instance, as ``rakv.cpu_linear``'s packed one is,
  so Hugging Face's own ``generate`` runs the same layers (the reference for outputs).
- Inference only, on the CPU. Importing this module loads no torch (the command lines take
  ``WEIGHTS`` from here before parsing).

``int4`` holds each Linear's weight in groups of 32 inputs, w = a * q + b with 4-bit q
(``rakv.int4``): a GGUF's 4-bit tensors as the file stores them (``rakv.gguf_groups``), its
5, 6 and 8-bit ones as int8 per channel (4 bits would lose what the file holds), and float
weights quantized between each group's min and max. Which layer runs how is part of the
int4 fingerprint.

``int4-pure`` runs every Linear as 4-bit groups: the 4-bit tensors as stored, the others
(5-8-bit, float) quantized to groups, as llama.cpp's ``--pure`` quantizes every tensor to
one type. Fewer bytes, and another model. It is meant for a draft: a draft only
proposes, so its precision moves the acceptance and the speed, never the output. The
Qwen2.5-Coder 0.5B draft's file holds 132 Q5_0 tensors; as int4-pure its decode step
took 0.64-0.72x int8's (two runs), and it agreed with the int8 target on 91.7 % of six
HumanEval outputs' tokens where int8 agreed on 93.2 % (one run, core 1).

A pair's mode is one mode for both models, or ``TARGET/DRAFT``: ``int8/int4-pure`` runs
the target in int8 and its draft in int4-pure.

``auto`` is the fastest mode for the checkpoint on the CPU at hand, measured once and
cached: for a GGUF file with 4-bit tensors int4, int8 or fp32, for one with other
quantized tensors int8 or fp32, and fp32 for a float checkpoint (and where the kernels
cannot be built, with a warning). A pair's choice is resolved and applied by
``rakv.auto_weights`` (``with_weights``), above this module: here are the modes and how
one model's layers run in each.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable

from rakv.kernels import LANES, kernel, kernel_forward  # import no torch either

if TYPE_CHECKING:
    import torch

AUTO, FP32, INT8, INT4, INT4_PURE = "auto", "fp32", "int8", "int4", "int4-pure"
WEIGHTS = (AUTO, FP32, INT8, INT4, INT4_PURE)  # a model's choices; a pair's: MODE or TARGET/DRAFT
FOUR_BIT = (INT4, INT4_PURE)  # the modes of 4-bit groups, on the int4 kernel
# A change in how a mode quantizes is a new model: bump its tag and every fingerprint moves.
FORMATS = {INT8: "int8: per-channel symmetric weights, per-row dynamic symmetric activations, v1",
           INT4: "int4: groups of 32, w = a q + b, f16 units, per-group symmetric int8 activations, v2"}
FORMATS[INT4_PURE] = FORMATS[INT4]  # the same layers: the plan (how each Linear runs) tells the two apart
# How a quantized model's attention and norms compute, also part of it: on the C library's
# kernels (rakv.row_attention, rakv.layer_kernel), or in torch where it cannot be built.
KERNEL_OPS = "attention (row-exact) and RMSNorm on rakv's C kernels, v1"
TORCH_OPS = "attention as torch SDPA one row at a time, Hugging Face's RMSNorm"
WEIGHTS_HELP = ("precision of the Linear layers (rows stay exact; each mode is its own model): int4 runs a "
                "GGUF's 4-bit groups as stored (5-8 bit tensors as int8, float ones quantized to 4-bit groups); "
                "int8 per-channel int8 weights, per-row int8 activations; fp32 as loaded; auto: the fastest of "
                "these for a quantized GGUF on this CPU, measured once and cached (fp32 for a float checkpoint); "
                "int4-pure: every Linear "
                "as 4-bit groups (5-8 bit tensors re-quantized: fewer bytes, another model; for a draft). "
                "TARGET/DRAFT gives the draft its own mode, e.g. int8/int4-pure (default: auto)")
DEFAULT_WEIGHTS = AUTO
QMAX = 127  # symmetric: -127..127, so negating a value never overflows
TINY = 1e-30  # the scale of an all-zero row or channel: its integers are all 0 anyway


class Int8Forward:
    """A Linear's forward on int8 weights: x [..., in] -> [..., out] in x's dtype, on the
    library's kernel (``rakv/int8_kernel.c``: one call per layer, the weights prefetched,
    the fastest exact path of the CPU at hand). Raises ``KernelUnavailable`` where the
    library cannot be built: int8 has no other arithmetic (oneDNN's int8 inner product
    gave other bits on an AVX2 CPU, and whether its rows stay exact there is not known)."""

    def __init__(self, linear: torch.nn.Linear):
        import torch
        from rakv.kernels import FASTEST
        self.lib = kernel()
        weight = linear.weight.detach().to(torch.float32)  # [out, in]
        scale = weight.abs().amax(dim=1).clamp_min(TINY) / QMAX  # [out]
        quantized = torch.round(weight / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)  # [out, in]
        self.out_features, self.in_features = weight.shape
        self.kernel_in_features = -(-self.in_features // 4) * 4  # the kernel takes inputs in fours: zeros after
        padded = -(-self.out_features // LANES) * LANES  # the kernel writes whole blocks of 16
        if (padded, self.kernel_in_features) != tuple(quantized.shape):  # a copy only where needed (freed
            # copies of big layers stay as the heap's holes)
            quantized = torch.nn.functional.pad(quantized, (0, self.kernel_in_features - self.in_features,
                                                            0, padded - self.out_features))
        extra = padded - self.out_features
        # [block, in / 4, lane, 4]: 16 channels x 4 inputs per 64-byte load
        self.packed = quantized.view(padded // LANES, LANES, self.kernel_in_features // 4, 4) \
            .transpose(1, 2).contiguous()
        self.colsum = quantized.sum(dim=1, dtype=torch.int32)  # [padded]
        self.scale = torch.cat([scale, scale.new_ones(extra)])  # [padded]
        self.bias = None if linear.bias is None else \
            torch.cat([linear.bias.detach().to(torch.float32), scale.new_zeros(extra)])  # [padded]
        self.padded = padded
        self.path = FASTEST  # or one of rakv.kernels.PATHS' indices (tests compare them)
        self.layer_arguments = self.arguments()

    TENSORS = ("packed", "colsum", "scale", "bias")  # each [blocks or padded, ...]

    def arguments(self) -> tuple:
        """The kernel's arguments that never change, from packed to n (the tensors stay held)."""
        return (self.packed.data_ptr(), self.colsum.data_ptr(), self.scale.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), self.padded)

    @property
    def num_bytes(self) -> int:
        """The bytes this layer holds: its int8 weight (padded to 16 channels), the channel
        sums and scales, and the bias."""
        held = (self.packed, self.colsum, self.scale, self.bias)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_forward(self, self.lib.rakv_int8_linear, x, INT8)


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Quantizing frees float32 weights and big temporaries, and the heap kept them
    resident as holes: about 1 GB of the Qwen pair's own memory in int8 and in int4."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def quantizable(model) -> bool:
    """Whether ``model`` can run int8 or int4 here: float weights on a CPU."""
    import torch
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype in (torch.float32, torch.float64)


def quantize_linears(model, mode: str, stored: dict) -> tuple[str, ...]:
    """Give every Linear of ``model`` a forward in ``mode`` and drop its float32 weight (in
    int4, each embedding the file stores quantized too: ``StoredRows``, the same bits);
    returns how each Linear runs ("name=int8", "name=int4:Q4_K", ...), in module order.
    ``stored``: ``rakv.gguf_groups.stored_linears`` of the model's GGUF, or {}. Modules
    shared with another model (a layer-prefix draft's) are quantized once."""
    import torch
    from rakv import int4
    from rakv.gguf_groups import StoredRows
    plan = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding) and isinstance(stored.get(name), StoredRows) \
                    and mode in FOUR_BIT and "_rakv_quantized" not in vars(module):
                # the same bits in the file's bytes: not another model, so not in the plan
                module.forward = module._rakv_quantized = stored[name]
                module.register_parameter("weight", None)
            if not isinstance(module, torch.nn.Linear):
                continue
            if "_rakv_quantized" not in vars(module):
                _, make = linear_forward(mode, module, stored.get(name))
                module.forward = module._rakv_quantized = make()
                module.register_parameter("weight", None)
                module.register_parameter("bias", None)
            forward = module._rakv_quantized
            plan.append(f"{name}={'int4:' + forward.source if isinstance(forward, int4.Int4Forward) else INT8}")
    return tuple(plan)


def linear_forward(mode: str, module, source) -> tuple[str, Callable[[], object]]:
    """How the quantized ``mode`` runs a Linear its checkpoint stores as ``source`` (a
    ``rakv.gguf_groups.stored_linears`` value, or None): its plan entry ("int8",
    "int4:Q4_K", "int4:float"), and a maker of that forward. In int4 and int4-pure a
    stored 4-bit tensor runs as stored; in int4 a 5-8 bit one in int8 (4 bits would lose
    what the file holds); in both a float one (int4-pure: any other) in 4-bit groups
    where its shape allows; the rest in int8."""
    from rakv import int4
    from rakv.gguf_groups import PLAIN
    four_bit = mode in FOUR_BIT
    if four_bit and isinstance(source, int4.GroupedWeight):
        return f"int4:{source.source}", lambda: int4.Int4Forward(module, source)
    int8 = (INT8, lambda: Int8Forward(module))
    if mode == INT4 and source is not None and source not in PLAIN:
        return int8  # 5-8 bits: int8 keeps what the file holds
    if four_bit and int4.packable(module.weight.shape):
        return "int4:float", lambda: int4.Int4Forward(module, int4.quantize_groups(module.weight))
    return int8


def tagged(fingerprint: str | None, mode: str, plan: tuple[str, ...] = (), ops: str = KERNEL_OPS) -> str | None:
    """The fingerprint of a model in ``mode``, from its float32 fingerprint; ``plan``: how
    each Linear runs in int4 (``quantize_linears``), which makes it another model. So do
    ``ops``: how its attention and norms compute (``KERNEL_OPS`` or ``TORCH_OPS``)."""
    if fingerprint is None or mode == FP32:
        return fingerprint
    detail = "|" + ";".join(plan) if mode in FOUR_BIT else ""
    return hashlib.blake2b(f"{fingerprint}|{FORMATS[mode]}|{ops}{detail}".encode(), digest_size=16).hexdigest()


def split_modes(spec: str) -> tuple[str, str | None]:
    """A pair's ``--weights``: MODE, or TARGET/DRAFT -> (target's choice, draft's or None
    for the same). Raises ValueError (one line)."""
    target, slash, draft = spec.partition("/")
    if target not in WEIGHTS or (slash and draft not in WEIGHTS):
        raise ValueError(f"--weights must be MODE or TARGET/DRAFT, each one of {', '.join(WEIGHTS)}; got {spec!r}")
    return target, draft if slash else None
