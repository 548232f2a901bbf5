"""The roofline `agent-mtp measure-machine` prints: a pass's bytes and multiply-adds against the machine's rates."""

from __future__ import annotations

import pytest
import torch

from agent_mtp.engine.fast import FastModel
from agent_mtp.engine.fast.roofline import (
    MachineRates,
    PassShape,
    Roofline,
    measure_passes,
    measure_rates,
)
from tests.unit.test_fast_blockq import _engine

RATES = MachineRates(read_gb_s=20.0, gemm_gmac_s=50.0, threads=2)
SHAPE = PassShape(
    weight_bytes=100_000_000, row_macs=125_000_000, kv_bytes_per_position=40_000, attention_macs_per_position=30_000
)


def test_a_short_pass_is_bound_by_what_it_reads_and_a_long_one_by_what_it_computes() -> None:
    read = (100_000_000 + 300 * 40_000) / 20e9  # 5.6 ms
    assert SHAPE.seconds_at(RATES, 1, 300) == pytest.approx(read)
    assert SHAPE.seconds_at(RATES, 2, 300) == pytest.approx(read)  # 2 x 134M multiply-adds: 5.36 ms < 5.6
    assert SHAPE.seconds_at(RATES, 8, 300) == pytest.approx(8 * (125_000_000 + 300 * 30_000) / 50e9)
    roofline = Roofline(RATES, SHAPE, context=300, measured=())
    assert roofline.ratio_at_rates(1) == 1.0
    assert roofline.ratio_at_rates(16) == pytest.approx(2 * roofline.ratio_at_rates(8))
    # a longer context reads more cache: the one-row pass takes longer, the ratio falls
    assert roofline.ratio_at_rates(8) > Roofline(RATES, SHAPE, context=3000, measured=()).ratio_at_rates(8)
    with pytest.raises(ValueError, match="rows=0"):
        SHAPE.seconds_at(RATES, 0, 300)


@pytest.fixture(scope="module")
def fast() -> FastModel:
    engine = _engine("plain-llama", adapter=True)
    engine.prepare_runtime()
    return engine._fast_model()


def test_the_pass_shape_counts_the_models_own_weights_and_cache(fast: FastModel) -> None:
    engine = _engine("plain-llama", adapter=True)
    hf = engine.model
    linears = [m for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    # the adapter's low-rank factors are not the model's rows; the base projections and the output head are
    base = [m for m in linears if m.weight.shape[0] > 8 and m.weight.shape[1] > 8]
    head = hf.get_output_embeddings().weight
    shape = PassShape.of(fast)
    assert shape.row_macs == sum(m.weight.numel() for m in base) + head.numel()
    config = hf.config
    kv_dim = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    assert shape.kv_bytes_per_position == config.num_hidden_layers * 2 * kv_dim * 4
    assert shape.attention_macs_per_position == config.num_hidden_layers * 2 * config.hidden_size
    # the blocks a one-token pass reads are fewer bytes than the float32 weights they were recovered from
    assert 0 < shape.weight_bytes < 4 * shape.row_macs


def test_the_rates_and_the_passes_are_measured_and_the_cache_rolled_back(fast: FastModel) -> None:
    rates = measure_rates(read_mib=8, gemm_size=64, rounds=1)
    assert rates.read_gb_s > 0 and rates.gemm_gmac_s > 0 and rates.threads == torch.get_num_threads()
    measured = measure_passes(fast, context=12, rows=(1, 3), rounds=1)
    assert [n for n, _ in measured] == [1, 3] and all(s > 0 for _, s in measured)
    with pytest.raises(ValueError, match="rows=\\[0\\]"):
        measure_passes(fast, context=12, rows=(0,))
    with pytest.raises(ValueError, match="gemm_size=4"):
        measure_rates(gemm_size=4)
