"""Policies: per request, choose whether to reuse stored KV (r), the drafter and the
draft length (k).

One interface serves the engine and the simulator: ``decide(features) -> Action`` before a
request runs, ``planner(features, action)`` for its rounds (``rakv.round_planner``) and
``observe(outcome)`` after it. Imports no torch.

Fixed policies (named in ``rakv.choices``): ``ar`` (0,0), ``kv-only`` (1,0), ``spec-kN`` (0,N), ``joint-kN`` (1,N)
with the draft model, ``ngram-kN`` (0,N) and ``joint-ngram-kN`` (1,N) with prompt lookup.
The adaptive policy ``rakv`` prices every action with the analytic cost model under an
EWMA of each drafter's acceptance, drops actions whose working KV would exceed the memory
limit, and picks the cheapest (ties: fewer draft tokens, then no reuse). Its rounds then
adapt: each re-chooses the drafter and k from the request's own acceptance so far.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from rakv.choices import (ADAPTIVE_NAME, FIXED_POLICY_HELP, K_CHOICES, Choice, fixed_action,
                          priced_actions, readied_drafters, usable_drafters)
from rakv.cost_model import (Action, PairTimings, RequestFeatures, action_bytes, action_terms, costs_under,
                             decode_context, progress_by_k)
from rakv.drafters import DRAFT_MODEL, SUFFIX
from rakv.suffix_drafter import suffix_prior
from rakv.prefix_index import as_token_array
from rakv.round_planner import (AcceptanceCount, AdaptiveRounds, FixedRounds, PlannerConfig, RoundCosts,
                                initial_estimate, round_costs)
from rakv.step_load import StepLoad

RoundPlanner = FixedRounds | AdaptiveRounds

@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class RequestOutcome:
    """What a policy learns from a finished request."""

    action: Action
    counts: tuple[AcceptanceCount, ...]  # each drafter's trials in the request, shadowed ones included


class Policy(Protocol):
    name: str

    def decide(self, features: RequestFeatures) -> Action: ...

    def planner(self, features: RequestFeatures, action: Action) -> RoundPlanner: ...

    def observe(self, outcome: RequestOutcome) -> None: ...


@dataclass
class FixedPolicy:
    name: str
    action: Action

    def decide(self, features: RequestFeatures) -> Action:
        return self.action

    def planner(self, features: RequestFeatures, action: Action) -> FixedRounds:
        return FixedRounds(action.drafter, action.k)

    def observe(self, outcome: RequestOutcome) -> None:
        pass


@dataclass(frozen=True)
class ControllerConfig:
    ewma_decay: float = 0.3  # weight of the newest request's acceptance
    memory_limit_bytes: int | None = None  # working KV limit per request; None: unlimited
    rounds: PlannerConfig = PlannerConfig()  # how each request adapts its rounds
    # Until the policy has seen the draft model draft, its acceptance is the calibration's
    # prior (code, prose and chat averaged), which can keep it off a workload where it
    # pays (Qwen2.5-Coder on code: prior 0.81, true 0.91). So while unseen, an action
    # readying it is taken if it is predicted within this fraction of the cheapest, and
    # the request's first round drafts with it (``AdaptiveRounds`` ``probe``): the running
    # estimate is then measured, and the rounds after it follow the request's own
    # acceptance. 0: never probe.
    probe_margin: float = 0.15
    # Readying the draft model removes none of prompt lookup's rounds (the planner picks a
    # drafter per round), so the draft is readied when its best action is predicted to
    # beat plain steps, not only when it beats prompt lookup's fixed-k price too: that
    # price uses prompt lookup's average acceptance, which says nothing about how much the
    # next request copies (without this rule, replaying Qwen on code readied the draft on 3
    # of 100 requests).
    ready_draft_over_plain: bool = True
    # Admitted into a batch where no round of the draft model would pay (``rakv.step_load``'s
    # prices at the running requests, the policy's acceptance), a request does not ready it:
    # readied, its first round would prefill the draft over the whole prompt, and its memory
    # is reserved for nothing. Off: readied as at batch 1, as engines before it did.
    ready_under_load: bool = field(default=True, metadata={"before": False})
    # Adaptive rounds may also draft from what earlier requests produced, held by the prefix
    # store (``rakv.suffix_drafter``); it costs a lookup, so it is always ready. Off: prompt
    # lookup and the draft model only, as engines before it.
    store_drafter: bool = field(default=True, metadata={"before": False})


@dataclass
class CostModelPolicy:
    """The adaptive ``rakv`` policy: cheapest feasible action under the analytic model."""

    timings: PairTimings
    config: ControllerConfig = field(default_factory=ControllerConfig)
    name: str = "rakv"

    MAX_SHAPES = 4096  # shapes each of ``_terms_at``'s and ``_draft_idle``'s memos keeps at most (then starts again)

    def __post_init__(self):
        drafters = usable_drafters(self.timings.draft is not None)
        self.drafters = drafters
        # EWMA of each drafter's per-token acceptance, from the calibration priors; and of
        # each (drafter, signal), which is where each request's rounds start from
        self.acceptance = {d: self.timings.prior(d) for d in drafters}
        if self.config.store_drafter:  # tracked, so its per-signal estimates carry across requests
            self.acceptance[SUFFIX] = suffix_prior(1)  # (its rounds start from its priors by signal)
        self.signal_acceptance: dict[tuple[str, int], float] = {}
        self.seen: set[str] = set()  # drafters whose acceptance has been measured (see ControllerConfig.probe_margin)
        self._round_cost_memo: dict[tuple, RoundCosts] = {}
        self._terms_memo: dict[tuple, tuple] = {}  # ``_terms_at``'s, by the request's lengths and hits
        self._idle_memo: dict[tuple, bool] = {}  # ``_draft_idle``'s, by (running requests, context, acceptance)
        self.actions = priced_actions(drafters)

    def decide(self, features: RequestFeatures) -> Action:
        priced = self.priced(features)
        if self._draft_idle(features):  # readied, the draft would cost its prompt and memory and never draft
            return min(p for p in priced if not (p[3].k and p[3].drafter == DRAFT_MODEL))[3]
        best = min(priced)  # rank's first, without sorting the rest
        probing = self._probing()
        if (best[3].drafter == DRAFT_MODEL and best[3].k) or not (probing or self.config.ready_draft_over_plain):
            return best[3]
        drafting = [p for p in priced if p[3].k and p[3].drafter == DRAFT_MODEL]
        if drafting and probing:
            probes = [p for p in drafting if p[0] <= best[0] * (1 + self.config.probe_margin)]
            if probes:
                return min(probes)[3]
        if drafting and self.config.ready_draft_over_plain:
            draft = min(drafting)
            if draft[0] <= min(p for p in priced if not p[3].k)[0]:
                return draft[3]
        return best[3]

    def rank(self, features: RequestFeatures) -> list[tuple[float, Action]]:
        """Feasible actions with their predicted seconds, cheapest first (ties: fewer draft
        tokens, then no reuse)."""
        return [(cost, action) for cost, _, _, action in sorted(self.priced(features))]

    def priced(self, features: RequestFeatures,
               acceptance: dict[str, float] | None = None) -> list[tuple[float, int, int, Action]]:
        """(predicted seconds, k, r, action) of every feasible action: the least is chosen.
        ``acceptance`` prices under other per-drafter estimates than the running ones."""
        ranked, terms = self._terms_at(features)
        costs = costs_under(terms, self.acceptance if acceptance is None else acceptance)
        return [(cost, *keys) for cost, keys in zip(costs, ranked)]

    def _terms_at(self, features: RequestFeatures) -> tuple[list[tuple[int, int, Action]], tuple]:
        """The feasible actions, each as (k, r, action), and their terms (``action_terms``):
        functions of the request's lengths and hits, computed once per set of them
        (requests repeat their prompts) and kept for at most ``MAX_SHAPES`` sets."""
        key = (features.num_prompt_tokens, features.num_new_tokens, features.target_hit_tokens,
               features.draft_hit_tokens, features.exact_repeat)
        found = self._terms_memo.get(key)
        if found is not None:
            return found
        limit = self.config.memory_limit_bytes
        actions = self.actions if limit is None else [
            a for a in self.actions if action_bytes(a, features, self.timings) <= limit]
        if not actions:
            raise ValueError(
                f"no action fits the memory limit of {limit} bytes for a "
                f"{features.num_prompt_tokens}-token prompt")
        rounds = self.round_costs_at(self.drafters, max(K_CHOICES), decode_context(features))
        if len(self._terms_memo) >= self.MAX_SHAPES:
            self._terms_memo.clear()
        found = self._terms_memo[key] = ([(a.k, a.r, a) for a in actions],
                                         action_terms(actions, features, self.timings, rounds))
        return found

    def planner(self, features: RequestFeatures, action: Action) -> AdaptiveRounds:
        """Rounds re-planned from the request's own acceptance, starting from the policy's
        running estimates (``planner_setup``)."""
        drafters, config, costs = self.planner_setup(features, action)
        probe = DRAFT_MODEL if self._probing() and DRAFT_MODEL in drafters else None
        return AdaptiveRounds(drafters, self.signal_acceptance, self.acceptance, costs, config, probe)

    def planner_setup(self, features: RequestFeatures, action: Action) -> tuple[tuple[str, ...], PlannerConfig,
                                                                                 RoundCosts]:
        """(the drafters ready, the planner settings, the round costs) of an adaptive
        request: prompt lookup is always ready (it needs no cache), the draft model only if
        the action prefilled it; draft lengths stay within the memory limit."""
        ready = readied_drafters(action, self.config.store_drafter)
        max_k = self.config.rounds.max_k
        limit = self.config.memory_limit_bytes
        while limit is not None and max_k > 0 and any(
                action_bytes(Action(action.r, max_k, d), features, self.timings) > limit for d in ready):
            max_k -= 1
        config = self.config.rounds
        if max_k != config.max_k:
            config = replace(config, max_k=max(max_k, 1))
        drafters = ready if max_k else ()
        return drafters, config, self.round_costs_at(drafters, config.max_k, decode_context(features))

    def _draft_idle(self, features: RequestFeatures) -> bool:
        """Whether, admitted beside ``features.num_running`` decoding requests, no round of
        the draft model would pay at the policy's running acceptance (``rakv.step_load``'s
        prices, as the round planner would see the step: the others one row each).
        Batch 1, or with ``ControllerConfig.ready_under_load`` off: never."""
        n = features.num_running
        if not (n and self.config.ready_under_load and self.config.rounds.load_aware):
            return False
        if DRAFT_MODEL not in self.drafters:
            return False
        # a function of the load, the context and the draft's acceptance, which moves only
        # when a request drafted with it: kept for the requests that meet them again
        context, acceptance = decode_context(features), self.acceptance[DRAFT_MODEL]
        idle = self._idle_memo.get((n, context, acceptance))
        if idle is None:
            max_k = self.config.rounds.max_k
            # the costs ``priced`` read at this context: requests of one length share their load prices
            rounds = self.round_costs_at(self.drafters, max(K_CHOICES), context)
            offset, plain_rate, costs_s = rounds.load_priced(StepLoad(n, n), (DRAFT_MODEL,), max_k,
                                                             self.config.rounds.min_gain)
            progress, costs = progress_by_k(acceptance, max_k), costs_s[DRAFT_MODEL]
            if len(self._idle_memo) >= self.MAX_SHAPES:
                self._idle_memo.clear()
            idle = self._idle_memo[n, context, acceptance] = all(
                (offset + progress[k]) / costs[k] <= plain_rate for k in range(1, max_k + 1))
        return idle

    def _probing(self) -> bool:
        """Whether the draft model is still to be probed (``ControllerConfig.probe_margin``)."""
        return self.config.probe_margin > 0 and DRAFT_MODEL in self.drafters and DRAFT_MODEL not in self.seen

    def round_costs_at(self, drafters: tuple[str, ...], max_k: int, num_context: int) -> RoundCosts:
        """``round_costs``, computed once per argument set (requests repeat their lengths)."""
        key = (drafters, max_k, num_context)
        if key not in self._round_cost_memo:
            self._round_cost_memo[key] = round_costs(self.timings, drafters, max_k, num_context)
        return self._round_cost_memo[key]

    def observe(self, outcome: RequestOutcome) -> None:
        beta = self.config.ewma_decay
        per_drafter: dict[str, list[int]] = {}
        for count in outcome.counts:
            if count.drafter not in self.acceptance:
                continue
            tally = per_drafter.setdefault(count.drafter, [0, 0])
            tally[0] += count.successes
            tally[1] += count.failures
            if count.successes + count.failures:
                self.seen.add(count.drafter)
            if count.rate is not None:
                key = (count.drafter, count.signal)
                old = self.signal_acceptance.get(key, initial_estimate(*key, self.acceptance))
                self.signal_acceptance[key] = (1 - beta) * old + beta * count.rate
        for drafter, (successes, failures) in per_drafter.items():
            if successes + failures:
                rate = successes / (successes + failures)
                self.acceptance[drafter] = (1 - beta) * self.acceptance[drafter] + beta * rate


def make_policy(name: str, timings: PairTimings | None = None,
                config: ControllerConfig = ControllerConfig()) -> Policy:
    """A built-in policy (fixed or ``rakv``) by name; raises ValueError naming the valid
    choices. ``rakv.policies.resolve_policy`` resolves every name, learned policies too."""
    action = fixed_action(name)
    if action is not None:
        return FixedPolicy(name, action)
    if name == ADAPTIVE_NAME:
        if timings is None:
            raise ValueError("policy 'rakv' needs timing statistics (calibrate the pair first)")
        return CostModelPolicy(timings, config)
    raise ValueError(f"unknown policy {name!r}; choose one of: {FIXED_POLICY_HELP}")


def make_planner(choice: Choice, features: RequestFeatures,
                 policy: CostModelPolicy | None) -> FixedRounds | AdaptiveRounds:
    """A fresh planner for the choice; an adaptive one starts from ``policy``'s estimates."""
    if not choice.adaptive:
        return FixedRounds(choice.drafter, choice.k)
    if policy is None:
        raise ValueError("an adaptive choice needs the adaptive policy's timings and estimates")
    return policy.planner(features, choice.action)


# -- a request's start ---------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """A request's start: its policy's action and round planner, the store's matches, and
    what it reuses (``StoreModel.start``: the entries reused are touched)."""

    action: Action
    planner: object
    match: object  # rakv.store_model.PrefixMatch, the target's
    draft_match: object  # the draft's
    reuse: object  # rakv.store_model.Reuse: the target's reused positions and hit kind
    draft_reused: int | None  # the draft model's reused positions; None: the action does not ready it


def request_features(store, namespaces: tuple[str | None, str | None], prompt,
                     max_new: int, num_running: int = 0) -> tuple[RequestFeatures, object, object]:
    """What the policy sees of a request, and the matches it is based on (nothing touched):
    ``store`` a ``rakv.store_model.StoreModel``, ``namespaces`` the target's and the draft's
    (None: no draft model), ``prompt`` its token ids, ``num_running`` the requests running
    beside it."""
    tokens = as_token_array(prompt)  # converted once for both lookups
    match, draft_match = store.match(namespaces[0], tokens), store.match(namespaces[1], tokens)
    return RequestFeatures.of(match, draft_match, max_new, tokens, num_running), match, draft_match


def start_request(store, namespaces: tuple[str | None, str | None], prompt, max_new: int, policy: Policy,
                  missing_draft: Exception | None = None, num_running: int = 0) -> Decision:
    """A request's start, as the engine makes it (``Engine.decide``) and the batched replay
    replays it (``simulator.batch_replay``): its lookups (``request_features``), its policy's
    action and round planner, then its reuse taken from the store. ``missing_draft``: what to
    raise, before the store is touched, where the planner readies a draft model the pair
    lacks (None: the pair has one); ``num_running``: the requests running beside it (the
    batching scheduler's, at its admission)."""
    features, match, draft_match = request_features(store, namespaces, prompt, max_new, num_running)
    action = policy.decide(features)
    planner = policy.planner(features, action)
    draft_ready = DRAFT_MODEL in planner.drafters
    if draft_ready and missing_draft is not None:
        raise missing_draft
    reuse, draft_reused = store.start(match, draft_match if draft_ready else None, action.r)
    return Decision(action, planner, match, draft_match, reuse, draft_reused if draft_ready else None)
