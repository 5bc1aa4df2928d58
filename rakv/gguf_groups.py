"""A GGUF file's Linear weights as they are stored: 4-bit groups as they are, and the
class of every other tensor, keyed by the model's module names.

GGUF's 4-bit types hold each group of 32 weights as w = a * q + b with q in 0..15:
Q4_0 (a = d, b = -8 d), Q4_1 (a = d, b = m) and Q4_K (a = d * sc, b = -dmin * m, with
6-bit sc and m per group and f16 d and dmin per super-block of 256). ``read_linears`` returns them in that form
(``rakv.int4.GroupedWeight``), so int4 mode runs the file's own weights, not a second
quantization of them.

An embedding stored quantized (any GGUF type) is kept as the file's raw rows and
dequantized a lookup at a time (``StoredRows``): the same bits as the float weight it
replaces, in the file's bytes (Qwen2.5-Coder-1.5B's: 934 MB in float32, 125 MB as Q4_K).

Invariant: groups and rows are used only if they equal, bit for bit, the weight the model
was loaded with (the same file dequantized by gguf-py); any other tensor, or one whose
name or row order this module gets wrong, is reported by its type only, and its Linear is
quantized from the loaded weight like a float checkpoint's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
PLAIN = ("F32", "F16", "BF16", "F64")  # not quantized
SUPER = 256  # weights per Q4_K super-block
CACHE_FORMAT = 4  # bump when what ``read_linears`` returns changes: older cached files are not read


def _groups(kind: str, blocks: np.ndarray, out: int, inputs: int):
    """q [out, in], a_step, b_step [out, groups] uint8 and a_unit, b_unit [out, units]
    float32 (``rakv.int4.GroupedWeight``) from one tensor's raw blocks [out, bytes]."""
    f16 = lambda raw: raw.copy().view(np.float16).astype(np.float32)  # noqa: E731
    if kind == "Q4_K":
        blocks = blocks.reshape(-1, 144)  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])  # [supers, 1]
        from gguf.quants import Q4_K
        a_step, b_step = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [supers, 8] each: a = d sc, b = -dmin m
        a_unit, b_unit = d, -dmin
        nibbles = blocks[:, 16:].reshape(-1, 4, 1, 32)  # each 32 bytes: low nibbles one group, high the next
    else:
        size = 18 if kind == "Q4_0" else 20  # d (f16), [m (f16)], 16 bytes of nibbles
        blocks = blocks.reshape(-1, size)
        a_unit = f16(blocks[:, 0:2])
        b_unit = np.float32(-8) * a_unit if kind == "Q4_0" else f16(blocks[:, 2:4])
        a_step = b_step = np.ones_like(blocks[:, 0:1])
        nibbles = blocks[:, size - 16:].reshape(-1, 1, 1, 16)  # low nibbles inputs 0..15, high 16..31
    q = (nibbles >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return (q.reshape(out, inputs), *(t.astype(np.uint8).reshape(out, -1) for t in (a_step, b_step)),
            *(t.reshape(out, -1) for t in (a_unit, b_unit)))


def _reverse_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for q and k (what transformers does on loading)."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


class StoredRows:
    """An embedding's forward on the file's raw rows: ids [...] -> [..., dim] float32, each
    row dequantized by gguf-py as transformers dequantized the whole table on loading."""

    def __init__(self, raw, source: str, dim: int):
        self.raw, self.source, self.dim = raw, source, dim  # raw [vocab, bytes per row] uint8; source: its type

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()  # uint8

    def __call__(self, ids):
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        rows = dequantize(self.raw[ids.reshape(-1)].numpy(), GGMLQuantizationType[self.source])
        return torch.from_numpy(rows.reshape(*ids.shape, self.dim))


def stored_linears(path: Path, model) -> dict[str, object]:
    """``read_linears``, cached: reading and checking a GGUF takes 10-40 s (its vocabulary
    fields alone take 20 s to parse), so the result is kept beside the file's float
    conversion (keyed by the file's path, size and mtime, and the model's module names)
    and loaded from there afterwards in about a second."""
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    from rakv.int4 import GroupedWeight
    from rakv.model_files import cache_root, file_key
    names = [name for name, _ in model.named_modules()]
    cached = cache_root() / "converted" / f"{path.stem}-groups-{file_key(path, CACHE_FORMAT, *names)}.safetensors"
    if cached.is_file():
        with safe_open(str(cached), "pt") as handle:
            kinds = json.loads(handle.metadata()["kinds"])
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        modules = dict(model.named_modules())
        return {name: GroupedWeight(*(tensors[f"{name}.{part}"] for part in GroupedWeight.TENSORS), kind)
                if f"{name}.q" in tensors else StoredRows(tensors[f"{name}.raw"], kind, modules[name].embedding_dim)
                if f"{name}.raw" in tensors else kind for name, kind in kinds.items()}
    found = read_linears(path, model)
    tensors = {}
    for name, stored in found.items():
        if isinstance(stored, StoredRows):
            tensors[f"{name}.raw"] = stored.raw
        elif isinstance(stored, GroupedWeight):
            tensors.update(zip((f"{name}.{part}" for part in GroupedWeight.TENSORS), stored.tensors()))
    kinds = {name: g if isinstance(g, str) else g.source for name, g in found.items()}
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(cached.name + ".partial")
    save_file(tensors, str(partial), metadata={"kinds": json.dumps(kinds)})
    partial.replace(cached)  # atomic: a crash never leaves half a file in use
    return found


def read_linears(path: Path, model) -> dict[str, object]:
    """Module name -> ``GroupedWeight`` for each Linear stored in 4-bit groups, and
    ``StoredRows`` for each quantized embedding, that match the loaded weight bit for bit;
    the GGUF type name of its tensor otherwise (absent where the file has no tensor)."""
    import gguf
    import torch
    from rakv.int4 import GroupedWeight
    reader = gguf.GGUFReader(str(path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers) if arch is not None else None
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or names is None:
            continue
        base = names.get_name(name)
        if base == "output" and "output.weight" not in tensors and getattr(config, "tie_word_embeddings", False):
            base = "token_embd"  # a tied head is stored once, as the embedding
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None:
            continue
        kind = tensor.tensor_type.name
        found[name] = kind
        if isinstance(module, torch.nn.Embedding):
            if kind not in PLAIN:
                rows = StoredRows(torch.from_numpy(np.array(tensor.data)).view(module.num_embeddings, -1), kind,
                                  module.embedding_dim)
                if torch.equal(rows(torch.arange(module.num_embeddings)), module.weight.detach()):
                    found[name] = rows
            continue
        out, inputs = module.weight.shape
        if kind not in FOUR_BIT or inputs % 32 or (kind == "Q4_K" and inputs % SUPER):
            continue
        parts = _groups(kind, np.asarray(tensor.data), out, inputs)
        if arch_name == "llama" and base.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if base.endswith("attn_q") else config.num_key_value_heads
            parts = [_reverse_permute(t, heads) for t in parts]
        grouped = GroupedWeight(*(torch.from_numpy(np.ascontiguousarray(t)) for t in parts), kind)
        if torch.equal(grouped.dequantized(), module.weight.detach().to(torch.float32)):
            found[name] = grouped
    return found
