"""A replay session: the engine's own store model and policy, fed recorded requests one at
a time, reproducing what the engine did with each. Imports no torch.

Per request, in the engine's order (``rakv.engine.Engine.generate``): match the prompt in
the store for the target and the draft; the policy decides the action from those
features and makes the request's round planner; the rounds replay exactly from the run
lengths (``rakv.acceptance.replay_request``); the store model applies the request
(reuse, then the kept entries); the policy observes the request's acceptance counts. Every
step is a function of the tokens and the decision inputs, so the session reproduces the
engine's actions, hits, rounds and store contents exactly, and carries the policy's and
the store's state from request to request as the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass

from profiler.schema import RunRow, policy_copy_dir
from rakv.acceptance import ReplayedRound, comparable_rounds, replay_request, with_store_drafter
from rakv.choices import Choice
from rakv.controller import Policy, RequestOutcome, make_policy
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL, NGRAM, SUFFIX, RunLengths
from rakv.policies import LEARNED, resolve_policy
from rakv.settings import DecisionInputs
from rakv.store_model import PrefixMatch, StoreModel, StoreOutcome
from simulator.trace import RecordedRequest, Trace


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class ReplayedRequest:
    request_id: int
    action: Action
    features: RequestFeatures
    store: StoreOutcome  # what it reused and kept
    drafters: tuple[str, ...]  # the drafters its planner had ready (the draft model's cache, if there, was prefilled)
    adaptive: bool  # its rounds were planned adaptively (not the same k every round)
    rounds: tuple[ReplayedRound, ...]
    num_output_tokens: int
    estimates: tuple[tuple[str, float], ...]  # the adaptive policy's acceptance per drafter when it decided
    foresight: bool = False  # its rounds were the round oracle's: planned knowing the run lengths, at no cost
    # the store drafter's run lengths at every position, as the store stood when the request
    # ran (None: not ready); the trace cannot hold them, as they depend on the store
    store_lengths: RunLengths | None = None

    @property
    def hit_tokens(self) -> int:
        return self.features.target_hit_tokens

    @property
    def draft_ready(self) -> bool:
        return DRAFT_MODEL in self.drafters

    @property
    def choice(self) -> Choice:
        """What ran, as a request-level choice."""
        if self.adaptive:
            return Choice(self.action.r, True, DRAFT_MODEL if self.draft_ready else NGRAM, 0)
        return Choice(self.action.r, False, self.action.drafter, self.action.k)

    @property
    def label(self) -> str:
        """What ran, in a histogram: the choice, or the round oracle's readied drafters."""
        if self.foresight:
            return f"(r={self.action.r}, {'+'.join(self.drafters) or 'plain'} with foresight)"
        return str(self.choice)


class SessionError(ValueError):
    """A replay the trace cannot support; the message is one line."""


class Session:
    """One engine's worth of state (store and policy), replayed."""

    def __init__(self, policy: Policy, inputs: DecisionInputs, target_namespace: str,
                 draft_namespace: str | None):
        self.policy = policy
        self.inputs = inputs
        self.store = StoreModel(inputs.engine.store)
        self._memo: dict[tuple, tuple[object, tuple[ReplayedRound, ...]]] = {}  # (planner, rounds) by key
        self.target_namespace, self.draft_namespace = target_namespace, draft_namespace
        self._store_lengths: RunLengths | None = None  # the request being replayed's (``ReplayedRequest``)

    @classmethod
    def for_policy(cls, name: str, inputs: DecisionInputs, target_namespace: str,
                   draft_namespace: str | None) -> "Session":
        return cls(make_policy(name, inputs.timings, inputs.controller), inputs, target_namespace, draft_namespace)

    def run(self, request: RecordedRequest, max_new_tokens: int) -> ReplayedRequest:
        """The request as the engine runs it with this cap on new tokens."""
        if max_new_tokens > request.max_new_tokens:
            raise SessionError(f"request {request.request_id} was recorded up to {request.max_new_tokens} new "
                               f"tokens; a replay cannot ask for {max_new_tokens}")
        n = len(request.prompt_ids)
        prompt = request.token_ids[:n]
        max_new = min(max_new_tokens, self.inputs.max_positions - n)
        target = self.store.match(self.target_namespace, prompt)
        draft = self.store.match(self.draft_namespace, prompt)
        features = RequestFeatures.of(target, draft, max_new, prompt)
        estimates = tuple(sorted(getattr(self.policy, "acceptance", {}).items()))
        action, planner, rounds = self.decide(request, features, target, draft)
        store_lengths, self._store_lengths = self._store_lengths, None
        draft_ready = DRAFT_MODEL in planner.drafters
        seq = request.token_ids[:n + output_length(request, max_new)]
        draft_side = (self.draft_namespace, draft, self.inputs.draft_sizes) if draft_ready else None
        outcome = self.store.serve(seq, n, (self.target_namespace, target, self.inputs.target_sizes),
                                   draft_side, action.r, rounds)
        self.policy.observe(RequestOutcome(action, planner.counts()))
        return ReplayedRequest(request.request_id, action, features, outcome, tuple(planner.drafters),
                               planner.adaptive, rounds, len(seq) - n, estimates, store_lengths=store_lengths)

    def decide(self, request: RecordedRequest, features: RequestFeatures, target: PrefixMatch,
               draft: PrefixMatch) -> tuple[Action, object, tuple[ReplayedRound, ...]]:
        """The policy's action, the request's planner after its rounds, and the rounds."""
        action = self.policy.decide(features)
        return (action, *self.rounds(request, features, self.policy.planner(features, action)))

    def rounds(self, request: RecordedRequest, features: RequestFeatures,
               planner) -> tuple[object, tuple[ReplayedRound, ...]]:
        """The request's rounds under ``planner``, and the planner after observing them. A
        planner whose rounds depend on the request and its cap alone (a ``memo_key``: a fixed
        one, a learned one) is replayed once per request, cap and key."""
        if planner.memo_key is not None:
            key = (request.request_id, planner.memo_key, features.num_new_tokens)
            if key not in self._memo:
                self._memo[key] = (planner, self._replay(request, features, planner))
            return self._memo[key]
        return planner, self._replay(request, features, planner)

    def _replay(self, request: RecordedRequest, features: RequestFeatures, planner) -> tuple[ReplayedRound, ...]:
        if DRAFT_MODEL in planner.drafters and self.inputs.draft_sizes is None:
            raise SessionError(f"policy {self.policy.name!r} needs a draft model; the trace's pair has none")
        if planner.drafters and request.max_k < self.inputs.controller.rounds.max_k:
            raise SessionError(f"request {request.request_id} holds run lengths up to {request.max_k} tokens; "
                               f"the planner drafts up to {self.inputs.controller.rounds.max_k}: re-record the "
                               f"trace (scripts/record_traces.sh), or --set planner.max_k={request.max_k}")
        if planner.confidence > 0 and DRAFT_MODEL in planner.drafters and not request.draft_top1_probs:
            raise SessionError(f"request {request.request_id} holds no draft probabilities, so confidence stops "
                               "cannot replay: re-record the trace (scripts/record_traces.sh), or "
                               "--set planner.draft_confidence=0")
        max_new = features.num_new_tokens
        num_output = output_length(request, max_new)
        lengths = self.lengths(request, planner.drafters, num_output)
        rounds = tuple(replay_request(planner, lengths, num_output, max_new, request.token_ids))
        if SUFFIX in lengths:  # the positions its rounds skipped, looked up before the store changes
            self._store_lengths = lengths[SUFFIX].materialized()
        return rounds

    def lengths(self, request: RecordedRequest, drafters: tuple[str, ...], num_output: int) -> dict:
        """The request's run lengths for ``drafters``: the trace's, and the store drafter's
        over the store as it stands (``rakv.acceptance.with_store_drafter``)."""
        return with_store_drafter(request.lengths, drafters, self.store, self.target_namespace,
                                  self.inputs.engine.suffix, request.token_ids, len(request.prompt_ids), num_output)


def replayed_lengths(request: RecordedRequest, replayed: ReplayedRequest) -> dict[str, RunLengths]:
    """The run lengths a replayed request ran with: the trace's, and the store drafter's
    as its replay looked them up."""
    store = {} if replayed.store_lengths is None else {SUFFIX: replayed.store_lengths}
    return {**request.lengths, **store}


def trace_policy(name: str, trace: Trace, inputs: DecisionInputs, strict: bool = False,
                 recorded: bool = False) -> Policy:
    """The named policy for the trace's pair and models, resolved as ``rakv.generate``
    resolves it (``rakv.policies``), calibrated and configured by ``inputs``; a learned
    policy decides with its own controller settings. ``recorded``: a learned policy the
    trace served is read from the trace's copy of it (``profiler.schema.policy_copy_dir``),
    the files it ran, where the trace holds one."""
    copy = policy_copy_dir(trace.path, name)
    if recorded and copy.is_dir():
        name = f"{LEARNED}={copy}"
    return resolve_policy(name, inputs.timings, inputs.controller, trace.target_namespace, trace.draft_namespace,
                          trace.meta.models.get("pair"), strict)


def output_length(request: RecordedRequest, max_new: int) -> int:
    """Tokens the request generates under a cap of ``max_new``: greedy output stops at EOS."""
    return min(len(request.output_ids), max_new)


def replay_runs(trace: Trace, policy_name: str) -> list[tuple[RunRow, ReplayedRequest]]:
    """The policy's recorded runs, each beside its replay: one session over the runs'
    requests in order, as the recording ran them (one engine per policy)."""
    inputs = trace.require_inputs()
    runs = sorted((r for r in trace.runs if r.policy == policy_name), key=lambda r: r.request_id)
    session = Session.for_policy(policy_name, inputs, trace.target_namespace, trace.draft_namespace)
    return [(run, session.run(trace.by_id[run.request_id], run.max_new_tokens)) for run in runs]


def run_mismatch(run: RunRow, replayed: ReplayedRequest) -> str | None:
    """The first way the replay differs from the recorded run, or None."""
    recorded, rounds = comparable_rounds(
        list(zip(run.start_per_round, run.drafter_per_round, run.k_per_round, run.proposed_per_round,
                 run.accepted_per_round)), replayed.rounds)
    checks = (
        ("action", (replayed.action.r, replayed.action.k, replayed.action.drafter), (run.r, run.k, run.drafter)),
        ("hit tokens", replayed.hit_tokens, run.hit_tokens),
        ("reused tokens", replayed.store.reuse.reused_tokens, run.reused_tokens),
        ("hit kind", replayed.store.reuse.hit_kind, run.hit_kind),
        ("output tokens", replayed.num_output_tokens, run.num_output_tokens),
        ("rounds (start, drafter, k, proposed, accepted)", rounds, recorded),
    )
    for what, got, want in checks:
        if got != want:
            return f"request {run.request_id} under {run.policy}: {what} replayed as {got}, recorded {want}"
    return None
