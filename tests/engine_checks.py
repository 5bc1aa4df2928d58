"""Checks shared by the engine tests of every pair."""
from __future__ import annotations

from conftest import policy_for
from rakv.acceptance import replay_rounds, run_lengths
from rakv.cost_model import K_CHOICES
from rakv.decoding import draft_agreement
from rakv.drafters import NGRAM, ngram_run_lengths
from rakv.engine import Engine, EngineConfig


def run_mix(pair, policy_name, prompts, max_new_tokens, store=None, config=EngineConfig()):
    engine = Engine(pair, policy_for(policy_name, pair), config, store)
    return [engine.generate(p, max_new_tokens) for p in prompts]


def drafter_run_lengths(pair, drafter: str, prompt, output, config=EngineConfig()):
    """(m_t, proposal length at t) from one teacher-forced pass of the drafter."""
    max_k = max(K_CHOICES)
    if drafter == NGRAM:
        return ngram_run_lengths(prompt, output, max_k, config.ngram)
    return run_lengths(draft_agreement(pair.draft, prompt, output), max_k), [max_k] * len(output)


def assert_rounds_replay(pair, prompts, results, max_new_tokens, config=EngineConfig()) -> int:
    """Engine rounds == replay of min(k, m_t) from one teacher-forced drafter pass."""
    checked = 0
    for prompt, result in zip(prompts, results):
        if result.action.k == 0:
            assert result.rounds == ()
            continue
        output = list(result.output_ids)
        lengths, proposed = drafter_run_lengths(pair, result.action.drafter, prompt, output, config)
        max_new = min(max_new_tokens, pair.max_positions - len(prompt))
        expected = replay_rounds(lengths, result.action.k, len(output), max_new)
        assert [(r.start, r.k, r.accepted) for r in result.rounds] == expected
        assert [r.num_proposed for r in result.rounds] == [min(k, proposed[t]) for t, k, _ in expected]
        checked += len(expected)
    return checked
