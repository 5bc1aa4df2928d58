"""oneDNN-packed Linear layers (rakv.cpu_linear): the same results as the stock layers up
to rounding, rows that never mix, a reversible switch, and an engine whose outputs equal
HF greedy on the packed model. The tiny pair in float32 here; the SmolLM2 tests run on
packed layers too, since ``auto`` packs a float32 pair."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, policy_for
from rakv.calibrate import calibration_path
from rakv.cpu_linear import ONEDNN, STOCK, PackedForward, pack_linears, stock_linears
from rakv.engine import Engine
from rakv.models import PairError, layer_prefix_draft, load_pair

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture(scope="module")
def packed_pair():
    return load_pair("tiny", dtype="float32")


def test_auto_packs_float32_and_keeps_identity(packed_pair):
    stock = load_pair("tiny", dtype="float32", linear_kernels="stock")
    assert (packed_pair.linear_kernels, stock.linear_kernels) == (ONEDNN, STOCK)
    assert load_pair("tiny").linear_kernels == STOCK  # float64: oneDNN has no such inner product
    # the same weights: same stored state and learned policies, but their own timings
    assert packed_pair.target_fingerprint == stock.target_fingerprint
    assert calibration_path(packed_pair) != calibration_path(stock)
    with pytest.raises(PairError, match="needs float32 models"):
        load_pair("tiny", linear_kernels="onednn")


def test_packed_rows_equal_stock_up_to_rounding_and_never_mix():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 200)
    packed = PackedForward(linear)
    x = torch.randn(1, 48)
    with torch.no_grad():
        alone = packed(x)  # one row, padded to MIN_ROWS
        torch.testing.assert_close(alone, linear(x), rtol=1e-5, atol=1e-5)
        for rows in (2, 4, 7, 33):
            batch = torch.cat([torch.randn(rows // 2, 48), x, torch.randn(rows - 1 - rows // 2, 48)])
            assert torch.equal(packed(batch)[rows // 2], alone[0])
        assert packed(torch.randn(2, 3, 48)).shape == (2, 3, 200)


def test_stock_linears_switches_back_and_forth(packed_pair):
    sharing = layer_prefix_draft(packed_pair.target, 1)  # a draft whose modules are the target's
    linear = next(m for m in sharing.modules() if isinstance(m, torch.nn.Linear))
    assert "forward" in vars(linear)
    packed = linear._rakv_packed
    with stock_linears(packed_pair.target, sharing):
        assert "forward" not in vars(linear)
        pack_linears(sharing)  # packed already: nothing is packed again
        assert "forward" not in vars(linear)
    assert vars(linear)["forward"] is linear._rakv_packed is packed


@pytest.mark.parametrize("policy_name", ["joint-k4", "rakv"])
def test_engine_on_packed_layers_matches_hf_greedy(packed_pair, policy_name):
    engine = Engine(packed_pair, policy_for(policy_name, packed_pair))
    for text in ("def add(a, b):\n    return", "The cache keeps keys and values", "def add(a, b):\n    return a"):
        prompt = packed_pair.encode(text)
        assert list(engine.generate(prompt, 24).output_ids) == hf_greedy(packed_pair, prompt, 24)
