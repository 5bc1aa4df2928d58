"""The op-timing grid: one row per timed operation, for the cost model and the ops table.

Every point gets warm-up runs, then ``repeats`` timed runs, each its own row. On a GPU an
op is timed with CUDA events and one synchronize per timed op; on the CPU with
perf_counter. A forward after a cached context leaves the context as it found it
(rolled back, as speculation does), so points share one prefilled cache.

``rakv.calibrate`` measures a small grid with these functions and fits the cost model's
``PairTimings`` to the rows; a recording (``profiler.record``) measures a larger grid and
stores the rows as its ops table, whose columns are ``OpRow``'s fields. Imports no torch
at module level.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

OP_KEY_FIELDS = ("model", "op", "num_new_tokens", "num_cached_tokens", "k", "num_bytes", "repeat", "num_requests")


@dataclass(frozen=True)
class OpRow:
    """One timed operation; ``repeat`` is the measurement's index among same-shape repeats,
    so the ``OP_KEY_FIELDS`` identify a row."""
    model: str  # target, draft, store, ngram
    op: str  # prefill, decode, verify, batch, clone, lookup, insert, propose
    num_new_tokens: int  # batch: each request's rows
    num_cached_tokens: int  # batch: each request's context
    k: int
    num_bytes: int
    repeat: int
    seconds: float
    probe_s: float | None = None  # the machine's speed beside it (a recording's ``MachineSpeed``)
    num_requests: int = 1  # batch: the requests whose rows one forward runs (each against its own cache)

    @property
    def key(self) -> tuple:
        """The row's ``OP_KEY_FIELDS``, in order."""
        return tuple(getattr(self, name) for name in OP_KEY_FIELDS)


@dataclass(frozen=True)
class OpGrid:
    prefill_new: tuple[int, ...] = (8, 32, 128)
    prefill_cached: tuple[int, ...] = (0, 256)
    decode_context: tuple[int, ...] = (16, 256)
    # k = 3 as well: a 4-row forward is not the mean of a 3 and a 5-row one where the kernel
    # runs rows in passes (AVX2 int4: 1-4 rows one pass, 5-8 two; Qwen's 4 rows 1.08
    # steps, 3 rows 1.01, 5 rows 1.53), and the cost model interpolates between these
    verify_k: tuple[int, ...] = (1, 2, 3, 4, 8, 16)
    verify_context: tuple[int, ...] = (16,)
    store_tokens: tuple[int, ...] = (128,)
    ngram_history: tuple[int, ...] = (1024,)
    # batched forwards (``decoding.forward_many``, the batching engine's step): this many
    # requests, each with these rows after this context; none in a calibration
    batch_requests: tuple[int, ...] = ()
    batch_rows: tuple[int, ...] = (1,)
    batch_context: tuple[int, ...] = (128,)
    # and one request's prefill chunk of this many rows after each batch context, through
    # the same batched forward (its last row's logits only): what a step's chunk costs
    batch_chunk_rows: tuple[int, ...] = ()
    warmup: int = 1
    repeats: int = 3


CALIBRATION_GRID = OpGrid()
# Prefill is measured densely below 32 new tokens, where prompts after a hit and the
# draft's catch-up on accepted tokens fall: there a forward's cost is a step function of
# the rows (the int8/int4 kernel streams the weights once per tile of 12 rows; oneDNN has
# its own blocks), and a line from 1 to 16 priced SmolLM2 int8's 17-18-token prefill at 14
# ms where it takes 21, and float32's 4-token one at 34 ms where it takes 28. Prompts of
# 80-120 tokens (HumanEval's) fall between 64 and 256, where a line through those two
# priced Qwen's prefill 2-15 % above its runs' (the 256-token forward, 9 MB of MLP
# activations, slowed 15 % in two of five passes while the 64-token one did not): 96 and
# 128 measure them. Between 128 and 256 (ShareGPT's turns, and prompts after a hit) the
# cost per token is not one line either: Qwen's is about 11.4 ms up to 64 tokens and 14.3
# on the way to 256, and the line priced 116-205-token prefills 5-10 % high; 160 and 192.
RECORDING_GRID = OpGrid(prefill_new=(1, 2, 3, 4, 6, 8, 12, 13, 16, 24, 25, 32, 64, 96, 128, 160, 192, 256, 512),
                        prefill_cached=(0, 256, 1024),
                        decode_context=(16, 256, 1024, 2048), verify_k=(1, 2, 3, 4, 6, 8, 12, 16),
                        verify_context=(128, 1024), store_tokens=(128, 1024),
                        ngram_history=(256, 2048), warmup=2, repeats=5)
# A serving recording's grid: a few points of each batch-1 op, and the batched forwards of
# 1-8 requests (a decode row, a verification of k = 1 and of k = 4) at a short and a long
# context, for a step's cost over its rows and its requests' contexts (SERVING.md), and
# one request's chunks of 16-256 rows: the batch-1 prefill points, another code path,
# priced SmolLM2's batched steps 20-40 % high.
SERVING_GRID = OpGrid(prefill_new=(1, 4, 16, 64, 128), prefill_cached=(0, 256), decode_context=(16, 256, 1024),
                      verify_k=(1, 2, 4, 8), verify_context=(128,), store_tokens=(128, 1024),
                      ngram_history=(256,), batch_requests=(1, 2, 4, 8), batch_rows=(1, 2, 5),
                      batch_context=(128, 512), batch_chunk_rows=(16, 64, 128, 256), warmup=1, repeats=3)


# A calibration leaves out a point guessed to take longer than this (a prefill of many
# tokens where every forward is slow): the cost model's line through the shorter ones
# prices it, and the calibration stays under a minute (Qwen 1.5B int4 on the AVX2 path: a
# 128-token prefill 3.5-5.6 s).
LONG_POINT_S = 2.0
# Nor does it prefill a context (untimed, before the points after it) that it guesses
# would take longer than this, from the model's first prefill: on the portable kernels
# (0.57 s a Qwen 1.5B token) the 256-token context and the store's 129-token entry were
# most of a 9-minute calibration. Its points are left out (the cost model's lines through
# the shorter contexts price them), and the store's entry is made as long as fits.
LONG_FILL_S = 8.0


class OpTimer:
    """Seconds of one call: CUDA events (one sync per op) on a GPU, perf_counter on a CPU."""

    def __init__(self, device: str = "cpu"):
        self.cuda = device.startswith("cuda")

    def seconds(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        import torch
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


class PointTimer:
    """Times grid points: warm-up runs, then one row per timed repeat (those in ``repeats``:
    all of the grid's by default, or some, for a pass of a recording that spreads them). A
    point whose rows are all in ``done`` (the ops keys of a resumed recording) is not
    measured again; where ``only`` is given, a row whose key it lacks is not measured."""

    def __init__(self, grid: OpGrid, timer: OpTimer, done: frozenset = frozenset(), repeats: range | None = None,
                 before: Callable[[], float | None] = lambda: None, slow_s: float | None = None,
                 only: frozenset | None = None, fill_s_per_token: dict[str, float] | None = None):
        self.grid, self.timer, self.done, self.before, self.only = grid, timer, done, before, only
        self.repeats = range(grid.repeats) if repeats is None else repeats
        self.slow_s = slow_s  # a first warm-up this slow is the point's timing (a calibration's, not a recording's)
        # per model role, its first prefill's seconds per token: the guess of a fill (a
        # calibration's later passes time no first prefill, so they are handed the first's)
        self.fill_s_per_token = {} if fill_s_per_token is None else fill_s_per_token

    def longest_fill(self, role: str) -> float:
        """The longest context this prefills for the role's points: a calibration's guessed
        to fill within LONG_FILL_S once the role's first prefill is timed; a recording's any."""
        per_token_s = self.fill_s_per_token.get(role, 0.0)
        return LONG_FILL_S / per_token_s if self.slow_s is not None and per_token_s > 0 else float("inf")

    def too_long(self, guess_s: float) -> bool:
        """Whether a point guessed to take ``guess_s`` is left out: in a calibration (``slow_s``
        set), past LONG_POINT_S. A recording times every point."""
        return self.slow_s is not None and guess_s > LONG_POINT_S

    def __call__(self, fn: Callable[[], object], **row) -> Iterator[OpRow]:
        keys = [tuple({**row, "repeat": i}[c] for c in OP_KEY_FIELDS) for i in self.repeats]
        if all(key in self.done for key in keys):
            return
        for i, repeat in enumerate(self.repeats):
            if self.only is not None and keys[i] not in self.only:
                continue
            probe_s = self.before()
            warmups = self.grid.warmup if i == 0 else 0  # after the probe: its wait leaves caches cold
            if warmups and self.slow_s is not None:
                # an op of seconds is not slowed by cold caches by much; where each forward
                # is slow (the portable kernels), warming it up would double the wait
                seconds = self.timer.seconds(fn)
                if seconds >= self.slow_s:
                    yield OpRow(repeat=repeat, seconds=seconds, probe_s=probe_s, **row)
                    continue
                warmups -= 1
            for _ in range(warmups):
                fn()
            yield OpRow(repeat=repeat, seconds=self.timer.seconds(fn), probe_s=probe_s, **row)


def _row(model: str, op: str, num_new: int = 0, num_cached: int = 0, k: int = 0, num_bytes: int = 0,
         num_requests: int = 1) -> dict:
    return dict(model=model, op=op, num_new_tokens=num_new, num_cached_tokens=num_cached, k=k, num_bytes=num_bytes,
                num_requests=num_requests)


def measure_model(model, role: str, points: PointTimer, max_positions: int, caches: dict,
                  seed: int = 0) -> Iterator[OpRow]:
    """prefill (n new after c cached), decode (one token after c), verify (k + 1 tokens
    after c), batch (r rows after c for each of b requests, in one batched forward); the
    prefilled contexts kept in ``caches`` (by role and length) for the next pass (a
    forward rolls its context back)."""
    import torch
    from rakv.decoding import crop_to, forward, forward_many
    from rakv.kv_cache import GrowingCache
    from rakv.kv_store import model_sizes

    vocab = model.config.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, size=max_positions).tolist()

    def after(cache, token_ids, num_logits=1):
        length = cache.get_seq_length()
        return lambda: (forward(model, cache, token_ids, num_logits), crop_to(cache, length))

    def cache_of(num_cached: int) -> GrowingCache | None:
        """The prefilled context, or None where a calibration leaves it out (kept so for
        its later passes)."""
        if (role, num_cached) not in caches:
            caches[role, num_cached] = None
            shortest = min(points.grid.decode_context + points.grid.verify_context)  # a step and a verify, always
            if num_cached <= max(points.longest_fill(role), shortest):
                caches[role, num_cached] = GrowingCache()
                if num_cached:
                    forward(model, caches[role, num_cached], tokens[:num_cached])
        return caches[role, num_cached]

    with torch.inference_mode():
        kv_bytes = model_sizes(cache_of(16), None).kv_bytes_per_token
        for c in points.grid.prefill_cached:
            per_token_s = 0.0  # the last prefill's at this context, for a calibration's guess of the next
            for n in points.grid.prefill_new:
                if c + n >= max_positions or points.too_long(per_token_s * n) or cache_of(c) is None:
                    continue
                for row in points(after(cache_of(c), tokens[c:c + n]),
                                  **_row(role, "prefill", n, c, num_bytes=n * kv_bytes)):
                    per_token_s = row.seconds / n
                    points.fill_s_per_token.setdefault(role, per_token_s)
                    yield row
        for c in points.grid.decode_context:
            if c + 1 < max_positions and cache_of(c) is not None:
                yield from points(after(cache_of(c), tokens[c:c + 1]), **_row(role, "decode", 1, c))
        for c in points.grid.verify_context:
            for k in points.grid.verify_k:
                # k + 1 rows cost at most k + 1 prefilled tokens: where that is slow, the
                # cost model's line through the smaller k prices the rest (the least k is
                # always timed: a calibration needs a verify)
                if c + k + 1 < max_positions and cache_of(c) is not None and (
                        k == min(points.grid.verify_k)
                        or not points.too_long(points.fill_s_per_token.get(role, 0.0) * (k + 1))):
                    yield from points(after(cache_of(c), tokens[c:c + k + 1], k + 1),
                                       **_row(role, "verify", k + 1, c, k=k))
        for c in points.grid.batch_context:
            if c == 0 or c + max(points.grid.batch_rows, default=0) >= max_positions:
                continue
            # the requests' own caches, copies of one context (attention runs per request, on its own)
            copies = [GrowingCache([(layer.keys, layer.values) for layer in cache_of(c).layers])
                      for _ in range(max(*points.grid.batch_requests, int(bool(points.grid.batch_chunk_rows)), 0))]
            for b in points.grid.batch_requests:
                own = copies[:b]
                for r in points.grid.batch_rows:
                    def batched(own=own, r=r, c=c):
                        forward_many(model, own, [tokens[c:c + r]] * len(own), [r] * len(own))
                        for cache in own:
                            crop_to(cache, c)
                    yield from points(batched, **_row(role, "batch", r, c, num_requests=b))
            for r in points.grid.batch_chunk_rows:
                if c + r >= max_positions or r in points.grid.batch_rows:
                    continue
                def chunk(own=copies[:1], r=r, c=c):
                    forward_many(model, own, [tokens[c:c + r]], [1])
                    crop_to(own[0], c)
                yield from points(chunk, **_row(role, "batch", r, c, num_requests=1))


def measure_store(model, points: PointTimer, max_positions: int, caches: dict) -> Iterator[OpRow]:
    """The prefix store's clone (a restore of every position of an entry), lookup (one
    model's match of a prompt) and insert (of a working cache's first positions, which
    copies them, as the engine's inserts do), at several entry sizes; each entry's
    source cache kept in ``caches`` for the next pass."""
    import torch
    from rakv.decoding import forward
    from rakv.kv_cache import GrowingCache
    from rakv.kv_store import KVStore
    from rakv.prefix_index import as_token_array

    with torch.inference_mode():
        longest = points.longest_fill("target")
        for num in points.grid.store_tokens:
            if num + 1 > longest:  # as long as a calibration fills (its cost is per byte)
                num = max(int(longest) - 1, 1)
            if num + 1 >= max_positions:
                continue
            tokens = list(range(1, num + 1))
            if ("store", num) not in caches:
                caches["store", num] = GrowingCache()
                forward(model, caches["store", num], tokens + [0])
            source = caches["store", num]
            store = KVStore()
            store.insert("ops", tokens, source, {})
            entry = store.index.entries()[0]
            num_bytes = entry.num_bytes
            yield from points(lambda: store.restore(entry, num), **_row("store", "clone", num, num_bytes=num_bytes))
            query = as_token_array(tokens + [0])
            yield from points(lambda: store.model.match("ops", query), **_row("store", "lookup", num))
            yield from points(lambda: KVStore().insert("ops", tokens, source, {}),
                              **_row("store", "insert", num, num_bytes=num_bytes))


def measure_ngram(points: PointTimer, seed: int = 0) -> Iterator[OpRow]:
    """One prompt-lookup proposal of 8 tokens over a history of n tokens."""
    from rakv.drafters import ngram_propose
    for n in points.grid.ngram_history:
        history = np.random.default_rng(seed).integers(0, 64, size=n).tolist()
        yield from points(lambda: ngram_propose(history, 8), **_row("ngram", "propose", 8, n, k=8))


def measure_pair(pair, grid: OpGrid, device: str = "cpu", done: frozenset = frozenset(),
                 repeats: range | None = None, before: Callable[[], float | None] = lambda: None,
                 slow_s: float | None = None, caches: dict | None = None, only: frozenset | None = None
                 ) -> Iterator[OpRow]:
    """Every op of the grid for the pair's target, its draft (if any), the store and ngram,
    skipping the points whose rows are all in ``done``; only ``repeats`` if given.
    ``before`` goes before each timed op (a recording's ``MachineSpeed.wait``); what it
    returns is the row's ``probe_s``. ``slow_s``, ``only``: see ``PointTimer``. ``caches``: a dict
    the caller keeps across passes, so that each prefilled context is prefilled once (a
    256-token one costs seconds where forwards are slow), and a calibration's later passes
    leave out the contexts its first left out."""
    caches = {} if caches is None else caches
    points = PointTimer(grid, OpTimer(device), done, repeats, before, slow_s, only,
                        fill_s_per_token=caches.setdefault("fill s per token", {}))
    yield from measure_model(pair.target, "target", points, pair.max_positions, caches)
    if pair.draft is not None:
        yield from measure_model(pair.draft, "draft", points, pair.max_positions, caches)
    yield from measure_store(pair.target, points, pair.max_positions, caches)
    yield from measure_ngram(points)
