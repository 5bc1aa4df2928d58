"""What a store-drafter proposal costs against the number of sequences the store holds.

    python -m bench.suffix_cost                      # 100, 1,000 and 10,000 stored requests
    python -m bench.suffix_cost --stored 100,1000 --tokens 128

The store (``rakv.store_model.StoreModel``, no tensors) is filled with requests of
``--tokens`` tokens each, built from a shared pool of phrases (as templated traffic is:
the same n-grams recur across requests, so a lookup has many candidates to weigh). Then
``--queries`` new requests are decoded token by token, a proposal looked up at every
position, as the engine does at every round's planning. Prints per stored count: the
median and p90 microseconds of a proposal, the share that proposed something, and the
microseconds per stored request of filing it, and the index's own memory per stored position
(traced as it is filed anew; the store's budget counts the tokens, not this). One
process, one thread, nothing else timed.
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

import numpy as np

from profiler.arrivals import seed_type
from rakv.sequence_index import SequenceIndex
from rakv.store_model import ModelSizes, StoreConfig, StoreModel
from rakv.suffix_drafter import SuffixConfig, SuffixDrafter

NAMESPACE = "bench"
VOCAB = 32_000


def phrase_pool(rng: np.random.Generator, num_phrases: int) -> list[list[int]]:
    return [rng.integers(0, VOCAB, int(rng.integers(4, 33))).tolist() for _ in range(num_phrases)]


def request_tokens(rng: np.random.Generator, pool: list[list[int]], num_tokens: int) -> list[int]:
    """Phrases from the pool, with a fresh token between them, cut to ``num_tokens``."""
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        tokens += pool[int(rng.integers(len(pool)))] + [int(rng.integers(VOCAB))]
    return tokens[:num_tokens]


def measure(num_stored: int, num_tokens: int, num_queries: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pool = phrase_pool(rng, 2000)
    store = StoreModel(StoreConfig(budget_bytes=2**62))
    sizes = ModelSizes(kv_bytes_per_token=1, logits_bytes=1)
    index = store.sequences(NAMESPACE, SuffixConfig().key_tokens)  # filed as each request is inserted
    start = time.perf_counter()
    for _ in range(num_stored):
        store.commit(store.plan_insert(NAMESPACE, request_tokens(rng, pool, num_tokens), (), sizes))
    fill_s = time.perf_counter() - start
    times_us, proposed = [], 0
    for _ in range(num_queries):
        tokens = request_tokens(rng, pool, num_tokens)
        drafter = SuffixDrafter(index)
        for length in range(1, len(tokens)):
            start = time.perf_counter()
            proposal, _ = drafter.lookup(tokens, length)
            times_us.append((time.perf_counter() - start) * 1e6)
            proposed += bool(proposal)
    times = np.asarray(times_us)
    tracemalloc.start()  # the index's own memory: the same index filed anew, allocations traced
    filed = SequenceIndex.holding(NAMESPACE, SuffixConfig().key_tokens, store.index.entries())
    index_bytes = tracemalloc.get_traced_memory()[0]  # held now, by ``filed``
    del filed
    tracemalloc.stop()
    return {"stored": num_stored, "bytes_per_position": index_bytes / (num_stored * num_tokens),
            "median_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90)),
            "proposed_share": proposed / len(times), "file_us_per_request": fill_s / num_stored * 1e6,
            "num_lookups": len(times)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.suffix_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--stored", default="100,1000,10000", help="stored request counts (default: 100,1000,10000)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request (default: 256)")
    p.add_argument("--queries", type=int, default=20, help="requests decoded against each store (default: 20)")
    p.add_argument("--seed", type=seed_type, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        counts = [int(c) for c in args.stored.split(",")]
        if min(counts) < 1 or args.tokens < 8 or args.queries < 1:
            raise ValueError
    except ValueError:
        print("error: --stored takes positive counts (100,1000), --tokens at least 8, --queries at least 1",
              file=sys.stderr)
        return 2
    print(f"{'stored':>8} {'median us':>10} {'p90 us':>8} {'proposed':>9} {'filing us/request':>18} "
          f"{'index bytes/position':>21}")
    for count in counts:
        row = measure(count, args.tokens, args.queries, args.seed)
        print(f"{row['stored']:>8} {row['median_us']:>10.1f} {row['p90_us']:>8.1f} {row['proposed_share']:>9.2f} "
              f"{row['file_us_per_request']:>18.0f} {row['bytes_per_position']:>21.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
