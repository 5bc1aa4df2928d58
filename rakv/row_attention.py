"""Attention whose rows never mix: a forward over T tokens gives each token the bits that
a one-token forward at its position gives it.

PyTorch's CPU attention splits a forward over T queries into blocks, and a row's sums
are added in an order that depends on T: a forward over 5 tokens and five one-token
forwards differ in the last bits of every layer's output (about 1e-7 relative). In
float32 the next Linear layer carries that along unchanged and greedy tokens almost never
flip. In int8 (``rakv.weights``) each Linear rounds its input to 255 levels a row, and a
difference in the last bit moves a value across a rounding boundary now and then: a
greedy token flipped on 3 of 3 SmolLM2 prompts under ``spec-k4``.

So every row runs the same code over its own keys, whatever T: the project's C kernel
(``attention_kernel.c``, in the library ``rakv.int4`` builds), for one token as for many.
Its sums have a fixed order, so a row's bits do not depend on T. Where the library cannot
be built, each row runs as a one-token decode step runs: Hugging Face's own SDPA
attention, one query, the keys and values up to and including its position, no mask.
Those two are different arithmetic, so which one runs is part of the model
(``rakv.weights.KERNEL_OPS``: bump it when the kernel's arithmetic changes). Either way, with the Linear layers' rows exact (int8 sums
are integers; oneDNN's packed float32 layers stream their weight once per row block, rows
never mixing) and every other op elementwise or per row, a verification forward over T
tokens equals T decode steps, and a prompt prefilled in one piece equals the same prompt
after a stored prefix.

Why a kernel: SDPA one row at a time cost a Qwen2.5-Coder-1.5B int8 target 93-102 ms of a
104-token prefill (550-630 ms) and 25-27 ms of a 9-token verification (181-192 ms); the
0.5B draft 68 of 221 ms and 15.5 of 68 (one thread, core 1).

Invariants:
- Batch size 1 with no padding (the engine's case, and HF greedy's reference): row i of T
  sees the first ``kv_length - T + 1 + i`` keys. Anything else (a batch, a padded mask)
  runs HF's SDPA unchanged, rows mixing.
- The name is registered with transformers' ``AttentionInterface`` on first use; importing
  this module loads no torch.
"""
from __future__ import annotations

ROW_EXACT = "rakv_row_exact"
PATH = -1  # the fastest path allowed here (rakv.kernels.FASTEST), or one of rakv.kernels.PATHS' indices


def row_exact_attention(module, query, key, value, attention_mask, **kwargs):
    """query [1, heads, T, dim], key/value [1, kv_heads, L, dim] -> ([1, T, heads, dim], None)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rakv.kernels import kernel_or_none
    num_rows, kv_length = query.shape[2], key.shape[2]
    plain = query.shape[0] == 1 and _causal(attention_mask, num_rows, kv_length)
    lib = kernel_or_none()  # None where the library cannot be built: SDPA rows, another arithmetic
    if plain and lib is not None and _kernel_takes(query, key, value, kwargs):
        # every T, one included: the kernel's rows are the model's attention
        return kernel_attention(lib, query, key, value, kwargs.get("scaling")), None
    if num_rows == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    if _one_query_call_is_plain(query, key, value, kwargs):
        # The one torch call HF's function makes for one query and no mask on a CPU, made
        # directly: its checks and reshapes cost more than the attention of a short row.
        scale, gqa = kwargs.get("scaling"), getattr(module, "num_key_value_groups", 1) > 1
        rows = [torch.nn.functional.scaled_dot_product_attention(
                    query[:, :, i:i + 1], key[:, :, :seen], value[:, :, :seen], attn_mask=None,
                    dropout_p=kwargs.get("dropout", 0.0), scale=scale, is_causal=False,
                    **({"enable_gqa": True} if gqa else {}))  # [1, heads, 1, dim]
                for i, seen in enumerate(range(kv_length - num_rows + 1, kv_length + 1))]
        return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None
    rows = []
    for i in range(num_rows):
        seen = kv_length - num_rows + 1 + i  # causal, no padding: this row's keys
        out, _ = sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :seen], value[:, :, :seen], None,
                                        is_causal=False, **kwargs)
        rows.append(out)  # [1, 1, heads, dim]
    return torch.cat(rows, dim=1), None


def kernel_attention(lib, query, key, value, scale: float | None):
    """query [1, heads, T, dim], key/value [1, kv_heads, L, dim] float32 -> [1, T, heads, dim],
    on the C kernel (``attention_kernel.c``): row i sees the first L - T + 1 + i keys."""
    import torch
    _, heads, num_rows, dim = query.shape
    out = torch.empty(1, num_rows, heads, dim)
    scale = dim ** -0.5 if scale is None else scale
    if lib.rakv_attention(query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), key.stride(1),
                          key.stride(2), value.data_ptr(), value.stride(1), value.stride(2), out.data_ptr(),
                          num_rows, heads, key.shape[1], key.shape[2], dim, scale, torch.get_num_threads(),
                          PATH):
        raise MemoryError(f"row-exact attention: no memory for {key.shape[2]} scores")
    return out


class ManyRequests:
    """The attention of a batched forward (``direct_forward.batched_logits``): several
    requests' rows, each against its own ``GrowingCache``, in one kernel call a layer
    (``rakv_attention_many``) where each request's own forward would run the kernel
    (``row_exact_attention``'s test, made at the first layer). That call appends each
    request's new keys and values to its cache and runs, for each, the very
    ``rakv_attention`` call its forward alone makes: the same bits, without a cache update
    and an attention call per request and layer from Python. ``finish`` after the last
    layer makes the appended positions part of the caches.

    ``parts``: (cache, first row, number of rows, mask) per request, in row order."""

    def __init__(self, lib, parts: list, num_layers: int):
        self.lib, self.parts, self.num_layers = lib, parts, num_layers
        self.fused: bool | None = None  # decided at the first layer
        self.layers: list = []  # per request, its cache's layers (GrowingLayer)

    def takes(self, query, key, value, kwargs) -> bool:
        """Whether the kernel runs every request's attention (asked at each layer; the
        first answer holds for the forward): what ``row_exact_attention`` asks of each."""
        if self.fused is None:
            from rakv.kv_cache import GrowingCache
            self.fused = (self.lib is not None and _kernel_takes(query, key, value, kwargs)
                          and all(isinstance(cache, GrowingCache) for cache, *_ in self.parts)
                          and all(_causal(mask, rows, cache.get_seq_length() + rows)
                                  for cache, _, rows, mask in self.parts))
            if self.fused:
                self._reserve(key)
        return self.fused

    def _reserve(self, key) -> None:
        import numpy as np
        kv_heads, dim = key.shape[1], key.shape[3]
        self.layers = [cache.grown_layers(self.num_layers, kv_heads, dim, key.dtype) for cache, *_ in self.parts]
        room = [[layer.reserve(rows) for layer in layers] for layers, (_, _, rows, _) in zip(self.layers, self.parts)]
        self.first = np.array([first for _, first, _, _ in self.parts], dtype=np.int32)
        self.rows = np.array([rows for _, _, rows, _ in self.parts], dtype=np.int32)
        self.length = np.array([own[0][2] for own in room], dtype=np.int32)
        # [layer, request]: each cache layer's key and value buffers [1, kv_heads, capacity, dim]
        self.keys = np.array([[own[i][0].data_ptr() for own in room] for i in range(self.num_layers)], np.uint64)
        self.values = np.array([[own[i][1].data_ptr() for own in room] for i in range(self.num_layers)], np.uint64)
        self.head_strides = np.array([[own[i][0].stride(1) for own in room] for i in range(self.num_layers)],
                                     np.int64)
        self.buffers = room  # kept alive while the kernel writes them

    def attend(self, index: int, query, key, value, scale: float | None):
        """Layer ``index``: query [1, heads, N, dim], the new key/value [1, kv_heads, N, dim]
        -> [1, N, heads, dim]."""
        import torch
        _, heads, num_rows, dim = query.shape
        out = torch.empty(1, num_rows, heads, dim)
        scale = dim ** -0.5 if scale is None else scale
        num = len(self.parts)
        if self.lib.rakv_attention_many(
                query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), key.stride(1), key.stride(2),
                value.data_ptr(), value.stride(1), value.stride(2), num, self.first.ctypes.data,
                self.rows.ctypes.data, self.length.ctypes.data, self.keys[index].ctypes.data,
                self.values[index].ctypes.data, self.head_strides[index].ctypes.data, out.data_ptr(), heads,
                key.shape[1], dim, scale, torch.get_num_threads(), PATH):
            raise MemoryError("row-exact attention: no memory for its scores")
        return out

    def finish(self) -> None:
        """The positions the layers appended join each cache."""
        for layers, (_, _, rows, _) in zip(self.layers, self.parts):
            for layer in layers:
                layer.extend(rows)


def _kernel_takes(query, key, value, kwargs) -> bool:
    """Whether the kernel computes this call: float32 on a CPU, each position's values
    contiguous, grouped heads, none of the optional inputs. None of it depends on T, so a
    model's every forward takes the same path."""
    import torch
    tensors = (query, key, value)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and query.shape[1] % key.shape[1] == 0
            and key.shape[:3] == value.shape[:3] and not kwargs.get("dropout")
            and not {"softcap", "position_bias", "output_attentions"} & kwargs.keys())


def _one_query_call_is_plain(query, key, value, kwargs) -> bool:
    """Whether HF's SDPA function, given one query row and no mask, would make exactly
    the call ``row_exact_attention`` makes: on a CPU (where it takes SDPA's own grouped
    heads when the head sizes allow) with none of its optional inputs."""
    return (query.device.type == "cpu" and key.shape[-1] == value.shape[-1] <= 256
            and not {"softcap", "position_bias", "output_attentions"} & kwargs.keys())


def _causal(attention_mask, num_rows: int, kv_length: int) -> bool:
    """Whether ``attention_mask`` (None, or a [1, 1, T, L] bool or additive mask) is the
    plain causal mask of T queries after ``L - T`` cached positions."""
    if attention_mask is None:
        return True
    import torch
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if mask.shape[0] != 1 or mask.shape[-2] != num_rows or mask.shape[-1] < kv_length:
        return False
    mask = mask[..., :kv_length].reshape(-1, num_rows, kv_length)  # [heads or 1, T, L]
    want = torch.ones(num_rows, kv_length, dtype=torch.bool, device=mask.device).tril(kv_length - num_rows)
    return bool((mask == want).all())


def use_row_exact_attention(model) -> None:
    """Run ``model``'s attention row by row (registers the function once)."""
    from transformers import AttentionInterface
    if ROW_EXACT not in AttentionInterface._global_mapping:
        AttentionInterface.register(ROW_EXACT, row_exact_attention)
    model.set_attn_implementation(ROW_EXACT)
