"""Greedy and speculative decoding steps over a Hugging Face causal LM and its KV cache.

A chain of small functions, in the manner of gpt-fast: ``forward`` feeds tokens after the
cached ones, ``speculative_round`` has a drafter propose k tokens and verifies them in one
target forward. Invariant kept by the engine between calls: the target cache holds every
token of the sequence but the last, whose logits are the last ones computed; a draft
model's cache holds a prefix of that (it catches up at its next forward).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rakv import direct_forward
from rakv.drafters import DRAFT_MODEL, Drafter


@functools.cache
def _cache_kwarg(model_class) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; accept both."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@torch.inference_mode()
def forward(model, cache: DynamicCache, token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
    """Feed ``token_ids`` after the cached positions; returns logits [num_logits, vocab]
    for the last ``num_logits`` fed tokens. The cache grows by len(token_ids)."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)  # [1, T]
    plan = direct_forward.plan_of(model)
    if plan is not None:  # HF's bits without its per-module machinery
        return direct_forward.logits(plan, model, cache, ids, num_logits)[0, -num_logits:]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=num_logits, **{_cache_kwarg(type(model)): cache})
    return out.logits[0, -num_logits:]


@torch.inference_mode()
def forward_many(model, caches: list, token_ids: list[list[int]], num_logits: list[int]) -> list[torch.Tensor | None]:
    """``forward`` for several requests in one batched forward (``direct_forward.batched_logits``:
    each request's rows get the bits a forward of them alone gives): request i's
    ``token_ids[i]`` after ``caches[i]`` -> logits [num_logits[i], vocab], None for 0. A
    model the direct forward does not take runs each request alone."""
    plan = direct_forward.plan_of(model)
    if plan is not None:
        return direct_forward.batched_logits(plan, model, caches, token_ids, num_logits)
    fed = [forward(model, cache, ids, max(n, 1)) for cache, ids, n in zip(caches, token_ids, num_logits)]
    return [logits if n else None for logits, n in zip(fed, num_logits)]


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of logits [T, vocab] (first index on ties, as torch.argmax)."""
    return logits.argmax(dim=-1).tolist()


def crop_to(cache: DynamicCache, num_positions: int) -> None:
    """Roll the cache back to its first ``num_positions`` positions."""
    excess = cache.get_seq_length() - num_positions
    if excess > 0:
        cache.crop(-excess)


def num_accepted(proposal: list[int], target_ids: list[int], eos_ids: frozenset[int]) -> int:
    """Leading draft tokens equal to the target's greedy tokens, up to and including an EOS.

    Stopping at an accepted EOS keeps the count equal to min(k, m_t) of the replay, whose
    run lengths end with the output.
    """
    accepted = 0
    for drafted, wanted in zip(proposal, target_ids):
        if drafted != wanted:
            break
        accepted += 1
        if drafted in eos_ids:
            break
    return accepted


@dataclass(frozen=True)
class Round:
    """One speculation round, starting at output position ``start``."""

    start: int
    k: int  # draft length asked for
    num_proposed: int  # tokens the drafter proposed (ngram: possibly fewer than k, or none)
    accepted: int
    new_ids: tuple[int, ...]  # accepted draft tokens, then the target's token (unless EOS ended it)
    logits: torch.Tensor  # [vocab] target logits whose argmax is new_ids[-1]
    draft_probs: tuple[float, ...] = ()  # the draft's probability of each proposed token (confidence stops only)


def top1_prob(logits: torch.Tensor) -> float:
    """Softmax probability of the greedy token of logits [1, vocab], computed as
    ``teacher_forced_top1`` does and rounded to float32 as a trace stores it, so the
    engine and a replay compare the same number with a threshold."""
    best = logits.max(dim=-1).values.double()
    return float(torch.exp(best - torch.logsumexp(logits.double(), dim=-1)).float()[0])


def draft_propose(draft, draft_cache: DynamicCache, seq: list[int], k: int,
                  stop_below: float = 0.0) -> tuple[list[int], list[float]]:
    """Up to k greedy draft tokens after ``seq``, and (when ``stop_below`` > 0) the draft's
    probability of each: it stops after a token it gives less than ``stop_below`` (as
    HF's ``assistant_confidence_threshold``). The draft first catches up on the tokens
    of ``seq`` it has not seen (at least the last one); afterwards its cache holds
    seq + proposal[:-1]."""
    return draft_propose_many(draft, [draft_cache], [seq], [k], [stop_below])[0]


def draft_propose_many(draft, caches: list, seqs: list[list[int]], ks: list[int],
                       stop_belows: list[float]) -> list[tuple[list[int], list[float]]]:
    """``draft_propose`` for several requests at once: each draft forward runs the rows of
    every request still drafting (``forward_many``), so each request's proposal is the one
    it makes alone."""
    logits = forward_many(draft, caches, [seq[cache.get_seq_length():] for cache, seq in zip(caches, seqs)],
                          [1] * len(caches))
    proposals, probs = [greedy(row) for row in logits], [[] for _ in caches]
    while True:
        active = []
        for i, row in enumerate(logits):
            if row is None:
                continue  # done in an earlier forward
            if stop_belows[i] > 0:
                probs[i].append(top1_prob(row))
                if probs[i][-1] < stop_belows[i]:
                    continue
            if len(proposals[i]) < ks[i]:
                active.append(i)
        if not active:
            return list(zip(proposals, probs))
        fed = forward_many(draft, [caches[i] for i in active], [proposals[i][-1:] for i in active], [1] * len(active))
        logits = [None] * len(caches)
        for i, row in zip(active, fed):
            logits[i] = row
            proposals[i] += greedy(row)


class DraftModelDrafter:
    """A draft model with its own cache, which may start from a stored prefix."""

    name = DRAFT_MODEL

    def __init__(self, model, cache: DynamicCache):
        self.model = model
        self.cache = cache

    def propose(self, seq: list[int], k: int) -> list[int]:
        return draft_propose(self.model, self.cache, seq, k)[0]

    def propose_confident(self, seq: list[int], k: int, stop_below: float) -> tuple[list[int], list[float]]:
        return draft_propose(self.model, self.cache, seq, k, stop_below)

    def signal(self, seq: list[int]) -> int:
        return 0  # nothing is known of a model's guess before it is made

    def rollback(self, num_valid: int) -> None:
        crop_to(self.cache, num_valid)


def speculative_round(target, drafter: Drafter, target_cache: DynamicCache, seq: list[int],
                      start: int, k: int, eos_ids: frozenset[int], stop_below: float = 0.0) -> Round:
    """Draft up to k tokens, verify them in one target forward, roll the target cache and
    the drafter back past the first mismatch. ``seq`` is the sequence so far (not
    modified). An empty proposal makes this one plain target step. ``stop_below`` > 0
    (a draft model only): the proposal ends after a token the draft was less sure of."""
    if stop_below > 0:
        proposal, probs = drafter.propose_confident(seq, k, stop_below)
    else:
        proposal, probs = drafter.propose(seq, k), []
    logits = forward(target, target_cache, seq[-1:] + proposal, len(proposal) + 1)  # [len+1, vocab]
    return verified_round(target_cache, drafter, seq, start, k, proposal, probs, logits, eos_ids)


def verified_round(target_cache: DynamicCache, drafter: Drafter, seq: list[int], start: int, k: int,
                   proposal: list[int], probs, logits: torch.Tensor, eos_ids: frozenset[int]) -> Round:
    """The round ``proposal`` makes, given the target's logits [len(proposal) + 1, vocab]
    over seq[-1:] + proposal: the target cache and the drafter rolled back past the first
    mismatch."""
    target_ids = greedy(logits)
    accepted = num_accepted(proposal, target_ids, eos_ids)
    ended_on_eos = accepted > 0 and proposal[accepted - 1] in eos_ids
    new_ids = proposal[:accepted] if ended_on_eos else proposal[:accepted] + [target_ids[accepted]]
    # The caches keep the sequence minus its (new) last token.
    num_valid = len(seq) + len(new_ids) - 1
    crop_to(target_cache, num_valid)
    drafter.rollback(num_valid)
    last = len(new_ids) - 1 if ended_on_eos else accepted
    return Round(start, k, len(proposal), accepted, tuple(new_ids), logits[last], tuple(probs))


@torch.inference_mode()
def teacher_forced_top1(model, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """``model``'s greedy next token at every position of ``token_ids``, and its probability,
    in one forward."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0]  # [T, vocab]
    best, argmax = logits.max(dim=-1)
    probs = torch.exp(best.double() - torch.logsumexp(logits.double(), dim=-1))
    return argmax.tolist(), probs.float().tolist()  # float32, as traces store them and the engine rounds them


def draft_predictions(draft, prompt_ids: list[int], output_ids: list[int]) -> tuple[list[bool], list[float]]:
    """(agree, top1_probs): at every output position t, whether the draft, teacher-forced on
    prompt + output[:t], predicts output[t], and the probability it gives its own greedy
    token there (what a confidence-based stop compares with its threshold)."""
    if not output_ids:
        return [], []
    predicted, probs = teacher_forced_top1(draft, prompt_ids + output_ids[:-1])
    start = len(prompt_ids) - 1
    return [p == o for p, o in zip(predicted[start:], output_ids)], probs[start:]


def draft_agreement(draft, prompt_ids: list[int], output_ids: list[int]) -> list[bool]:
    """agree[t]: the draft, teacher-forced on prompt + output[:t], predicts output[t]."""
    return draft_predictions(draft, prompt_ids, output_ids)[0]
