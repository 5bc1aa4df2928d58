"""The decode loop's walk over one request's output, shared by the engine
(``rakv.engine.Engine.generate``, on the models), the replay
(``rakv.acceptance.replay_request``, from a trace's run lengths) and the pricing
(``simulator.costs``, over rounds already made). Imports no torch.

The prefill gives the output its first token, so the walk starts with t = 1 tokens
generated (the sequence is n + t long) and ends at the output's end. Each iteration is a
plain target step, which appends one token, or a speculation round starting at t: a
drafter proposes up to k tokens (fewer where prompt lookup's proposal is shorter or the
draft model stops on low confidence), the target verifies them in one forward, and the
round appends its accepted tokens and the target's own, except at the output's end,
where an accepted EOS ends it (``tokens_appended``).

The draft model's cache holds a prefix of the sequence: the positions reused from the
store, then it moves at the draft model's own rounds only, each of which first catches it
up on the tokens it has not seen (after rounds it did not draft, several) and ends by
rolling it back to the tokens that stand (``draft_cache_after``). ``walk`` tracks it.

What happens at each position comes from a ``Moves`` object:
- ``PlannedRounds``: a round planner's (``rakv.round_planner``) rounds, as the engine and
  the replay make them: the planner is asked before every iteration and told after it
  what was proposed and accepted, and what each shadowed drafter would have proposed.
  A subclass says what the drafters propose and the target accepts: the models in the
  engine, a trace's run lengths in the replay.
- ``RecordedRounds``: rounds already made, a plain step wherever none starts (the pricing).
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

from rakv.drafters import DRAFT_MODEL, Columns

_PLAIN_STEP = (None, 1)  # a move: no round, one token (shared, as moves are made on every iteration)
_NO_PLAN = (None, 0)


def tokens_appended(accepted: int, start: int, num_output: int) -> int:
    """Tokens a round at output position ``start`` that accepted ``accepted`` appends to an
    output of ``num_output`` tokens: those and the target's own, except at the output's
    end, where an accepted EOS ends it."""
    return min(accepted + 1, num_output - start)


def draft_cache_after(num_prompt: int, start: int, num_proposed: int, appended: int) -> int:
    """Positions the draft model's cache holds after its round at output position
    ``start``: caught up on the sequence (n + start tokens), it fed all but the last of its
    ``num_proposed`` tokens (n + start + num_proposed - 1); the rollback keeps the
    positions of the tokens that stand (n + start + appended - 1)."""
    return num_prompt + start + min(num_proposed, appended) - 1


def draft_cache_positions(num_prompt: int, draft_reused: int, rounds: Sequence, num_output: int) -> int:
    """Positions the draft model's cache holds when a request ends: the reused ones, moved
    by its own rounds only (what ``walk`` ends with, in O(rounds)). ``rounds`` need
    ``start``, ``drafter``, ``num_proposed`` and ``accepted``."""
    positions = draft_reused
    for rnd in rounds:
        if rnd.drafter == DRAFT_MODEL:
            positions = draft_cache_after(num_prompt, rnd.start, rnd.num_proposed,
                                          tokens_appended(rnd.accepted, rnd.start, num_output))
    return positions


class Moves(Protocol):
    end: int  # output tokens at which the walk stops (the engine's drops to where it appends an EOS)

    def move(self, t: int, draft_seen: int) -> tuple[object | None, int]:
        """The iteration with t tokens generated and ``draft_seen`` positions in the draft
        model's cache: (the round, with ``drafter`` and ``num_proposed``, or None for a
        plain step; tokens appended)."""


def walk(moves: Moves, num_prompt: int, draft_reused: int = 0,
         on_step: Callable[[int, object | None, int], None] | None = None) -> list:
    """Makes the decode loop's iterations under ``moves``, and returns the rounds made, in
    order. ``on_step(t, the round or None for a plain step, positions in the draft model's
    cache before it)`` is told of each iteration as it is made; a draft-model round's
    catch-up is n + t minus the last. (A callback, not a generator: the replay walks
    every request of a simulation, and a generator's yields cost it 7 % more.)"""
    rounds = []
    t, draft_seen = 1, draft_reused
    move = moves.move
    while t < moves.end:
        rnd, appended = move(t, draft_seen)
        if on_step is not None:
            on_step(t, rnd, draft_seen)
        if rnd is not None:
            rounds.append(rnd)
            if rnd.drafter == DRAFT_MODEL:
                draft_seen = draft_cache_after(num_prompt, t, rnd.num_proposed, appended)
        t += appended
    return rounds


class RecordedRounds:
    """The moves of rounds already made (``start``, ``drafter``, ``num_proposed``,
    ``accepted`` each) over an output of ``num_output`` tokens."""

    def __init__(self, rounds: Sequence, num_output: int):
        self.end = num_output
        self._by_start = {r.start: r for r in rounds}

    def move(self, t: int, draft_seen: int) -> tuple[object | None, int]:
        rnd = self._by_start.get(t)
        return _PLAIN_STEP if rnd is None else (rnd, tokens_appended(rnd.accepted, t, self.end))


class PlannedRounds:
    """The moves ``planner`` makes, up to ``max_new_tokens`` new tokens, over its drafters'
    ``lengths`` (``rakv.drafters.RunLengths``, one per drafter the planner readies): before
    each iteration it is given their signals and t and plans (drafter, k); k is clipped so a
    round never drafts past max_new_tokens (its own target token included), and 0 is a
    plain step. After a round it is told what was proposed and accepted (and, when the
    draft model stops on confidence, its probabilities of the tokens the round covers);
    after every iteration, how much of each shadowed drafter's proposal at t (its first
    ``planner.shadow_length`` tokens) the appended tokens confirm, unless that drafter
    drafted the round. The planner is bound to ``lengths`` and ``tokens`` first (``bind``;
    ``tokens``: the sequence, prompt first, n + t tokens of it known at t): one that reads
    more than the signals reads them there, at t, before its iteration.

    A subclass makes the steps and rounds, keeps ``lengths`` ahead of the walk (a trace's
    are whole; the engine's are filled in as its output grows: signals and proposal
    lengths at t before the iteration at t, runs, of shadowed drafters only, after it), and
    lowers ``end`` where the output ends early:
    - ``step(t)``: a plain target step (None: nothing to do, as in a replay, which skips
      the call on every plain step);
    - ``propose(t, drafter, k, stop_below, draft_seen) -> (round, probs)``: a round of
      ``drafter`` with draft length k that stops after a token of probability below
      ``stop_below`` (> 0: the draft model only); ``round`` has ``drafter``,
      ``num_proposed`` and ``accepted``, ``probs`` the draft's probability of each
      proposed token (confidence stops only, else empty).
    """

    def __init__(self, planner, lengths: Mapping[str, Columns], max_new_tokens: int, end: int,
                 tokens: Sequence[int] = ()):
        self.planner = planner
        self.end = end
        self.max_new_tokens = max_new_tokens
        self._plan, self._observe = planner.plan, planner.observe  # called on every iteration
        planner.bind(lengths, tokens)
        # read by position, as lists: this is the simulator's hot path
        self._signal_lists = [(d, lengths[d].signals) for d in planner.drafters]
        self._shadow_lists = [(d, lengths[d].proposed, lengths[d].runs) for d in planner.shadowed]
        self._shadow_length = planner.shadow_length if planner.shadowed else 0  # a fixed planner shadows nothing
        self._signals: dict[str, int] = {}  # refilled at every position, read by the planner before the next

    step: Callable[[int], None] | None = None

    def propose(self, t: int, drafter: str, k: int, stop_below: float, draft_seen: int) -> tuple[object, Sequence]:
        raise NotImplementedError

    def move(self, t: int, draft_seen: int) -> tuple[object | None, int]:
        drafter, k = self.plan_move(t)
        if k > 0:
            rnd, probs = self.propose(t, drafter, k, self.stop_below(drafter), draft_seen)
            return self.finish_move(t, drafter, k, rnd, probs)
        if self.step is not None:
            self.step(t)
        return self.finish_move(t, drafter, 0)

    # The two halves of ``move``, apart for an engine that runs many requests' moves in one
    # batched forward (``rakv.batch_engine``): ``plan_move`` before it, ``finish_move`` after.
    def plan_move(self, t: int, max_k: int | None = None, load=None) -> tuple[str | None, int]:
        """The planner's (drafter, k) at t, k clipped so the round drafts nothing past
        max_new_tokens (and to ``max_k`` where given: a step's row budget); k = 0: a plain
        step. ``load``: the rest of the batched step (``rakv.step_load.StepLoad``), or None."""
        signals = self._signals
        for d, by_position in self._signal_lists:
            signals[d] = by_position[t]
        # From max_new_tokens - 1 on a round could draft nothing, and the planner is not
        # asked (its choice would not matter).
        limit = self.max_new_tokens - t - 1
        if max_k is not None and max_k < limit:
            limit = max_k
        drafter, k = self._plan(signals, t, load) if limit > 0 else _NO_PLAN
        return drafter, k if k <= limit else limit

    def stop_below(self, drafter: str) -> float:
        """The draft model's confidence stop (the planner moves it as its tokens are verified)."""
        return self.planner.confidence if drafter == DRAFT_MODEL else 0.0

    def finish_move(self, t: int, drafter: str | None, k: int, rnd=None, probs: Sequence = ()) -> tuple[object | None, int]:
        """The planner told of the iteration at t (a round ``rnd`` with k > 0, else a plain
        step): what was proposed and accepted, and what each shadowed drafter's proposal
        the appended tokens confirm. Returns the move: (the round or None, tokens appended)."""
        signals = self._signals
        if k > 0:
            appended = tokens_appended(rnd.accepted, t, self.end)
            # the probabilities of output positions only: none past an accepted EOS
            self._observe(drafter, signals[drafter], rnd.num_proposed, rnd.accepted, probs[:appended])
            made = (rnd, appended)
        else:
            appended, made = 1, _PLAIN_STEP
        for shadow, proposed, runs in self._shadow_lists:
            num_proposed = proposed[t]
            if num_proposed and (k == 0 or shadow != drafter):  # an empty proposal teaches nothing
                checked = min(num_proposed, self._shadow_length, appended)
                self._observe(shadow, signals[shadow], checked, min(runs[t], checked))
        return made
