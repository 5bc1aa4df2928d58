"""A serving trace's rate sweep as a tuning objective: the goodput a policy serves, summed
over Poisson loads, replayed by the batching engine's own scheduler. Imports no torch.

``policy.train --serve-trace`` scores each trial's learned planner by it beside the
batch-1 traces' tokens per second: a planner tuned at batch 1 only prices its rounds for
an idle machine's trade-offs, and what pays under load is not what pays alone (results
section 15: prompt lookup +26 % at one request in flight, -15 % at four). The sweep's
requests are the trace's, resampled with their prefix families to ``num_requests`` (one
request of 16 is 6 % of a rate's goodput; a smoother objective needs more) under each of
its seeds and pooled (more requests of one seed repeat its prompts more: another
workload), on the trace's step model (``simulator.step_costs``), under the recording's
ITL and TTFT targets or those given, as ``simulator.replay --arrival-rate R,... --slo ...
--seed S,... [--itl-target S] [--ttft-target S] [--max-num-prefills N]`` replays them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from profiler.serve_record import Load
from profiler.serve_summary import Slo
from rakv.controller import Policy
from rakv.scheduler import BatchConfig
from rakv.settings import DecisionInputs, Settings
from simulator.load_replay import has_serving_grid
from simulator.load_result import summarize_load
from simulator.serve_validate import ServingReplay, fit_serving_costs
from simulator.trace import Trace, load_trace


@dataclass(frozen=True)
class SweepConfig:
    rates_per_s: tuple[float, ...]  # Poisson arrival rates, requests per second
    slo: Slo  # a request counts towards goodput if it meets every stated bound
    num_requests: int = 200  # resampled from the trace's, with their prefix families
    seeds: tuple[int, ...] = (0,)  # of the resampling and the arrivals: each rate replayed under each, pooled
    # the server's targets (``rakv.scheduler.BatchConfig``): None, the recording's; 0, none
    itl_target_s: float | None = None
    ttft_target_s: float | None = None
    max_num_prefills: int | None = None  # the server's (``BatchConfig``); None: the recording's


class LoadSweep:
    """One serving trace's sweep (today's settings), replayed under any policy; a named
    policy's goodput (the baseline's) is replayed once and kept."""

    def __init__(self, path: Path, config: SweepConfig):
        trace = load_trace(path)
        if not has_serving_grid(trace):
            raise ValueError(f"{path}: not a serving trace (record it with profiler.record --grid serving)")
        if not config.slo.stated:
            raise ValueError("a rate sweep's goodput needs an SLO of at least one bound")
        self.trace: Trace = trace
        self.config = config
        self.servings = [ServingReplay(trace, trace.decision_inputs(Settings()), config.num_requests, seed,
                                       itl_target_s=config.itl_target_s, ttft_target_s=config.ttft_target_s,
                                       max_num_prefills=config.max_num_prefills)
                         for seed in config.seeds]
        self.costs = fit_serving_costs(trace)
        self._named: dict[str, float] = {}

    @property
    def inputs(self) -> DecisionInputs:
        return self.servings[0].inputs

    @property
    def batch(self) -> BatchConfig:
        return self.servings[0].batch

    def goodput_per_s(self, policy: str | Callable[[], Policy]) -> float:
        """The goodput a policy serves, summed over the sweep's rates (each rate's seeds
        pooled): a name (computed once), or a function making a fresh one, called per rate
        and seed (a policy carries what it learned from one load into the next)."""
        if isinstance(policy, str) and policy in self._named:
            return self._named[policy]
        total = 0.0
        for rate in self.config.rates_per_s:
            load = Load(rate_per_s=rate)
            runs = [serving.run(load, policy if isinstance(policy, str) else policy(), self.costs)
                    for serving in self.servings]
            total += summarize_load(load.label, "", runs, self.config.slo).goodput_per_s or 0.0
        if isinstance(policy, str):
            self._named[policy] = total
        return total
