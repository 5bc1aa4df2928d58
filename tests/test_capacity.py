"""simulator.capacity: the highest Poisson rate at which a policy keeps a goal share of its
requests within the SLO, bisected between a sweep's rates; through ``python -m
simulator.replay --attainment`` on a serving trace, and its bad input as one line."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from simulator.capacity import (Capacity, bisect_capacity, capacity_lines, first_crossing, sweep_capacities)
from simulator.replay import main as replay_main

TRACES = Path(__file__).resolve().parents[1] / "traces"
SERVING = TRACES / "smollm2-humaneval-serve"


def result(policy: str, rate: float, attained: float, num_requests: int = 100):
    """What ``sweep_capacities`` reads of a ``LoadResult``."""
    return SimpleNamespace(load=f"rate={rate:g}", policy=policy, num_requests=num_requests,
                           num_meeting_slo=round(attained * num_requests))


def falls_at(knee: float):
    """Attainment 1 up to ``knee``, 0.5 past it."""
    return lambda rate: 1.0 if rate <= knee else 0.5


def test_the_first_crossing_brackets_the_capacity():
    assert first_crossing([(0.5, 0.99), (1.0, 0.95), (1.5, 0.6)], 0.9) == (1.0, 1.5)
    assert first_crossing([(0.5, 0.8), (1.0, 0.7)], 0.9) is None  # below the goal from the first rate
    assert first_crossing([(0.5, 1.0), (1.0, 0.95)], 0.9) == (1.0, float("inf"))  # never below it
    # attainment that dips and recovers: the first crossing is the one taken
    assert first_crossing([(0.5, 1.0), (1.0, 0.85), (1.5, 0.92), (2.0, 0.5)], 0.9) == (0.5, 1.0)


def test_bisection_ends_within_its_tolerance_at_a_rate_that_met_the_goal():
    rate, num_replays = bisect_capacity(falls_at(0.73), 0.5, 1.0, 0.9, rel_tol=0.01)
    assert 0.73 * 0.99 <= rate <= 0.73 and num_replays == 7  # 0.5 / 2^7 < 1 % of 0.73 < 0.5 / 2^6
    assert bisect_capacity(falls_at(0.73), 0.5, 0.504, 0.9, rel_tol=0.01) == (0.5, 0)  # already narrow


def test_each_policy_is_bisected_within_its_own_bracket():
    knees = {"kv-only": 0.62, "joint-k2": 0.81, "rakv": 0.93}
    results = [result(policy, rate, falls_at(knee)(rate)) for rate in (0.4, 0.6, 0.8, 1.0)
               for policy, knee in knees.items()]
    results += [result("never", rate, 1.0) for rate in (0.4, 1.0)] + [result("hopeless", rate, 0.5)
                                                                       for rate in (0.4, 1.0)]
    asked = []

    def attainment_at(policy: str, rate: float) -> float:
        asked.append((policy, rate))
        return falls_at(knees[policy])(rate)
    found = {c.policy: c for c in sweep_capacities(results, 0.9, attainment_at)}
    for policy, knee in knees.items():
        assert knee * 0.99 <= found[policy].rate_per_s <= knee and found[policy].num_replays > 0
        low, high = {"kv-only": (0.6, 0.8), "joint-k2": (0.8, 1.0), "rakv": (0.8, 1.0)}[policy]
        assert all(low < rate < high for asked_policy, rate in asked if asked_policy == policy)
    assert found["never"] == Capacity("never", 0.9, 1.0, beyond_sweep=True)
    assert found["hopeless"] == Capacity("hopeless", 0.9, None)
    assert list(found) == ["kv-only", "joint-k2", "rakv", "never", "hopeless"]  # the results' order


def test_the_summary_line_sets_each_policy_against_the_best_fixed_one():
    capacities = [Capacity("kv-only", 0.9, 0.6), Capacity("joint-k2", 0.9, 0.8, num_replays=5),
                  Capacity("joint-k4", 0.9, 0.7), Capacity("rakv", 0.9, 0.88), Capacity("learned", 0.9, 1.0, True),
                  Capacity("foresight", 0.9, None)]
    (line,) = capacity_lines(capacities, frozenset({"kv-only", "joint-k2", "joint-k4"}), frozenset({"foresight"}))
    assert line.startswith("Capacity, the highest Poisson rate (req/s) keeping at least 90 % of the requests within "
                           "the SLO")
    assert line.endswith(": the best fixed policy joint-k2 0.800; kv-only 0.600 (-25.0 %); rakv 0.880 (+10.0 %); "
                         "learned at least 1.000 (at least +25.0 %); foresight (a reference) below the goal at every "
                         "rate")
    assert "joint-k4" not in line  # fixed policies other than the best and kv-only are left out


def test_replay_prints_each_policys_capacity(capsys):
    argv = ["--trace", str(SERVING), "--policy", "ar,rakv", "--arrival-rate", "1,3", "--requests", "40",
            "--slo", "ttft=1,itl=0.2", "--attainment", "0.9"]
    assert replay_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("Capacity, the highest Poisson rate (req/s) keeping at least 90 % of the requests")
    assert replay_main(argv + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    capacities = {r["policy"]: r for r in rows if "goal" in r}
    assert set(capacities) == {"ar", "rakv"} and len(rows) == 4 + 2
    bisected = [found for found in capacities.values() if found["num_replays"]]
    assert bisected  # here ar's attainment falls below the goal between the two rates
    for found in bisected:
        attained = {r["load"]: r["num_meeting_slo"] / r["num_requests"] for r in rows
                    if r.get("policy") == found["policy"] and "load" in r}
        assert attained["rate=1"] >= 0.9 > attained["rate=3"] and 1 <= found["rate_per_s"] < 3
        # a capacity is a rate at which the policy was replayed at the goal
        assert replay_main(argv[:3] + [found["policy"], "--arrival-rate", repr(found["rate_per_s"])] + argv[6:10]
                           + ["--json"]) == 0
        (at,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert at["num_meeting_slo"] / at["num_requests"] >= 0.9


def test_a_capacity_under_several_seeds_meets_the_goal_over_their_requests_pooled(capsys):
    argv = ["--trace", str(SERVING), "--policy", "ar", "--requests", "20", "--slo", "ttft=1,itl=0.2",
            "--seed", "3,4", "--json"]
    assert replay_main(argv + ["--arrival-rate", "2,4", "--attainment", "0.9"]) == 0
    (found,) = [row for row in map(json.loads, capsys.readouterr().out.splitlines()) if "goal" in row]
    assert found["num_replays"] and 2 <= found["rate_per_s"] < 4
    assert replay_main(argv + ["--arrival-rate", repr(found["rate_per_s"])]) == 0
    (at,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert at["num_requests"] == 40 and at["num_meeting_slo"] >= 0.9 * 40


def test_several_goals_are_bisected_from_one_sweep(capsys):
    """--attainment 0.9,0.95: a capacity per policy and goal, a summary line per goal; a
    higher goal's capacity is never the higher."""
    argv = ["--trace", str(SERVING), "--policy", "ar,rakv", "--arrival-rate", "2,4", "--requests", "20",
            "--slo", "ttft=1,itl=0.2", "--attainment", "0.9,0.95"]
    assert replay_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" of the requests")[0].split(" keeping ")[1] for line in lines[-2:]] == ["at least 90 %",
                                                                                         "at least 95 %"]
    assert replay_main(argv + ["--json"]) == 0
    found = {(r["policy"], r["goal"]): r["rate_per_s"] for r in map(json.loads, capsys.readouterr().out.splitlines())
             if "goal" in r}
    assert set(found) == {(p, g) for p in ("ar", "rakv") for g in (0.9, 0.95)}
    assert all(found[p, 0.95] <= found[p, 0.9] for p in ("ar", "rakv"))


@pytest.mark.parametrize("argv, message", [
    (["--arrival-rate", "1,2", "--slo", "ttft=1", "--attainment", "1.5"], "--attainment must be a share in (0, 1]"),
    (["--arrival-rate", "1,2", "--attainment", "0.9"], "--attainment needs an --slo"),
    (["--arrival-rate", "1,2", "--slo", "ttft=1", "--attainment", "0.9,most"], "--attainment: 'most' is not a number"),
    (["--arrival-rate", "1,2", "--slo", "ttft=1", "--attainment", "0.9,0.90"], "--attainment lists 0.9 twice"),
    (["--arrival-rate", "1", "--slo", "ttft=1", "--attainment", "0.9"], "two or more finite --arrival-rate values"),
    (["--concurrency", "1,2", "--slo", "ttft=1", "--attainment", "0.9"], "two or more finite --arrival-rate values"),
])
def test_bad_attainment_is_one_line_and_exit_2(capsys, argv, message):
    assert replay_main(["--trace", str(SERVING), "--policy", "ar"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_attainment_needs_a_serving_trace(capsys):
    assert replay_main(["--trace", str(TRACES / "smollm2-chat"), "--attainment", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "--attainment needs a serving trace" in err and len(err.strip().splitlines()) == 1


def test_the_attainment_plot_is_written(tmp_path, capsys):
    assert replay_main(["--trace", str(SERVING), "--policy", "ar,rakv", "--arrival-rate", "1,3", "--requests", "20",
                        "--slo", "ttft=1,itl=0.2", "--attainment", "0.9,0.95", "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 10_000


def test_with_attainment_the_recorded_loads_are_priced_as_its_bisection_prices_rates(capsys):
    """Replaying a trace's own loads prices each at the machine's speed as it ran; with
    --attainment they are priced at the usual speed, as the rates bisected between them."""
    argv = ["--trace", str(TRACES / "qwen-coder-sharegpt-serve-amx-past-knee-ttft"), "--policy", "rakv",
            "--slo", "ttft=6,itl=0.15", "--json"]

    def rows(extra: list[str]) -> list[dict]:
        assert replay_main(argv + extra) == 0
        return [row for row in map(json.loads, capsys.readouterr().out.splitlines()) if "load" in row]
    at_usual_speed = rows(["--arrival-rate", "1.5,1.8"])  # the recorded requests and arrivals
    assert rows(["--attainment", "0.8"]) == at_usual_speed != rows([])
