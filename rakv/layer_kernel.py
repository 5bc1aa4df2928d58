"""Rotary embedding and RMSNorm on the C kernel (``layer_kernel.c``, in the library
``rakv.int4`` builds): one call each where torch takes 5-8 ops.

Why: after the Linear layers, a Qwen2.5-Coder 0.5B int4-pure draft step spent about 14 of
its 46 ms in small ops and their dispatch (cProfile): RMSNorm's mean alone cost 25 us a
call, 49 calls a step, and the two rotary embeddings of a layer about 60 us.

Invariants:
- ``rope`` gives Hugging Face's bits (the same three roundings per element), so
  ``rakv.direct_forward`` runs it in every float32 model where the library exists; the
  torch expression otherwise, the same bits.
- ``KernelRMSNorm`` is another arithmetic than HF's (its sum of squares has its own fixed
  order), so it runs only where ``use_kernel_norms`` puts it: the quantized modes
  (``rakv.weights``), whose fingerprints name it. It is set as the norm module's instance
  ``forward``, so HF's own ``generate`` runs it too (the reference for outputs).
- Rows never mix: each row is normalized alone.
- Importing this module loads no torch.
"""
from __future__ import annotations

NORM_CLASSES = {"LlamaRMSNorm", "Qwen2RMSNorm"}
PATH = -1  # the fastest path allowed here (rakv.kernels.FASTEST), or one of rakv.kernels.PATHS' indices


def rope(lib, query, key, cos, sin):
    """HF's ``apply_rotary_pos_emb``: query [1, heads, T, dim], key [1, kv_heads, T, dim]
    float32 on a CPU, each position's dim values contiguous (views of a Linear's output);
    cos, sin [1, 1, T, dim] as HF's rotary embedding makes them -> (query, key) rotated,
    contiguous."""
    import torch
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    query_out, key_out = torch.empty(1, heads, rows, dim), torch.empty(1, kv_heads, rows, dim)
    lib.rakv_rope(query.data_ptr(), query.stride(1), query.stride(2), heads, key.data_ptr(), key.stride(1),
                  key.stride(2), kv_heads, rows, dim, cos.data_ptr(), sin.data_ptr(), query_out.data_ptr(),
                  key_out.data_ptr(), PATH)
    return query_out, key_out


class KernelRMSNorm:
    """A norm module's forward on the kernel: hidden [..., n] float32 -> [..., n]."""

    def __init__(self, module, lib):
        self.lib = lib
        self.weight = module.weight  # [n] the module's own tensor
        self.eps = float(module.variance_epsilon)

    def __call__(self, hidden):
        import torch
        x = hidden if hidden.is_contiguous() else hidden.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self.lib.rakv_rms_norm(x.data_ptr(), x.numel() // n, n, self.weight.data_ptr(), self.eps, out.data_ptr(),
                               PATH)
        return out


def use_kernel_norms(model) -> bool:
    """Run ``model``'s RMSNorm modules on the kernel, where the library exists and the
    model is float32; returns whether it does."""
    import torch
    from rakv.kernels import kernel_or_none
    lib = kernel_or_none()
    norms = [m for m in model.modules() if type(m).__name__ in NORM_CLASSES]
    if lib is None or any(m.weight.dtype != torch.float32 or not m.weight.is_contiguous() for m in norms):
        return False
    for module in norms:
        module.forward = KernelRMSNorm(module, lib)
    return True
