"""Exact prefix index: digest buckets, longest-common-prefix match, byte budget, LRU.

The index holds token ids, byte sizes and an opaque payload per entry; it imports no
torch, so the simulator can run the very same index over token ids and byte sizes.

Invariants:
- Digests only *choose candidates*; a hit is always decided by an exact comparison of
  token ids. A digest collision only adds candidates (each compared exactly, at the cost
  of the comparison): it can never produce a wrong prefix.
- ``total_bytes <= budget_bytes`` after every call returns.
- LRU order: ``lru_ids()`` lists entries least recently used first. ``insert`` and a
  touching ``lookup`` hit move the entry to the most-recent end; eviction pops the
  least-recent end until the new entry fits.
- Namespaces (one per model fingerprint) never see each other's entries: the namespace is
  part of every bucket key, compared exactly.
- Every listener (``listeners``: ``added(entry)``, ``removed(entry)``) is told of each
  entry as it enters and leaves, after the index has changed, so a listener's view of the
  entries is the index's (``rakv.sequence_index.SequenceIndex``).

Bucketing: an entry of n tokens is registered under the digests of its first j tokens for
j = 1 .. min(16, n). A lookup of a prompt P uses the digest of P's first min(16, |P|)
tokens, so a prompt shorter than 16 tokens finds every stored sequence it prefixes. An
entry shorter than 16 tokens is found only by prompts no longer than itself (a lookup
would need up to 16 digests to find it inside a longer prompt; such entries are rare
and nearly free to recompute).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

BUCKET_TOKENS = 16
DIGEST_BYTES = 12
DIGEST_MEMO_ENTRIES = 4096


def prefix_digest(token_ids: np.ndarray) -> bytes:
    """BLAKE2b-12 of the int64 little-endian bytes of ``token_ids``."""
    data = np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    equal = a[:n] == b[:n]
    return n if equal.all() else int(equal.argmin())  # argmin: the first False


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)


@dataclass(eq=False)
class Entry:
    entry_id: int
    namespace: str
    token_ids: np.ndarray  # [num_tokens] int64, never mutated after insert
    num_bytes: int
    payload: object = None
    last_used: int = 0  # logical clock; larger is more recent (tie-break for equal hits)
    keys: list = field(default_factory=list, repr=False)
    token_bytes: bytes = field(default=b"", repr=False)  # token_ids' int64 bytes, for fast comparison

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class Hit:
    entry: Entry
    num_tokens: int  # exact longest common prefix with the query, >= 1


class PrefixIndex:
    """Budgeted LRU index of token sequences with exact longest-prefix lookup."""

    def __init__(self, budget_bytes: int, digest: Callable[[np.ndarray], bytes] = prefix_digest):
        if budget_bytes <= 0:
            raise ValueError(f"store budget must be positive, got {budget_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        self._digest = digest
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # least recent first
        self._buckets: dict[tuple[str, bytes], dict[int, Entry]] = {}
        self._next_id = 0
        self._clock = 0
        self.total_bytes = 0
        self.num_evictions = 0
        self._digest_memo: dict[bytes, tuple[bytes, ...]] = {}  # first 16 tokens' bytes -> their prefix digests
        self.listeners: list = []  # told of every entry added and removed

    # -- queries -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def lru_ids(self) -> list[int]:
        """Entry ids, least recently used first."""
        return list(self._lru)

    def entries(self) -> list[Entry]:
        return list(self._lru.values())

    def lookup(self, namespace: str, token_ids: Sequence[int] | np.ndarray, touch: bool = True) -> Hit | None:
        """Longest exact prefix of ``token_ids`` held in ``namespace``, or None.

        Ties in length go to the most recently used entry. ``touch`` marks the hit entry
        as used (moves it to the most-recent end of the LRU order).
        """
        query = as_token_array(token_ids)
        if len(query) == 0:
            return None
        head = query[:BUCKET_TOKENS]
        known = self._digest_memo.get(head.tobytes())
        key = (namespace, known[-1] if known is not None else self._digest(head))
        best: Hit | None = None
        query_bytes = query.tobytes()
        for entry in self._buckets.get(key, {}).values():
            # the shorter one a prefix of the other (the usual hit): found by one memcmp
            if len(entry.token_bytes) <= len(query_bytes):
                q = entry.num_tokens if query_bytes.startswith(entry.token_bytes) else -1
            else:
                q = len(query) if entry.token_bytes.startswith(query_bytes) else -1
            if q < 0:  # they differ within the shorter one: its first difference
                n = min(entry.num_tokens, len(query))
                q = int((entry.token_ids[:n] == query[:n]).argmin())
            if q == 0:
                continue  # digest collision
            if best is None or q > best.num_tokens or (q == best.num_tokens and entry.last_used > best.entry.last_used):
                best = Hit(entry, q)
        if best is not None and touch:
            self.touch(best.entry)
        return best

    # -- updates -----------------------------------------------------------------
    def touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
        self._lru.move_to_end(entry.entry_id)

    def insert(self, namespace: str, token_ids: Sequence[int] | np.ndarray, num_bytes: int,
               payload: object = None) -> Entry | None:
        """Insert an entry, evicting least-recently-used entries until it fits.

        Returns None (and changes nothing) when the entry alone exceeds the budget.
        """
        tokens = as_token_array(token_ids).copy()
        if len(tokens) == 0:
            raise ValueError("cannot store an empty token sequence")
        if num_bytes > self.budget_bytes:
            return None
        while self.total_bytes + num_bytes > self.budget_bytes:
            self.evict_lru()
        entry = Entry(self._next_id, namespace, tokens, int(num_bytes), payload, token_bytes=tokens.tobytes())
        self._next_id += 1
        # dict.fromkeys: colliding digests (or a patched constant one) register one key once
        entry.keys = list(dict.fromkeys((namespace, digest) for digest in self._prefix_digests(tokens)))
        for key in entry.keys:
            self._buckets.setdefault(key, {})[entry.entry_id] = entry
        self._lru[entry.entry_id] = entry
        self.total_bytes += entry.num_bytes
        self.touch(entry)
        for listener in self.listeners:
            listener.added(entry)
        return entry

    def evict_lru(self) -> bool:
        """Evict the least recently used entry; False when there is none."""
        if not self._lru:
            return False
        self.remove(next(iter(self._lru.values())))
        self.num_evictions += 1
        return True

    def _prefix_digests(self, tokens: np.ndarray) -> tuple[bytes, ...]:
        """The digests of the first 1 .. min(16, n) tokens. Remembered per distinct first
        16 tokens (a replay inserts the same prefixes again and again); the memo is bounded
        and changes no result."""
        head = tokens[:BUCKET_TOKENS]
        key = head.tobytes()
        digests = self._digest_memo.get(key)
        if digests is None:
            digests = tuple(self._digest(head[:j]) for j in range(1, len(head) + 1))
            if len(self._digest_memo) >= DIGEST_MEMO_ENTRIES:
                self._digest_memo.pop(next(iter(self._digest_memo)))
            self._digest_memo[key] = digests
        return digests

    def remove(self, entry: Entry) -> None:
        del self._lru[entry.entry_id]
        for key in entry.keys:
            bucket = self._buckets[key]
            del bucket[entry.entry_id]
            if not bucket:
                del self._buckets[key]
        entry.keys = []
        self.total_bytes -= entry.num_bytes
        for listener in self.listeners:
            listener.removed(entry)
