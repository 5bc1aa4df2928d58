"""A few seconds of timing on the machine at hand: the cost model's ``PairTimings``.

Measures the small op grid of ``rakv.op_timing`` (target and draft prefill, decode and
verify; the store's clone and lookup; the prompt-lookup proposal), fits the cost model to
those rows (``rakv.cost_model.fit_timings``, which fits a trace's ops table the same way),
and measures each drafter's agreement with the target's greedy continuations of built-in
code, prose and chat prompts (the acceptance priors).

Results are cached per (machine, model fingerprints, Linear kernels) as JSON under
``<cache root>/calibration/``.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from rakv.cost_model import PairTimings, fit_timings
from rakv.decoding import draft_agreement, forward, greedy
from rakv.drafters import ngram_run_lengths
from rakv.kernels import kernel_or_none, machine_id, path_here
from rakv.kv_cache import GrowingCache
from rakv.model_files import cache_root
from rakv.models import ModelPair
from rakv.op_timing import CALIBRATION_GRID, measure_pair
from rakv.settings import settings_from_json, settings_to_json
from rakv.weights import FP32

# Bump when an engine change moves what an op costs or how it is measured (v8: KV caches
# append in place, rakv.kv_cache; v9: timed in passes, verify rows over their own pass's step;
# v10: layers run as plain calls, rakv.direct_forward; v11: rotary embedding on the C
# library in every mode, rakv.layer_kernel; the quantized modes' key names the library;
# v12: a verification of 3 drafts timed too, OpGrid.verify_k; v13: the later passes time
# again (v12 timed one pass: their keys named the wrong field), so each point is a median of 3).
CALIBRATION_VERSION = 13
SLOW_POINT_S = 0.5  # a grid point this slow is timed once (see calibrate)
PRIOR_TOKENS, MIN_PRIOR_TOKENS = 16, 6  # each sample's continuation for the priors, and its least
PRIORS_BUDGET_S = 20.0  # about what the priors' forwards may take (Qwen 1.5B fp32 on AVX2: about 10 tokens)
# Where even the least priors would not fit the budget (the portable kernel path, whose
# forward costs each row alone: Qwen 1.5B int4 1 s a row, so the three prompts' 40 prefill
# rows alone take 40 s), the controller starts from these and learns each drafter's
# acceptance from the first rounds (it probes the draft model while unmeasured)
UNMEASURED_PRIORS = (0.5, 0.05)  # (draft model, ngram)
SAMPLE_PROMPTS = (  # code, prose and chat: one kind alone would bias the acceptance priors
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins in the fifteenth century, when",
    "User: Give me three tips for writing clear emails.\nAssistant:",
)


def sample_prompts(pair: ModelPair) -> list[list[int]]:
    return [pair.encode(text)[: pair.max_positions - PRIOR_TOKENS] for text in SAMPLE_PROMPTS]


def acceptance_priors(pair: ModelPair, num_tokens: int = PRIOR_TOKENS) -> tuple[float, float]:
    """(draft model, ngram) agreement with the target's greedy continuations of built-in
    prompts: the fraction of positions whose next token the drafter proposes correctly."""
    draft_agree, ngram_agree = [], []
    for prompt in sample_prompts(pair):
        cache = GrowingCache()
        output = greedy(forward(pair.target, cache, prompt))
        while len(output) < num_tokens:
            output += greedy(forward(pair.target, cache, output[-1:]))
        ngram_agree += ngram_run_lengths(prompt, output, max_k=1).runs
        if pair.draft is not None:
            draft_agree += draft_agreement(pair.draft, prompt, output)
    return float(np.mean(draft_agree)) if draft_agree else 0.0, float(np.mean(ngram_agree))


def calibrate(pair: ModelPair) -> PairTimings:
    """Times the calibration grid and the acceptance priors, with a progress bar on stderr."""
    device = str(pair.target.device)
    # in passes of one repeat each, not each op's repeats in a block, so that every op's
    # median spans the same minutes of the machine and the fit compares each verify row
    # with the step of its own pass (rakv.cost_model): timed in blocks, the verify points
    # of one calibration caught a fast minute and priced a 17-token forward at one step.
    # The first pass warms every point up; the later ones follow it directly. A point that
    # takes SLOW_POINT_S or more is timed once, its first run, and one guessed to take
    # longer than LONG_POINT_S not at all (rakv.op_timing): where every forward is slow (an
    # older CPU's kernel path), long prefills are what would make a calibration last (Qwen
    # 1.5B int4 on the AVX2 path: a 128-token prefill 3.5 s).
    grids = [CALIBRATION_GRID] + [replace(CALIBRATION_GRID, warmup=0)] * (CALIBRATION_GRID.repeats - 1)
    rows, fast, caches = [], None, {}
    with tqdm(desc=f"calibrating {pair.name} ({pair.weights}) on this machine, once", unit=" op", file=sys.stderr,
              disable=None) as progress:
        for i, grid in enumerate(grids):
            only = None if fast is None else frozenset(replace(row, repeat=i).key for row in fast)
            for row in measure_pair(pair, grid, device, repeats=range(i, i + 1), slow_s=SLOW_POINT_S,
                                    caches=caches, only=only):
                rows.append(row)
                progress.update()
            if fast is None:  # the later passes time again only what the first timed quickly
                fast = [row for row in rows if row.seconds < SLOW_POINT_S]
        timings = fit_timings(rows)
        num_tokens = prior_tokens([len(p) for p in sample_prompts(pair)], timings)
        progress.set_postfix_str("acceptance priors" if num_tokens else "acceptance priors: too slow, the defaults")
        draft_prior, ngram_prior = acceptance_priors(pair, num_tokens) if num_tokens else UNMEASURED_PRIORS
    return replace(timings, acceptance_prior=draft_prior, ngram_acceptance_prior=ngram_prior)


def prior_tokens(prompt_lengths: list[int], timings: PairTimings) -> int:
    """Tokens of each sample prompt's continuation the priors take: as many up to 16 as fit
    PRIORS_BUDGET_S, or 0 where not even MIN_PRIOR_TOKENS do, priced by the calibration's
    own fit: each prompt costs the target a prefill and a decode step per token after the
    first, and the draft one teacher-forced forward over prompt and continuation."""
    target, draft = timings.target, timings.draft

    def cost_s(num_tokens: int) -> float:
        return sum(target.prefill_s(n, 0) + (num_tokens - 1) * target.step_s(n)
                   + (draft.prefill_s(n + num_tokens, 0) if draft is not None else 0.0) for n in prompt_lengths)
    fitting = [n for n in range(MIN_PRIOR_TOKENS, PRIOR_TOKENS + 1) if cost_s(n) <= PRIORS_BUDGET_S]
    return max(fitting, default=0)


def calibration_path(pair: ModelPair) -> Path:
    # the kernels are part of the machine's speed, not of the models' identity: the same
    # weights on stock and packed kernels share stored state and learned policies, not timings;
    # an edit of the kernels' sources measures again (ctypes' documented ``_name``: the
    # library's path, named by a hash of its sources, compiler and flags), and so does
    # another of their paths (RAKV_KERNEL_PATH: an AVX-512 machine timing its AVX2 path)
    library = kernel_or_none() if pair.weights != FP32 else None
    kernel = f"{Path(library._name).name}|{path_here()}" if library is not None else ""
    key = hashlib.blake2b(f"{pair.target_fingerprint}|{pair.draft_fingerprint}|{pair.linear_kernels}|{kernel}"
                          .encode(), digest_size=8).hexdigest()
    return cache_root() / "calibration" / f"v{CALIBRATION_VERSION}-{machine_id()}-{key}.json"


RECALIBRATE_HELP = ("measure this machine's timings of the pair again first (what the planners price rounds and "
                    "steps by): a calibration cached on another day can be 10-40 %% off")


def load_or_calibrate(pair: ModelPair, refresh: bool = False) -> PairTimings:
    """Cached timings of this pair on this machine, measuring them on first use."""
    path = calibration_path(pair)
    if path.exists() and not refresh:
        try:
            return settings_from_json(PairTimings, json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again
    timings = calibrate(pair)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings_to_json(timings), indent=1))
    tmp.replace(path)
    return timings
