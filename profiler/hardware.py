"""The hardware fingerprint every trace file carries (``TraceMeta.hardware``): CPU, GPU,
driver and software versions. Imports no torch unless asked to name a GPU.
"""
from __future__ import annotations

import os
import platform
import re
from importlib import metadata as importlib_metadata

import pyarrow as pa


def _package_version(name: str) -> str | None:
    try:
        return importlib_metadata.version(name)  # read from the installed metadata, not imported
    except importlib_metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
    except OSError:
        match = None
    return match.group(1).strip() if match else (platform.processor() or platform.machine())


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def hardware_fingerprint(probe_gpu: bool = True) -> dict:
    """The ``hardware`` dict of ``TraceMeta``: CPU, GPU (None when absent), driver and
    software versions. Package versions are read without importing the packages; torch is
    imported, here only, to name the GPU when ``probe_gpu`` (a missing torch is tolerated)."""
    gpu_name = cuda_version = None
    if probe_gpu:
        try:
            import torch
            if torch.cuda.is_available():
                gpu_name = torch.cuda.get_device_name(torch.cuda.current_device())
                cuda_version = torch.version.cuda
        except Exception:  # noqa: BLE001 - no torch, or a broken CUDA setup: record no GPU
            gpu_name = cuda_version = None
    return {
        "cpu_model": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "gpu_name": gpu_name,
        "cuda_version": cuda_version,
        "nvidia_driver": _nvidia_driver() if gpu_name else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _package_version("torch"),
        "transformers": _package_version("transformers"),
        "pyarrow": pa.__version__,
        "numpy": _package_version("numpy"),
    }
