"""The recorder's guard against a busy machine: which runs count as slowed, which attempt
is kept, how a slow phase of the whole machine is waited out, and that a snapshot restores
an engine so a request runs again the same way."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from profiler.run_noise import EngineSnapshot, MachineSpeed, SlowRuns, forward_probe, mean_probe_s, median_attempt


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


def test_the_median_attempt_is_kept_with_its_probe():
    attempts = [(SimpleNamespace(e2e_s=s), probe_s) for s, probe_s in ((3.0, 0.3), (1.0, 0.1), (2.0, 0.2))]
    assert median_attempt(attempts)[0].e2e_s == 2.0 and median_attempt(attempts)[1] == 0.2
    assert median_attempt(attempts[:2])[0].e2e_s == 1.0  # the lower middle of an even count
    assert mean_probe_s(0.1, 0.3) == pytest.approx(0.2) and mean_probe_s(None, 0.3) is None


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


class FakeMachine:
    """Probe times from a script, on a clock that only probing moves."""

    def __init__(self, probes_s):
        self.probes_s, self.now_s = list(probes_s), 0.0

    def probe(self) -> float:
        seconds = self.probes_s.pop(0)
        self.now_s += seconds
        return seconds


def speed_of(machine: FakeMachine, **kwargs) -> MachineSpeed:
    kwargs.setdefault("max_wait_s", 120.0)
    return MachineSpeed(machine.probe, tolerance=0.15, clock=lambda: machine.now_s, **kwargs)


def test_a_slow_phase_is_waited_out_and_the_usual_speed_is_the_median():
    machine = FakeMachine([1.0, 1.02, 1.45, 1.0, 1.01,  # five before any wait: one in a slow phase
                           1.1,  # within 15 % of usual: no wait
                           1.5, 1.0,  # one slow probe alone is noise (a cold start): no wait
                           1.45, 1.46,  # two in a row: slow, so probe on
                           1.44, 1.47, 1.5, 1.03,  # still slow, then back: one fast probe ends the wait
                           ])
    speed = speed_of(machine)
    for _ in range(5):
        speed.wait()  # too few probes to judge
    assert speed.usual_s() == 1.01
    assert speed.wait() == 1.1
    speed.wait()
    assert speed.num_waits == 0 and len(machine.probes_s) == 6
    assert speed.wait() == 1.03  # the speed the timing starts at: the probe that ended the wait
    assert speed.num_waits == 1 and speed.waited_s == pytest.approx(1.44 + 1.47 + 1.5 + 1.03)
    assert speed.num_unsettled == 0 and machine.probes_s == []
    assert speed.probes_s == [1.0, 1.02, 1.45, 1.0, 1.01, 1.1, 1.5, 1.45]  # each timing's first probe only


def test_a_wait_gives_up_after_its_limit_and_says_so():
    machine = FakeMachine([1.0] * 5 + [1.5] * 12)
    speed = speed_of(machine, max_wait_s=5.0)
    for _ in range(5):
        speed.wait()
    speed.wait()  # slow (2 probes), then 2 pairs of probes (6 s >= 5 s): timed anyway
    assert speed.num_unsettled == 1 and len(machine.probes_s) == 12 - 6
    assert "waited 6 s, 1 times in vain" in speed.summary()


def test_the_forward_probe_times_a_forward(tiny_pair):
    probe = forward_probe(tiny_pair.target)
    assert 0 < probe() < 10


def test_no_wait_allowed_means_no_probe():
    speed = MachineSpeed(lambda: 1 / 0, tolerance=0.15, max_wait_s=0)
    assert speed.wait() is None and speed.probe() is None  # nor is a run stored beside a probe
    assert speed.probes_s == [] and "not probed" in speed.summary()


def test_a_probe_after_a_run_stays_out_of_the_usual():
    machine = FakeMachine([1.0] * 5 + [2.0])
    speed = speed_of(machine)
    for _ in range(5):
        speed.wait()
    assert speed.probe() == 2.0 and speed.probes_s == [1.0] * 5
