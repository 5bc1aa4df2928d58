"""Load-aware round prices (``rakv.step_load``): alone they are the batch-1 prices bit for
bit; under load a round pays only while its rows are worth the others' time; the
scheduler shows each round the rest of its step; a draft catch-up waits for a step that
prefills no other request; a request admitted where the draft cannot pay does not ready
it; settings written before the switches replay as they ran."""
from __future__ import annotations

import json
from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest

from rakv.controller import ControllerConfig, CostModelPolicy
from rakv.cost_model import PairTimings, RequestFeatures
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.round_planner import AdaptiveRounds, PlannerConfig, round_costs
from rakv.scheduler import VERIFY, BatchConfig, Scheduler, Seq
from rakv.settings import settings_from_json, settings_to_json
from rakv.step_load import ALONE, StepLoad, load_prices

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DRAFTERS = (DRAFT_MODEL, NGRAM)


@pytest.fixture(scope="module")
def timings():
    """The Qwen pair's int4 calibration on a Zen 3 core (qwen-coder-chat-serve as recorded
    at ab5d8eb, kept here: a re-recording moves it): a draft step is 0.45 target steps,
    9 rows cost 2.7 steps."""
    return settings_from_json(PairTimings, json.loads((FIXTURES / "qwen_int4_zen3_timings.json").read_text()))


def planner(timings, acceptance: float, load_aware: bool = True) -> AdaptiveRounds:
    costs = round_costs(timings, DRAFTERS, 16, 300)
    priors = {(DRAFT_MODEL, 0): acceptance, (NGRAM, 3): acceptance}
    return AdaptiveRounds(DRAFTERS, priors, {DRAFT_MODEL: acceptance, NGRAM: acceptance}, costs,
                          PlannerConfig(load_aware=load_aware))


def test_alone_the_prices_are_the_batch_1_round_costs_bit_for_bit(timings):
    costs = round_costs(timings, DRAFTERS, 16, 300)
    prices = load_prices(ALONE, timings, DRAFTERS, 16, 300)
    assert prices.offset == 0.0 and prices.base_s == costs.step_s
    assert prices.costs_s == {d: costs.round_s[d] for d in DRAFTERS}


def test_a_round_that_pays_alone_stops_paying_as_the_step_fills(timings):
    signals = {DRAFT_MODEL: 0, NGRAM: 3}
    sure = planner(timings, 0.9)
    assert sure.plan(signals)[1] > 0
    assert sure.plan(signals, 0, StepLoad(0, 0)) == sure.plan(signals)  # no other request: batch 1's choice
    ks = [sure.plan(signals, 0, StepLoad(n, n))[1] for n in range(8)]
    assert ks[0] > 0 and ks[-1] == 0 and ks == sorted(ks, reverse=True)
    # not load-aware: the batch-1 choice whatever the step holds
    assert planner(timings, 0.9, load_aware=False).plan(signals, 0, StepLoad(7, 7)) == sure.plan(signals)


def test_a_round_joining_the_others_draft_forwards_pays_only_their_rows(timings):
    alone = load_prices(StepLoad(1, 1), timings, (DRAFT_MODEL,), 8, 300)
    joined = load_prices(StepLoad(1, 5, (1, 1, 1, 1)), timings, (DRAFT_MODEL,), 8, 300)
    draft_step_s = timings.draft.step_s(300)
    # the others' four draft forwards are in the step already: what k = 4 adds is far less
    assert joined.base_s - alone.base_s > 4 * draft_step_s
    assert (joined.costs_s[DRAFT_MODEL][4] - joined.base_s) < (alone.costs_s[DRAFT_MODEL][4] - alone.base_s) - 3 * draft_step_s


class _Moves:
    """A planner walk that drafts k with the draft model when told to, and records its loads."""

    def __init__(self, k: int, loads: list):
        self.k, self.loads = k, loads

    def plan_move(self, t, max_k=None, load=None):
        self.loads.append(load)
        return DRAFT_MODEL, min(self.k, max_k)


def test_the_scheduler_shows_each_round_the_rest_of_its_step():
    loads: list = []
    scheduler = Scheduler(BatchConfig(max_num_seqs=4, max_num_batched_tokens=64), lambda seq: None,
                          lambda seq: None, lambda: 0, lambda: False)
    for i, k in enumerate((3, 0, 2)):
        seq = Seq(i, 4, 16, 1, num_tokens=5, num_computed=4, prefill_end=4, moves=_Moves(k, loads), admitted=True)
        scheduler.running.append(seq)
    works = scheduler.schedule()
    assert [w.kind for w in works] == [VERIFY, "decode", VERIFY]
    assert loads == [StepLoad(2, 2, ()), StepLoad(2, 5, (1, 1, 1)), StepLoad(2, 5, (1, 1, 1))]
    assert scheduler.waiting == deque()


def test_the_scheduler_shows_a_round_its_draft_catch_up_where_the_step_prefills():
    """Only where another request prefills (a running chunk or an admission) is the lag of
    the request's draft cache shown: elsewhere a catch-up delays no first token."""
    def scheduled(waiting: bool, prefilling: bool) -> list:
        loads: list = []
        scheduler = Scheduler(BatchConfig(max_num_seqs=4, max_num_batched_tokens=64), lambda seq: None,
                              lambda seq: None, lambda: 0, lambda: False)
        scheduler.running.append(Seq(0, 40, 16, 1, num_tokens=42, num_computed=41, prefill_end=40,
                                     moves=_Moves(2, loads), admitted=True, draft_seen=38))
        if prefilling:
            scheduler.running.append(Seq(1, 30, 16, 1, num_tokens=30, num_computed=8, prefill_end=30, admitted=True))
        if waiting:
            scheduler.add(Seq(2, 20, 16, 1, num_tokens=20, prefill_end=20, admitted=True))
        scheduler.schedule()
        return [load.catch_up_beside_prefill for load in loads]

    assert scheduled(waiting=False, prefilling=False) == [0]
    assert scheduled(waiting=True, prefilling=False) == [42 - 38]
    assert scheduled(waiting=False, prefilling=True) == [42 - 38]


def test_a_draft_catch_up_waits_for_a_step_that_prefills_no_other_request(timings):
    """A probe of the draft model (the request's first round, whatever the price) over a
    prompt it has not seen is held while the step prefills another request, and made at the
    first step that does not; a short catch-up is not held, nor any with the limit off."""
    signals = {DRAFT_MODEL: 0, NGRAM: 3}
    limit = PlannerConfig().max_catch_up_beside_prefill
    costs = round_costs(timings, DRAFTERS, 16, 300)
    priors = {(DRAFT_MODEL, 0): 0.2, (NGRAM, 3): 0.2}  # no round pays: only the probe drafts

    def probing(config: PlannerConfig = PlannerConfig()) -> AdaptiveRounds:
        return AdaptiveRounds(DRAFTERS, priors, {DRAFT_MODEL: 0.2, NGRAM: 0.2}, costs, config, probe=DRAFT_MODEL)

    held = probing()
    beside_prefill = StepLoad(1, 1, catch_up_beside_prefill=300)
    assert held.plan(signals, 1, beside_prefill)[1] == 0
    assert held.plan(signals, 2, beside_prefill)[1] == 0
    assert held.plan(signals, 3, StepLoad(1, 1))[0] == DRAFT_MODEL and held.plan(signals, 4, StepLoad(1, 1))[1] == 0
    short = StepLoad(1, 1, catch_up_beside_prefill=limit)
    assert probing().plan(signals, 1, short)[0] == DRAFT_MODEL
    unlimited = probing(PlannerConfig(max_catch_up_beside_prefill=None))
    assert unlimited.plan(signals, 1, beside_prefill)[0] == DRAFT_MODEL


def test_a_request_admitted_where_the_draft_cannot_pay_does_not_ready_it(timings):
    """Readied, the draft would prefill the prompt at its first round and hold memory, and
    under this load no round of it pays: the controller takes the best action without it."""
    sure = replace(timings, acceptance_prior=0.97)
    features = RequestFeatures(300, 48, 0, 0, False)
    alone = CostModelPolicy(sure).decide(features)
    assert alone.drafter == DRAFT_MODEL and alone.k > 0
    crowded = CostModelPolicy(sure).decide(replace(features, num_running=7))
    assert not (crowded.drafter == DRAFT_MODEL and crowded.k > 0)
    as_before = CostModelPolicy(sure, ControllerConfig(ready_under_load=False))
    assert as_before.decide(replace(features, num_running=7)) == alone


def test_settings_written_before_load_aware_pricing_replay_without_it():
    written = settings_to_json(ControllerConfig())
    del written["rounds"]["load_aware"], written["ready_under_load"], written["rounds"]["max_catch_up_beside_prefill"]
    assert settings_from_json(ControllerConfig, written) == replace(
        ControllerConfig(ready_under_load=False),
        rounds=replace(PlannerConfig(), load_aware=False, max_catch_up_beside_prefill=None))
    assert ControllerConfig().rounds.load_aware and ControllerConfig().ready_under_load
