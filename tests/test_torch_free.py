"""The simulator and the policy (every module of each) and the decision core of rakv must
import without torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TORCH_FREE_PACKAGES = ("simulator", "policy")  # every module of each, found on disk: a new one is checked too
TORCH_FREE_ELSEWHERE = (  # the torch-free modules of rakv and profiler, which also hold torch code
    "rakv.prefix_index, rakv.store_model, rakv.controller, rakv.cost_model, rakv.acceptance, "
    "rakv.round_planner, rakv.round_yield, rakv.step_load, rakv.settings, rakv.sequence_index, "
    "rakv.suffix_drafter, rakv.drafters, rakv.choices, rakv.learned, rakv.learned_rounds, rakv.policies, "
    "rakv.trees, rakv.prompt_file, rakv.op_timing, rakv.cpu_linear, rakv.models, rakv.rounds, "
    "rakv.scheduler, profiler.schema, profiler.trace_io, profiler.workloads, profiler.arrivals, "
    "profiler.serve_record, profiler.serve_summary")


def _package_modules() -> list[str]:
    return [name for package in TORCH_FREE_PACKAGES
            for name in [package] + [f"{package}.{path.stem}" for path in sorted((REPO_ROOT / package).glob("*.py"))
                                     if path.stem != "__init__"]]


TORCH_FREE_MODULES = ", ".join(_package_modules()) + ", " + TORCH_FREE_ELSEWHERE


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_torch_free_modules_do_not_import_torch():
    code = (
        f"import {TORCH_FREE_MODULES}; import sys; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr


def test_numpy_is_allowed_in_torch_free_modules():
    # numpy is an allowed dependency (rakv.prefix_index uses it); importing it next to the
    # torch-free modules must not pull torch in either.
    code = (
        f"import numpy; import {TORCH_FREE_MODULES}; import sys; "
        "assert 'numpy' in sys.modules; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
