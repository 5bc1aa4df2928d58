"""The store's sequences, filed for the store drafter (``rakv.suffix_drafter``). Imports no torch.

A hashed n-gram table: every position p of a stored sequence with ``key_tokens`` tokens
before it and at least one after is filed under those tokens (their int64 bytes: the key
is compared exactly, never by a hash). ``rakv.prefix_index.PrefixIndex`` tells the index of
each entry inserted and removed, so it holds exactly the entries the store holds. It also
keeps the answers of the lookups made over it (``LookupAnswers``), for requests that
repeat a prompt and look the same sequences up again: a lookup reads only the positions
filed under its key, so an entry inserted or removed drops the answers under the keys it
files, and those alone.
"""
from __future__ import annotations

TOKEN_BYTES = 8  # keys and sequences are int64 bytes, as the prefix index keeps them (``Entry.token_bytes``)
_POSITION_BITS = 32  # a filed position is entry_id << 32 | p


class SequenceIndex:
    """Every position of one namespace's stored sequences, filed by the ``key_tokens``
    tokens before it (``rakv.prefix_index.PrefixIndex`` tells it of each insert and
    removal, so it holds exactly the entries the store holds).

    Invariant: under a key, positions are in filing order (entry id, then position), so
    "most recent" is the same wherever the store model runs. A removed entry's positions
    are skipped, and dropped when they outnumber the live ones (the order is kept)."""

    def __init__(self, namespace: str, key_tokens: int):
        self.namespace = namespace
        self.key_tokens = key_tokens
        self._sequences: dict[int, bytes] = {}  # entry id -> its tokens' int64 bytes
        self._positions: dict[bytes, list[int]] = {}  # key -> filed positions
        self._num_live = self._num_dead = 0
        self._answers: dict[tuple, LookupAnswers] = {}  # (config, max_k) -> lookups over what it holds now

    def answers(self, config, max_k: int) -> LookupAnswers:
        """The answers of lookups under ``config`` (a ``SuffixConfig``) and ``max_k`` over
        what the index holds (``SuffixDrafter``): an entry added or removed drops those
        under the keys it files, so an answer is valid while it is there."""
        found = self._answers.get((config, max_k))
        if found is None:
            found = self._answers[config, max_k] = LookupAnswers()
        return found

    def _changed(self, data: bytes) -> None:
        """The answers under the keys an entry of int64 bytes ``data`` files, dropped."""
        kept = [answers for answers in self._answers.values() if answers.by_key]
        if kept:
            n, w = self.key_tokens, TOKEN_BYTES
            keys = {data[(p - n) * w:p * w] for p in range(n, len(data) // w)}
            for answers in kept:
                answers.drop(keys)

    @classmethod
    def holding(cls, namespace: str, key_tokens: int, entries) -> "SequenceIndex":
        """An index of ``entries`` (the namespace's among them), filed in insertion order:
        what an index kept since the store's start would hold now."""
        index = cls(namespace, key_tokens)
        for entry in sorted(entries, key=lambda e: e.entry_id):
            index.added(entry)
        return index

    def __len__(self) -> int:
        return len(self._sequences)

    def added(self, entry) -> None:
        if entry.namespace != self.namespace:
            return
        data = entry.token_bytes
        self._sequences[entry.entry_id] = data
        self._changed(data)
        file_positions(self._positions, data, self.key_tokens, len(data) // TOKEN_BYTES,
                       entry.entry_id << _POSITION_BITS)
        self._num_live += max(0, len(data) // TOKEN_BYTES - self.key_tokens)

    def removed(self, entry) -> None:
        data = self._sequences.pop(entry.entry_id, None) if entry.namespace == self.namespace else None
        if data is None:
            return
        self._changed(data)
        filed = max(0, len(data) // TOKEN_BYTES - self.key_tokens)
        self._num_live -= filed
        self._num_dead += filed
        if self._num_dead > max(self._num_live, 4096):
            self._compact()

    def _compact(self) -> None:
        live = self._sequences
        kept = {}
        for key, filed in self._positions.items():
            filed = [code for code in filed if code >> _POSITION_BITS in live]
            if filed:
                kept[key] = filed
        self._positions, self._num_dead = kept, 0

    def occurrences(self, key: bytes, limit: int) -> list[tuple[bytes, int]]:
        """Up to ``limit`` (sequence bytes, position) filed under ``key``, newest first."""
        filed = self._positions.get(key)
        if not filed:
            return []
        found, sequences = [], self._sequences
        for code in reversed(filed):
            data = sequences.get(code >> _POSITION_BITS)
            if data is not None:
                found.append((data, code & 0xFFFFFFFF))
                if len(found) == limit:
                    break
        return found


class LookupAnswers:
    """Store-drafter lookups' answers over a ``SequenceIndex``, by the lookup's key (its
    last ``key_tokens`` tokens), then by the looked-up tokens' int64 bytes: a proposal is a
    function of those and of the positions filed under the key. The answers are shared:
    read-only. Once ``MAX_TOKEN_BYTES`` of looked-up tokens have been put, it starts again
    empty."""

    MAX_TOKEN_BYTES = 16 * 2**20

    __slots__ = ("by_key", "token_bytes")

    def __init__(self):
        self.by_key: dict[bytes, dict[bytes, tuple[list[int], int]]] = {}
        self.token_bytes = 0

    def get(self, key: bytes, tokens: bytes) -> tuple[list[int], int] | None:
        under = self.by_key.get(key)
        return under.get(tokens) if under is not None else None

    def put(self, key: bytes, tokens: bytes, answer: tuple[list[int], int]) -> None:
        if self.token_bytes + len(tokens) > self.MAX_TOKEN_BYTES:
            self.by_key.clear()
            self.token_bytes = 0
        under = self.by_key.get(key)
        if under is None:
            under = self.by_key[key] = {}
        under[tokens] = answer
        self.token_bytes += len(tokens)

    def drop(self, keys: set[bytes]) -> None:
        """The answers under ``keys``, dropped (from the smaller side)."""
        by_key = self.by_key
        if len(by_key) < len(keys):
            for key in [key for key in by_key if key in keys]:
                del by_key[key]
        else:
            for key in keys:
                by_key.pop(key, None)


def file_positions(table: dict[bytes, list[int]], data: bytes | bytearray, key_tokens: int, stop: int,
                   code: int = 0) -> None:
    """File the positions before ``stop`` of the int64 bytes ``data`` (each with a token
    after it: ``stop`` at most its length) under the ``key_tokens`` tokens before each, as
    ``code | position``, in position order."""
    w = TOKEN_BYTES
    for p in range(key_tokens, stop):
        key = bytes(data[(p - key_tokens) * w:p * w])
        filed = table.get(key)
        if filed is None:
            table[key] = [code | p]
        else:
            filed.append(code | p)
