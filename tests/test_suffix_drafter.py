"""The store drafter: what it proposes from the store's sequences and the request's own,
that the store's evictions leave its index, and that the engine's store-drafter rounds
give the greedy output and replay exactly."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import hf_greedy, policy_for
from engine_checks import assert_rounds_replay, run_mix
from rakv.controller import ControllerConfig, CostModelPolicy
from rakv.sequence_index import file_positions
from rakv.store_model import ModelSizes, StoreConfig, StoreModel
from rakv.suffix_drafter import SuffixConfig, SuffixDrafter, own_positions, suffix_signal, walk_continuations

NS = "target"
SIZES = ModelSizes(kv_bytes_per_token=8, logits_bytes=8)
BASE = np.random.default_rng(0).integers(100, 1000, 120).tolist()
KEY = SuffixConfig().key_tokens


def store_of(*sequences, budget_bytes: int = 2**30) -> StoreModel:
    store = StoreModel(StoreConfig(budget_bytes=budget_bytes))
    for seq in sequences:
        store.commit(store.plan_insert(NS, seq, (), SIZES))
    return store


def propose(store, tokens, config=SuffixConfig(), max_k=16):
    index = store.sequences(NS, config.key_tokens) if store is not None else None
    return SuffixDrafter(index, config, max_k).lookup(tokens, len(tokens))


def test_the_longest_match_wins_and_its_continuation_is_proposed():
    whole = [1, 2, 3] + BASE
    edited = [9] + BASE[:40] + [7, 7] + BASE[40:]  # matches the query's last 10 tokens only
    store = store_of(whole, edited)
    query = [5, 5] + BASE[:50]
    proposal, signal = propose(store, query)
    assert proposal == BASE[50:66]  # the unedited sequence matches all 50 tokens: its continuation
    assert signal == suffix_signal(50, 1, 1.0) == 4  # one match, 32 tokens or more
    assert propose(store_of(edited), query) == (BASE[50:60], suffix_signal(10, 1, 1.0))  # at most 1 x the match


def test_frequency_picks_the_continuation_and_a_rare_one_stops_the_draft():
    context = BASE[:8]
    store = store_of([1] + context + [11, 12, 13], [2] + context + [11, 12, 14], [3] + context + [21, 22, 23])
    query = [4] + context
    proposal, signal = propose(store, query)
    assert proposal == [11, 12, 14]  # 2 of 3 follow 11, 12; then 14 and 13 tie and the newer wins
    assert signal == suffix_signal(8, 3, 2 / 3) and signal > 8  # several matches that disagree
    assert propose(store, query, SuffixConfig(min_prob=0.5)) == ([11, 12], signal)  # 1 of 3 follow 14
    assert propose(store, query, SuffixConfig(min_prob=0.7)) == ([], 0)  # no first token reaches 0.7
    assert walk_continuations([], 4, 0.1) == ([], 0.0)


def plain_walk(continuations, cap, min_prob):
    """walk_continuations as its docstring says it, a token at a time (the spec its
    common-prefix jumps are held to)."""
    total, alive, draft, first_share = len(continuations), list(continuations), [], 0.0
    for depth in range(cap):
        counts = {}
        for c in alive:
            if len(c) > depth:
                counts[c[depth]] = counts.get(c[depth], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: item[1])  # first seen of equals
        if count < min_prob * total:
            break
        first_share = count / total if depth == 0 else first_share
        draft.append(token)
        alive = [c for c in alive if len(c) > depth and c[depth] == token]
    return draft, first_share


def test_the_walk_is_the_plain_walk_of_its_docstring():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        stem = rng.integers(0, 3, int(rng.integers(0, 6))).tolist()  # shared beginnings, small alphabet: ties
        continuations = [(stem[:int(rng.integers(0, len(stem) + 1))] if rng.random() < 0.7 else [])
                         + rng.integers(0, 3, int(rng.integers(0, 7))).tolist()
                         for _ in range(int(rng.integers(1, 12)))]
        cap, min_prob = int(rng.integers(1, 10)), float(rng.choice([0.0, 0.1, 0.3, 0.5]))
        as_bytes = [np.asarray(c, dtype=np.int64).tobytes() for c in continuations]
        assert walk_continuations(as_bytes, cap, min_prob) == plain_walk(continuations, cap, min_prob), continuations


def test_the_request_itself_is_searched_first_and_never_its_future():
    own = BASE[:30] + [3, 3] + BASE[:10]
    drafter = SuffixDrafter(None)
    assert drafter.lookup(own, len(own))[0] == BASE[10:20]  # prompt lookup's case, found without a store
    assert drafter.lookup(own, 20)[0] == []  # looked up after a longer length: nothing after 20 is known
    assert drafter.lookup(own, len(own))[0] == BASE[10:20]
    fresh = SuffixDrafter(None)
    assert fresh.lookup(own, 20) == ([], 0)


def test_searching_a_request_finds_what_filing_it_would():
    rng = np.random.default_rng(1)
    for _ in range(500):
        # tokens whose int64 bytes repeat inside one another (256 = 0x100, 1, 65536), so a key
        # also matches across token boundaries, which the search must skip
        tokens = rng.choice([1, 256, 65536, 257, 0], int(rng.integers(0, 40))).tolist()
        context = np.asarray(tokens, dtype=np.int64).tobytes()
        n, limit = int(rng.integers(1, 4)), int(rng.integers(1, 50))
        length = int(rng.integers(0, len(tokens) + 1))
        filed: dict[bytes, list[int]] = {}
        file_positions(filed, context, n, length)
        for p in range(n, length + 1):
            key = context[(p - n) * 8:p * 8]
            assert own_positions(context, key, length, limit) == filed.get(key, [])[::-1][:limit]


def test_an_evicted_sequence_leaves_the_index():
    first, second = [1] + BASE[:60], [2] + BASE[60:120]
    entry_bytes = 61 * (8 + SIZES.kv_bytes_per_token)
    store = store_of(first, budget_bytes=entry_bytes + 16)
    index = store.sequences(NS, SuffixConfig().key_tokens)
    assert propose(store, [9] + BASE[:20])[0] == BASE[20:36]
    store.commit(store.plan_insert(NS, second, (), SIZES))  # evicts the first (LRU) to fit
    assert store.num_evictions == 1 and len(index) == 1
    assert propose(store, [9] + BASE[:20]) == ([], 0)
    assert propose(store, [9] + BASE[60:80])[0] == BASE[80:96]


def test_requests_share_an_answer_until_the_store_changes_under_its_key():
    store = store_of([1] + BASE[:30])
    query = [5] + BASE[:20]
    first = propose(store, query)
    assert first == (BASE[20:30], suffix_signal(20, 1, 1.0))
    assert propose(store, query)[0] is first[0]  # another request, the same tokens, the same store: kept
    store.commit(store.plan_insert(NS, [3, 4, 5, 6], (), SIZES))  # files none of the query's key
    assert propose(store, query)[0] is first[0]
    store.commit(store.plan_insert(NS, [2] + BASE[:60], (), SIZES))  # a longer continuation now
    assert propose(store, query) == (BASE[20:36], suffix_signal(20, 2, 1.0))
    assert propose(store, query) == propose(store_of([1] + BASE[:30], [2] + BASE[:60]), query)


def test_an_index_built_late_holds_what_one_kept_all_along_would():
    sequences = [[i] + BASE[i * 7:i * 7 + 50] for i in range(8)]
    early = StoreModel(StoreConfig(budget_bytes=3 * 51 * 16 + 8))  # holds three at a time
    early_index = early.sequences(NS, KEY)
    for seq in sequences:
        early.commit(early.plan_insert(NS, seq, (), SIZES))
    late = store_of(*sequences, budget_bytes=3 * 51 * 16 + 8)
    for start in range(0, 70, 5):
        query = [0] + BASE[start:start + 12]
        assert SuffixDrafter(early_index).lookup(query, len(query)) == propose(late, query)
    assert len(early_index) == len(late.sequences(NS, KEY)) == 3


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="key_tokens"):
        SuffixConfig(key_tokens=0)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixConfig(min_prob=0.0)


def test_engine_drafts_from_an_earlier_request_and_replays_exactly(tiny_pair):
    """A repeat after another request: the prefix store reuses its prompt, and only the
    store drafter knows what followed it, so its rounds accept the whole output (the tiny
    pair's random weights continue a prompt under another first token differently, so
    an exact repeat is its one case); outputs stay greedy."""
    prompt = tiny_pair.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    prompts = [prompt, tiny_pair.encode("# a\n") + prompt, prompt]
    results, planners = run_mix(tiny_pair, "rakv", prompts, 24)
    for p, result in zip(prompts, results):
        assert list(result.output_ids) == hf_greedy(tiny_pair, p, 24)
    later = [r for r in results[2].rounds if r.drafter == "suffix"]
    assert sum(r.accepted for r in later) == 21 and len(later) == 2  # 16, then the 5 left before the cap
    assert assert_rounds_replay(tiny_pair, prompts, results, planners, 24) >= len(later)
    off = CostModelPolicy(policy_for("rakv", tiny_pair).timings, ControllerConfig(store_drafter=False))
    without, _ = run_mix(tiny_pair, off, prompts, 24)
    assert [r.output_ids for r in without] == [r.output_ids for r in results]
    assert not any(r.drafter == "suffix" for result in without for r in result.rounds)


def test_a_recorded_trace_replays_its_store_drafter_rounds(tmp_path):
    """Recorded live, replayed from the trace: the repeat of the fixture's first prompt drafts
    from the store, and every run's rounds replay exactly (the store drafter's run lengths
    are not in the trace; the replay looks them up over its own store model)."""
    from profiler.record import main
    from simulator.session import replay_runs, run_mismatch
    from simulator.trace import load_trace
    out = tmp_path / "tiny-code"
    assert main(["--pair", "tiny", "--workload", "fixture-code", "--max-new-tokens", "16", "--runs-sample", "6",
                 "--runs-max-new-tokens", "16", "--runs-max-wait-s", "0", "--runs-policies", "ar,rakv",
                 "--out", str(out)]) == 0
    trace = load_trace(out)
    pairs = replay_runs(trace, "rakv")
    assert len(pairs) == 6 and [run_mismatch(run, replayed) for run, replayed in pairs] == [None] * 6
    repeat = next(run for run, _ in pairs if run.request_id == 4)
    assert "suffix" in repeat.drafter_per_round and sum(
        a for d, a in zip(repeat.drafter_per_round, repeat.accepted_per_round) if d == "suffix") >= 8
    assert {r.policy for r in trace.runs} == {"ar", "rakv"}
    assert main(["--pair", "tiny", "--workload", "fixture-code", "--runs-policies", "ar,nope",
                 "--out", str(tmp_path / "bad")]) == 2
