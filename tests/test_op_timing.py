"""The op-timing grid where every forward is slow: what a calibration leaves out so that it
stays under a minute (its grid and its acceptance priors), and that a recording leaves out
nothing."""
from __future__ import annotations

import dataclasses

import pytest

from rakv import calibrate, op_timing
from rakv.cost_model import ModelTimings, PairTimings
from rakv.op_timing import CALIBRATION_GRID, LONG_FILL_S, measure_pair

OP_S = 1.0  # every timed op takes this long: a slow machine (an 8-token prefill, 0.125 s a token)
# the calibration's grid with its long contexts within the tiny pair's 256 positions
GRID = dataclasses.replace(CALIBRATION_GRID, prefill_cached=(0, 128), decode_context=(16, 128))


@pytest.fixture
def slow_ops(monkeypatch):
    def seconds(self, fn):
        fn()
        return OP_S
    monkeypatch.setattr(op_timing.OpTimer, "seconds", seconds)


def test_a_slow_calibration_leaves_out_what_it_guesses_too_long_to_fill_or_run(tiny_pair, slow_ops):
    caches = {}
    rows = list(measure_pair(tiny_pair, GRID, repeats=range(1), slow_s=0.5, caches=caches))  # a first pass
    longest = LONG_FILL_S / (OP_S / GRID.prefill_new[0])  # 64 tokens
    target = [r for r in rows if r.model == "target"]
    assert {r.num_cached_tokens for r in target if r.op == "prefill"} == {0}  # 128 not filled
    assert {r.num_new_tokens for r in target if r.op == "prefill"} == {8}  # 32 guessed 4 s, past LONG_POINT_S
    assert {r.num_cached_tokens for r in target if r.op == "decode"} == {16}
    assert {r.k for r in target if r.op == "verify"} == {1, 2, 3, 4, 8}  # 17 rows guessed 2.1 s
    assert caches["target", 128] is None and caches["draft", 128] is None
    assert {r.num_new_tokens for r in rows if r.model == "store"} == {int(longest) - 1}
    # a later pass fills nothing the first left out
    filled = {key for key, cache in caches.items() if cache is not None}
    list(measure_pair(tiny_pair, GRID, repeats=range(1, 2), slow_s=0.5, caches=caches,
                      only=frozenset(dataclasses.replace(r, repeat=1).key for r in rows)))
    assert {key for key, cache in caches.items() if cache is not None} == filled


def test_a_recording_times_every_point_however_slow(tiny_pair, slow_ops):
    rows = list(measure_pair(tiny_pair, GRID, repeats=range(1)))
    target = [r for r in rows if r.model == "target"]
    assert {r.num_cached_tokens for r in target if r.op == "prefill"} == set(GRID.prefill_cached)
    assert {r.k for r in target if r.op == "verify"} == set(GRID.verify_k)
    assert {r.num_new_tokens for r in rows if r.model == "store"} == set(GRID.store_tokens)


def priced(step_s: float, target_per_token_s: float, draft_per_token_s: float) -> PairTimings:
    """Timings whose forwards cost a step, and a prefill so much per token."""
    def model(per_token_s: float) -> ModelTimings:
        return ModelTimings(prefill_fixed_s=0.0, prefill_per_token_s=per_token_s, prefill_per_token_context_s=0.0,
                            step_fixed_s=step_s, step_per_context_s=0.0, verify_per_token_s=0.0, kv_bytes_per_token=1)
    return PairTimings(model(target_per_token_s), model(draft_per_token_s), 0.0, 0.0, 0.0)


def test_the_priors_take_as_many_tokens_as_fit_their_budget_or_none():
    lengths = [13, 14, 13]  # the Qwen tokenizer's sample prompts
    assert calibrate.prior_tokens(lengths, priced(0.0, 0.0, 0.0)) == calibrate.PRIOR_TOKENS  # the tiny pair
    assert calibrate.prior_tokens(lengths, priced(0.1, 0.03, 0.01)) == calibrate.PRIOR_TOKENS  # AVX2 int4: 6.6 s
    # fp32 on AVX2: 16 tokens would take 27.8 s, 10 take 18.9 s, 11 take 20.4 s
    assert calibrate.prior_tokens(lengths, priced(0.45, 0.1, 0.04)) == 10
    assert calibrate.prior_tokens(lengths, priced(1.2, 1.0, 0.2)) == 0  # portable: the prefills alone take 40 s


def test_a_slow_calibration_starts_from_default_priors(tiny_pair, slow_ops):
    timings = calibrate.calibrate(tiny_pair)
    assert (timings.acceptance_prior, timings.ngram_acceptance_prior) == calibrate.UNMEASURED_PRIORS


def test_a_calibration_times_its_quick_points_in_every_pass(tiny_pair):
    timed = []

    def spy(*args, **kwargs):
        for row in measure_pair(*args, **kwargs):
            timed.append(row)
            yield row
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "measure_pair", spy)
        calibrate.calibrate(tiny_pair)
    by_pass = [{dataclasses.replace(r, repeat=0).key for r in timed if r.repeat == i}
               for i in range(CALIBRATION_GRID.repeats)]
    assert by_pass[0] and by_pass[1] == by_pass[0] and by_pass[2] == by_pass[0]  # the tiny pair's points are all quick
