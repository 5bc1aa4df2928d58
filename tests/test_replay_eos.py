"""A recorded workload replays exactly across requests when outputs end on an EOS that a
drafter proposed: SmolLM2 (fp32) asked to repeat a sentence it said before copies it and
ends with EOS, so prompt lookup proposes the EOS, and a draft model that agrees with the
target (its own full depth) accepts it. Timings that make the draft cheap keep the
adaptive policy drafting with it while it shadows prompt lookup: the case where the
shadow's count of checked tokens used to disagree with the engine's."""
from __future__ import annotations

import dataclasses
import json

import pytest

import rakv.calibrate
import rakv.models
from conftest import SMOLLM2_MAX_CONTEXT
from profiler.record import main
from profiler.schema import table_to_rows
from profiler.trace_io import read_table
from rakv.cost_model import ModelTimings, PairTimings
from rakv.drafters import DRAFT_MODEL, NGRAM
from simulator.session import replay_runs, run_mismatch
from simulator.trace import load_trace

pytestmark = pytest.mark.slow

SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Caching keys and values saves time.",
             "Paris is the capital of France.")  # the first two share a conversation: a store hit
CHEAP_DRAFT = PairTimings(
    target=ModelTimings(0.02, 0.001, 0.0, 0.04, 0.0, 0.004, 46080, 0.03),
    draft=ModelTimings(0.005, 0.0002, 0.0, 0.004, 0.0, 0.001, 46080),
    clone_s_per_byte=1e-10, lookup_s=2e-5, acceptance_prior=0.9, ngram_lookup_s=5e-5, ngram_acceptance_prior=0.3)


# every kind of policy, at the shortest and the longest k (the tiny pair runs every policy
# name, ``test_engine_identity``): a copy's whole output, EOS included, is one long run
RUN_POLICIES = ("ar", "kv-only", "spec-k1", "spec-k8", "joint-k8", "ngram-k1", "ngram-k8", "joint-ngram-k8", "rakv")


def copy_prompt(sentence: str) -> str:
    return (f"<|im_start|>user\nRepeat exactly: {sentence}<|im_end|>\n<|im_start|>assistant\n{sentence}<|im_end|>\n"
            "<|im_start|>user\nRepeat it once more, exactly.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    load_pair = rakv.models.load_pair

    def full_depth_draft(spec, dtype=None, max_context=None, draft_layers=4, linear_kernels="auto", weights_mode="fp32"):
        pair = load_pair("smollm2", dtype, SMOLLM2_MAX_CONTEXT, linear_kernels=linear_kernels, weights_mode=weights_mode)
        draft = rakv.models.layer_prefix_draft(pair.target, pair.target.config.num_hidden_layers)
        return dataclasses.replace(pair, draft=draft,
                                   draft_fingerprint=rakv.models.model_fingerprint(draft, "smollm2-full-depth"))

    directory = tmp_path_factory.mktemp("eos")
    prompts = directory / "copy.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": copy_prompt(s), "group": f"copy-{i // 2}"}) + "\n"
                               for i, s in enumerate(SENTENCES)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rakv.models, "load_pair", full_depth_draft)
        patch.setattr(rakv.calibrate, "load_or_calibrate", lambda pair, refresh=False: CHEAP_DRAFT)
        out = directory / "trace"
        # fp32: the mode this case was found in (auto's pick depends on the machine)
        assert main(["--pair", "smollm2", "--weights", "fp32", "--workload", str(prompts), "--max-new-tokens", "16",
                     "--runs-sample", "3", "--runs-policies", ",".join(RUN_POLICIES),
                     "--runs-max-new-tokens", "16", "--runs-max-wait-s", "0", "--skip", "ops", "--out", str(out)]) == 0
    return out


def test_outputs_end_on_eos_inside_proposals(trace):
    loaded = load_trace(trace)
    for request in loaded.requests:
        n = len(request.output_ids)
        assert request.output_ids[-1] == 2 and n < 16  # EOS, before the cap
        for drafter in (NGRAM, DRAFT_MODEL):  # both propose the whole copy, EOS included, from t = 0
            assert request.lengths[drafter].runs[0] == n
    rakv_rounds = [(run, r) for run in loaded.runs if run.policy == "rakv"
                   for r in zip(run.start_per_round, run.drafter_per_round, run.accepted_per_round)]
    # draft rounds that ended on the EOS while prompt lookup was shadowed
    assert any(drafter == DRAFT_MODEL and start + accepted == run.num_output_tokens
               for run, (start, drafter, accepted) in rakv_rounds)


def test_whole_workload_replays_for_every_kind_of_policy(trace):
    loaded = load_trace(trace)
    policies = sorted({r.policy for r in loaded.runs})
    assert policies == sorted(RUN_POLICIES)
    for policy in policies:
        pairs = replay_runs(loaded, policy)
        assert len(pairs) == 3 and [run_mismatch(run, replayed) for run, replayed in pairs] == [None] * 3
    decisions = {d.request_id: d for d in table_to_rows("decisions", read_table(trace, "decisions"))}
    for run, replayed in replay_runs(loaded, "rakv"):  # the policy's state carried from request to request
        d = decisions[run.request_id]
        estimates = dict(replayed.estimates)
        assert (estimates[DRAFT_MODEL], estimates[NGRAM]) == (d.acceptance_draft, d.acceptance_ngram)
