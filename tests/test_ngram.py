"""The prompt-lookup drafter: exact proposals, identity and exact replay in the engine,
and a pair with no draft model."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import hf_greedy, policy_for
from engine_checks import assert_rounds_replay, run_mix
from rakv.drafters import MAX_EXTENT, NgramConfig, ngram_lookup, ngram_match, ngram_propose, ngram_run_lengths
from rakv.engine import Engine


def test_proposes_what_followed_the_most_recent_occurrence():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_propose(seq, 2) == [7, 8]  # "1 2 3" last seen at 4, followed by 7 8
    assert ngram_propose(seq, 10) == [7, 8, 5, 1, 2, 3]
    assert ngram_propose([4, 5, 6], 3) == []  # nothing repeats
    assert ngram_propose([5, 1, 9, 1], 2) == [9, 1]  # falls back to the 1-gram "1"
    assert ngram_propose([5, 1, 9, 1], 2, NgramConfig(max_ngram=3, min_ngram=2)) == []
    assert ngram_propose([7], 4) == []


def test_longer_ngram_wins_over_a_more_recent_shorter_one():
    seq = [1, 2, 3, 4, 0, 3, 5, 1, 2, 3]
    assert ngram_propose(seq, 1) == [4]  # "1 2 3" at 0, not "3" at 5


def test_run_lengths():
    prompt = [1, 2, 3, 4, 1, 2]
    output = [3, 4, 9]  # "1 2" -> "3 4 1 2": m_0 = 2 (3, 4 match, then 1 != 9)
    lengths = ngram_run_lengths(prompt, output, max_k=8)
    assert (lengths.runs[0], lengths.proposed[0], lengths.signals[0]) == (2, 4, 2)  # matched the 2-gram "1 2"
    assert (lengths.runs[2], lengths.signals[2]) == (0, 3)  # "2 3 4" -> "1 2 ...", but 9 follows
    assert ngram_match([5, 6, 7], 4) == ([], 0)


def test_a_match_extended_backwards():
    # "... 1 2 3 4" occurred before as "9 1 2 3 4 5": the 3-gram match extends over 4 tokens
    assert ngram_lookup([9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4], 2) == ([5, 7], 3, 4)
    assert ngram_lookup([8, 2, 3, 4, 5, 7, 1, 2, 3, 4], 2)[1:] == (3, 3)  # it stops where they differ
    assert ngram_lookup([1, 2, 3], 2) == ([], 0, 0)  # no match
    repeated = [5] * 200  # a long copy is counted up to MAX_EXTENT
    assert ngram_lookup(repeated, 1)[2] == MAX_EXTENT
    lengths = ngram_run_lengths([9, 1, 2, 3, 4, 5], [7, 1, 2, 3, 4], 4)
    assert lengths.extents == [ngram_lookup([9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4][:6 + t], 4)[2] for t in range(5)]


def test_config_is_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramConfig(max_ngram=1, min_ngram=2)


def test_ngram_with_no_draft_model(tiny_pair):
    pair = dataclasses.replace(tiny_pair, draft=None, draft_fingerprint=None)
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
    prompts = [pair.encode(text), pair.encode(text + "x, y):")]
    for policy_name in ("ngram-k4", "joint-ngram-k8", "rakv"):
        results, planners = run_mix(pair, policy_name, prompts, 24)
        for prompt, result in zip(prompts, results):
            assert list(result.output_ids) == hf_greedy(pair, prompt, 24)
        assert_rounds_replay(pair, prompts, results, planners, 24)
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(pair, policy_for("spec-k4", pair)).generate(prompts[0], 4)
