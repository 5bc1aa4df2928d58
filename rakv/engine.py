"""The engine: one request at a time, exact KV reuse across requests, per-request action.

Per request: look the prompt up in the store (target and draft separately), let the
policy choose (r, drafter, k), prefill what is not reused, then decode round by round as
the policy's planner says (k = 0: one greedy step; k > 0: a speculation round), and store
the sequence's KV for later requests. Every action gives the target's plain greedy
output; only the time differs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from transformers import DynamicCache

from rakv.acceptance import round_draft_length
from rakv.controller import Policy, RequestOutcome
from rakv.cost_model import Action, RequestFeatures, reused_positions
from rakv.decoding import DraftModelDrafter, crop_to, forward, greedy, speculative_round
from rakv.drafters import DRAFT_MODEL, NGRAM, NgramConfig, NgramDrafter, matching_prefix_length
from rakv.kv_store import DEFAULT_BUDGET_BYTES, KVStore, StoreHit
from rakv.models import ModelPair
from rakv.prefix_index import as_token_array
from rakv.round_planner import MAX_DRAFT_LENGTH

STORE_MODES = ("full", "prompt", "off")


class RequestError(ValueError):
    """A request the engine cannot run; the message is one line."""


@dataclass(frozen=True)
class EngineConfig:
    store_budget_bytes: int = DEFAULT_BUDGET_BYTES
    store_mode: str = "full"  # full: prompt and output; prompt: the paper's; off: store nothing
    ngram: NgramConfig = NgramConfig()

    def __post_init__(self):
        if self.store_budget_bytes <= 0:
            raise ValueError(f"store budget must be positive, got {self.store_budget_bytes} bytes")
        if self.store_mode not in STORE_MODES:
            raise ValueError(f"store mode must be one of {', '.join(STORE_MODES)}, got {self.store_mode!r}")


@dataclass(frozen=True)
class RoundRecord:
    start: int  # output position of the round's first drafted token
    drafter: str
    k: int  # draft length asked for
    num_proposed: int  # tokens proposed (a draft model always proposes k)
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
        self.store = store if store is not None else KVStore(config.store_budget_bytes)
        self.num_requests = 0
        self.max_positions = pair.max_positions
        if pair.draft is not None:
            from rakv.models import max_positions_of
            self.max_positions = min(self.max_positions, max_positions_of(pair.draft))

    # -- one request -------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> RequestResult:
        start = time.perf_counter()
        prompt = self.validate(prompt_ids, max_new_tokens)
        n = len(prompt)
        max_new = min(max_new_tokens, self.max_positions - n)
        features, hit, draft_hit = self.features(prompt, max_new)
        action = self.policy.decide(features)
        planner = self.policy.planner(features, action)
        if DRAFT_MODEL in planner.drafters and self.pair.draft is None:
            raise RequestError(f"policy {self.policy.name!r} needs a draft model; pair {self.pair.name!r} has none")
        decide_s = time.perf_counter() - start

        target_cache, logits, reused, hit_kind = self._prefill(prompt, hit if action.r else None)
        prompt_logits = logits
        seq = prompt + greedy(logits[None])
        ttft_s = time.perf_counter() - start

        drafters, draft_reused = self._drafters(planner.drafters, action.r, n, draft_hit)
        rounds: list[RoundRecord] = []
        eos = self.pair.eos_token_ids
        while seq[-1] not in eos and len(seq) - n < max_new:
            signals = {d: drafters[d].signal(seq) for d in planner.drafters}
            shadow_proposals = {d: drafters[d].propose(seq, MAX_DRAFT_LENGTH) for d in planner.shadowed}
            name, k = planner.plan(signals)
            k = round_draft_length(k, len(seq) - n, max_new)
            before = len(seq)
            if k == 0:
                logits = forward(self.pair.target, target_cache, seq[-1:])[0]
                seq += greedy(logits[None])
            else:
                rnd = speculative_round(self.pair.target, drafters[name], target_cache, seq, len(seq) - n, k, eos)
                rounds.append(RoundRecord(rnd.start, name, rnd.k, rnd.num_proposed, rnd.accepted))
                planner.observe(name, signals[name], rnd.num_proposed, rnd.accepted)
                seq += rnd.new_ids
                logits = rnd.logits
            for shadow, proposal in shadow_proposals.items():
                if k == 0 or shadow != name:  # as replay_request reports it
                    verified = min(len(proposal), len(seq) - before)
                    planner.observe(shadow, signals[shadow], verified, matching_prefix_length(proposal, seq[before:]))

        drafter = drafters.get(DRAFT_MODEL)
        draft_cache = drafter.cache if isinstance(drafter, DraftModelDrafter) else None
        self._store(prompt, seq, target_cache, {n: prompt_logits, len(seq) - 1: logits}, draft_cache)
        result = RequestResult(
            request_id=self.num_requests, policy=self.policy.name, action=action,
            num_prompt_tokens=n, hit_tokens=hit.num_tokens if hit else 0, reused_tokens=reused,
            draft_reused_tokens=draft_reused, hit_kind=hit_kind, output_ids=tuple(seq[n:]),
            ttft_s=ttft_s, e2e_s=time.perf_counter() - start, decide_s=decide_s, rounds=tuple(rounds))
        self.num_requests += 1
        self.policy.observe(RequestOutcome(action, planner.counts()))
        return result

    def features(self, prompt: list[int], max_new: int) -> tuple[RequestFeatures, StoreHit | None, StoreHit | None]:
        """What the policy sees, and the store hits it is based on (not yet touched)."""
        tokens = as_token_array(prompt)  # converted once for both lookups
        hit = self.store.lookup(self.pair.target_fingerprint, tokens)
        draft_hit = None
        if self.pair.draft is not None:
            draft_hit = self.store.lookup(self.pair.draft_fingerprint, tokens)
        exact = hit is not None and hit.num_tokens == len(prompt) and hit.payload.logits_at(len(prompt)) is not None
        features = RequestFeatures(
            num_prompt_tokens=len(prompt), num_new_tokens=max_new,
            target_hit_tokens=hit.num_tokens if hit else 0,
            draft_hit_tokens=draft_hit.num_tokens if draft_hit else 0,
            exact_repeat=exact, acceptance=0.0)
        return features, hit, draft_hit

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

    def _drafters(self, names, r: int, num_prompt: int, draft_hit: StoreHit | None):
        """The request's drafters by name, and the draft-model positions reused from the store."""
        drafters, reused = {}, 0
        if NGRAM in names:
            drafters[NGRAM] = NgramDrafter(self.config.ngram, max_k=MAX_DRAFT_LENGTH)
        if DRAFT_MODEL in names:
            reused = min(draft_hit.num_tokens, num_prompt) if (r and draft_hit) else 0
            cache = self.store.restore(draft_hit, reused) if reused else DynamicCache()
            drafters[DRAFT_MODEL] = DraftModelDrafter(self.pair.draft, cache)
        return drafters, reused

    def _prefill(self, prompt: list[int], hit: StoreHit | None):
        """Target cache holding the prompt, the logits after it, positions reused, hit kind."""
        n = len(prompt)
        if hit is not None:
            stored_logits = hit.payload.logits_at(n) if hit.num_tokens >= n else None
            reused = reused_positions(n, hit.num_tokens, stored_logits is not None)
            if reused == n:
                return self.store.restore(hit, n), stored_logits, n, "exact"
            if reused > 0:
                cache = self.store.restore(hit, reused)
                return cache, forward(self.pair.target, cache, prompt[reused:])[0], reused, "partial"
        cache = DynamicCache()
        return cache, forward(self.pair.target, cache, prompt)[0], 0, "miss"

    def _store(self, prompt, seq, target_cache, logits_by_len, draft_cache) -> None:
        """Hand the request's caches to the store (they are not used afterwards)."""
        if self.config.store_mode == "off":
            return
        length = len(seq) - 1 if self.config.store_mode == "full" else len(prompt)
        crop_to(target_cache, length)
        logits = {n: lg for n, lg in logits_by_len.items() if n <= length}
        self.store.insert(self.pair.target_fingerprint, seq[:length], target_cache, logits)
        if draft_cache is not None:
            draft_length = min(draft_cache.get_seq_length(), length)
            if draft_length > 0:
                crop_to(draft_cache, draft_length)
                self.store.insert(self.pair.draft_fingerprint, seq[:draft_length], draft_cache, {})
