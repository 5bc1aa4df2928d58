"""SmolLM2-135M (fp32) with its own first layers as draft: every policy matches Hugging
Face greedy generate on the prompt mix, and rounds replay exactly.

A SmolLM2 step costs about 0.1 s on 2 CPU cores, and the self-speculative draft accepts
a few percent of tokens, so the 13 policies x 51 prompts run with 4 new tokens each
(which clips k to 2 at most); a second test runs k = 8 for full rounds on fewer prompts.
"""
from __future__ import annotations

import pytest

from conftest import ALL_POLICIES, SMOLLM2_MAX_CONTEXT, hf_greedy
from prompt_mix import prompt_mix
from rakv.acceptance import replay_rounds, run_lengths
from rakv.decoding import draft_agreement
from engine_checks import assert_rounds_replay, run_mix

pytestmark = pytest.mark.slow

MIX_NEW_TOKENS = 4
LONG_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def mix(smollm2_pair):
    prompts = prompt_mix(smollm2_pair.encode, SMOLLM2_MAX_CONTEXT)
    return prompts, [hf_greedy(smollm2_pair, p, MIX_NEW_TOKENS) for p in prompts]


def test_layer_prefix_draft_shares_the_targets_tensors(smollm2_pair):
    target_ptrs = {p.data_ptr() for p in smollm2_pair.target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in smollm2_pair.draft.parameters())
    assert smollm2_pair.draft.config.num_hidden_layers < smollm2_pair.target.config.num_hidden_layers


def test_every_policy_matches_hf_greedy(smollm2_pair, mix):
    prompts, oracle = mix
    assert len(prompts) >= 50
    for policy_name in ALL_POLICIES:
        results = run_mix(smollm2_pair, policy_name, prompts, MIX_NEW_TOKENS)
        mismatches = [i for i, (r, o) in enumerate(zip(results, oracle)) if list(r.output_ids) != o]
        assert not mismatches, f"{policy_name}: prompts {mismatches} differ from HF greedy"
        if results[0].action.r == 1 and policy_name != "rakv":
            assert {"miss", "partial", "exact"} <= {r.hit_kind for r in results}
        assert_rounds_replay(smollm2_pair, prompts, results, MIX_NEW_TOKENS)


@pytest.mark.parametrize("policy_name", ["spec-k8", "joint-k8"])
def test_full_rounds_replay_exactly(smollm2_pair, mix, policy_name):
    prompts = mix[0][8:14]  # shared system prompt: the joint policy hits
    results = run_mix(smollm2_pair, policy_name, prompts, LONG_NEW_TOKENS)
    for prompt, result in zip(prompts, results):
        assert list(result.output_ids) == hf_greedy(smollm2_pair, prompt, LONG_NEW_TOKENS)
        assert any(r.k == 8 for r in result.rounds)
    assert_rounds_replay(smollm2_pair, prompts, results, LONG_NEW_TOKENS)


def test_report_draft_agreement(smollm2_pair, mix):
    """The self-speculative draft's agreement on the target's greedy output (printed)."""
    prompts = mix[0][:20]
    agree = []
    for prompt in prompts:
        output = hf_greedy(smollm2_pair, prompt, 32)
        agree += draft_agreement(smollm2_pair.draft, prompt, output)
    rate = sum(agree) / len(agree)
    print(f"\nsmollm2 draft ({smollm2_pair.draft.config.num_hidden_layers} layers) agreement: "
          f"{rate:.3f} over {len(agree)} tokens")
    assert 0.0 <= rate < 0.5
    assert replay_rounds(run_lengths(agree[:32], 8), 4, 32, 32)
