"""A Llama-family decoder's forward as plain calls: Hugging Face's arithmetic, bit for bit,
without its per-module machinery.

A decode step of the Qwen 0.5B draft in int8 spent about 20 of its 60-75 ms outside any
op: ``nn.Module.__call__`` on some 300 modules, keyword plumbing, deprecation wrappers
and config lookups in every layer (cProfile). Here a layer is one function over the
tensors and Linear forwards a ``LayerPlan`` gathered once per model.

Invariants:
- The same torch ops on the same tensors, in the same order, as the Hugging Face
  modules they stand for (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, transformers 5.24):
  the logits are HF's bit for bit (tests/test_direct_forward.py compares them, and the
  engine's outputs equal HF ``generate``). Skipped are only calls that return their input
  (a ``.to`` to the tensor's own dtype).
- Each Linear runs through its module's ``forward`` attribute at call time, so a kernel
  swapped in later (``rakv.cpu_linear``, ``rakv.weights``, the benches' labels) is the
  one that runs; where q/k/v or gate/up are joined (``rakv.joined_linears``: one kernel
  call, each part's bits), the joined call runs only while each module still runs its
  part. A norm runs its module's instance ``forward`` where the quantized modes set one
  (``rakv.layer_kernel``), else HF's arithmetic on the module's own weight.
- Any other architecture, a model in training mode, or one whose forward was wrapped (an
  instance ``forward``, forward hooks on it, or hooks on an inner module when the plan is
  built) gets ``None`` from ``plan_of`` and runs through Hugging Face's forward
  unchanged. A hook put on an inner module after the plan exists is not run.
"""
from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rakv import layer_kernel
from rakv.kernels import kernel_or_none
from rakv.row_attention import ManyRequests, row_exact_attention

_LAYER_CLASSES = {"LlamaDecoderLayer", "Qwen2DecoderLayer"}
_NORM_CLASSES = {"LlamaRMSNorm", "Qwen2RMSNorm"}
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ModelPlan | None


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's parts, gathered so a step looks none of them up."""

    norm_in: Callable[[torch.Tensor], torch.Tensor]  # input_layernorm's arithmetic (``norm_of``)
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    attention: torch.nn.Module  # the self_attn module: the attention function reads its fields
    attention_kwargs: dict  # what HF's attention module passes besides the tensors
    head_dim: int
    index: int
    norm_post: Callable[[torch.Tensor], torch.Tensor]  # post_attention_layernorm's
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module
    qkv: object = None  # q, k and v as one kernel call (``rakv.joined_linears.Joined``), or None
    gate_up: object = None  # gate and up likewise


@dataclass(frozen=True)
class ModelPlan:
    layers: tuple[LayerPlan, ...]
    inner: torch.nn.Module  # model.model: embeddings, rotary embedding
    norm: Callable[[torch.Tensor], torch.Tensor]  # the final norm's arithmetic
    head: torch.nn.Module
    eager: object  # the modeling module's eager attention, HF's fallback for an unknown name
    create_causal_mask: object
    library: object  # the C library (``rakv.kernels.kernel_or_none``), or None where it cannot be built


def plan_of(model) -> ModelPlan | None:
    """``model``'s plan, built on first use; None where this module does not apply
    (another architecture, training mode: dropout, or a forward someone wrapped: an
    instance ``forward`` or hooks on the model run as they would under HF's call)."""
    if model.training or "forward" in vars(model) or model._forward_hooks or model._forward_pre_hooks:
        return None
    if model not in _PLANS:
        _PLANS[model] = _build(model)
    return _PLANS[model]


def _build(model) -> ModelPlan | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        return None
    config = model.config
    used = list(layers[:config.num_hidden_layers])
    if not used or any(type(layer).__name__ not in _LAYER_CLASSES for layer in used) \
            or type(inner.norm).__name__ not in _NORM_CLASSES \
            or getattr(config, "pretraining_tp", 1) != 1:
        return None
    modeling = sys.modules[type(used[0]).__module__]
    plans = []
    for index, layer in enumerate(used):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer.input_layernorm).__name__ not in _NORM_CLASSES \
                or type(layer.post_attention_layernorm).__name__ not in _NORM_CLASSES:
            return None
        kwargs = {"dropout": 0.0, "scaling": attn.scaling}
        if hasattr(attn, "sliding_window"):  # Qwen2 passes it, Llama does not
            kwargs["sliding_window"] = attn.sliding_window
        plans.append(LayerPlan(norm_of(layer.input_layernorm), attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                               attn, kwargs, attn.head_dim, attn.layer_idx, norm_of(layer.post_attention_layernorm),
                               mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn,
                               vars(attn).get("_rakv_joined"), vars(mlp).get("_rakv_joined")))
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(used)
    if any(kind != "full_attention" for kind in layer_types[:len(used)]):
        return None  # sliding-window layers take another mask: HF's forward builds it
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return None  # plain calls would skip an inner module's hooks
    return ModelPlan(tuple(plans), inner, norm_of(inner.norm), model.lm_head, modeling.eager_attention_forward,
                     modeling.create_causal_mask, kernel_or_none())


def norm_of(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A norm module's arithmetic: its instance ``forward`` where one was set (the quantized
    modes' kernel, ``rakv.layer_kernel``; set before the plan is built), else HF's."""
    return vars(module).get("forward") or functools.partial(rms_norm, weight=module.weight,
                                                            eps=module.variance_epsilon)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm: [..., hidden] -> [..., hidden]."""
    dtype = hidden.dtype
    x = hidden if dtype == torch.float32 else hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: [..., d] -> [..., d], the halves swapped and the second negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def layer_forward(plan: LayerPlan, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Callable, kernel=None) -> torch.Tensor:
    """One decoder layer: hidden [1, T, hidden] -> [1, T, hidden]; cos/sin [1, 1, T, head_dim];
    ``attend(plan, query, key, value)``: the cache update and attention of the T rows
    (``_attend``, or ``_attend_each`` for many requests' rows); ``kernel``: the C library,
    where the rotary embedding runs on it."""
    residual = hidden
    x = plan.norm_in(hidden)
    shape = (*x.shape[:-1], -1, plan.head_dim)
    if plan.qkv is not None and plan.qkv.current((plan.q, plan.k, plan.v)):
        query, key, value = plan.qkv(x)  # one kernel call, each part's bits
    else:
        query, key, value = plan.q.forward(x), plan.k.forward(x), plan.v.forward(x)
    query = query.view(shape).transpose(1, 2)  # [1, heads, T, head_dim]
    key = key.view(shape).transpose(1, 2)  # [1, kv_heads, T, head_dim]
    value = value.view(shape).transpose(1, 2)
    if kernel is not None:  # HF's bits in one call
        query, key = layer_kernel.rope(kernel, query, key, cos, sin)
    else:
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
    out = attend(plan, query, key, value)  # [1, T, heads, head_dim]
    out = out.reshape(*x.shape[:-1], -1).contiguous()  # [1, T, heads * head_dim]
    hidden = residual + plan.o.forward(out)
    residual = hidden
    x = plan.norm_post(hidden)
    if plan.gate_up is not None and plan.gate_up.current((plan.gate, plan.up)):
        gate, up = plan.gate_up(x)
    else:
        gate, up = plan.gate.forward(x), plan.up.forward(x)
    return residual + plan.down.forward(plan.act.forward(gate) * up)


@dataclass(frozen=True)
class _Rows:
    """One request's rows in a forward: where they lie, and what HF's layers pass its attention."""

    start: int
    stop: int
    cache: object
    mask: object
    extra: dict  # position_ids [1, T] and use_cache, as HF's layers pass them on


def _attend(rows: _Rows, attention) -> Callable:
    """The cache update and attention of one request's rows, as HF's attention module makes them."""
    def attend(plan: LayerPlan, query, key, value):
        if rows.cache is not None:
            key, value = rows.cache.update(key, value, plan.index, kwargs=rows.extra)
        return attention(plan.attention, query, key, value, rows.mask, **plan.attention_kwargs, **rows.extra)[0]
    return attend


def _attend_each(parts: list[_Rows], attention, many: ManyRequests | None) -> Callable:
    """``_attend`` for each request's rows of a batched forward, on views of them: the calls
    each request's forward alone makes, so its rows never meet another's. ``many``: where
    those calls would each run the row-exact kernel, all of them in one (``ManyRequests``)."""
    def attend(plan: LayerPlan, query, key, value):
        if many is not None and many.takes(query, key, value, {**plan.attention_kwargs, **parts[0].extra}):
            return many.attend(plan.index, query, key, value, plan.attention_kwargs.get("scaling"))
        outs = []
        for rows in parts:
            k, v = rows.cache.update(key[:, :, rows.start:rows.stop], value[:, :, rows.start:rows.stop], plan.index,
                                     kwargs=rows.extra)
            outs.append(attention(plan.attention, query[:, :, rows.start:rows.stop], k, v, rows.mask,
                                  **plan.attention_kwargs, **rows.extra)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return attend


def _rotary(plan: ModelPlan, embeds: torch.Tensor, position_ids: torch.Tensor):
    """cos, sin [1, 1, T, head_dim] (as apply_rotary_pos_emb takes them), and the C library
    where the rotary embedding can run on it."""
    cos, sin = plan.inner.rotary_emb(embeds, position_ids)  # [1, T, head_dim]: each row from its position alone
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    kernel = plan.library if cos.dtype == torch.float32 and cos.device.type == "cpu" and cos.is_contiguous() \
        else None
    return cos, sin, kernel


def _attention_function(model, plan: ModelPlan):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, plan.eager)


def _rows_of(plan: ModelPlan, model, cache, embeds: torch.Tensor, start: int = 0) -> _Rows:
    """A request's rows ``embeds`` [1, T, hidden] after its cache's positions (the mask is
    made before any layer updates the cache, as HF makes it)."""
    past = cache.get_seq_length() if cache is not None else 0
    position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + past).unsqueeze(0)  # [1, T]
    mask = plan.create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                                   position_ids=position_ids)
    return _Rows(start, start + embeds.shape[1], cache, mask, {"position_ids": position_ids,
                                                               "use_cache": cache is not None})


def logits(plan: ModelPlan, model, cache, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
    """ids [1, T] after the cache's positions -> logits [1, num_logits, vocab], as
    ``model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=num_logits)``."""
    embeds = plan.inner.embed_tokens(ids)  # [1, T, hidden]
    rows = _rows_of(plan, model, cache, embeds)
    cos, sin, kernel = _rotary(plan, embeds, rows.extra["position_ids"])
    attend = _attend(rows, _attention_function(model, plan))
    hidden = embeds
    for layer in plan.layers:
        hidden = layer_forward(layer, hidden, cos, sin, attend, kernel)
    hidden = plan.norm(hidden)
    return plan.head(hidden[:, -num_logits:, :])


def batched_logits(plan: ModelPlan, model, caches: list, token_ids: list[list[int]],
                   num_logits: list[int]) -> list[torch.Tensor | None]:
    """One forward over several requests' rows: request i's ``token_ids[i]`` after the
    positions of ``caches[i]`` -> its logits [num_logits[i], vocab] for its last rows (None
    for 0).

    Embeddings, norms, Linear layers and the MLP run over all the rows at once; positions,
    masks, cache updates and attention per request, the very calls a forward of that
    request alone makes (``_attend_each``). So wherever a Linear's rows never mix (the
    int8/int4 kernels' integer sums, oneDNN's packed rows) and attention's rows do not
    depend on their count (``rakv.row_attention``), each request gets the bits
    ``logits`` gives it alone: batching changes no token."""
    lengths = [len(ids) for ids in token_ids]
    ids = torch.tensor([[t for part in token_ids for t in part]], dtype=torch.long, device=model.device)  # [1, N]
    embeds = plan.inner.embed_tokens(ids)  # [1, N, hidden]
    parts, start = [], 0
    for cache, length in zip(caches, lengths):
        parts.append(_rows_of(plan, model, cache, embeds[:, start:start + length], start))
        start += length
    position_ids = torch.cat([rows.extra["position_ids"] for rows in parts], dim=1)  # [1, N]
    cos, sin, kernel = _rotary(plan, embeds, position_ids)
    attention = _attention_function(model, plan)
    many = ManyRequests(plan.library, [(rows.cache, rows.start, rows.stop - rows.start, rows.mask) for rows in parts],
                        len(plan.layers)) if attention is row_exact_attention else None
    attend = _attend_each(parts, attention, many)
    hidden = embeds
    for layer in plan.layers:
        hidden = layer_forward(layer, hidden, cos, sin, attend, kernel)
    if many is not None and many.fused:
        many.finish()
    # only the rows whose logits are wanted go through the final norm and the head (per-row ops)
    wanted = [i for rows, n in zip(parts, num_logits) for i in range(rows.stop - n, rows.stop)]
    if not wanted:
        return [None] * len(parts)
    out = plan.head(plan.norm(hidden[:, wanted, :]))[0]  # [sum(num_logits), vocab]
    result, at = [], 0
    for n in num_logits:
        result.append(out[at:at + n] if n else None)
        at += n
    return result
