"""Tests of rakv.prefix_index: a stateful property test against a reference model, and
unit tests with exact numbers.

Candidate rule (read off ``PrefixIndex.insert`` / ``lookup``): an entry E of n tokens is
registered under ``digest(E[:j])`` for j = 1 .. min(16, n); a query Q looks in the one
bucket ``(namespace, digest(Q[:m]))`` with m = min(16, |Q|), skips candidates with LCP 0,
and returns the candidate with the largest LCP, ties going to the larger ``last_used``
(= the later position in LRU order).

- Real digest (no collisions in practice): E is a candidate iff E[:m] == Q[:m] for some
  registered j, i.e. j == m, which means LCP(E, Q) >= m = min(16, |Q|) (this implies
  n >= m). So the answer is the max LCP over live same-namespace entries with
  LCP >= min(16, |Q|), or None.
- Constant digest: every live entry of the namespace sits in the single bucket, so the
  answer is the max LCP over live same-namespace entries with LCP >= 1, or None.
- Any other deterministic digest: E is a candidate iff digest(Q[:m]) is one of E's
  registered digests and LCP >= 1; the weak-digest track checks that rule directly.
  (Such candidates are a superset of the real-digest ones, so a collision can only add
  candidates; every hit is still an exact, verified prefix.)
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rakv.prefix_index import BUCKET_TOKENS, PrefixIndex, common_prefix_len, prefix_digest

NAMESPACES = ("a", "b")
BUDGET = 100


def constant_digest(ids) -> bytes:
    return b"\0" * 12


def weak_digest(ids) -> bytes:
    """Collides a lot (sum of tokens mod 3), to exercise the collision path."""
    return bytes([int(ids.sum()) % 3]) * 12


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Track:
    """One PrefixIndex and its reference model.

    The reference is a list of records [entry_id, namespace, tokens (tuple), num_bytes],
    least recently used first.
    """

    def __init__(self, name: str, digest):
        self.name = name
        self.digest = digest
        self.index = PrefixIndex(BUDGET) if digest is None else PrefixIndex(BUDGET, digest=digest)
        self.ref: list[list] = []
        self.evictions = 0
        self._digest_cache: dict[tuple[int, ...], set] = {}

    def is_candidate(self, rec, query) -> bool:
        q = lcp(rec[2], query)
        if self.digest is None:  # real digest: the exact rule
            return q >= min(BUCKET_TOKENS, len(query))
        if self.digest is constant_digest:  # one bucket per namespace
            return q >= 1
        if q == 0:  # any other digest: the bucket rule itself, LCP 0 skipped as a collision
            return False
        m = min(BUCKET_TOKENS, len(query))
        return self.digest(np.asarray(query[:m], dtype=np.int64)) in self.registered_digests(rec[2])

    def registered_digests(self, toks) -> set:
        if toks not in self._digest_cache:
            self._digest_cache[toks] = {self.digest(np.asarray(toks[:j], dtype=np.int64))
                                        for j in range(1, min(BUCKET_TOKENS, len(toks)) + 1)}
        return self._digest_cache[toks]

    def expected(self, namespace, query):
        """(record, hit length) of the reference answer, or None."""
        best = None  # (lcp, position in LRU order, record); ties → larger position = more recent
        for pos, rec in enumerate(self.ref):
            if rec[1] == namespace and self.is_candidate(rec, query):
                key = (lcp(rec[2], query), pos)
                if best is None or key > best[:2]:
                    best = (*key, rec)
        return None if best is None else (best[2], best[0])

    def insert(self, namespace, tokens, num_bytes) -> None:
        before = (self.index.lru_ids(), self.index.total_bytes, self.index.num_evictions)
        entry = self.index.insert(namespace, list(tokens), num_bytes)
        if num_bytes > BUDGET:  # refused, nothing changes
            assert entry is None, self.name
            assert (self.index.lru_ids(), self.index.total_bytes, self.index.num_evictions) == before, self.name
            return
        assert entry is not None, self.name
        assert entry.entry_id not in [r[0] for r in self.ref], self.name
        assert tuple(entry.token_ids.tolist()) == tokens and entry.namespace == namespace, self.name
        while sum(r[3] for r in self.ref) + num_bytes > BUDGET:  # evict least recent first
            self.ref.pop(0)
            self.evictions += 1
        self.ref.append([entry.entry_id, namespace, tokens, num_bytes])

    def lookup(self, namespace, query, touch) -> None:
        exp = self.expected(namespace, query)
        hit = self.index.lookup(namespace, np.asarray(query), touch=touch)
        ctx = (self.name, namespace, query, hit, exp)
        if exp is None:
            assert hit is None, ctx
            return
        rec, length = exp
        assert hit is not None, ctx
        assert (hit.entry.entry_id, hit.num_tokens) == (rec[0], length), ctx
        assert hit.num_tokens == common_prefix_len(hit.entry.token_ids, np.asarray(query)) >= 1, ctx
        assert hit.entry.namespace == namespace, ctx
        if touch:
            self.ref.remove(rec)
            self.ref.append(rec)

    def remove(self, entry_id) -> None:
        recs = [r for r in self.ref if r[0] == entry_id]
        if recs:  # the entry may be live in one track and already evicted in another
            self.index.remove(next(e for e in self.index.entries() if e.entry_id == entry_id))
            self.ref.remove(recs[0])

    def check(self) -> None:
        idx, name = self.index, self.name
        assert idx.total_bytes <= idx.budget_bytes, name
        assert idx.total_bytes == sum(e.num_bytes for e in idx.entries()) == sum(r[3] for r in self.ref), name
        assert idx.lru_ids() == [r[0] for r in self.ref], name
        assert len(idx) == len(self.ref), name
        assert idx.num_evictions == self.evictions, name
        for e, r in zip(idx.entries(), self.ref):
            assert (e.namespace, tuple(e.token_ids.tolist()), e.num_bytes) == (r[1], r[2], r[3]), name
        # draw-free, non-touching probes around every live entry (cheap extra coverage)
        for _, namespace, toks, _ in list(self.ref):
            other = NAMESPACES[1 - NAMESPACES.index(namespace)]
            self.lookup(namespace, toks, touch=False)  # exact: hits len(toks), or longer via another entry
            self.lookup(other, toks, touch=False)  # namespace isolation
            self.lookup(namespace, toks[:-1] + ((toks[-1] + 1) % 4,), touch=False)  # fork at the last token
        assert idx.lru_ids() == [r[0] for r in self.ref], name


# -- strategies (module-level and argument-keyed, so hypothesis caches them) -------------
NAMESPACE = st.sampled_from(NAMESPACES)
SMALL_BYTES = st.integers(0, 35)
# mostly entries that fit a few times over; sometimes ones at or just over the budget
INSERT_BYTES = st.one_of(SMALL_BYTES, SMALL_BYTES, SMALL_BYTES,
                         st.sampled_from([BUDGET - 1, BUDGET, BUDGET + 1, 3 * BUDGET]))
KINDS = st.sampled_from(["fresh", "prefix", "fork"])
QUARTER = st.integers(0, 3)


def draw_token_tuple(data, min_size: int, max_size: int, label: str) -> tuple[int, ...]:
    """Tokens over the alphabet 0..3: a length, then one bytes choice of that length.

    (An explicit length because st.binary alone skews hard toward very short values; one
    bytes choice because a list of integers costs a hypothesis choice per token.)
    """
    n = data.draw(st.integers(min_size, max_size), label=f"{label}_len")
    return tuple(x % 4 for x in data.draw(st.binary(min_size=n, max_size=n), label=label))


class PrefixIndexMachine(RuleBasedStateMachine):
    """Random insert / lookup / remove over 2 namespaces and tokens 0..3 of length 1..40.

    Every operation is applied to three indexes side by side (the real digest, a constant
    digest, a weak colliding digest), each checked against its own reference model; the
    hypothesis draws are shared, which keeps the test fast. The tracks' LRU orders and
    evictions can diverge (different hits touch different entries); each reference
    follows its own index.
    """

    def __init__(self):
        super().__init__()
        self.tracks = [Track("real", None), Track("constant", constant_digest), Track("weak", weak_digest)]

    def live(self) -> list[list]:
        """Live records of all tracks, deduplicated by entry id (ids agree across tracks)."""
        seen = {}
        for t in self.tracks:
            for r in t.ref:
                seen.setdefault(r[0], r)
        return [seen[k] for k in sorted(seen)]

    def draw_tokens(self, data) -> tuple[tuple[int, ...], str | None]:
        """Fresh tokens, a prefix of a live entry, or such a prefix plus a fresh tail.

        Returns the tokens and the namespace of the entry they were derived from (or None).
        """
        live = self.live()
        kind = data.draw(KINDS, label="kind") if live else "fresh"
        if kind == "fresh":
            return draw_token_tuple(data, 1, 40, "tokens"), None
        _, namespace, base, _ = live[data.draw(st.integers(0, len(live) - 1), label="base")]
        n = len(base)
        if kind == "prefix":
            return base[:data.draw(st.integers(1, n), label="keep")], namespace
        # keep anything, or (half the time) at least a whole bucket's worth of the base
        if data.draw(st.booleans(), label="long_keep"):
            keep = data.draw(st.integers(min(BUCKET_TOKENS, n), n), label="keep")
        else:
            keep = data.draw(st.integers(0, n), label="keep")
        return base[:keep] + draw_token_tuple(data, 0 if keep else 1, 40 - keep, "tail"), namespace

    @initialize(data=st.data(), num_bytes=st.lists(SMALL_BYTES, min_size=1, max_size=6))
    def populate(self, data, num_bytes):
        """Start from a few entries so that lookups and evictions have something to act on."""
        for b in num_bytes:
            self.insert(data.draw(NAMESPACE, label="namespace"), data, b)

    @rule(namespace=NAMESPACE, data=st.data(), num_bytes=INSERT_BYTES)
    def insert(self, namespace, data, num_bytes):
        tokens, _ = self.draw_tokens(data)
        for t in self.tracks:
            t.insert(namespace, tokens, num_bytes)
        # every track accepts or refuses alike, so entry ids agree across tracks
        assert len({t.index._next_id for t in self.tracks}) == 1

    @rule(namespace=NAMESPACE, touch=st.booleans(), data=st.data())
    def lookup(self, namespace, touch, data):
        query, base_namespace = self.draw_tokens(data)
        if base_namespace is not None and data.draw(QUARTER, label="same_ns") > 0:
            namespace = base_namespace  # mostly ask the namespace the query was derived from
        for t in self.tracks:
            t.lookup(namespace, query, touch)

    @precondition(lambda self: any(t.ref for t in self.tracks))
    @rule(data=st.data())
    def remove(self, data):
        live = self.live()
        entry_id = live[data.draw(st.integers(0, len(live) - 1), label="victim")][0]
        for t in self.tracks:
            t.remove(entry_id)

    @invariant()
    def consistent(self):
        for t in self.tracks:
            t.check()


TestPrefixIndexMachine = PrefixIndexMachine.TestCase
TestPrefixIndexMachine.settings = settings(
    max_examples=200,
    stateful_step_count=15,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- unit tests with exact numbers ----------------------------------------------------
BASE = list(range(100, 130))  # 30 distinct tokens


def test_digest_is_blake2b_12_of_int64_le():
    ids = np.array([1, 2, 3], dtype=np.int64)
    assert prefix_digest(ids) == hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=12).digest()
    assert prefix_digest([1, 2, 3]) == prefix_digest(np.array([1, 2, 3], dtype=np.int32))


def test_short_prompt_hits_longer_stored_sequence():
    idx = PrefixIndex(1000)
    e = idx.insert("m", BASE, 10)
    hit = idx.lookup("m", BASE[:10])
    assert hit is not None and hit.entry is e and hit.num_tokens == 10
    hit = idx.lookup("m", BASE[:1])
    assert hit is not None and hit.num_tokens == 1


def test_twenty_token_prompt_sharing_eighteen_hits_eighteen():
    idx = PrefixIndex(1000)
    e = idx.insert("m", BASE, 10)
    prompt = BASE[:18] + [7, 7]
    assert len(prompt) == 20
    hit = idx.lookup("m", prompt)
    assert hit is not None and hit.entry is e and hit.num_tokens == 18


def test_prompt_sharing_ten_of_first_sixteen_misses():
    prompt = BASE[:10] + [7] * 10  # 20 tokens, diverges at position 10 < 16
    idx = PrefixIndex(1000)
    idx.insert("m", BASE, 10)
    assert idx.lookup("m", prompt) is None
    # the miss is the digest gate: with a constant digest the same entry is a 10-token hit
    idx_const = PrefixIndex(1000, digest=constant_digest)
    idx_const.insert("m", BASE, 10)
    hit = idx_const.lookup("m", prompt)
    assert hit is not None and hit.num_tokens == 10


def test_bucket_boundary_sixteen_hits_fifteen_misses():
    idx = PrefixIndex(1000)
    e = idx.insert("m", BASE, 10)
    hit = idx.lookup("m", BASE[:16] + [7] * 4)
    assert hit is not None and hit.entry is e and hit.num_tokens == 16
    assert idx.lookup("m", BASE[:15] + [7] * 5) is None
    hit = idx.lookup("m", BASE[:15])  # a 15-token prompt is its own bucket key: hits 15
    assert hit is not None and hit.num_tokens == 15


def test_entry_shorter_than_bucket_not_found_by_longer_prompt():
    idx = PrefixIndex(1000)
    e = idx.insert("m", BASE[:10], 10)
    assert idx.lookup("m", BASE[:20]) is None  # documented limitation
    hit = idx.lookup("m", BASE[:8])
    assert hit is not None and hit.entry is e and hit.num_tokens == 8


def test_namespaces_are_isolated():
    idx = PrefixIndex(1000)
    ea = idx.insert("a", BASE, 10)
    assert idx.lookup("b", BASE) is None
    assert idx.lookup("b", BASE[:5]) is None
    eb = idx.insert("b", BASE, 10)
    assert idx.lookup("a", BASE).entry is ea
    assert idx.lookup("b", BASE).entry is eb
    idx_const = PrefixIndex(1000, digest=constant_digest)
    idx_const.insert("a", BASE, 10)
    assert idx_const.lookup("b", BASE) is None


@pytest.mark.parametrize("budget", [0, -1, -100])
def test_nonpositive_budget_raises(budget):
    with pytest.raises(ValueError, match=r"budget must be positive, got -?\d+ bytes"):
        PrefixIndex(budget)


def test_empty_insert_raises_and_empty_lookup_misses():
    idx = PrefixIndex(1000)
    with pytest.raises(ValueError, match="empty token sequence"):
        idx.insert("m", [], 10)
    assert len(idx) == 0 and idx.total_bytes == 0
    idx.insert("m", BASE, 10)
    assert idx.lookup("m", []) is None


def test_tie_breaks_to_most_recently_used():
    idx = PrefixIndex(1000)
    shared = BASE[:20]
    old = idx.insert("m", shared + [1, 1, 1], 10)
    new = idx.insert("m", shared + [2, 2, 2], 10)
    tie_query = shared + [3]
    hit = idx.lookup("m", tie_query)
    assert hit.entry is new and hit.num_tokens == 20
    # touch the older entry with a query it matches longer; now it wins the tie
    assert idx.lookup("m", shared + [1, 1]).entry is old
    assert idx.lru_ids() == [new.entry_id, old.entry_id]
    assert idx.lookup("m", tie_query, touch=False).entry is old
    # a non-touching lookup changes neither the order nor the tie-break
    assert idx.lookup("m", shared + [2], touch=False).entry is new
    assert idx.lru_ids() == [new.entry_id, old.entry_id]
    assert idx.lookup("m", tie_query).entry is old


def test_lru_eviction_and_oversize_refusal():
    idx = PrefixIndex(100)
    e0 = idx.insert("m", [0] * 20, 40)
    e1 = idx.insert("m", [1] * 20, 40)
    assert idx.lru_ids() == [e0.entry_id, e1.entry_id] and idx.total_bytes == 80
    idx.lookup("m", [0] * 20)  # touch e0: e1 is now least recent
    e2 = idx.insert("m", [2] * 20, 40)
    assert idx.lru_ids() == [e0.entry_id, e2.entry_id]
    assert idx.total_bytes == 80 and idx.num_evictions == 1
    assert idx.lookup("m", [1] * 20) is None
    assert idx.insert("m", [3] * 20, 101) is None  # larger than the whole budget
    assert idx.lru_ids() == [e0.entry_id, e2.entry_id] and idx.total_bytes == 80
    e3 = idx.insert("m", [3] * 20, 100)  # exactly the budget: evicts everything else
    assert idx.lru_ids() == [e3.entry_id] and idx.total_bytes == 100 and idx.num_evictions == 3


def test_entries_filling_the_budget_exactly_are_all_kept():
    idx = PrefixIndex(100)
    ids = [idx.insert("m", [k] * 20, b).entry_id for k, b in enumerate([60, 30, 10])]
    assert idx.lru_ids() == ids and idx.total_bytes == 100 and idx.num_evictions == 0
    e = idx.insert("m", [9] * 20, 0)  # zero bytes always fits
    assert idx.lru_ids() == ids + [e.entry_id] and idx.num_evictions == 0
    idx.insert("m", [8] * 20, 1)  # one byte over: exactly the least recent entry goes
    assert idx.lru_ids()[:2] == ids[1:] and idx.total_bytes == 41 and idx.num_evictions == 1
