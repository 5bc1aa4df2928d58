"""The recorder's guard against a busy machine: which runs count as slowed, which attempt
is kept, and that a snapshot restores an engine so a request runs again the same way."""
from __future__ import annotations

from types import SimpleNamespace

from profiler.run_noise import EngineSnapshot, SlowRuns, median_attempt


def test_a_run_slower_than_its_siblings_is_picked_and_a_policy_priced_high_is_learned():
    slowed = SlowRuns(tolerance=0.15)
    assert slowed({"a": 1.0, "b": 1.02}) == []  # too few siblings for a median
    assert slowed({"a": 1.0, "b": 1.02, "c": 0.98, "d": 1.5}) == ["d"]
    # "e" runs 1.3x its price on every request (the calibration prices its work low): once
    # seen unslowed, it is its usual share, and only a run far above that counts
    slowed = SlowRuns(tolerance=0.15)
    first = slowed({"a": 1.0, "b": 1.0, "c": 1.0, "e": 1.1})
    assert first == []
    for _ in range(3):
        slowed({"a": 1.0, "b": 1.0, "c": 1.0, "e": 1.12})
    assert slowed({"a": 1.0, "b": 1.0, "c": 1.0, "e": 1.24}) == []
    assert slowed({"a": 1.0, "b": 1.0, "c": 1.0, "e": 1.6}) == ["e"]


def test_the_median_attempt_is_kept():
    attempts = [SimpleNamespace(e2e_s=s) for s in (3.0, 1.0, 2.0)]
    assert median_attempt(attempts).e2e_s == 2.0
    assert median_attempt(attempts[:2]).e2e_s == 1.0  # the lower middle of an even count


def test_a_snapshot_runs_a_request_again_from_the_same_engine_state(tiny_pair):
    from rakv.controller import make_policy
    from rakv.engine import Engine
    from rakv.calibrate import load_or_calibrate
    engine = Engine(tiny_pair, make_policy("rakv", load_or_calibrate(tiny_pair)))
    first = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    engine.generate(first, 8)
    snapshot = EngineSnapshot(engine)
    before = (engine.store.total_bytes, dict(engine.policy.acceptance), engine.num_requests)
    again = engine.generate(first + [24, 25], 8)
    after = (engine.store.total_bytes, dict(engine.policy.acceptance), engine.num_requests)
    snapshot.restore(engine)
    assert (engine.store.total_bytes, dict(engine.policy.acceptance), engine.num_requests) == before
    repeat = engine.generate(first + [24, 25], 8)
    assert (repeat.output_ids, repeat.rounds, repeat.action, repeat.hit_tokens) == (
        again.output_ids, again.rounds, again.action, again.hit_tokens)
    assert (engine.store.total_bytes, dict(engine.policy.acceptance), engine.num_requests) == after
