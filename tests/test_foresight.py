"""simulator.foresight: rakv's rule with each round's outcome known. A round drafts no
further than the run it will meet, and not where there is none; under load every round it
drafts is accepted whole, beside other requests in its step."""
from __future__ import annotations

from pathlib import Path

from profiler.serve_record import Load
from rakv.acceptance import RunLengthRounds
from rakv.drafters import NGRAM, RunLengths
from rakv.round_planner import PlannerConfig, RoundCosts
from rakv.scheduler import PREFILL
from rakv.settings import Settings
from simulator.foresight import ForesightPolicy, ForesightRounds
from simulator.serve_validate import ServingReplay, fit_serving_costs
from simulator.trace import load_trace

SERVING = Path(__file__).resolve().parents[1] / "traces" / "smollm2-humaneval-serve"


def planner(step_s: float, row_s: float) -> ForesightRounds:
    """Prompt lookup alone, priced as a step plus ``row_s`` for each drafted row."""
    costs = RoundCosts(step_s, {NGRAM: tuple(step_s + k * row_s for k in range(17))})
    rounds = ForesightRounds((NGRAM,), {}, {NGRAM: 0.5}, costs, PlannerConfig())
    runs = [0, 3, 16]
    rounds.bind({NGRAM: RunLengths(runs, [16] * len(runs), [1] * len(runs))})
    return rounds


def test_a_round_drafts_its_run_and_no_further():
    cheap = planner(1.0, 0.05)
    assert cheap.plan({NGRAM: 1}, 0) == (NGRAM, 0)  # no run: a plain step
    assert cheap.plan({NGRAM: 1}, 1) == (NGRAM, 3)  # 4 tokens in 1.15 s; a fourth row would bring none
    assert cheap.plan({NGRAM: 1}, 2) == (NGRAM, 16)
    costly = planner(1.0, 1.0)  # every row a step's price: 2 tokens in 2 s lose to 1.1 in 1
    assert costly.plan({NGRAM: 1}, 1) == (NGRAM, 0)


def test_under_load_every_round_is_accepted_whole(monkeypatch):
    rounds = []
    finish_move = RunLengthRounds.finish_move

    def counted(self, t, drafter, k, rnd=None, probs=()):
        if k:
            rounds.append((k, rnd.num_proposed, rnd.accepted))
        return finish_move(self, t, drafter, k, rnd, probs)

    trace = load_trace(SERVING)
    inputs = trace.decision_inputs(Settings())
    serving, costs = ServingReplay(trace, inputs), fit_serving_costs(trace)
    monkeypatch.setattr(RunLengthRounds, "finish_move", counted)  # after the fit, which replays the recorded loads
    run = serving.run(Load(concurrency=4), ForesightPolicy(inputs.timings, inputs.controller), costs)
    assert len(rounds) >= 20 and all(k == proposed == accepted for k, proposed, accepted in rounds)
    shared = [s for s in run.steps if any(s.composition.ks)
              and sum(kind != PREFILL for kind in s.composition.kinds) > 1]
    assert shared  # rounds planned beside other requests' rows
    assert len(run.requests) == 16
