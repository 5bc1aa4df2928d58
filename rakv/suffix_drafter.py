"""The store drafter (``suffix``): what earlier requests produced, held by the prefix store,
as a drafter. Imports no torch.

Serving traffic repeats itself across requests (tool calls, templated SQL, a revision of
the previous answer); prompt lookup sees only the current request. This drafter looks the
sequence's end up in every sequence the store holds (prompts and outputs of earlier
requests, as ``StoreModel`` keeps them) and in the request's own prompt and output so far,
and proposes what followed the longest match, as SuffixDecoding does (vLLM's ``suffix``).

Index: a hashed n-gram table of the store's sequences (``rakv.sequence_index``). A lookup
takes the most recent ``max_candidates`` positions filed under the sequence's last
``key_tokens`` tokens (the request's own first, then the store's, newest entry first),
extends each match backwards (up to ``max_match`` tokens), keeps those with the longest
match, and walks their continuations: at each depth the most frequent next token (ties:
the earlier candidate) while the share of candidates that follow the draft so far stays at
least ``min_prob``, for at most ``spec_factor`` x the match length tokens
(SuffixDecoding's rule).

Exactness: a proposal is a function of the request's tokens so far and of the sequences
the store holds when it is made. The store model decides what it holds from the request
order and the store settings, the same in the engine and in a replay, and both look a
position up when its round is planned (``SuffixColumns``): so the proposals, run lengths
and rounds replay exactly. Being such a function, an answer is kept by the index until
a change that reaches it (``rakv.sequence_index.LookupAnswers``), for the requests that
look the same tokens up again.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rakv.drafters import SUFFIX, RunLengths, matching_prefix_length
from rakv.sequence_index import TOKEN_BYTES, SequenceIndex


@dataclass(frozen=True)
class SuffixConfig:
    # tokens a match starts from: 2 finds a templated answer's stored continuation again two
    # tokens after a slot value where it differs (4: four; replayed, 2 is ahead on most traces)
    key_tokens: int = 2
    max_candidates: int = 32  # most recent positions a lookup extends and counts
    max_match: int = 64  # a match is extended backwards up to this many tokens
    spec_factor: float = 1.0  # a proposal is at most this many times the match length
    min_prob: float = 0.1  # a proposal stops before a token fewer than this share of the matches follow

    def __post_init__(self):
        if not 1 <= self.key_tokens <= self.max_match or self.max_candidates < 1:
            raise ValueError(f"need 1 <= key_tokens <= max_match and max_candidates >= 1, got "
                             f"{self.key_tokens}, {self.max_match}, {self.max_candidates}")
        if self.spec_factor <= 0 or not 0 < self.min_prob <= 1:
            raise ValueError(f"need spec_factor > 0 and 0 < min_prob <= 1, got {self.spec_factor}, {self.min_prob}")


# -- signals ----------------------------------------------------------------------
# What the planner knows before a proposal: the match length's bucket and whether the
# matches agree. signal = bucket + 4 x kind; 0: no proposal.
MATCH_BUCKETS = (8, 16, 32)  # bucket 1: a match shorter than 8 tokens, ... 4: 32 or more
ONE, AGREE, SPLIT = 0, 1, 2  # kinds: one match; several, agreeing on the first token; several, not
# Per-token acceptance before a request has shown its own, by bucket, for one match or
# several agreeing ones; matches that disagree start at 0.6 of it.
SUFFIX_PRIOR_BY_BUCKET = {1: 0.45, 2: 0.6, 3: 0.75, 4: 0.85}


def suffix_signal(match: int, num_matches: int, first_share: float) -> int:
    if match == 0:
        return 0
    bucket = 1 + bisect_right(MATCH_BUCKETS, match)  # 1 + the bucket bounds it reaches
    kind = ONE if num_matches == 1 else AGREE if first_share == 1.0 else SPLIT
    return bucket + 4 * kind


def suffix_prior(signal: int) -> float:
    """Starting acceptance estimate under a signal (0: no proposal)."""
    if signal == 0:
        return 0.0
    bucket, kind = (signal - 1) % 4 + 1, (signal - 1) // 4
    return SUFFIX_PRIOR_BY_BUCKET[bucket] * (0.6 if kind == SPLIT else 1.0)


# -- one request's drafter ------------------------------------------------------------
def own_positions(context: bytes | bytearray, key: bytes, length: int, limit: int) -> list[int]:
    """Up to ``limit`` positions p < ``length`` of the int64 bytes ``context`` whose tokens
    just before p are ``key``, newest first: the positions ``file_positions`` would file
    from the first ``length`` tokens, found by searching the bytes instead (a request's own
    sequence is searched a few times per round; filing it cost more than its lookups)."""
    w, found = TOKEN_BYTES, []
    end = (length - 1) * w  # a key ends at p * w <= (length - 1) * w
    while len(found) < limit:
        i = context.rfind(key, 0, end)
        if i < 0:
            break
        if i % w:  # a match across token boundaries
            end = i + len(key) - 1
            continue
        found.append((i + len(key)) // w)
        end = i + len(key) - w
    return found


def match_length(source: bytes | bytearray, position: int, context: bytes | bytearray, length: int,
                 known: int, limit: int) -> int:
    """How many tokens before ``position`` of ``source`` equal the last of the first
    ``length`` tokens of ``context``: ``known`` at least (already compared), at most
    ``limit``. Tries the longest first (a repeat's match, the common case), then gallops
    and halves: a short match costs two comparisons."""
    w = TOKEN_BYTES
    low, high, step = known, min(limit, position, length), 1
    if low < high and source[w * (position - high):w * position] == context[w * (length - high):w * length]:
        return high  # as long as it can be: a repeat's match, most often
    while low < high:
        m = min(low + step, high)
        if source[w * (position - m):w * position] == context[w * (length - m):w * length]:
            low, step = m, step * 2
        else:
            high = m - 1
            break
    while low < high:
        m = (low + high + 1) // 2
        if source[w * (position - m):w * position] == context[w * (length - m):w * length]:
            low = m
        else:
            high = m - 1
    return low


def walk_continuations(continuations: Sequence[bytes], cap: int, min_prob: float) -> tuple[list[int], float]:
    """The draft along the most frequent of the continuations (int64 bytes; ties: the
    earlier one), stopping before a token fewer than ``min_prob`` of all continuations
    follow, at most ``cap`` tokens; and the share of them that follow its first token (0:
    no draft). Equal continuations are walked as one, weighted by their number."""
    w = TOKEN_BYTES
    if len(continuations) == 1:  # the common case: one match, followed whole
        c = continuations[0][:cap * w]
        return memoryview(c).cast("q").tolist(), 1.0 if c else 0.0
    groups: dict[bytes, int] = {}  # in first-seen order, so ties still go to the earlier candidate
    for c in continuations:
        groups[c] = groups.get(c, 0) + 1
    total = len(continuations)
    alive = list(groups.items())
    draft, first_share, depth = bytearray(), 0.0, 0
    while depth < cap and alive:
        if len(alive) == 1:  # one continuation left, followed by a share that no longer falls: the rest of it
            c, count = alive[0]
            if depth == 0:
                first_share = count / total if c else 0.0
            draft += c[depth * w:cap * w]
            break
        # The tokens every alive continuation has next, the same in each (those of the
        # least and the greatest, which bound the rest): followed by all that are alive,
        # whose share passed min_prob where they parted from the others (at depth 0: all)
        common = _common_tokens(min(c for c, _ in alive), max(c for c, _ in alive), depth, cap)
        if common:
            if depth == 0:
                first_share = 1.0
            draft += alive[0][0][depth * w:(depth + common) * w]
            depth += common
            continue
        begin, counts = depth * w, {}
        for c, count in alive:
            if len(c) > begin:
                token = c[begin:begin + w]
                counts[token] = counts.get(token, 0) + count
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: item[1])  # max keeps the first of equals
        if count < min_prob * total:
            break
        if depth == 0:
            first_share = count / total
        draft += token
        alive = [(c, n) for c, n in alive if len(c) > depth * w and c[begin:begin + w] == token]
        depth += 1
    return memoryview(draft).cast("q").tolist(), first_share


def _common_tokens(low: bytes, high: bytes, depth: int, cap: int) -> int:
    """Whole tokens from ``depth`` on, before ``cap``, that ``low`` and ``high`` share."""
    w = TOKEN_BYTES
    end = min(len(low), len(high), cap * w) // w
    if low[depth * w:end * w] == high[depth * w:end * w]:
        return max(end - depth, 0)
    n = depth
    while n < end and low[n * w:n * w + w] == high[n * w:n * w + w]:
        n += 1
    return n - depth


class SuffixDrafter:
    """The store drafter over one request (``rakv.drafters.Drafter``). Its sequence only
    grows, so each length is looked up once (the first time it is asked, at its round's
    planning: ``SuffixColumns``), however many times it is asked for, and not at all where
    a request before it looked the same tokens up over the store as it stands."""

    name = SUFFIX

    def __init__(self, store: SequenceIndex | None, config: SuffixConfig = SuffixConfig(), max_k: int = 16):
        self.store, self.config, self.max_k = store, config, max_k
        self._context = b""  # the request's tokens so far (a replay's: all of them), int64 bytes
        self._memo: tuple[int, list[int], int] = (-1, [], 0)  # (length, proposal up to max_k, signal)
        self._answers = store.answers(config, max_k) if store is not None else None  # shared with other requests

    @classmethod
    def over(cls, store, namespace: str, config: SuffixConfig, max_k: int) -> "SuffixDrafter":
        """A request's drafter over ``store``'s (a ``rakv.store_model.StoreModel``)
        sequences in ``namespace``, the engine's and a replay's alike."""
        return cls(store.sequences(namespace, config.key_tokens), config, max_k)

    def lookup(self, tokens: Sequence[int], length: int) -> tuple[list[int], int]:
        """(the proposal after the first ``length`` tokens, up to ``max_k``; its signal)."""
        if self._memo[0] != length:
            self._memo = (length, *self._lookup(tokens, length))
        return self._memo[1], self._memo[2]

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        return self.lookup(seq, len(seq))[0][:k]

    def signal(self, seq: Sequence[int]) -> int:
        return self.lookup(seq, len(seq))[1]

    def rollback(self, num_valid: int) -> None:
        pass  # the true sequence of a given length never changes

    def extend(self, tokens: Sequence[int], length: int) -> None:
        """Holds the request's own tokens up to ``length`` at least, as int64 bytes (a
        lookup at a length reads no further: a replay, which knows them all, gives them
        at once)."""
        known = len(self._context) // TOKEN_BYTES
        if length > known:
            self._context += np.asarray(tokens[known:length], dtype=np.int64).tobytes()

    def _lookup(self, tokens: Sequence[int], length: int) -> tuple[list[int], int]:
        """The answer after the first ``length`` tokens: another request's where it looked
        the same tokens up over the index as it stands, else searched."""
        self.extend(tokens, length)
        w, n = TOKEN_BYTES, self.config.key_tokens
        if length < n:
            return [], 0
        context = self._context
        key = context[(length - n) * w:length * w]
        answers = self._answers
        if answers is not None:
            looked_up = context[:length * w]
            found = answers.get(key, looked_up)
            if found is not None:
                return found
        answer = self._search(context, length, key)
        if answers is not None:
            answers.put(key, looked_up, answer)
        return answer

    def _search(self, context: bytes, length: int, key: bytes) -> tuple[list[int], int]:
        """``_lookup``'s answer, found over the index and the first ``length`` tokens of
        ``context`` (of at least ``key_tokens``), the last of which are ``key``."""
        config, w = self.config, TOKEN_BYTES
        n = config.key_tokens
        # the request's own positions before ``length`` (a replay may look an earlier length up
        # after a later one), their continuations cut there; then the store's
        candidates = [(context, p, length) for p in own_positions(context, key, length, config.max_candidates)]
        if self.store is not None and len(candidates) < config.max_candidates:
            candidates += [(data, p, len(data) // w)
                           for data, p in self.store.occurrences(key, config.max_candidates - len(candidates))]
        if not candidates:
            return [], 0
        # the longest match, and the candidates that reach it, in order: a candidate is
        # measured only where it reaches the longest so far (one comparison rules it out)
        best, longest = n, []
        for candidate in candidates:
            source, p, _ = candidate
            if best > n and not (best <= p and source[(p - best) * w:p * w] == context[(length - best) * w:length * w]):
                continue
            m = match_length(source, p, context, length, best, config.max_match)
            if m > best:
                best, longest = m, [candidate]
            else:
                longest.append(candidate)
        cap = min(self.max_k, max(1, int(config.spec_factor * best)))
        continuations = [source[p * w:min(p + cap, end) * w] for source, p, end in longest]  # bytes
        draft, first_share = walk_continuations(continuations, cap, config.min_prob)
        return draft, suffix_signal(best, len(continuations), first_share) if draft else 0


class SuffixColumns:
    """A store drafter's ``rakv.drafters.RunLengths`` columns over one request, each
    position looked up when first read: the signal at t is read when the round at t is
    planned, in the engine and in a replay alike, so both see the store as it stands then.
    ``output``: the whole greedy output where it is known (a replay), which gives the run
    lengths; the engine fills ``runs`` in as its output grows."""

    def __init__(self, drafter: SuffixDrafter, tokens: Sequence[int], num_prompt: int, num_positions: int,
                 output: Sequence[int] | None = None):
        self.drafter, self.tokens, self.num_prompt = drafter, tokens, num_prompt
        self._output = None
        if output is not None:  # a replay: the whole output is known, and every token with it
            self._output = np.asarray(output, dtype=np.int64).tolist()  # a list: runs compared at once
            drafter.extend(tokens, len(tokens))
        # t -> (proposal, signal, its length, its run length: 0 where the output is not known)
        self._looked: dict[int, tuple[list[int], int, int, int]] = {}
        self.signals = _Column(self, 1)
        self.proposed = _Column(self, 2)
        self.runs = _Column(self, 3) if output is not None else [0] * num_positions

    def materialized(self) -> RunLengths:
        """Every position's run length, proposal length and signal, looked up now (those
        read before keep what they were); a replay's columns only (the output is known)."""
        looked = [self.at(t) for t in range(len(self._output))]
        return RunLengths([at[3] for at in looked], [at[2] for at in looked], [at[1] for at in looked])

    def at(self, t: int) -> tuple[list[int], int, int, int]:
        """(the proposal at t, its signal, its length, its run length), looked up once."""
        looked = self._looked.get(t)
        if looked is None:
            proposal, signal = self.drafter.lookup(self.tokens, self.num_prompt + t)
            output = self._output
            run = matching_prefix_length(proposal, output[t:t + len(proposal)]) if output is not None else 0
            looked = self._looked[t] = (proposal, signal, len(proposal), run)
        return looked

    def proposal(self, t: int) -> list[int]:
        return self.at(t)[0]


class _Column:
    """A read-only sequence: item t is field ``field`` of ``columns.at(t)`` (one call a
    read: the planners read these on every iteration)."""

    __slots__ = ("_columns", "_looked", "_field")

    def __init__(self, columns: SuffixColumns, field: int):
        self._columns, self._looked, self._field = columns, columns._looked, field

    def __getitem__(self, t: int):
        looked = self._looked.get(t)
        return (looked if looked is not None else self._columns.at(t))[self._field]
