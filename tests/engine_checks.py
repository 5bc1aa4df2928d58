"""Checks shared by the engine tests of every pair."""
from __future__ import annotations

from conftest import policy_for
from rakv.acceptance import replay_rounds, run_lengths
from rakv.cost_model import K_CHOICES
from rakv.decoding import draft_agreement
from rakv.engine import Engine, EngineConfig


def run_mix(pair, policy_name, prompts, max_new_tokens, store=None, config=EngineConfig()):
    engine = Engine(pair, policy_for(policy_name, pair), config, store)
    return [engine.generate(p, max_new_tokens) for p in prompts]


def assert_rounds_replay(pair, prompts, results, max_new_tokens) -> int:
    """Engine rounds == replay of min(k, m_t) from one teacher-forced draft pass."""
    checked = 0
    for prompt, result in zip(prompts, results):
        if result.action.k == 0:
            assert result.rounds == ()
            continue
        output = list(result.output_ids)
        lengths = run_lengths(draft_agreement(pair.draft, prompt, output), max(K_CHOICES))
        max_new = min(max_new_tokens, pair.max_positions - len(prompt))
        expected = replay_rounds(lengths, result.action.k, len(output), max_new)
        assert [(r.start, r.k, r.accepted) for r in result.rounds] == expected
        checked += len(expected)
    return checked
