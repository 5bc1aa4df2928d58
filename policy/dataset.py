"""Training data for the learned policy: one group per request, one row per choice, each
labelled with the choice's cost. Imports no torch.

A trace's requests are served in order by the oracle (``simulator.oracle``), whose store
and running ``rakv`` estimates evolve as the oracle's choices make them; before each
request, every choice (``rakv.choices``) gets its features (``rakv.learned_features``) and its
cost: **measured**, from the runs table, where the trace ran that choice on that request
from the same store contents and with the same rounds; **simulated** (exact acceptance,
fitted costs) elsewhere. ``Group.measured`` says which.

Splits are by prefix family (a conversation, a prompt family; the trace is part of the
name), so a family's requests are never on both sides of a split.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rakv.choices import Choice, adaptive_choice, fixed_action
from rakv.controller import ControllerConfig
from rakv.learned_features import FEATURES, feature_rows
from simulator.oracle import Oracle
from simulator.schedule import schedule
from simulator.session import replay_runs
from simulator.timing import Timing
from simulator.trace import Trace

SPLITS = ("train", "validation", "test")
SPLIT_SHARES = (0.6, 0.2, 0.2)


@dataclass(frozen=True)
class Group:
    trace: str
    request_id: int
    family: str  # "<trace>/<group id>": held out together
    choices: tuple[Choice, ...]
    rows: np.ndarray  # [choices, FEATURES]
    cost_s: np.ndarray  # [choices] the label: seconds of service
    measured: np.ndarray  # [choices] bool: the label is a measured run's
    analytic_choice: int  # what the analytic rakv policy would choose here (its rounds are adaptive)

    @property
    def best(self) -> int:
        return int(np.argmin(self.cost_s))


def build_groups(trace: Trace, timing: Timing, controller: ControllerConfig | None = None,
                 resample: int | None = None, seed: int = 0) -> list[Group]:
    """The trace's requests in recorded order (or ``resample`` of them drawn with their
    prefix families: more store and estimate states to learn from), served by the oracle
    (see the module docstring); ``controller`` replaces the recorded controller settings
    (EWMA decay, planner margin)."""
    inputs = timing.decision_inputs(trace, None)  # the recorded settings, ``controller`` aside
    if controller is not None:
        inputs = replace(inputs, controller=controller)
    oracle = Oracle(inputs, timing.costs, timing.overhead, trace.target_namespace, trace.draft_namespace)
    measured = _measured_runs(trace, controller)
    pending = {}

    def features_now(request, features):
        pending["rows"] = feature_rows(features, oracle.policy.adaptive, oracle.choices)
        pending["analytic"] = oracle.choices.index(adaptive_choice(oracle.policy.adaptive.decide(features)))

    oracle.before_pricing = features_now
    groups = []
    for arrival in schedule(trace, resample, seed=seed):
        request = arrival.request
        oracle.run(request, request.max_new_tokens)
        costs, from_run = [], []
        for choice, cost_s, replayed in oracle.priced:
            run = measured.get((request.request_id, choice))
            same = run is not None and run[1].store == replayed.store and run[1].rounds == replayed.rounds
            costs.append(run[0].e2e_s if same else cost_s)
            from_run.append(same)
        groups.append(Group(trace.path.name, request.request_id, f"{trace.path.name}/{request.group_id}",
                            oracle.choices, pending["rows"], np.array(costs), np.array(from_run), pending["analytic"]))
    return groups


def _measured_runs(trace: Trace, controller: ControllerConfig | None) -> dict:
    """(request id, choice) -> (run, its replay), for the runs a label may use: the fixed
    policies', and the adaptive policy's when it decided with the settings in use."""
    found = {}
    adaptive_ok = controller is None or controller == trace.require_inputs().controller
    for policy in sorted({r.policy for r in trace.runs}):
        if fixed_action(policy) is None and not (policy == "rakv" and adaptive_ok):
            continue
        for run, replayed in replay_runs(trace, policy):
            found[run.request_id, replayed.choice] = (run, replayed)
    return found


def split_families(groups: list[Group], seed: int = 0) -> dict[str, list[Group]]:
    """``SPLITS`` by prefix family, in seeded order, each taking its share of requests."""
    families = sorted({g.family for g in groups})
    order = np.random.default_rng(seed).permutation(len(families))
    sizes = {f: sum(g.family == f for g in groups) for f in families}
    total, taken, assigned = len(groups), 0, {}
    bounds = np.cumsum(SPLIT_SHARES) * total
    for i in order:
        family = families[i]
        split = next(s for s, bound in zip(SPLITS, bounds) if taken < bound - 1e-9) if taken < total else SPLITS[-1]
        assigned[family] = split
        taken += sizes[family]
    return {s: [g for g in groups if assigned[g.family] == s] for s in SPLITS}


def stack(groups: list[Group]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(rows [sum choices, FEATURES], costs, group sizes) for LightGBM."""
    if not groups:
        return np.empty((0, len(FEATURES))), np.empty(0), []
    return (np.concatenate([g.rows for g in groups]), np.concatenate([g.cost_s for g in groups]),
            [len(g.choices) for g in groups])
