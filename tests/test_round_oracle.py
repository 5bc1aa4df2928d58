"""The round oracle: its schedule is the cheapest of every schedule on small requests
(exhaustive enumeration, priced by ``simulator.costs.request_cost``), never dearer than
any policy's own rounds on the shipped traces, and reported in every replay."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rakv.acceptance import ReplayedRound
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL, NGRAM, RunLengths
from rakv.rounds import tokens_appended
from rakv.settings import Settings
from rakv.store_model import Reuse, StoreModel, StoreOutcome
from simulator.costs import Overhead, request_cost
from simulator.replay import main as replay_main
from simulator.round_oracle import READY_SETS, best_schedule
from simulator.schedule import schedule
from simulator.session import ReplayedRequest, Session, output_length, replayed_lengths
from simulator.timing import load_timing
from simulator.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = [ROOT / "traces" / name for name in ("smollm2-chat", "qwen-coder-humaneval-runs")]


def priced(rounds, n, num_output, drafters, draft_reused, timing, inputs, overhead) -> float:
    """A request's e2e seconds with these rounds, as a replay prices it (no reuse)."""
    ready = DRAFT_MODEL in drafters
    kept, kept_draft = StoreModel(inputs.engine.store).kept_lengths(n, n + num_output, draft_reused if ready else None,
                                                                    rounds)
    outcome = StoreOutcome(Reuse(0, "miss"), draft_reused, kept, kept_draft)
    features = RequestFeatures(n, num_output, 0, 0, False)
    replayed = ReplayedRequest(0, Action(0, 0), features, outcome, drafters, True, tuple(rounds), num_output, (),
                               foresight=True)
    return request_cost(replayed, n, timing.costs, inputs, overhead).e2e_s


def every_schedule(lengths, drafters, num_output, max_new, max_k, t=1):
    """Every sequence of moves from t: a plain step, or a round of a ready drafter with k <= max_k."""
    if t >= num_output:
        yield []
        return
    yield from every_schedule(lengths, drafters, num_output, max_new, max_k, t + 1)
    for drafter in drafters:
        for k in range(1, min(max_k, max_new - t - 1) + 1):
            proposed = k if drafter == DRAFT_MODEL else min(k, lengths[drafter].proposed[t])
            if proposed == 0:
                continue
            accepted = min(k, lengths[drafter].runs[t])
            rnd = ReplayedRound(t, drafter, k, proposed, accepted)
            for rest in every_schedule(lengths, drafters, num_output, max_new, max_k,
                                       t + tokens_appended(accepted, t, num_output)):
                yield [rnd] + rest


@pytest.mark.parametrize("seed", range(6))
def test_the_schedule_is_the_cheapest_of_all(seed):
    trace = load_trace(TRACES[seed % 2])
    timing = load_timing(None, trace)
    inputs = timing.decision_inputs(trace, Settings())
    rng = np.random.default_rng(seed)
    n, num_output, max_k = int(rng.integers(5, 300)), int(rng.integers(2, 8)), 3
    max_new = num_output + int(rng.integers(0, 2))
    runs = {d: [int(min(rng.geometric(0.4) - 1, max_k)) for _ in range(num_output)] for d in (DRAFT_MODEL, NGRAM)}
    proposed = [int(rng.integers(runs[NGRAM][t], max_k + 1)) for t in range(num_output)]
    lengths = {DRAFT_MODEL: RunLengths(runs[DRAFT_MODEL], [max_k] * num_output, [0] * num_output),
               NGRAM: RunLengths(runs[NGRAM], proposed, [1] * num_output)}
    overhead = Overhead(iteration_s=1e-3 * seed, round_s=2e-3 * (seed % 3))
    for drafters in READY_SETS:
        draft_reused = int(rng.integers(0, n + 1)) if DRAFT_MODEL in drafters else 0
        kept = StoreModel(inputs.engine.store).kept_lengths(n, n + num_output, None, ())[0]
        best = best_schedule(n, num_output, max_new, max_k, drafters, lengths, draft_reused, kept, timing.costs,
                             inputs, overhead)
        costs = [priced(s, n, num_output, drafters, draft_reused, timing, inputs, overhead)
                 for s in every_schedule(lengths, drafters, num_output, max_new, max_k)]
        got = priced(best.rounds, n, num_output, drafters, draft_reused, timing, inputs, overhead)
        assert got == pytest.approx(min(costs), rel=1e-12, abs=1e-15), drafters
        # its own account of the decode loop is the pricing's, up to the parts no schedule changes
        plain = priced((), n, num_output, drafters, draft_reused, timing, inputs, overhead)
        plain_s = best_schedule(n, num_output, max_new, 0, drafters, lengths, draft_reused, kept, timing.costs,
                                inputs, overhead).decode_s
        assert got - plain == pytest.approx(best.decode_s - plain_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_never_dearer_than_a_policys_own_rounds(path):
    trace = load_trace(path)
    timing = load_timing(None, trace)
    inputs = timing.decision_inputs(trace, Settings())
    for policy in ("ar", "spec-k4", "ngram-k8", "joint-k2", "rakv"):
        session = Session.for_policy(policy, inputs, trace.target_namespace, trace.draft_namespace)
        for arrival in schedule(trace):
            request = arrival.request
            replayed = session.run(request, request.max_new_tokens)
            n = len(request.prompt_ids)
            num_output = output_length(request, request.max_new_tokens)
            best = best_schedule(n, num_output, replayed.features.num_new_tokens,
                                 min(inputs.controller.rounds.max_k, request.max_k), replayed.drafters,
                                 replayed_lengths(request, replayed), replayed.store.draft_reused_tokens,
                                 replayed.store.kept_tokens,
                                 timing.costs, inputs, timing.overhead)
            kept_draft = session.store.kept_lengths(n, n + num_output, replayed.store.draft_reused_tokens if
                                                    replayed.draft_ready else None, best.rounds)[1]
            ours = replace(replayed, rounds=best.rounds, foresight=True,
                           store=replace(replayed.store, kept_draft_tokens=kept_draft))
            theirs_s = request_cost(replayed, n, timing.costs, inputs, timing.overhead).e2e_s
            ours_s = request_cost(ours, n, timing.costs, inputs, timing.overhead).e2e_s
            assert ours_s <= theirs_s * (1 + 1e-12), (policy, request.request_id)


def test_every_replay_reports_it(capsys):
    assert replay_main(["--trace", str(TRACES[0]), "--policy", "ar,rakv"]) == 0
    out = capsys.readouterr().out
    assert "vs round oracle" in out
    assert replay_main(["--trace", str(TRACES[0]), "--policy", "rakv,round-oracle,oracle", "--json"]) == 0
    rows = {r["policy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["round-oracle"]["regret_vs_round_oracle"] == 0.0
    assert rows["rakv"]["regret_vs_round_oracle"] > 0 and rows["oracle"]["regret_vs_round_oracle"] > 0
    assert all("foresight" in action for action in rows["round-oracle"]["action_histogram"])
