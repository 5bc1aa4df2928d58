"""The project's C library: its kernels (int4 and int8 Linear layers, row-exact attention,
rotary embedding and RMSNorm), built once, and which vector path they run.

Invariants:
- **Built once, never silently different.** The library is compiled from the sources
  with the system C compiler into the cache (``<cache root>/kernels/``), keyed by the
  sources, the compiler and the flags, written atomically. Where it cannot be built,
  ``kernel()`` raises ``KernelUnavailable`` (one line) and the quantized modes are not
  offered; nothing falls back to another arithmetic under the same name.
- **Every path gives the same bits.** Each kernel has a portable path and vector paths
  (``PATHS``: AVX2, 256-bit VNNI, AVX-512 VNNI, AMX), chosen at run time for the CPU at
  hand; its integer sums are exact and its float operations the same in the same order
  on each (the kernels' comments say how). So which path ran is the machine's speed, not
  the model: it keys calibrations (``rakv.calibrate``), never fingerprints. Tests force
  each path the CPU runs (``paths_here``), and ``RAKV_KERNEL_PATH=avx2`` (any name of
  ``PATHS``) caps a whole process at one, to measure or test an older CPU's path on a
  newer one.
- Importing this module loads no torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# kernel_paths.h's paths, slowest to fastest: a CPU that runs one runs every one before it
PATHS = ("portable", "avx2", "vnni256", "avx512", "amx")
PATH_ENV = "RAKV_KERNEL_PATH"  # caps the paths a process runs (a name of PATHS)
FASTEST = -1  # a kernel call's path: the fastest allowed here
LANES = 16  # output channels per packed block of the Linear kernels (kernel_paths.h's LANES)
SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("kernel_paths.c", "int4_kernel.c", "int8_kernel.c", "attention_kernel.c", "layer_kernel.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in  # included by the sources: part of the build's key
                ("kernel_paths.h", "int4_256.h", "int8_256.h", "lane_sums.h"))
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-ffp-contract=off")
OPENMP = "-fopenmp"  # threads over output blocks; built without it where the compiler lacks it


class KernelUnavailable(ValueError):
    """The kernel library cannot be built or loaded here, or RAKV_KERNEL_PATH is not a
    path (one line)."""


@functools.cache
def kernel() -> ctypes.CDLL:
    """The kernel library, built into the cache on first use, capped at RAKV_KERNEL_PATH
    where it is set. Raises KernelUnavailable."""
    cap = _path_cap()
    lib = _library()
    lib.rakv_cap_path(cap)
    return lib


@functools.cache
def kernel_or_none() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be built here. Cached: each quantized
    layer asks, and a failed build is not retried."""
    try:
        return kernel()
    except KernelUnavailable:
        return None


def cpu_path() -> int:
    """The fastest path this CPU runs (an index into PATHS). Raises KernelUnavailable."""
    return kernel().rakv_cpu_path()


def path_here() -> str:
    """The name of the path the kernels run in this process: the CPU's fastest, or the
    cap where RAKV_KERNEL_PATH sets a lower one. Raises KernelUnavailable."""
    return PATHS[kernel().rakv_path(FASTEST)]


def paths_here() -> tuple[int, ...]:
    """Every path this CPU runs, slowest first (what the tests force, one by one)."""
    return tuple(range(cpu_path() + 1))


def use_path(path: int) -> None:
    """Cap every kernel call of this process that asks for the fastest path at ``path`` (an
    index into PATHS; FASTEST lifts the cap), as RAKV_KERNEL_PATH does when the library
    loads: a benchmark compares paths on one model with it."""
    kernel().rakv_cap_path(path)


def machine_id() -> str:
    """The machine as the caches of its measurements key it (calibrations, ``--weights
    auto``'s timings): its device (the GPU's name, else the CPU's), torch's threads and
    torch's version; the kernels' path is keyed beside it where it matters."""
    import platform

    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    text = f"{device}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def kernel_forward(layer, function, x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype through one of the library's Linear entry
    points (``rakv_int4_linear``, ``rakv_int8_linear``): it takes the input, its rows and
    width, the layer's ``layer_arguments``, the output [rows, padded] float32, the threads
    and the layer's ``path``, and returns non-zero where it had no memory. A layer whose
    ``in_features`` is below its ``kernel_in_features`` gets zero inputs appended."""
    import torch  # already loaded (a quantized model exists): a dictionary lookup
    rows = x.shape[:-1].numel()
    flat = x.reshape(rows, layer.in_features)  # [rows, in]
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    width = getattr(layer, "kernel_in_features", layer.in_features)
    if width != layer.in_features:  # zeros quantize to zeros and meet zero weights: no row's bits move
        flat = torch.nn.functional.pad(flat, (0, width - layer.in_features))
    out = torch.empty(rows, layer.padded, dtype=torch.float32)  # [rows, padded out]
    if function(flat.data_ptr(), rows, width, *layer.layer_arguments, out.data_ptr(),
                torch.get_num_threads(), layer.path):
        raise MemoryError(f"{mode}: no memory to quantize {rows} rows of {layer.in_features} inputs")
    if layer.padded != layer.out_features:
        out = out[:, :layer.out_features]
    out = out.view(*x.shape[:-1], layer.out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _path_cap() -> int:
    name = os.environ.get(PATH_ENV, "").strip().lower()
    if not name:
        return FASTEST
    if name not in PATHS:
        raise KernelUnavailable(f"{PATH_ENV} must be one of {', '.join(PATHS)}; got {name!r}")
    return PATHS.index(name)


@functools.cache
def _library() -> ctypes.CDLL:
    from rakv.model_files import cache_root
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not shutil.which(compiler):
        raise KernelUnavailable("the quantized modes need a C compiler to build their kernels "
                                "(none found: set CC or install gcc)")
    ran = _run([compiler, "--version"])
    version = ran.stdout.splitlines()[0] if ran is not None and ran.stdout else "?"
    sources = "".join(repr(source.read_bytes()) for source in SOURCES + HEADERS)
    key = hashlib.blake2b(f"{sources}|{compiler}|{version}|{FLAGS}".encode(), digest_size=8).hexdigest()
    target = cache_root() / "kernels" / f"rakv-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        for flags in ((*FLAGS, OPENMP), FLAGS):
            result = _run([compiler, *flags, *map(str, SOURCES), "-o", str(partial), "-lm"])
            if result is not None and result.returncode == 0:
                break
        else:
            reason = (result.stderr.strip().splitlines() or ["no output"])[0] if result else "it did not run"
            raise KernelUnavailable(f"cannot build the kernels with {compiler}: {reason}")
        partial.replace(target)  # atomic: a crash never leaves half a library in use
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load the kernels {target}: {exc}") from None
    pointer, integer, wide = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    signatures = {  # name: (argument types, result type)
        "rakv_int4_linear": ([pointer, integer, integer, pointer, pointer, pointer, pointer, pointer, integer,
                              pointer, integer, pointer, integer, integer], integer),
        "rakv_int8_linear": ([pointer, integer, integer, pointer, pointer, pointer, pointer, integer, pointer,
                              integer, integer], integer),
        "rakv_attention": ([pointer, wide, wide, pointer, wide, wide, pointer, wide, wide, pointer, integer,
                            integer, integer, integer, integer, ctypes.c_float, integer, integer], integer),
        "rakv_attention_many": ([pointer, wide, wide, pointer, wide, wide, pointer, wide, wide, integer, pointer,
                                 pointer, pointer, pointer, pointer, pointer, pointer, integer, integer, integer,
                                 ctypes.c_float, integer, integer], integer),
        "rakv_rope": ([pointer, wide, wide, integer, pointer, wide, wide, integer, integer, integer, pointer,
                       pointer, pointer, pointer, integer], None),
        "rakv_rms_norm": ([pointer, integer, integer, pointer, ctypes.c_float, pointer, integer], None),
        "rakv_cpu_path": ([], integer),
        "rakv_path": ([integer], integer),
        "rakv_cap_path": ([integer], None),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def _run(command):
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
