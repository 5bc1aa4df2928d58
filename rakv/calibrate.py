"""A few seconds of timing on the machine at hand: the cost model's ``PairTimings``.

Measures, for target and draft: prefill at several lengths and cached contexts, one-token
steps at two contexts, verification of 2..9 tokens; the store's clone rate and lookup
time; the prompt-lookup proposal time; and each drafter's agreement with the target's
greedy continuation of a built-in text (the acceptance priors). Fits are least squares over medians of repeated, warmed-up timings.

Results are cached per (machine, model fingerprints) as JSON under
``<cache root>/calibration/``; traces replace this source of timings once they exist.
"""
from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from rakv.cost_model import ModelTimings, PairTimings
from rakv.drafters import ngram_propose, ngram_run_lengths
from rakv.decoding import crop_to, draft_agreement, forward, greedy
from rakv.kv_store import KVStore
from rakv.model_files import cache_root
from rakv.models import ModelPair

CALIBRATION_VERSION = 2
SAMPLE_TEXT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The quick brown fox jumps over the lazy dog. A cache keeps the keys and values of "
    "earlier tokens so that the model does not compute them again for the next request.\n")


def machine_id() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    text = f"{device}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _prefilled(model, token_ids: list[int]) -> DynamicCache:
    cache = DynamicCache()
    forward(model, cache, token_ids)
    return cache


def _timed_forward(model, cache: DynamicCache | None, token_ids: list[int], num_logits: int = 1):
    """A forward after ``cache`` that leaves it as it was (rolled back, as speculation does)."""
    if cache is None:
        return lambda: forward(model, DynamicCache(), token_ids, num_logits)
    length = cache.get_seq_length()
    return lambda: (forward(model, cache, token_ids, num_logits), crop_to(cache, length))


def time_model(model, max_positions: int, repeats: int, seed: int = 0) -> ModelTimings:
    """Fit prefill, step and verify costs of one model."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    tokens = rng.integers(0, vocab, size=max_positions).tolist()
    long_ctx = min(256, max_positions // 2)
    prefill_points = [(n, 0) for n in (8, 32, min(128, long_ctx))] + [(16, long_ctx)]
    rows, prefill_s = [], []
    for n, c in prefill_points:
        base = _prefilled(model, tokens[:c]) if c else None
        prefill_s.append(_median_s(_timed_forward(model, base, tokens[c:c + n]), repeats))
        rows.append([1.0, n, n * (c + n / 2)])
    fit = np.linalg.lstsq(np.array(rows), np.array(prefill_s), rcond=None)[0]
    p_fixed, p_token, p_ctx = (max(float(x), 0.0) for x in fit)

    step_points, step_s = (16, long_ctx), []
    verify_points, verify_s = (2, 5, 9), []
    for c in step_points:
        base = _prefilled(model, tokens[:c])
        step_s.append(_median_s(_timed_forward(model, base, tokens[c:c + 1]), repeats))
    base = _prefilled(model, tokens[:step_points[0]])
    for num in verify_points:
        verify_s.append(_median_s(_timed_forward(model, base, tokens[16:16 + num], num), repeats))
    step_slope = max((step_s[1] - step_s[0]) / (step_points[1] - step_points[0]), 0.0)
    verify_slope = max(float(np.polyfit(np.array(verify_points) - 1, verify_s, 1)[0]), 0.0)
    kv_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in base.layers)
    return ModelTimings(
        prefill_fixed_s=p_fixed, prefill_per_token_s=p_token, prefill_per_token_context_s=p_ctx,
        step_fixed_s=max(step_s[0] - step_slope * step_points[0], 0.0), step_per_context_s=step_slope,
        verify_per_token_s=verify_slope, kv_bytes_per_token=kv_bytes // step_points[0])


def time_store(model, repeats: int) -> tuple[float, float]:
    """(clone seconds per byte, lookup seconds) of the prefix store."""
    cache = _prefilled(model, list(range(1, 129)))
    store = KVStore()
    store.insert("calibration", list(range(1, 129)), cache, {})
    hit = store.lookup("calibration", list(range(1, 129)))
    num_bytes = hit.entry.num_bytes
    clone_s = _median_s(lambda: store.restore(hit, 128), repeats)
    lookup_s = _median_s(lambda: store.lookup("calibration", list(range(1, 200))), repeats)
    return clone_s / num_bytes, lookup_s


def acceptance_priors(pair: ModelPair, num_tokens: int = 32) -> tuple[float, float]:
    """(draft model, ngram) agreement with the target's greedy continuation of a built-in
    text: the fraction of positions whose next token the drafter proposes correctly."""
    prompt = pair.encode(SAMPLE_TEXT)[: pair.max_positions - num_tokens]
    cache = DynamicCache()
    output = greedy(forward(pair.target, cache, prompt))
    while len(output) < num_tokens:
        output += greedy(forward(pair.target, cache, output[-1:]))
    ngram_lengths, _ = ngram_run_lengths(prompt, output, max_k=1)
    draft = 0.0 if pair.draft is None else float(np.mean(draft_agreement(pair.draft, prompt, output)))
    return draft, float(np.mean(ngram_lengths))


def calibrate(pair: ModelPair, repeats: int = 3) -> PairTimings:
    with torch.inference_mode():
        target = time_model(pair.target, pair.max_positions, repeats)
        draft = None if pair.draft is None else time_model(pair.draft, pair.max_positions, repeats)
        clone_s_per_byte, lookup_s = time_store(pair.target, repeats)
    history = np.random.default_rng(0).integers(0, 64, size=1024).tolist()
    ngram_lookup_s = _median_s(lambda: ngram_propose(history, 8), repeats)
    draft_prior, ngram_prior = acceptance_priors(pair)
    return PairTimings(target, draft, clone_s_per_byte, lookup_s, draft_prior, ngram_lookup_s, ngram_prior)


def calibration_path(pair: ModelPair) -> Path:
    key = hashlib.blake2b(f"{pair.target_fingerprint}|{pair.draft_fingerprint}".encode(), digest_size=8).hexdigest()
    return cache_root() / "calibration" / f"v{CALIBRATION_VERSION}-{machine_id()}-{key}.json"


def load_or_calibrate(pair: ModelPair, refresh: bool = False) -> PairTimings:
    """Cached timings of this pair on this machine, measuring them on first use."""
    path = calibration_path(pair)
    if path.exists() and not refresh:
        try:
            return timings_from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again
    timings = calibrate(pair)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(timings), indent=1))
    tmp.replace(path)
    return timings


def timings_from_json(data: dict) -> PairTimings:
    draft = data["draft"]
    return PairTimings(
        target=ModelTimings(**data["target"]), draft=None if draft is None else ModelTimings(**draft),
        clone_s_per_byte=data["clone_s_per_byte"], lookup_s=data["lookup_s"],
        acceptance_prior=data["acceptance_prior"], ngram_lookup_s=data["ngram_lookup_s"],
        ngram_acceptance_prior=data["ngram_acceptance_prior"])
