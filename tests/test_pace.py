"""The ITL target's pace (``rakv.scheduler``, ``BatchConfig.itl_target_s``): a round stays
within the tightest bound a plain step keeps; each request's slack moves by the target's
seconds for its tokens less the steps' prices; a request behind does not bound the step;
the live engine's choices under a target replay step for step, and the target changes
them; bad values are one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_checks import machine_free_prices
from profiler.record import main as record
from rakv.cost_model import PairTimings
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.round_planner import AdaptiveRounds, PlannerConfig, round_costs
from rakv.scheduler import DECODE, PREFILL, VERIFY, BatchConfig, Composition, Scheduler, Seq
from rakv.settings import settings_from_json
from rakv.step_load import StepLoad, load_prices, longest_within, step_price_s
from simulator import serve_validate
from simulator.replay import main as replay
from simulator.trace import load_trace

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def timings():
    return settings_from_json(PairTimings, json.loads((FIXTURES / "qwen_int4_zen3_timings.json").read_text()))


def test_a_round_stays_within_the_tightest_bound_a_plain_step_keeps():
    costs = (1.0, 1.2, 1.4, 1.6, 1.8)
    assert longest_within(costs, 4, ()) == 4  # no target
    assert longest_within(costs, 4, (1.5,)) == 2
    assert longest_within(costs, 4, (1.5, 1.7)) == 2  # the tightest
    assert longest_within(costs, 4, (0.9, 1.5)) == 2  # 0.9: a plain step puts that one behind anyway
    assert longest_within(costs, 4, (0.9,)) == 4
    assert longest_within(costs, 4, (1.1,)) == 0  # even k = 1 would put one behind
    assert longest_within(costs, 3, (5.0,)) == 3  # never past top


def test_a_planner_under_a_pace_bound_drafts_less(timings):
    signals = {DRAFT_MODEL: 0, NGRAM: 3}
    planner = AdaptiveRounds((DRAFT_MODEL, NGRAM), {(DRAFT_MODEL, 0): 0.9, (NGRAM, 3): 0.9},
                             {DRAFT_MODEL: 0.9, NGRAM: 0.9}, round_costs(timings, (DRAFT_MODEL, NGRAM), 16, 300),
                             PlannerConfig())
    load = StepLoad(2, 2)
    free = planner.plan(signals, 0, load)
    assert free[1] > 1
    prices = load_prices(load, timings, (DRAFT_MODEL, NGRAM), 16, 300)
    drafter, k = free
    bound_s = prices.costs_s[drafter][k - 1]  # one draft token fewer fits
    bounded = planner.plan(signals, 0, StepLoad(2, 2, (), (bound_s,)))
    assert 0 < bounded[1] < k and prices.costs_s[bounded[0]][bounded[1]] <= bound_s
    assert planner.plan(signals, 0, StepLoad(2, 2, (), (prices.base_s * 1.0001,)))[1] == 0


class _Plain:
    """A planner walk that takes k = 0, and records the loads it was shown."""

    def __init__(self, loads: list):
        self.loads = loads

    def plan_move(self, t, max_k=None, load=None):
        self.loads.append(load)
        return NGRAM, 0


def test_each_slack_moves_by_the_target_for_its_tokens_less_the_steps_price():
    loads: list = []
    prices = iter((0.15, 0.35, 0.1))
    scheduler = Scheduler(BatchConfig(max_num_batched_tokens=64, itl_target_s=0.2), lambda seq: None,
                          lambda seq: None, lambda: 0, lambda: False, lambda step: next(prices))
    seqs = [Seq(i, 4, 16, 1, num_tokens=5, num_computed=4, prefill_end=4, moves=_Plain(loads), admitted=True)
            for i in range(2)]
    scheduler.running.extend(seqs)
    scheduler.schedule()
    scheduler.ran(None)  # priced 0.15
    assert [load.pace_bounds_s for load in loads] == [(0.2,), (0.2,)]  # both on pace, no slack yet
    seqs[0].num_tokens += 1  # a token for the first, none for the second (as a preempted one)
    loads.clear()
    scheduler.schedule()
    scheduler.ran(None)  # priced 0.35
    assert seqs[0].slack_s == pytest.approx(0.05) and seqs[1].slack_s == pytest.approx(-0.15)
    # the second is behind: it bounds nobody; the first bounds the second's round
    assert [load.pace_bounds_s for load in loads] == [(), (pytest.approx(0.25),)]
    for seq in seqs:
        seq.num_tokens += 1
    loads.clear()
    scheduler.schedule()
    assert seqs[0].slack_s == pytest.approx(-0.1)
    assert [load.pace_bounds_s for load in loads] == [(), ()]


def test_without_a_target_no_pace_is_kept():
    loads: list = []
    scheduler = Scheduler(BatchConfig(), lambda seq: None, lambda seq: None, lambda: 0, lambda: False,
                          lambda step: 1.0)
    scheduler.running.extend(Seq(i, 4, 16, 1, num_tokens=5, num_computed=4, prefill_end=4, moves=_Plain(loads),
                                 admitted=True) for i in range(2))
    for _ in range(2):
        scheduler.schedule()
        scheduler.ran(None)
    assert [load.pace_bounds_s for load in loads] == [()] * 4
    assert [seq.slack_s for seq in scheduler.running] == [0.0, 0.0]


def test_a_step_is_priced_as_its_rounds_are(timings):
    """Three plain decodes are the price of one round's step under the other two; a
    prefill chunk is priced by the prefill's tokens, its fixed part paid once by the
    step; a draft round that stopped short is priced by what it drafted; no work, no time."""
    plain = Composition((0, 1, 2), (DECODE,) * 3, (1, 1, 1), (299, 250, 200), ("",) * 3, (0, 0, 0))
    assert step_price_s(plain, timings) == pytest.approx(
        load_prices(StepLoad(2, 2), timings, (NGRAM,), 4, 300).base_s)
    chunk = Composition((0, 9), (DECODE, PREFILL), (1, 8), (299, 0), ("", ""), (0, 0))
    target = timings.target
    assert step_price_s(chunk, timings) == pytest.approx(
        target.step_s(300) + target.prefill_s(8, 0) - target.prefill_fixed_s)
    stopped = Composition((0, 1), (VERIFY, DECODE), (3, 1), (299, 250), (DRAFT_MODEL, ""), (8, 0))
    assert step_price_s(stopped, timings) == pytest.approx(
        timings.target.step_s(302) + timings.target.rows_extra_s(4) + 2 * timings.draft.step_s(302))
    assert step_price_s(Composition((), (), (), (), (), ()), timings) == 0.0


def test_the_price_bench_reads_recorded_steps(capsys):
    """bench.step_price: price over measured seconds of a shipped trace's recorded steps;
    chunks priced by the prefill's line sit nearer what they took than on the rows curve;
    one request's steps by rows; a missing trace is a one-line error."""
    from bench.step_price import main as step_price
    trace = Path(__file__).resolve().parents[1] / "traces" / "qwen-coder-humaneval-serve"
    assert step_price(["--trace", str(trace), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["num_plain"], row["num_chunk"]) == (2971, 146)
    assert 1.0 < row["chunk"] < row["chunk_on_rows_curve"]
    # one request's steps by rows: a plain step, and rounds drafting 1-3 tokens
    assert [(b["rows"], b["num"]) for b in row["by_rows"]] == [(1, 865), (2, 111), (3, 114), (4, 22)]
    assert step_price(["--trace", "no-such-trace"]) == 1
    assert capsys.readouterr().err.strip() == "error: no-such-trace: no such trace directory"


@pytest.fixture
def machine_free_calibration(monkeypatch):
    """The recorder calibrates the tiny pair at prices that do not turn on the machine
    (0.2 ms a further row): at this machine's own, a fresh calibration drafted one round
    fewer about half the time, and then no target bound."""
    import rakv.calibrate
    calibrate = rakv.calibrate.load_or_calibrate
    monkeypatch.setattr(rakv.calibrate, "load_or_calibrate",
                        lambda pair, *args, **kwargs: machine_free_prices(calibrate(pair, *args, **kwargs), 2e-4))


def _record_tiny(out: Path, *target: str):
    assert record(["--pair", "tiny", "--workload", "fixture-code", "--max-new-tokens", "16", "--grid", "serving",
                   "--skip", "runs", "--serve-requests", "6", "--max-num-seqs", "3", "--max-num-batched-tokens",
                   "64", "--serve-concurrency", "3", "--serve-policies", "rakv", *target, "--out", str(out)]) == 0
    return load_trace(out)


def _drafted(steps) -> int:
    return sum(sum(step.ks) for step in steps)


def test_the_engine_under_a_target_replays_step_for_step(tmp_path, machine_free_calibration):
    """Exact because the pace runs on prices, not the wall. The target is one that binds
    at the recording's prices: the replay of a recording without a target finds it (a
    replay makes the engine's choices), then the engine runs under it."""
    free = _record_tiny(tmp_path / "free")
    step_s = free.require_inputs().timings.target.step_s(64)
    [unpaced] = serve_validate.recorded_table(free, "steps").values()

    def replayed(target_s: float) -> int:
        return _drafted(s.composition for s in serve_validate.ServingReplay(free, itl_target_s=target_s)
                        .replay("c=3", "rakv", None).steps)
    factors = (1.01 * 1.04 ** i for i in range(30))  # 1.01 to 3.1 times a one-row step
    binding = [t for t in (step_s * f for f in factors) if replayed(t) < _drafted(unpaced)]
    assert binding, "no target binds on this calibration of the tiny pair"
    paced = _record_tiny(tmp_path / "paced", "--itl-target", str(binding[0]))
    assert paced.meta.config["itl_target"] == binding[0]
    [row] = [row for row in serve_validate.validate_serving(paced) if row.steps is not None]
    assert row.steps.first_difference is None and row.steps.num_equal == row.steps.num_recorded
    [recorded] = serve_validate.recorded_table(paced, "steps").values()
    assert _drafted(recorded) < _drafted(unpaced)


@pytest.mark.parametrize("argv, message", [
    (["--itl-target", "-1"], "--itl-target must be 0 (none) or above, got -1"),
])
def test_a_bad_target_is_a_one_line_error(argv, message, capsys):
    assert replay(["--trace", "traces/qwen-coder-chat-serve", "--policy", "rakv", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
