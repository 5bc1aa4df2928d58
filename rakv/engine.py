"""The engine: one request at a time, exact KV reuse across requests, per-request action.

Per request: look the prompt up in the store (target and draft separately), let the
policy choose (r, drafter, k), prefill what is not reused, then decode round by round as
the policy's planner says (k = 0: one greedy step; k > 0: a speculation round), walking the
output as the replay and the simulator's pricing do (``rakv.rounds.walk``), and store the
sequence's KV for later requests. Every action gives the target's plain greedy
output; only the time differs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from transformers import DynamicCache

from rakv.controller import Decision, Policy, RequestOutcome, request_features, start_request
from rakv.cost_model import Action, RequestFeatures
from rakv.decoding import DraftModelDrafter, crop_to, forward, greedy, speculative_round
from rakv.drafters import DRAFT_MODEL, NGRAM, SUFFIX, NgramDrafter, RunLengths, matching_prefix_length
from rakv.kv_cache import GrowingCache
from rakv.kv_store import KVStore
from rakv.models import ModelPair
from rakv.round_planner import MAX_DRAFT_LENGTH
from rakv.rounds import PlannedRounds, draft_cache_positions, walk
from rakv.settings import EngineConfig
from rakv.store_model import PrefixMatch
from rakv.suffix_drafter import SuffixColumns, SuffixDrafter


class RequestError(ValueError):
    """A request the engine cannot run; the message is one line."""


@dataclass(frozen=True)
class RoundRecord:
    start: int  # output position of the round's first drafted token
    drafter: str
    k: int  # draft length asked for
    num_proposed: int  # tokens proposed (a draft model proposes k unless it stopped on low confidence)
    accepted: int


@dataclass(frozen=True)
class RequestResult:
    request_id: int
    policy: str
    action: Action
    num_prompt_tokens: int
    hit_tokens: int  # exact common prefix of the prompt with the target's stored state
    reused_tokens: int  # target positions actually taken from the store (0 when r = 0)
    draft_reused_tokens: int
    hit_kind: str  # miss, partial or exact (exact: whole prompt and logits reused, no prefill)
    output_ids: tuple[int, ...]
    ttft_s: float
    e2e_s: float
    decide_s: float  # lookup plus the policy's decision
    rounds: tuple[RoundRecord, ...]
    queue_s: float = 0.0  # arrival to admission (the batching engine's; 0 at batch 1)
    num_preemptions: int = 0  # times the batching engine dropped its state to recompute it

    @property
    def accepted_per_round(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    def to_json(self) -> dict:
        row = asdict(self)
        row["action"] = {"r": self.action.r, "k": self.action.k, "drafter": self.action.drafter}
        row["output_ids"] = list(self.output_ids)
        row["accepted_per_round"] = self.accepted_per_round
        row["k_per_round"] = [r.k for r in self.rounds]
        row["drafter_per_round"] = [r.drafter for r in self.rounds]
        row["proposed_per_round"] = [r.num_proposed for r in self.rounds]
        del row["rounds"]
        return row


class Engine:
    def __init__(self, pair: ModelPair, policy: Policy, config: EngineConfig = EngineConfig(),
                 store: KVStore | None = None):
        self.pair = pair
        self.policy = policy
        self.config = config
        self.store = store if store is not None else KVStore(config.store)
        self.num_requests = 0
        self.max_positions = pair.max_positions  # the smaller model's, or a smaller cap

    # -- one request -------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> RequestResult:
        start = time.perf_counter()
        prompt = self.validate(prompt_ids, max_new_tokens)
        n = len(prompt)
        max_new = min(max_new_tokens, self.max_positions - n)
        decision = self.decide(prompt, max_new, self.policy)
        decide_s = time.perf_counter() - start

        target_cache, logits = self._prefill(prompt, decision.match, decision.reuse.reused_tokens)
        prompt_logits = logits
        seq = prompt + greedy(logits[None])
        ttft_s = time.perf_counter() - start

        draft_reused = decision.draft_reused or 0
        drafters = self._drafters(decision.planner.drafters, decision.draft_match, draft_reused)
        loop = _ModelRounds(decision.planner, max_new, self.pair, target_cache, drafters, seq, n, logits)
        rounds = walk(loop, n, draft_reused)

        drafter = drafters.get(DRAFT_MODEL)
        self._store(prompt, seq, target_cache, {n: prompt_logits, len(seq) - 1: loop.logits},
                    drafter.cache if drafter is not None else None, decision.draft_reused, rounds)
        result = RequestResult(
            request_id=self.num_requests, policy=self.policy.name, action=decision.action,
            num_prompt_tokens=n, hit_tokens=decision.match.hit_tokens, reused_tokens=decision.reuse.reused_tokens,
            draft_reused_tokens=draft_reused, hit_kind=decision.reuse.hit_kind, output_ids=tuple(seq[n:]),
            ttft_s=ttft_s, e2e_s=time.perf_counter() - start, decide_s=decide_s, rounds=tuple(rounds))
        self.num_requests += 1
        self.policy.observe(RequestOutcome(decision.action, decision.planner.counts()))
        return result

    def decide(self, prompt: list[int], max_new: int, policy: Policy, num_running: int = 0) -> Decision:
        """The request's lookups, its policy's decision, and its reuse taken from the store
        (``num_running``: the requests running beside it)."""
        missing = None if self.pair.draft is not None else RequestError(
            f"policy {policy.name!r} needs a draft model; pair {self.pair.name!r} has none")
        return start_request(self.store.model, self._namespaces, prompt, max_new, policy, missing, num_running)

    def features(self, prompt: list[int], max_new: int) -> tuple[RequestFeatures, PrefixMatch, PrefixMatch]:
        """What the policy sees, and the store matches it is based on (not yet touched)."""
        return request_features(self.store.model, self._namespaces, prompt, max_new)

    @property
    def _namespaces(self) -> tuple[str, str | None]:
        return self.pair.target_fingerprint, self.pair.draft_fingerprint

    # -- steps -------------------------------------------------------------------
    def validate(self, prompt_ids, max_new_tokens: int) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError("empty prompt: nothing to condition on")
        if len(prompt) >= self.max_positions:
            raise RequestError(f"prompt of {len(prompt)} tokens leaves no room to generate: "
                               f"the model's maximum is {self.max_positions} positions")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return prompt

    def _drafters(self, names, draft_match: PrefixMatch, draft_reused: int) -> dict:
        """The request's drafters by name; the draft model starts from its reused positions."""
        drafters = {}
        if NGRAM in names:
            drafters[NGRAM] = NgramDrafter(self.config.ngram, max_k=MAX_DRAFT_LENGTH)
        if SUFFIX in names:
            drafters[SUFFIX] = SuffixDrafter.over(self.store.model, self.pair.target_fingerprint, self.config.suffix,
                                                  MAX_DRAFT_LENGTH)
        if DRAFT_MODEL in names:
            cache = self.store.restore(draft_match.entry, draft_reused) if draft_reused else GrowingCache()
            drafters[DRAFT_MODEL] = DraftModelDrafter(self.pair.draft, cache)
        return drafters

    def _prefill(self, prompt: list[int], match: PrefixMatch, reused: int):
        """Target cache holding the prompt, and the logits after it."""
        n = len(prompt)
        if reused == n:  # an exact repeat: stored logits, no forward
            return self.store.restore(match.entry, n), self.store.stored_logits(match)
        cache = self.store.restore(match.entry, reused) if reused else GrowingCache()
        return cache, forward(self.pair.target, cache, prompt[reused:])[0]

    def _store(self, prompt, seq, target_cache, logits_by_len, draft_cache, draft_reused, rounds) -> None:
        """Hand the request's caches to the store, as its model keeps them (they are not
        used afterwards)."""
        n = len(prompt)
        kept, kept_draft = self.store.model.kept_lengths(n, len(seq), draft_reused, rounds)
        if kept:
            crop_to(target_cache, kept)
            logits = {length: logits_by_len[length] for length in self.store.model.kept_logits(n, len(seq), kept)}
            self.store.insert(self.pair.target_fingerprint, seq[:kept], target_cache, logits)
        if draft_reused is not None:  # the store model's account of the draft cache is exact
            assert draft_cache.get_seq_length() == draft_cache_positions(n, draft_reused, rounds, len(seq) - n)
        if kept_draft:
            crop_to(draft_cache, kept_draft)
            self.store.insert(self.pair.draft_fingerprint, seq[:kept_draft], draft_cache, {})


class _ModelRounds(PlannedRounds):
    """A planner's rounds on the models (``rakv.rounds.PlannedRounds``): plain target steps
    and speculation rounds over the request's caches, appending to ``seq``; ``logits`` are
    the last computed, those of its last token. The drafters' ``lengths`` are filled in as
    the output grows: at each position before its iteration, the signals and shadowed
    proposals (prompt lookup's match, computed once, serves both), and after it, how much
    of each shadowed proposal the appended tokens confirm."""

    def __init__(self, planner, max_new_tokens: int, pair: ModelPair, target_cache: DynamicCache, drafters: dict,
                 seq: list[int], num_prompt: int, logits):
        self.eos = pair.eos_token_ids
        # the store drafter's are looked up when read (at each round's planning), as a replay's are
        self.lengths = {d: SuffixColumns(drafters[d], seq, num_prompt, max_new_tokens) if d == SUFFIX else
                        RunLengths(*([0] * max_new_tokens for _ in range(3)),
                                   extents=[0] * max_new_tokens if d == NGRAM else None) for d in planner.drafters}
        self._looked = tuple(d for d in planner.drafters if d != SUFFIX)
        self._looked_shadows = tuple(d for d in planner.shadowed if d != SUFFIX)
        # seq grows in place, so the planner reads the tokens known at each iteration
        super().__init__(planner, self.lengths, max_new_tokens, 1 if seq[-1] in self.eos else max_new_tokens, seq)
        self.target, self.target_cache, self.drafters = pair.target, target_cache, drafters
        self.seq, self.num_prompt, self.logits = seq, num_prompt, logits
        self._proposals: dict[str, list[int]] = {}  # the shadowed drafters', at the current position
        self._look(1)

    def step(self, t: int) -> None:
        self.logits = forward(self.target, self.target_cache, self.seq[-1:])[0]
        self.append(t, greedy(self.logits[None]))

    def propose(self, t: int, drafter: str, k: int, stop_below: float, draft_seen: int) -> tuple[RoundRecord, tuple]:
        if drafter == DRAFT_MODEL:  # the walk's account of the draft cache, which the simulator prices, is exact
            assert self.drafters[DRAFT_MODEL].cache.get_seq_length() == draft_seen
        rnd = speculative_round(self.target, self.drafters[drafter], self.target_cache, self.seq, t, k, self.eos,
                                stop_below)
        self.logits = rnd.logits
        self.append(t, rnd.new_ids)
        return RoundRecord(t, drafter, k, rnd.num_proposed, rnd.accepted), rnd.draft_probs

    def append(self, t: int, token_ids) -> None:
        self.seq += token_ids
        if self.seq[-1] in self.eos:  # greedy output ends at EOS, which only the appended tokens' last can be
            self.end = len(self.seq) - self.num_prompt
        for d, proposal in self._proposals.items():
            self.lengths[d].runs[t] = matching_prefix_length(proposal, token_ids)
        if SUFFIX in self.planner.shadowed:
            self.lengths[SUFFIX].runs[t] = matching_prefix_length(self.lengths[SUFFIX].proposal(t), token_ids)
        self._look(t + len(token_ids))

    def _look(self, t: int) -> None:
        """The drafters' signals and shadowed proposals at t, where the walk goes on to it."""
        if t >= self.end:
            return
        seq, drafters = self.seq, self.drafters
        for d in self._looked:
            self.lengths[d].signals[t] = drafters[d].signal(seq)
        for d in self._looked_shadows:
            self._proposals[d] = drafters[d].propose(seq, self._shadow_length)
            self.lengths[d].proposed[t] = len(self._proposals[d])
            if d == NGRAM:
                self.lengths[d].extents[t] = drafters[d].extent(seq)
