"""What a request-level decision can choose, so that the choice changes what runs: reuse
or not (r), and either a fixed (drafter, k) for every round (k = 0: plain steps) or the
adaptive planner (``rakv``'s per-round planning) with or without the draft model readied.
Imports no torch.

The one list of choices: ``R_CHOICES``, ``K_CHOICES`` and ``FIXED_KINDS`` below. The fixed
policies' names and help, the analytic policy's actions (``rakv.controller``), the
oracle's and the learned policy's choices (``simulator.oracle``, ``rakv.learned``) all
derive from them: adding a k is a change to ``K_CHOICES``, adding a drafter a line in
``FIXED_KINDS`` (its fixed policies) and, for a request-level decision to choose it, an
entry in ``DECIDED_DRAFTERS``. Each list keeps its own order (policy names group by kind,
the choices by r), which traces, replays and the shipped learned policies' sidecars rely
on.

An adaptive choice's planner starts from a ``rakv`` policy's running estimates, which the
caller keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

from rakv.cost_model import Action
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.drafters import SUFFIX


R_CHOICES = (0, 1)  # 0: compute the prompt, 1: reuse stored KV
K_CHOICES = (0, 1, 2, 4, 6, 8)  # draft tokens per round of a fixed policy; 0: plain steps
DRAFT_KS = K_CHOICES[1:]
PLAIN_NAMES = ("ar", "kv-only")  # the k = 0 policy under each r
# Per drafter, in the order its choices are listed: the kind of its fixed policies under
# each r (their names are "<kind>-k<k>"). The store drafter's come last: a request-level
# decision never picks it (the adaptive planner readies it beside prompt lookup,
# ``readied_drafters``), but a fixed policy of it is the baseline the planners must beat
# where requests repeat earlier ones.
FIXED_KINDS = {DRAFT_MODEL: ("spec", "joint"), NGRAM: ("ngram", "joint-ngram"), SUFFIX: ("suffix", "joint-suffix")}
DECIDED_DRAFTERS = (DRAFT_MODEL, NGRAM)  # those a request-level decision chooses among
ADAPTIVE_NAME = "rakv"
FIXED_POLICY_HELP = (", ".join(PLAIN_NAMES + tuple(f"{kind}-kN" for kinds in FIXED_KINDS.values() for kind in kinds))
                     + f" (N in {', '.join(map(str, DRAFT_KS))}), {ADAPTIVE_NAME}")


def usable_drafters(draft_model: bool) -> tuple[str, ...]:
    """The drafters a request-level decision chooses among that a pair can run, in
    ``FIXED_KINDS`` order (the draft model needs one)."""
    return tuple(d for d in DECIDED_DRAFTERS if draft_model or d != DRAFT_MODEL)


def fixed_drafters(draft_model: bool) -> tuple[str, ...]:
    """The drafters of the fixed policies a pair can run, in ``FIXED_KINDS`` order."""
    return tuple(d for d in FIXED_KINDS if draft_model or d != DRAFT_MODEL)


def readied_drafters(action: Action, store_drafter: bool = False) -> tuple[str, ...]:
    """The drafters an action readies for adaptive rounds: prompt lookup always (it needs no
    cache), the draft model only when the action prefills it, the store drafter where
    ``store_drafter`` (it needs no cache either)."""
    ready = (DRAFT_MODEL, NGRAM) if action.k and action.drafter == DRAFT_MODEL else (NGRAM,)
    return ready + (SUFFIX,) if store_drafter else ready


def fixed_policy_name(action: Action) -> str:
    """A fixed action's policy name: ``ar``, ``kv-only`` or ``<kind>-k<k>``."""
    return PLAIN_NAMES[action.r] if action.k == 0 else f"{FIXED_KINDS[action.drafter][action.r]}-k{action.k}"


def fixed_policy_names(draft_model: bool = True) -> tuple[str, ...]:
    """Every fixed policy: ar, kv-only, then each kind (each drafter's under r = 0, then
    r = 1) and k; ``draft_model`` False leaves out those that need a draft model."""
    actions = tuple(Action(r, 0) for r in R_CHOICES) + tuple(
        Action(r, k, d) for d in fixed_drafters(draft_model) for r in R_CHOICES for k in DRAFT_KS)
    return tuple(fixed_policy_name(a) for a in actions)


def priced_actions(drafters: tuple[str, ...]) -> tuple[Action, ...]:
    """The fixed actions the analytic policy prices: k = 0 under each r, then each drafter's
    k under each r."""
    return tuple(Action(r, 0) for r in R_CHOICES) + tuple(
        Action(r, k, d) for d in drafters for k in DRAFT_KS for r in R_CHOICES)


_BY_NAME = {fixed_policy_name(a): a for a in priced_actions(fixed_drafters(True))}


def fixed_action(name: str) -> Action | None:
    """The action of a fixed policy name, or None if ``name`` is not a fixed policy."""
    return _BY_NAME.get(name)


@dataclass(frozen=True, order=True)
class Choice:
    r: int
    adaptive: bool  # the planner picks each round's drafter and k
    drafter: str  # fixed: who drafts every round (the draft model for k = 0); adaptive: the draft model if readied
    k: int  # fixed: draft tokens every round; adaptive: 0

    @property
    def action(self) -> Action:
        """The request-level action the engine logs: an adaptive choice that readies the
        draft model is (r, k=1, draft), one that does not is (r, k=0)."""
        if self.adaptive:
            return Action(self.r, 1, DRAFT_MODEL) if self.drafter == DRAFT_MODEL else Action(self.r, 0)
        return Action(self.r, self.k, self.drafter)

    def __str__(self) -> str:
        if self.adaptive:
            return f"(r={self.r}, adaptive{', draft' if self.drafter == DRAFT_MODEL else ''})"
        return str(self.action)


def adaptive_choice(action: Action) -> Choice:
    """The choice the analytic ``rakv`` policy makes with ``action``: adaptive rounds, with
    the draft model readied if the action readies it (``Choice.action``'s inverse)."""
    return Choice(action.r, True, DRAFT_MODEL if DRAFT_MODEL in readied_drafters(action) else NGRAM, 0)


def all_choices(draft_model: bool, adaptive: bool = True) -> tuple[Choice, ...]:
    """Every choice, under r = 0 then r = 1: k = 0, each drafter's fixed k, then the adaptive
    planner without and with the draft model (``draft_model`` False: no draft-model choice;
    ``adaptive`` False: no adaptive choice)."""
    choices = []
    for r in R_CHOICES:
        choices.append(Choice(r, False, DRAFT_MODEL, 0))
        choices += [Choice(r, False, d, k) for d in usable_drafters(draft_model) for k in DRAFT_KS]
        if adaptive:
            choices.append(Choice(r, True, NGRAM, 0))
            if draft_model:
                choices.append(Choice(r, True, DRAFT_MODEL, 0))
    return tuple(choices)
