"""Shared fixtures: the tiny pair (float64), the SmolLM2 pair, and the HF greedy oracle."""
from __future__ import annotations

import pytest
import torch

from rakv.choices import fixed_policy_names
from rakv.controller import make_policy

ALL_POLICIES = fixed_policy_names() + ("rakv",)
SMOLLM2_MAX_CONTEXT = 320  # a cap below the model's 8192 positions keeps near-max prompts cheap on a CPU


def kernel_problem() -> str | None:
    """Why the kernel library (every quantized mode's) cannot be built here, or None."""
    from rakv import kernels
    try:
        kernels.kernel()
    except kernels.KernelUnavailable as exc:
        return str(exc)
    return None


_KERNEL_PROBLEM = kernel_problem()
NEEDS_KERNELS = pytest.mark.skipif(_KERNEL_PROBLEM is not None, reason=str(_KERNEL_PROBLEM))


def kernel_paths() -> list:
    """Every kernel path, as pytest params named by path: those this CPU lacks (or all,
    where the library cannot be built) skipped with the reason."""
    from rakv import kernels
    here = () if _KERNEL_PROBLEM is not None else kernels.paths_here()
    return [pytest.param(path, id=name, marks=() if path in here else pytest.mark.skip(
                reason=_KERNEL_PROBLEM or f"this CPU has no {name} path (its fastest: {kernels.PATHS[here[-1]]})"))
            for path, name in enumerate(kernels.PATHS)]


def hf_greedy(pair, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: Hugging Face generate(do_sample=False) of the target alone."""
    max_new_tokens = min(max_new_tokens, pair.max_positions - len(prompt_ids))
    ids = torch.tensor([prompt_ids])
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens, pad_token_id=next(iter(pair.eos_token_ids), 0))
    return out[0, len(prompt_ids):].tolist()


def policy_for(name: str, pair):
    timings = None
    if name == "rakv":
        from rakv.calibrate import load_or_calibrate
        timings = load_or_calibrate(pair)
    return make_policy(name, timings)


@pytest.fixture(scope="session")
def tiny_pair():
    from rakv.models import load_pair
    return load_pair("tiny")


@pytest.fixture(scope="session")
def smollm2_pair():
    from rakv.models import load_pair
    # fp32: the mode of the shipped SmolLM2 traces and policy these tests check against
    # (the default, auto, is whichever mode is fastest on the machine at hand)
    return load_pair("smollm2", max_context=SMOLLM2_MAX_CONTEXT, weights_mode="fp32")


@pytest.fixture
def calibration_refreshes(monkeypatch):
    """The ``refresh`` of each call of ``rakv.calibrate.load_or_calibrate``, in order; the
    calls get the cached timings."""
    import rakv.calibrate
    calibrated, refreshes = rakv.calibrate.load_or_calibrate, []

    def spy(pair, refresh=False):
        refreshes.append(refresh)
        return calibrated(pair)

    monkeypatch.setattr(rakv.calibrate, "load_or_calibrate", spy)
    return refreshes
