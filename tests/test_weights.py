"""Weights modes (rakv.weights): int8 and int4 rows that never mix for every Linear kind
of both real pairs and the tiny one, attention rows that never mix (rakv.row_attention),
an engine whose outputs equal HF greedy on the quantized model under every policy, and a
mode that is part of the model's identity."""
from __future__ import annotations

import pytest
import torch

from conftest import ALL_POLICIES, NEEDS_KERNELS, SMOLLM2_MAX_CONTEXT, hf_greedy, kernel_paths, policy_for
from engine_checks import assert_rounds_replay, run_mix
from rakv.calibrate import calibration_path
from rakv.decoding import forward
from rakv.engine import Engine
from rakv.models import PairError, load_pair
from rakv.int4 import Int4Forward, quantize_groups
from rakv.weights import FP32, INT4, INT4_PURE, INT8, Int8Forward


MAX_ROWS = 32
TINY_LINEAR_KINDS = {(64, 64, False), (64, 32, False), (64, 128, False), (128, 64, False), (64, 258, False)}
TEXTS = ("def add(a, b):\n    return", "The cache keeps keys and values", "def add(a, b):\n    return a")


def linear_kinds(*shapes: str) -> set[tuple[int, int, bool]]:
    """(in, out, bias) of every Linear of these embedded model shapes, built on the meta device."""
    from transformers import AutoModelForCausalLM
    from rakv.shapes import shape_config
    kinds = set()
    for shape in shapes:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape_config(shape))
        kinds |= {(m.in_features, m.out_features, m.bias is not None)
                  for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return kinds


@pytest.fixture(scope="module")
def int8_tiny():
    return load_pair("tiny", dtype="float32", weights_mode=INT8)  # float32: CPU attention is slow in float64


@pytest.fixture(scope="module")
def int4_tiny():
    return load_pair("tiny", dtype="float32", weights_mode=INT4)


QUANTIZED = {INT8: Int8Forward, INT4: lambda linear: Int4Forward(linear, quantize_groups(linear.weight))}


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=NEEDS_KERNELS) for mode in (INT8, INT4)])
@pytest.mark.parametrize("kind", sorted(linear_kinds("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
                                        | TINY_LINEAR_KINDS))
def test_quantized_rows_are_bit_identical_for_1_to_32_rows(kind, mode):
    """Every Linear kind of SmolLM2, both Qwen models and the tiny pair: a row's result is
    the same bits whether it runs alone or with up to 31 others (padding included)."""
    in_features, out_features, bias = kind
    torch.manual_seed(in_features * 7 + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        torch.nn.init.normal_(linear.bias)
    layer = QUANTIZED[mode](linear)
    x = torch.randn(MAX_ROWS, in_features) * torch.linspace(0.1, 10.0, MAX_ROWS)[:, None]  # rows of other scales
    with torch.no_grad():
        full = layer(x)
        error = 0.05 if mode == INT8 else 0.2  # 4 bits: tests/test_int4.py checks the kernel's own arithmetic
        torch.testing.assert_close(full, linear(x), rtol=error, atol=error * float(linear(x).abs().max()))
        # a vocabulary head (up to 233 M weights) checks the row counts where kernels switch
        counts = range(1, MAX_ROWS) if in_features * out_features < 50_000_000 else (1, 2, 3, 4, 5, 8, 9, 16, 17, 31)
        for rows in counts:
            assert torch.equal(layer(x[:rows]), full[:rows]), f"{rows} rows"
            assert torch.equal(layer(x[rows:rows + 1])[0], full[rows]), f"row {rows} alone"
        assert layer(x.view(2, MAX_ROWS // 2, in_features)).shape == (2, MAX_ROWS // 2, out_features)


def int8_reference(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel computes, bit for bit, in torch: exact integer sums (float64
    holds them: under 2^53), then ((float)sum * w_scale) * x_scale + bias in float32."""
    weight = linear.weight.detach()
    w_scale = weight.abs().amax(dim=1).clamp_min(1e-30) / 127  # [out]
    wq = torch.round(weight / w_scale[:, None]).clamp(-127, 127)  # [out, in]
    x_scale = x.abs().amax(dim=1).clamp_min(1e-30) / 127  # [rows]
    xq = torch.round(x / x_scale[:, None]).clamp(-127, 127)  # [rows, in]: half to even, as nearbyintf
    out = (xq.double() @ wq.double().T).float() * w_scale * x_scale[:, None]
    return out if linear.bias is None else out + linear.bias.detach()


@NEEDS_KERNELS
@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("kind", [(896, 4864, False), (1536, 256, True), (64, 258, False), (8960, 1536, False),
                                  (20, 48, True)])
def test_int8_gives_the_same_bits_on_every_kernel_path(kind, path):
    """Each path the CPU runs (portable, AVX2, 256-bit VNNI, AVX-512 VNNI, AMX: forced one
    by one) gives the arithmetic int8 is defined as, bit for bit, at every row count
    where tiles switch. Inputs include ties (x / scale at .5), an all-zero row, and (20
    inputs) a width the kernel pads to fours."""
    in_features, out_features, bias = kind
    torch.manual_seed(in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = Int8Forward(linear)
    layer.path = path
    x = torch.randn(MAX_ROWS, in_features) * torch.linspace(0.1, 10.0, MAX_ROWS)[:, None]
    x[1] = 0.0
    x[2, :3] = torch.tensor([127.0, 0.5, -1.5])  # scale 1: 0.5 and -1.5 are ties, to even
    with torch.no_grad():
        expected = int8_reference(linear, x)
        for rows in (1, 2, 3, 5, 6, 7, 9, 12, 16, 17, MAX_ROWS):
            assert torch.equal(layer(x[:rows]), expected[:rows]), rows
        assert layer(x[:0]).shape == (0, out_features)  # no rows: an empty result, not a MemoryError


@NEEDS_KERNELS
def test_auto_takes_the_fastest_mode_measured_here_once(monkeypatch, tmp_path, capsys):
    """auto on a quantized checkpoint: each candidate mode's Linear layers timed on this
    CPU, the cheapest taken, the figures cached (a second choice measures nothing); a float
    checkpoint stays fp32 unmeasured; int4 only where the file holds 4-bit tensors."""
    from rakv import auto_weights
    from rakv.auto_weights import choose_weights
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    model = load_pair("tiny", dtype="float32").target
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    stored = {name: quantize_groups(model.get_submodule(name).weight) for name in linears[:3]}
    stored |= {name: "Q6_K" for name in linears[3:5]}  # 5-8 bit tensors: int8 in int4 mode
    kinds = auto_weights.layer_kinds([model], [stored], INT4)
    assert {how for _, _, how in kinds} == {"int4:float", INT8}
    assert sum(count for _, count in kinds.values()) == len(linears)
    assert auto_weights.candidates(four_bit=True, quantized=True) == (INT4, INT8, FP32)
    assert auto_weights.candidates(four_bit=False, quantized=True) == (INT8, FP32)
    measured = []
    real_cost = auto_weights.mode_cost
    monkeypatch.setattr(auto_weights, "mode_cost", lambda *a: measured.append(a[2]) or real_cost(*a))
    chosen = choose_weights("auto", [stored], [model], key="tiny")
    costs = {mode: real_cost([model], [stored], mode) for mode in (INT4, INT8, FP32)}
    assert sorted(measured) == sorted((INT4, INT8, FP32)) and chosen in costs
    assert f"weights auto: {chosen} (Linear layers of a step and a 5-token forward" in capsys.readouterr().err
    assert choose_weights("auto", [stored], [model], key="tiny") == chosen and len(measured) == 3  # cached
    assert choose_weights("auto", [{}], [model], key="tiny") == FP32 and len(measured) == 3  # a float checkpoint


@NEEDS_KERNELS
def test_each_mode_is_another_model(int8_tiny, int4_tiny):
    fp32 = load_pair("tiny", dtype="float32")
    assert (fp32.weights, int8_tiny.weights, int4_tiny.weights) == (FP32, INT8, INT4)
    for quantized in (int8_tiny, int4_tiny):
        assert quantized.target_fingerprint != fp32.target_fingerprint
        assert quantized.draft_fingerprint != fp32.draft_fingerprint
        assert calibration_path(quantized) != calibration_path(fp32)
    assert int4_tiny.target_fingerprint != int8_tiny.target_fingerprint
    assert load_pair("tiny", weights_mode="auto").weights == FP32  # not a quantized checkpoint
    assert {(m.in_features, m.out_features, m.bias is not None) for model in (fp32.target, fp32.draft)
            for m in model.modules() if isinstance(m, torch.nn.Linear)} == TINY_LINEAR_KINDS
    for quantized, kind in ((int8_tiny, Int8Forward), (int4_tiny, Int4Forward)):
        linears = [m for m in quantized.target.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(m.weight is None and isinstance(m._rakv_quantized, kind)  # no float32 copy
                               for m in linears)


def test_modes_that_cannot_run_are_one_line_errors():
    with pytest.raises(PairError, match="--weights int8 needs float32 or float64 models"):
        load_pair("tiny", dtype="float16", weights_mode=INT8)
    with pytest.raises(PairError, match="--linear-kernels stock is for fp32 weights"):
        load_pair("tiny", dtype="float32", weights_mode=INT8, linear_kernels="stock")
    with pytest.raises(PairError, match="--weights int4 needs float32 or float64 models"):
        load_pair("tiny", dtype="float16", weights_mode=INT4)
    with pytest.raises(PairError, match="--weights must be MODE or TARGET/DRAFT, each one of auto, fp32, int8, int4"):
        load_pair("tiny", weights_mode="int3")
    with pytest.raises(PairError, match="--weights must be MODE or TARGET/DRAFT"):
        load_pair("tiny", weights_mode="int8/int3")


@NEEDS_KERNELS
def test_a_draft_runs_in_a_mode_of_its_own(int8_tiny, int4_tiny):
    """TARGET/DRAFT: each model is the one its own mode makes, and the output is the target's."""
    pair = load_pair("tiny", dtype="float32", weights_mode="int8/int4")
    assert pair.weights == "int8/int4"
    assert pair.target_fingerprint == int8_tiny.target_fingerprint
    assert pair.draft_fingerprint == int4_tiny.draft_fingerprint
    assert load_pair("tiny", dtype="float32", weights_mode="int8/int8").weights == INT8
    for name in ("spec-k4", "rakv"):
        engine = Engine(pair, policy_for(name, pair))
        for text in TEXTS:
            assert list(engine.generate(pair.encode(text), 24).output_ids) == hf_greedy(int8_tiny, pair.encode(text), 24)


@NEEDS_KERNELS
def test_int4_pure_runs_every_layer_in_4_bit_groups(int4_tiny):
    """On a float checkpoint int4 and int4-pure are one model; on SmolLM2's GGUF, whose tied
    head is stored as Q8_0 (int8 under int4), int4-pure is another. A layer-prefix draft
    runs the target's layers, so it cannot take a mode of its own."""
    assert load_pair("tiny", dtype="float32", weights_mode=INT4_PURE).target_fingerprint == \
        int4_tiny.target_fingerprint
    pure = load_pair("smollm2", max_context=SMOLLM2_MAX_CONTEXT, weights_mode=INT4_PURE)
    linears = [m for m in pure.target.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m._rakv_quantized, Int4Forward) for m in linears)
    text = "def add(a, b):\n"
    engine = Engine(pure, policy_for("rakv", pure))
    assert list(engine.generate(pure.encode(text), 12).output_ids) == hf_greedy(pure, pure.encode(text), 12)
    with pytest.raises(PairError, match="this draft runs the target's own layers"):
        load_pair("smollm2", max_context=SMOLLM2_MAX_CONTEXT, weights_mode="int8/int4")


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=NEEDS_KERNELS) for mode in (INT8, INT4)])
def test_quantized_engine_matches_hf_greedy_under_every_policy(mode, request):
    pair = request.getfixturevalue(f"{mode}_tiny")
    oracle = {text: hf_greedy(pair, pair.encode(text), 24) for text in TEXTS}
    for name in ALL_POLICIES:
        engine = Engine(pair, policy_for(name, pair))
        for text in TEXTS:
            assert list(engine.generate(pair.encode(text), 24).output_ids) == oracle[text], (mode, name, text)


@pytest.fixture(scope="module", params=[INT8, "auto"])
def quantized_smollm2(request):
    """SmolLM2 in int8, and in auto: int4 (its Q4_1 groups as the GGUF stores them) or int8,
    whichever is faster here."""
    return load_pair("smollm2", max_context=SMOLLM2_MAX_CONTEXT, weights_mode=request.param)


@NEEDS_KERNELS
@pytest.mark.slow
def test_smollm2_quantized_forward_rows_never_mix(quantized_smollm2):
    """A verification forward over 6 tokens equals 6 one-token steps, and a prompt prefilled
    in one piece equals it after a stored prefix, bit for bit."""
    from transformers import DynamicCache
    pair = quantized_smollm2
    assert pair.weights in (INT8, INT4)
    ids = pair.encode("The cache keeps keys and values in a specific order, and the store")
    whole = forward(pair.target, DynamicCache(), ids, num_logits=6)
    split_cache, steps_cache = DynamicCache(), DynamicCache()
    forward(pair.target, split_cache, ids[:-6])
    forward(pair.target, steps_cache, ids[:-6])
    assert torch.equal(forward(pair.target, split_cache, ids[-6:], num_logits=6), whole)
    steps = torch.cat([forward(pair.target, steps_cache, [t]) for t in ids[-6:]])
    assert torch.equal(steps, whole)


@NEEDS_KERNELS
@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["spec-k8", "joint-ngram-k8", "rakv"])
def test_smollm2_quantized_matches_hf_greedy_and_rounds_replay(quantized_smollm2, policy_name):
    pair = quantized_smollm2
    prompts = [pair.encode(text) for text in TEXTS]
    results, planners = run_mix(pair, policy_name, prompts, 24)
    for prompt, result in zip(prompts, results):
        assert list(result.output_ids) == hf_greedy(pair, prompt, 24)
    assert_rounds_replay(pair, prompts, results, planners, 24)


def test_a_mistyped_pair_is_a_one_line_error_that_names_the_pairs(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(PairError, match=r"^cannot load .*no-such-model.* \(a pair is one of tiny, smollm2, "
                                        r"qwen-coder, or TARGET\[,DRAFT\]") as raised:
        load_pair(missing)
    assert "\n" not in str(raised.value)
