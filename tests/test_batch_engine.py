"""Batch invariance: under continuous batching every request's output ids equal its own
batch-1 greedy output, whatever runs beside it, in whatever order requests arrive, under
every policy, with chunked prefill, store hits and preemptions."""
from __future__ import annotations

import random

import pytest

from conftest import ALL_POLICIES, NEEDS_KERNELS, SMOLLM2_MAX_CONTEXT, policy_for
from rakv.batch_engine import BatchEngine
from rakv.controller import make_policy
from rakv.engine import Engine, RequestError
from rakv.kv_store import KVStore
from rakv.models import load_pair
from rakv.scheduler import PREFILL, BatchConfig, Scheduler, Seq
from rakv.store_model import StoreConfig
from rakv.weights import INT4, INT8

TEXTS = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
         "The cache keeps keys and values for every position, so",
         "User: what is a prefix store?\nAssistant:",
         "import os\nimport sys\n\n",
         "Once upon a time")


def prompts_of(pair, num: int, rng: random.Random) -> list[list[int]]:
    """Prompts that share prefixes (store hits), repeat exactly, and vary in length."""
    prompts = []
    for i in range(num):
        text = rng.choice(TEXTS)
        if i % 3 == 1:
            text += f" case {i}" * rng.randint(1, 6)  # a longer prompt: several prefill chunks
        prompts.append(pair.encode(text))
    prompts.append(list(prompts[0]))  # an exact repeat
    return prompts


def reference(pair, prompts: list[list[int]], max_new: int) -> list[tuple[int, ...]]:
    """Each prompt's batch-1 greedy output (plain decoding, nothing stored)."""
    return [Engine(pair, make_policy("ar")).generate(p, max_new).output_ids for p in prompts]


def run_schedule(engine: BatchEngine, prompts, policies, max_new: int, rng: random.Random) -> dict:
    """Requests arrive in a random order, a random number at each step; returns each
    prompt's streamed output (checked against its final result)."""
    order = list(range(len(prompts)))
    rng.shuffle(order)
    by_id, streamed, outputs = {}, {}, {}
    while order or engine.has_work():
        for _ in range(rng.randint(0, 3) if engine.has_work() else 1):
            if order:
                i = order.pop()
                by_id[engine.submit(prompts[i], max_new, policy=policies[i])] = i
        for event in engine.step():
            i = by_id[event.request_id]
            streamed.setdefault(i, []).extend(event.token_ids)
            if event.finished:
                assert i not in outputs  # never duplicated
                outputs[i] = event.result.output_ids
                assert tuple(streamed[i]) == event.result.output_ids
    assert sorted(outputs) == list(range(len(prompts)))  # never lost
    return outputs


def bytes_per_position(pair) -> int:
    from rakv.kv_store import measure_sizes
    return sum(measure_sizes(m).kv_bytes_per_token for m in (pair.target, pair.draft) if m is not None)


def check_schedules(pair, prompts, policy_names, max_new: int, configs, seeds) -> int:
    """Every (config, seed) schedule's outputs equal the batch-1 ones; returns the number of
    preemptions seen."""
    want = reference(pair, prompts, max_new)
    policies = {name: policy_for(name, pair) for name in set(policy_names)}
    preemptions = 0
    for config in configs:
        for seed in seeds:
            rng = random.Random(seed)
            chosen = [policies[rng.choice(policy_names)] for _ in prompts]  # mixed policies
            engine = BatchEngine(pair, make_policy("ar"), batch=config)
            got = run_schedule(engine, prompts, chosen, max_new, rng)
            mismatches = [i for i, ids in got.items() if ids != want[i]]
            assert not mismatches, f"{config}, seed {seed}: prompts {mismatches} differ from batch 1"
            preemptions += engine.stats().num_preemptions
            assert engine.stats().num_running == engine.stats().num_waiting == 0
    return preemptions


def configs_for(pair, prompts, max_new: int) -> list[BatchConfig]:
    """Concurrency 1 to 8, row budgets that chunk prefills and clip rounds, one prompt
    prefilled a step or as many as fit, and a memory budget small enough to preempt."""
    longest = max(len(p) for p in prompts) + max_new
    tight = int(bytes_per_position(pair) * longest * 1.3)  # one request fits, two at full length do not
    return [BatchConfig(max_num_seqs=1, max_num_batched_tokens=256),
            BatchConfig(max_num_seqs=2, max_num_batched_tokens=8, max_num_prefills=2),
            BatchConfig(max_num_seqs=4, max_num_batched_tokens=16, memory_budget_bytes=tight),
            BatchConfig(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefills=8),
            BatchConfig(max_num_seqs=8, max_num_batched_tokens=5, memory_budget_bytes=tight)]


def test_tiny_outputs_equal_batch_1_under_random_schedules(tiny_pair):
    rng = random.Random(0)
    prompts = prompts_of(tiny_pair, 8, rng)
    configs = configs_for(tiny_pair, prompts, 12)
    check_schedules(tiny_pair, prompts, ALL_POLICIES, 12, configs, seeds=(0, 1))
    # requests that ready the draft model hold the most memory: under the tight budget
    # they preempt one another, whatever the mix above drew (on some orders a repeat hits
    # its prompt, kept when the first one's prefill ended, and none has to: two orders)
    tight = [c for c in configs if c.memory_budget_bytes < BatchConfig().memory_budget_bytes]
    assert check_schedules(tiny_pair, prompts, ("spec-k4", "joint-k8"), 12, tight, seeds=(0, 1)) > 0


@NEEDS_KERNELS
@pytest.mark.parametrize("mode", [INT8, INT4])
def test_tiny_quantized_outputs_equal_batch_1_under_random_schedules(mode):
    pair = load_pair("tiny", dtype="float32", weights_mode=mode)
    rng = random.Random(1)
    prompts = prompts_of(pair, 8, rng)
    check_schedules(pair, prompts, ("ar", "spec-k4", "joint-ngram-k2", "rakv"), 12,
                    configs_for(pair, prompts, 12), seeds=(2,))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param(INT8, marks=NEEDS_KERNELS), pytest.param(INT4, marks=NEEDS_KERNELS),
                                  "fp32"])
def test_smollm2_outputs_equal_batch_1_under_random_schedules(mode, request):
    # fp32: the session's pair (loaded once for the other SmolLM2 tests)
    pair = request.getfixturevalue("smollm2_pair") if mode == "fp32" else \
        load_pair("smollm2", max_context=SMOLLM2_MAX_CONTEXT, weights_mode=mode)
    rng = random.Random(2)
    prompts = prompts_of(pair, 6, rng)
    configs = configs_for(pair, prompts, 12)
    check_schedules(pair, prompts, ("ar", "joint-k4", "ngram-k4", "rakv"), 10, configs[2:3], seeds=(3,))


def test_a_step_never_exceeds_its_row_budget_or_seats(tiny_pair):
    engine = BatchEngine(tiny_pair, make_policy("spec-k8"), batch=BatchConfig(max_num_seqs=3,
                                                                               max_num_batched_tokens=6))
    for text in TEXTS:
        engine.submit(tiny_pair.encode(text), 4)
    while engine.has_work():
        works = engine.scheduler.schedule()
        assert sum(w.rows for w in works) <= 6
        assert len(engine.scheduler.running) <= 3
        engine.run_works(works)


class _PlainSteps:
    def plan_move(self, t, max_k=None, load=None):
        return None, 0


def test_a_step_prefills_at_most_max_num_prefills_requests():
    """One prompt a step by default: a second waits for a step of its own even where rows
    are left, and a running request's next chunk counts as one; with more allowed, the
    rows left go to the next prompt (the engines before the option)."""
    def prefills(max_num_prefills: int) -> list[list[tuple[int, int]]]:
        """(request id, rows) of each step's prefills, three 40-token prompts under a
        30-row budget, until the first two are prefilled (a request decodes once its
        prefill ends)."""
        scheduler = Scheduler(BatchConfig(max_num_batched_tokens=30, max_num_prefills=max_num_prefills),
                              lambda seq: None, lambda seq: None, lambda: 0, lambda: False)
        seqs = [Seq(i, 40, 8, 1, num_tokens=40, prefill_end=40, moves=_PlainSteps()) for i in range(3)]
        for seq in seqs:
            scheduler.add(seq)
        steps = []
        while seqs[1].prefilling:
            works = [work for work in scheduler.schedule() if work.kind == PREFILL]  # and the decoders' rows
            for work in works:
                work.seq.num_computed += work.rows
            steps.append([(work.seq.request_id, work.rows) for work in works])
        return steps
    assert prefills(1) == [[(0, 30)], [(0, 10)], [(1, 29)], [(1, 11)]]  # 29: request 0 decodes beside it
    assert prefills(2) == [[(0, 30)], [(0, 10), (1, 20)], [(1, 20), (2, 9)]]
    with pytest.raises(ValueError, match="max_num_prefills must be at least 1"):
        BatchConfig(max_num_prefills=0)


def test_abort_frees_the_request_and_stores_no_output(tiny_pair):
    engine = BatchEngine(tiny_pair, make_policy("ar"), batch=BatchConfig(max_num_prefills=2))
    kept, dropped_prompt = tiny_pair.encode(TEXTS[0]), tiny_pair.encode(TEXTS[1])
    kept_id = engine.submit(kept, 6)
    dropped = engine.submit(dropped_prompt, 50)
    engine.step()  # both prompts prefilled: each kept as its prefill ended
    engine.abort(dropped)
    finished = []
    while engine.has_work():
        finished += [e.request_id for e in engine.step() if e.finished]
    assert finished == [kept_id]
    assert engine.stats().num_running == 0
    # the kept request's whole sequence, and the dropped one's prompt, nothing of its output
    stored = sorted(len(entry.token_ids) for entry in engine.store.index.entries())
    assert stored == sorted([len(dropped_prompt), len(kept) + 6 - 1])


def test_a_repeat_hits_a_prompt_still_running(tiny_pair):
    """A prompt is kept when its prefill ends: an exact repeat submitted while the first
    still decodes reuses every position and prefills nothing."""
    prompt = tiny_pair.encode(TEXTS[2])
    for early, want in ((True, len(prompt)), (False, 0)):
        store = KVStore(StoreConfig(early_prompts=early))
        engine = BatchEngine(tiny_pair, make_policy("kv-only"), store=store)
        first = engine.submit(prompt, 20)
        engine.step()  # its prefill
        repeat = engine.submit(prompt, 20)
        results = {}
        while engine.has_work():
            results.update((e.request_id, e.result) for e in engine.step() if e.finished)
        assert results[repeat].reused_tokens == want, early
        assert results[repeat].output_ids == results[first].output_ids
        assert results[first].reused_tokens == 0


def test_a_first_token_counts_from_the_end_of_the_step_that_delivers_it(tiny_pair, monkeypatch):
    """An exact repeat's first token is made at its admission, from the stored logits, but
    reaches its client with the step's other tokens: its TTFT counts to after the step's
    forward (as the server's and the simulator's), not to its admission before it."""
    import rakv.batch_engine
    forward_ends = []

    def timed_forward(*args, **kwargs):
        logits = real_forward(*args, **kwargs)
        forward_ends.append(rakv.batch_engine.time.perf_counter())
        return logits
    real_forward = rakv.batch_engine.forward_many
    monkeypatch.setattr(rakv.batch_engine, "forward_many", timed_forward)
    prompt = tiny_pair.encode(TEXTS[2])
    engine = BatchEngine(tiny_pair, make_policy("kv-only"), store=KVStore(StoreConfig(early_prompts=True)))
    first = engine.submit(prompt, 20)
    engine.step()  # its prefill: the prompt is kept
    repeat = engine.submit(prompt, 20)
    engine.step()  # the repeat's admission (its first token) and the first's decode
    assert engine.scheduler.running[-1].request_id == repeat
    assert engine._requests[repeat].first_token_s >= forward_ends[-1]
    results = {}
    while engine.has_work():
        results.update((e.request_id, e.result) for e in engine.step() if e.finished)
    assert results[repeat].reused_tokens == len(prompt) and results[first].reused_tokens == 0


def test_requests_that_can_never_run_are_one_line_errors(tiny_pair):
    engine = BatchEngine(tiny_pair, make_policy("ar"), batch=BatchConfig(memory_budget_bytes=1000))
    with pytest.raises(RequestError, match="over the memory budget"):
        engine.submit(tiny_pair.encode(TEXTS[0]), 8)
    with pytest.raises(RequestError, match="empty prompt"):
        engine.submit([], 8)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        BatchConfig(max_num_seqs=0)
