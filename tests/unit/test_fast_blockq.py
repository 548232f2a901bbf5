"""Block-weight kernels: GGUF Q4_1/Q8_0 blocks recovered bit for bit from float32 weights, products close to the
float32 GEMM and independent of the rows beside them, and the fast runtime on block weights still exact."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from agent_mtp.engine import DecodeConfig, MTPEngine, new_adapter
from agent_mtp.engine.fast import FastModel, blockq
from agent_mtp.engine.loading import LoadedModel, ensure_mask_token
from agent_mtp.errors import ConfigError
from tests.tiny import tiny_tokenizer
from tests.unit.test_fast_runtime import _family_model, _random_ids

pytestmark = pytest.mark.skipif(not blockq.kernels_available(), reason="block-weight kernels unavailable here")


@pytest.fixture(autouse=True)
def _avx_kernels() -> Any:
    """These tests are of the AVX kernels: AMX tiles and VNNI (where the CPU has them) are off,
    tests/unit/test_fast_tiles.py covers them."""
    with blockq.avx_kernels():
        yield


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """What a GGUF Q4_1 file dequantizes to: per block of 32, d = (max - min) / 15 and m = min in float16,
    q = round((w - m) / d) in 0..15, weight d * q + m in float32."""
    blocks = weight.reshape(weight.shape[0], -1, 32).float()
    low = blocks.amin(-1, keepdim=True).half().float()
    d = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
    q = torch.round((blocks - low) / torch.where(d > 0, d, 1.0)).clamp(0, 15)
    return (q * d + low).reshape(weight.shape)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    blocks = weight.reshape(weight.shape[0], -1, 32).float()
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp(-128, 127)
    return (q * d).reshape(weight.shape)


def _plain_llama(vocab: int) -> Any:
    """A Llama without biases (like SmolLM2): every layer can run in the fused C++ pass."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape) * 0.3 + 1.0)
    return model


def _quantized_model(family: str, vocab: int) -> Any:
    model = _plain_llama(vocab) if family == "plain-llama" else _family_model(family, vocab)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(q4_1(p))
        model.get_input_embeddings().weight.copy_(q8_0(model.get_input_embeddings().weight))
        head = model.get_output_embeddings().weight
        if head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            head.copy_(q4_1(head))
    return model


def _engine(family: str, *, adapter: bool) -> MTPEngine:
    tok = tiny_tokenizer()
    model = _quantized_model(family, len(tok))
    mask, mask_id, _ = ensure_mask_token(model, tok, None)  # adds a float32 embedding row: an exception row
    mtp = None
    if adapter:
        mtp = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=3)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in mtp.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        mtp.requires_grad_(False)
    return MTPEngine(LoadedModel(model, tok, "tiny-q-" + family, mask, mask_id, False), adapter=mtp)


@pytest.fixture(
    scope="module",
    params=[("llama", False), ("llama", True), ("qwen3", True), ("plain-llama", False), ("plain-llama", True)],
    ids=str,
)
def engine(request: pytest.FixtureRequest) -> MTPEngine:
    family, adapter = request.param
    return _engine(family, adapter=adapter)


def test_q4_1_weights_are_recovered_and_multiplied_in_float32() -> None:
    weight = q4_1(torch.randn(40, 96))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == "q4_1" and blocks.exception_rows is None
    assert blocks.nbytes < weight.numel() * weight.element_size() / 4
    x = torch.randn(5, 96)
    torch.testing.assert_close(blocks(x), F.linear(x, weight), atol=2e-5, rtol=1e-5)


def _awkward_blocks() -> torch.Tensor:
    """[rows, blocks, 32] float32 values of every kind the recovery meets: exact Q4_1 and Q8_0 blocks, the same
    perturbed by one ulp, random, zero, constant, tiny (float16 underflow), huge (float16 overflow), infinite, NaN
    and negative-zero blocks, ties at .5 after the division."""
    torch.manual_seed(3)
    rows = [q4_1(torch.randn(8, 64)), q8_0(torch.randn(8, 64)), torch.randn(8, 64)]
    bumped = q4_1(torch.randn(4, 64))
    bumped[:, 5] = torch.nextafter(bumped[:, 5], torch.tensor(float("inf")))
    special = torch.zeros(12, 64)
    special[1] = 0.375
    special[2] = torch.randn(64) * 1e-9
    special[3] = torch.randn(64) * 1e6
    special[4, 3] = float("inf")
    special[5, 7] = float("nan")
    special[6] = -0.0
    special[7, :32] = torch.arange(32) * 0.5  # (v - min) / d lands on .5 ties
    special[8] = torch.randn(64) * 70000  # beyond float16's range: d overflows
    special[9, 0] = float("-inf")
    special[10] = q4_1(torch.randn(1, 64)) * 2**-20
    special[11, 31] = float("nan")
    return torch.cat([*rows, bumped, special]).reshape(-1, 2, 32).contiguous()


def test_the_one_pass_recovery_computes_what_the_torch_ops_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _awkward_blocks()
    assert blockq._kernels_loaded()  # the module's skip check loaded the kernels: the C++ pass serves
    q, d, m, ok = blockq._q4_1_blocks(blocks)
    q_ref, d_ref, m_ref, ok_ref = blockq._q4_1_blocks_reference(blocks)
    assert torch.equal(ok, ok_ref) and 8 <= int(ok.sum()) < len(ok)
    torch.testing.assert_close(d, d_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(m, m_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q[ok], q_ref[ok])  # the quants of rows not rebuilt bit for bit are never read
    finite = torch.isfinite(blocks).flatten(1).all(-1)
    assert torch.equal(q[finite], q_ref[finite])
    q8, d8, ok8 = blockq._q8_0_blocks(blocks)
    q8_ref, d8_ref, ok8_ref = blockq._q8_0_blocks_reference(blocks)
    assert torch.equal(ok8, ok8_ref) and int(ok8.sum()) >= 8
    torch.testing.assert_close(d8, d8_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q8[finite], q8_ref[finite])
    # and a model's weights take the same blocks either way
    weight = q4_1(torch.randn(24, 96))
    fast = blockq.block_weights(weight)
    monkeypatch.setattr(blockq, "_kernels_loaded", lambda: False)
    slow = blockq._recover_blocks(weight)
    assert fast is not None and slow is not None
    assert torch.equal(fast.qs, slow.qs) and torch.equal(fast.scale, slow.scale)
    assert fast.minimum is not None and slow.minimum is not None and torch.equal(fast.minimum, slow.minimum)


@pytest.mark.parametrize("rows", [2, 7])  # row and lane kernels
def test_q8_0_weights_with_an_added_row_and_padding(rows: int) -> None:
    weight = torch.cat([q8_0(torch.randn(45, 64)), torch.randn(1, 64)])  # 46 rows: padded to 48, one exception
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == "q8_0"
    assert blocks.exception_rows is not None and blocks.exception_rows.tolist() == [45]
    x = torch.randn(rows, 64)
    y = blocks(x)
    assert y.shape == (rows, 46)
    torch.testing.assert_close(y, F.linear(x, weight), atol=2e-5, rtol=1e-5)
    extra = torch.randn(3, 64)  # float32 rows computed in the same call, after the block rows (padding dropped)
    torch.testing.assert_close(blocks(x, extra), F.linear(x, torch.cat([weight, extra])), atol=2e-5, rtol=1e-5)


def test_products_added_into_a_residual_in_the_kernel() -> None:
    weight = q4_1(torch.randn(32, 64))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.accumulates
    x, residual, extra = torch.randn(3, 64), torch.randn(3, 32), torch.randn(2, 64)
    expected = residual + F.linear(x, weight)
    low = blocks.add_into(residual, x, extra)
    torch.testing.assert_close(residual, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(low, F.linear(x, extra), atol=2e-5, rtol=1e-5)
    assert blocks.add_into(residual, x).shape == (3, 0)
    padded = blockq.block_weights(q4_1(torch.randn(20, 64)))
    assert padded is not None and not padded.accumulates  # padding rows would land in the residual


def test_rms_norm_inside_the_kernel_matches_torch() -> None:
    weight = q4_1(torch.randn(16, 96))
    blocks = blockq.block_weights(weight)
    assert blocks is not None
    x, gain = torch.randn(3, 96) * 4, torch.randn(96)
    expected = F.linear(F.rms_norm(x, (96,), gain, 1e-6), weight)
    torch.testing.assert_close(blocks(x, norm=(gain, 1e-6)), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, 7])  # row and lane kernels
def test_rms_norm_reaches_the_float32_exception_rows(rows: int) -> None:
    """A row that is not block-structured is computed beside the kernel: it must multiply the normalised input too."""
    weight = torch.cat([q4_1(torch.randn(79, 96)), torch.randn(1, 96)])  # one exception row, padded to 80
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == "q4_1" and blocks.exception_rows is not None
    x, gain = torch.randn(rows, 96) * 4, torch.randn(96)
    expected = F.linear(F.rms_norm(x, (96,), gain, 1e-6), weight)
    torch.testing.assert_close(blocks(x, norm=(gain, 1e-6)), expected, atol=2e-5, rtol=1e-5)


def test_weights_that_are_not_blocks_stay_float32() -> None:
    assert blockq.block_weights(torch.randn(16, 64)) is None
    assert blockq.block_weights(q4_1(torch.randn(16, 64)).to(torch.bfloat16)) is None
    assert blockq.block_weights(torch.randn(16, 48)) is None  # in_features not a multiple of 32


# 3, 5 and 9 groups of 8 features: short lane tiles take 2-4 groups at once, buffered passes 3 (and the last 1-2)
@pytest.mark.parametrize("out", [24, 40, 72])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: str, out: int) -> None:
    """Within each kernel class (row kernels below LANE_ROWS rows of their kind, lane kernels from there) a row's
    numbers are the same whatever the pass size and position (a lane tile of 2-5 rows multiplies several groups at
    once, a longer one one group, passes of 9+ rows multiply weights rebuilt once into a buffer in tiles of 1-4
    rows: the same bits); between the classes only the summation order differs."""
    blocks = blockq.block_weights((q4_1 if kind == "q4_1" else q8_0)(torch.randn(out, 128)))
    assert blocks is not None and blocks.kind == kind and blocks.lanes is not None
    lane = blockq.LANE_ROWS[kind]
    x = torch.randn(42, 128)
    short = blocks(x[: lane - 1])
    for n in range(1, lane - 1):
        assert torch.equal(blocks(x[:n]), short[:n])
        assert torch.equal(blocks(x[n : n + 1]), short[n : n + 1])
    together = blocks(x)
    for n in range(lane, 42):  # lane tiles up to 8 rows, then buffered passes (9+ rows) of 3-11 tiles
        assert torch.equal(blocks(x[:n]), together[:n])
        assert torch.equal(blocks(x[n - lane + 1 : n + 1]), together[n - lane + 1 : n + 1])
    torch.testing.assert_close(together[: lane - 1], short, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kind", "rows"),
    [(k, r) for k in ("q4_1", "q8_0") for r in (2, 3, 4, 5, 8, 9, 13, 17, 24) if r >= blockq.LANE_ROWS[k]],
)
def test_lane_kernels_match_the_float32_gemm(rows: int, kind: str) -> None:
    """Passes of LANE_ROWS rows or more (per kind): plain, with extra rows, normed, and added into a residual."""
    weight = (q4_1 if kind == "q4_1" else q8_0)(torch.randn(40, 96))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == kind and blocks.lanes is not None and rows >= blockq.LANE_ROWS[kind]
    x, extra, gain = torch.randn(rows, 96), torch.randn(3, 96), torch.randn(96)
    torch.testing.assert_close(blocks(x), F.linear(x, weight), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(blocks(x, extra), F.linear(x, torch.cat([weight, extra])), atol=2e-5, rtol=1e-5)
    normed = F.linear(F.rms_norm(x, (96,), gain, 1e-6), weight)
    torch.testing.assert_close(blocks(x, norm=(gain, 1e-6)), normed, atol=2e-5, rtol=1e-5)
    residual = torch.randn(rows, 40)
    expected = residual + F.linear(x, weight)
    low = blocks.add_into(residual, x, extra)
    torch.testing.assert_close(residual, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(low, F.linear(x, extra), atol=2e-5, rtol=1e-5)


def test_lane_layout_holds_each_feature_in_its_nibble() -> None:
    weight = q4_1(torch.randn(16, 64))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.lanes is not None
    assert blocks.lanes.shape == (2, 2 * 128) and blocks.lanes.dtype == torch.uint8
    words = blocks.lanes.view(torch.int32).reshape(2, 2, 32).long() & 0xFFFFFFFF  # [group, block, position]
    scale = blocks.scale.reshape(2, 2, 8)
    low = blocks.minimum.reshape(2, 2, 8) if blocks.minimum is not None else None
    assert low is not None
    for feature in range(16):
        g, f = divmod(feature, 8)
        q = (words[g] >> (4 * f)) & 15  # [block, position]
        rebuilt = (q.float() * scale[g, :, f, None] + low[g, :, f, None]).reshape(-1)
        assert torch.equal(rebuilt, weight[feature])


def test_kernel_rejects_a_bad_lane_layout() -> None:
    blocks = blockq.block_weights(q4_1(torch.randn(8, 64)))
    assert blocks is not None and blocks.lanes is not None
    with pytest.raises(RuntimeError, match="lanes must be"):
        torch.ops.agent_mtp_blockq.q4_1_linear(
            torch.randn(6, 64), blocks.qs, blocks.scale, blocks.minimum, lanes=blocks.lanes[:, :-4].contiguous()
        )


def test_kernel_rejects_bad_shapes_with_a_message() -> None:
    blocks = blockq.block_weights(q4_1(torch.randn(8, 64)))
    assert blocks is not None
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.agent_mtp_blockq.q4_1_linear(torch.randn(2, 48), blocks.qs, blocks.scale, blocks.minimum)


def test_switch_off_keeps_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blockq.ENV_SWITCH, "0")
    assert blockq.block_weights(q4_1(torch.randn(8, 64))) is None
    assert blockq.kernel_tag() == "fp32"


def test_fast_model_reads_blocks_on_short_passes(engine: MTPEngine) -> None:
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert all(layer.qkv.linear.blocks is not None for layer in fast.layers)
    assert fast.lm_head.blocks is not None and fast.lm_head.blocks.exception_rows is not None  # the mask row
    assert fast.layers[0].down.linear.reads_blocks(blockq.MAX_ROWS)
    assert not fast.layers[0].down.linear.reads_blocks(blockq.MAX_ROWS + 1)


def test_block_passes_match_hf_and_the_float32_gemm(engine: MTPEngine) -> None:
    """Every pass shape: a prompt and a 6-token pass (float32 GEMM), 1- to 4-token passes (blocks), masks included,
    rollbacks."""
    blocks = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    dense = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, blocks=False)
    ids = _random_ids(20, seed=3)
    cb, cd = blocks.new_cache(), dense.new_cache()
    torch.testing.assert_close(blocks.forward(ids, cb, 3), dense.forward(ids, cd, 3), atol=1e-4, rtol=1e-4)
    mask = engine.mask_token_id
    for step, tokens in enumerate([[5], [7, mask], [9, 3, 8], [11, 12], [mask, 4, mask, 6], [1, 2, 3, 4, 5, mask]]):
        a = blocks.forward(tokens, cb, len(tokens))
        b = dense.forward(tokens, cd, len(tokens))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        if step % 2:
            cb.truncate(cb.length - 1)
            cd.truncate(cd.length - 1)
    hf = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(blocks.forward(ids, blocks.new_cache(), 1)[0], hf, atol=1e-4, rtol=1e-4)


def assert_greedy_equals_hf(engine: MTPEngine, mode: str) -> None:
    """``engine`` in ``mode`` (k_max 4) gives HF ``generate``'s greedy tokens on three random prompts."""
    hf = engine.with_runtime("hf")
    for seed in range(3):
        prompt = _random_ids(5 + 7 * seed, seed)
        cfg = DecodeConfig(mode="ntp", max_new_tokens=30)
        expected = hf.generate(prompt, cfg).token_ids
        assert engine.generate(prompt, cfg.replace(mode=mode, k_max=4)).token_ids == expected, (seed, mode)


@pytest.mark.parametrize("mode", ["ntp", "verified"])
def test_greedy_on_block_weights_equals_hf(engine: MTPEngine, mode: str) -> None:
    assert_greedy_equals_hf(engine, mode)


def test_bench_curves_time_the_fast_runtime_with_and_without_block_weights(engine: MTPEngine) -> None:
    from agent_mtp.bench.curves import SIZES, measure_curves

    report = measure_curves(engine, context=16, rounds=1)
    wide = {"fast-avx2"} if blockq.avx512_active() else set()  # the AVX2 forms beside, where AVX-512 serves
    assert set(report.ms) == {"hf", "fast", "fast-fp32"} | wide
    assert all(sorted(curve) == sorted(SIZES) and min(curve.values()) > 0 for curve in report.ms.values())


@pytest.mark.parametrize("adapter", [False, True])
def test_fused_layers_give_the_python_loops_numbers(adapter: bool) -> None:
    """The one-call C++ pass over all layers (plain Llama blocks, one sequence, up to MAX_ROWS tokens) runs the
    same ops in the same order as the Python layer loop: logits and caches equal bit for bit, masks included."""
    engine = _engine("plain-llama", adapter=adapter)
    fused = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    loop = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fused._fused is not None
    loop._fused = None
    m = engine.mask_token_id
    cf, cl = fused.new_cache(), loop.new_cache()
    assert torch.equal(fused.forward(_random_ids(20, seed=7), cf, 2), loop.forward(_random_ids(20, seed=7), cl, 2))
    # the last two: mask rows not contiguous; masks as drafts (the adapter's bfloat16 factor there)
    for tokens, drafts in (
        ([5], False),
        ([7, m], False),
        ([9, 3, 8], False),
        ([11, m, m, m], False),
        ([1, 2], False),
        ([m, 4, m, 6], False),
        ([3, m, m], True),
        ([m, 2, m], True),
    ):
        assert torch.equal(
            fused.forward(tokens, cf, len(tokens), coarse_masks=drafts),
            loop.forward(tokens, cl, len(tokens), coarse_masks=drafts),
        )
        layers = zip(cf.layers, cl.layers, strict=True)
        assert all(torch.equal(a[:, :, : cf.length], b[:, :, : cl.length]) for a, b in layers)
        cf.truncate(cf.length - 1)
        cl.truncate(cl.length - 1)


@pytest.mark.parametrize("adapter", [False, True])
def test_fused_layers_serve_a_batch_with_the_python_loops_numbers(adapter: bool) -> None:
    """Several sequences in one C++ layer pass, each with its own cache and its own mask tail."""
    from agent_mtp.engine.fast.model import BatchItem

    engine = _engine("plain-llama", adapter=adapter)
    fused = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    loop = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    loop._fused = None
    m = engine.mask_token_id
    prompts = [_random_ids(6 + 5 * i, seed=20 + i) for i in range(3)]
    caches = {id(model): [model.new_cache() for _ in prompts] for model in (fused, loop)}
    for model in (fused, loop):
        for ids, cache in zip(prompts, caches[id(model)], strict=True):
            model.forward(ids, cache, 1)
    # 4, 6 and 4 rows (two sequences); masks in several sequences; in the last step the first sequence's masks are
    # only drafts (the adapter's bfloat16 factor at those rows), the second's exact (float32)
    steps = [[[5], [7, m], [9]], [[3, m, m], [4], [m, 8]], [[2, m], [6, m]]]
    for step, drafts in zip(steps, [(), (), (0,)], strict=True):
        a, b = (
            model.forward_batch(
                [
                    BatchItem(t, c, len(t), i in drafts)
                    for i, (t, c) in enumerate(zip(step, caches[id(model)][: len(step)], strict=True))
                ]
            )
            for model in (fused, loop)
        )
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for cf, cl in zip(caches[id(fused)], caches[id(loop)], strict=True):
            layers = zip(cf.layers, cl.layers, strict=True)
            assert all(torch.equal(x[:, :, : cf.length], y[:, :, : cl.length]) for x, y in layers)


@pytest.mark.parametrize("adapter", [False, True])
def test_lane_kernel_passes_in_the_model(monkeypatch: pytest.MonkeyPatch, adapter: bool) -> None:
    """Passes of LANE_ROWS rows or more on block weights (the crossover pinned past them): the fused C++ pass gives
    the Python loop's numbers bit for bit, alone and batched, and both stay close to the float32 GEMM."""
    from agent_mtp.engine.fast.model import BatchItem

    monkeypatch.setenv(blockq.ROWS_ENV, "16")
    engine = _engine("plain-llama", adapter=adapter)
    fused = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    loop = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    dense = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, blocks=False)
    loop._fused = None
    m = engine.mask_token_id
    models = (fused, loop, dense)
    assert all(layer.gate_up.linear.blocks.lanes is not None for layer in fused.layers)  # type: ignore[union-attr]
    prompts = [_random_ids(6 + 5 * i, seed=30 + i) for i in range(3)]
    caches = {id(model): [model.new_cache() for _ in prompts] for model in models}
    for model in models:
        for ids, cache in zip(prompts, caches[id(model)], strict=True):
            model.forward(ids, cache, 1)
    steps = ([[5, 6, 7, 8, 9, m]], [[3, m, m], [4, 1], [m, 8, 2, m]], [[1, 2, 3, 4, 5, 6, 7, 8, 9, m, m], [4], [7]])
    for step in steps:  # 6, 9 and 13 rows: one and two tiles
        out = [
            model.forward_batch([BatchItem(t, c, len(t)) for t, c in zip(step, caches[id(model)], strict=False)])
            for model in models
        ]
        assert all(torch.equal(x, y) for x, y in zip(out[0], out[1], strict=True))
        for x, y in zip(out[0], out[2], strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        for model in models:
            for cache, tokens in zip(caches[id(model)], step, strict=False):
                cache.truncate(cache.length - len(tokens) + 1)


FORMS = (blockq.Wide.NONE, blockq.Wide.ROWS, blockq.Wide.LANES, blockq.Wide.ALL)
"""Every mix of kernel forms: AVX2 only, AVX-512 for the row or the lane kernels alone, for both."""


def _wide_or_skip() -> None:
    with blockq.avx512(True) as on:
        if not on:
            pytest.skip("this CPU has no AVX-512 F/BW/DQ/VL/VBMI: only the AVX2 kernels run here")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_avx512_kernels_give_the_avx2_bits(kind: str) -> None:
    """Both kernel classes in their AVX-512 forms compute every output with the AVX2 forms' operations in the same
    order (two 8-lane halves per register): equal bit for bit at every pass size, plain, with extra rows, normed,
    added into a residual, and for an odd number of 8-feature groups (the lane kernels' last group alone)."""
    _wide_or_skip()
    for out, k in ((40, 96), (48, 160)):
        weight = (q4_1 if kind == "q4_1" else q8_0)(torch.randn(out, k))
        blocks = blockq.block_weights(weight)
        assert blocks is not None and blocks.kind == kind and blocks.lanes is not None
        for rows in (1, 2, 3, 4, 5, 6, 8, 9, 13, 17, 24):
            x, extra, gain, residual = torch.randn(rows, k), torch.randn(3, k), torch.randn(k), torch.randn(rows, out)
            results = []
            for wide in FORMS:
                with blockq.avx512(wide) as on:
                    assert on == bool(wide)
                    into = residual.clone()
                    low = blocks.add_into(into, x, extra)
                    results.append((blocks(x), blocks(x, extra), blocks(x, norm=(gain, 1e-6)), into, low))
            for other in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True)), (out, rows)
            torch.testing.assert_close(results[1][0], F.linear(x, weight), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("adapter", [False, True])
def test_avx512_passes_give_the_avx2_logits(monkeypatch: pytest.MonkeyPatch, adapter: bool) -> None:
    """Whole fused passes (row and lane kernels, masks and the adapter's delta) on either form: the same logits and
    caches bit for bit, so a cost curve is all that differs between machines with and without AVX-512."""
    _wide_or_skip()
    monkeypatch.setenv(blockq.ROWS_ENV, "16")
    engine = _engine("plain-llama", adapter=adapter)
    model = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    m = engine.mask_token_id
    prompt = _random_ids(20, seed=11)
    outs: dict[blockq.Wide, list[torch.Tensor]] = {}
    for wide in FORMS:
        cache = model.new_cache()
        with blockq.avx512(wide):
            outs[wide] = [model.forward(prompt, cache, 2)]
            for tokens in ([5], [7, m, m], [1, 2, 3, 4, 5, m, m], [9, 8, 7, 6, 5, 4, 3, 2, 1, m, m, m]):
                outs[wide].append(model.forward(tokens, cache, len(tokens)))
            outs[wide] += [layer[:, :, : cache.length].clone() for layer in cache.layers]
    for wide in FORMS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[blockq.Wide.NONE], outs[wide], strict=True)), wide


def test_kernel_tag_names_the_avx512_forms() -> None:
    with blockq.buffered_from(blockq.BUFFERED_ROWS):  # a model loaded before may have moved the threshold (-b5)
        with blockq.avx512(True) as on:
            assert blockq.kernel_tag() == ("blockq14-avx512" if on else "blockq14")
        if on:
            with blockq.avx512(blockq.Wide.ROWS):
                assert blockq.kernel_tag() == "blockq14-avx512rows" and blockq.avx512_forms() == blockq.Wide.ROWS
            with blockq.avx512(blockq.Wide.LANES):
                assert blockq.kernel_tag() == "blockq14-avx512lanes" and blockq.avx512_active()
        with blockq.avx512(False):
            assert blockq.kernel_tag() == "blockq14" and not blockq.avx512_active()


@pytest.mark.parametrize(("value", "forms"), [("0", "0"), ("rows", "1"), ("LANES", "2")])
def test_avx512_forms_can_be_pinned_by_environment(value: str, forms: str) -> None:
    import subprocess
    import sys

    code = "from agent_mtp.engine.fast import blockq; print(blockq.kernels_available(), int(blockq.avx512_forms()))"
    env = {**os.environ, blockq.AVX512_ENV: value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with blockq.avx512(True) as on:
        pass
    assert done.stdout.split() == ["True", forms if on else "0"]


def test_a_bad_avx512_setting_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blockq.AVX512_ENV, "fast")
    with pytest.raises(ConfigError, match=r"AGENT_MTP_AVX512='fast'.*0 \(AVX2 only\).*rows or lanes"):
        blockq.pinned_forms()
    monkeypatch.setenv(blockq.AVX512_ENV, " ")
    assert blockq.pinned_forms() is None


def test_low_rank_delta_at_the_mask_runs_matches_addmm() -> None:
    """The adapter's delta in one C++ call (both layer paths use it): only the runs' rows change, by low @ b_t."""
    y = torch.randn(9, 21 + 3)  # 21 outputs (a remainder past the 8-wide vectors), rank 3 in the same rows
    b_t = torch.randn(3, 21)
    expected = y[:, :21].clone()
    runs = [slice(1, 3), slice(6, 9)]
    for run in runs:
        expected[run] += y[run, 21:] @ b_t
    torch.ops.agent_mtp_blockq.low_rank_add(y[:, :21], y[:, 21:], b_t, [1, 3, 6, 9])
    torch.testing.assert_close(y[:, :21], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[[0, 3, 4, 5], :21], expected[[0, 3, 4, 5]])  # rows outside the runs untouched
    with pytest.raises(RuntimeError, match="run out of range"):
        torch.ops.agent_mtp_blockq.low_rank_add(y[:, :21], y[:, 21:], b_t, [8, 10])
    with pytest.raises(RuntimeError, match="low must be"):
        torch.ops.agent_mtp_blockq.low_rank_add(y[:, :21], y[:, 20:], b_t, [0, 1])


def _block_diagonal(out_sizes: list[int], rank: int, seed: int = 0) -> torch.Tensor:
    """A fused projection's B^T [parts x rank, sum(out)]: each part's rank rows reach only its own outputs."""
    g = torch.Generator().manual_seed(seed)
    b_t = torch.zeros(rank * len(out_sizes), sum(out_sizes))
    o0 = 0
    for i, size in enumerate(out_sizes):
        b_t[i * rank : (i + 1) * rank, o0 : o0 + size] = torch.randn(rank, size, generator=g)
        o0 += size
    return b_t


def test_low_rank_spans_name_the_rank_rows_each_64_outputs_reach() -> None:
    from agent_mtp.engine.fast.weights import low_rank_spans

    b_t = _block_diagonal([128, 64, 64], rank=4)  # qkv-like: parts of 128, 64 and 64 outputs
    expected = [[0, 4], [0, 4], [4, 8], [8, 12]]
    assert low_rank_spans(b_t).tolist() == expected
    assert torch.ops.agent_mtp_blockq.low_rank_spans(b_t).tolist() == expected
    b_t[:, 64:128] = 0  # a slice no rank row reaches: empty
    b_t[1, 0] = 0  # an interior zero inside a span changes nothing
    assert low_rank_spans(b_t).tolist()[:2] == [[0, 4], [0, 0]]
    assert torch.ops.agent_mtp_blockq.low_rank_spans(b_t).tolist()[:2] == [[0, 4], [0, 0]]
    ragged = torch.randn(3, 70)  # a last slice of 6 outputs
    assert low_rank_spans(ragged).tolist() == [[0, 3], [0, 3]]


@pytest.mark.parametrize("out_sizes", [[128, 64, 64], [21, 13, 8]], ids=["avx512-tiles", "ragged"])
def test_low_rank_delta_reads_only_its_spans_and_gives_the_same_numbers(out_sizes: list[int]) -> None:
    """Skipping the all-zero rank rows of a block-diagonal B^T (spans) leaves every number as it was."""
    b_t = _block_diagonal(out_sizes, rank=4, seed=1)
    out, rank = b_t.shape[1], b_t.shape[0]
    y = torch.randn(7, out + rank, generator=torch.Generator().manual_seed(2))
    runs = [1, 3, 4, 7]
    plain, spanned = y.clone(), y.clone()
    torch.ops.agent_mtp_blockq.low_rank_add(plain[:, :out], plain[:, out:], b_t, runs)
    spans = torch.ops.agent_mtp_blockq.low_rank_spans(b_t)
    torch.ops.agent_mtp_blockq.low_rank_add(spanned[:, :out], spanned[:, out:], b_t, runs, None, spans)
    assert torch.equal(spanned, plain)
    expected = y[:, :out].clone()
    for r0, r1 in ((1, 3), (4, 7)):
        expected[r0:r1] += y[r0:r1, out:] @ b_t
    torch.testing.assert_close(spanned[:, :out], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_sizes", [[128, 64, 64], [21, 13, 8]], ids=["avx512-tiles", "ragged"])
def test_draft_rows_take_the_bfloat16_factor_and_exact_rows_keep_float32(out_sizes: list[int]) -> None:
    """Rows flagged as drafts get the delta of B^T rounded to bfloat16 (the kernel's own float32 product of the
    rounded factor, bit for bit); every other row the float32 factor's bits, also in a run that mixes both."""
    b_t = _block_diagonal(out_sizes, rank=4, seed=3)
    out, rank = b_t.shape[1], b_t.shape[0]
    draft = b_t.to(torch.bfloat16)
    spans = torch.ops.agent_mtp_blockq.low_rank_spans(b_t)
    y = torch.randn(9, out + rank, generator=torch.Generator().manual_seed(4))
    runs, coarse = [1, 9], [3, 6]  # one run of 8 mask rows, rows 3-5 drafts
    mixed, exact, rounded = y.clone(), y.clone(), y.clone()
    torch.ops.agent_mtp_blockq.low_rank_add(mixed[:, :out], mixed[:, out:], b_t, runs, draft, spans, coarse)
    torch.ops.agent_mtp_blockq.low_rank_add(exact[:, :out], exact[:, out:], b_t, runs, None, spans)
    torch.ops.agent_mtp_blockq.low_rank_add(rounded[:, :out], rounded[:, out:], draft.float(), runs, None, spans)
    drafts, others = [3, 4, 5], [0, 1, 2, 6, 7, 8]
    assert torch.equal(mixed[drafts], rounded[drafts])
    assert torch.equal(mixed[others], exact[others])
    assert not torch.equal(mixed[drafts], exact[drafts])
    torch.testing.assert_close(mixed[drafts], exact[drafts], atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.agent_mtp_blockq.low_rank_add(mixed[:, :out], mixed[:, out:], b_t, runs, b_t, spans, coarse)
    with pytest.raises(RuntimeError, match="spans"):
        short = spans.flatten()[:1]
        torch.ops.agent_mtp_blockq.low_rank_add(mixed[:, :out], mixed[:, out:], b_t, runs, draft, short, coarse)


def _reference_attention(
    qkv: torch.Tensor, rope: torch.Tensor, kv: torch.Tensor, start: int, heads: int, kv_heads: int, d: int
) -> torch.Tensor:
    """RoPE, cache write and causal softmax attention with plain torch ops (what the kernel replaces)."""
    n, q_dim, kv_dim = qkv.shape[0], heads * d, kv_heads * d
    rotated = torch.view_as_real(torch.view_as_complex(qkv[:, : q_dim + kv_dim].reshape(n, -1, d // 2, 2)) * rope)
    q = rotated[:, :heads].reshape(n, heads, d)
    kv[0, :, start : start + n] = rotated[:, heads:].reshape(n, kv_heads, d).transpose(0, 1)
    kv[1, :, start : start + n] = qkv[:, q_dim + kv_dim :].reshape(n, kv_heads, d).transpose(0, 1)
    keys = kv[0, :, : start + n].repeat_interleave(heads // kv_heads, 0)  # [heads, end, d]
    values = kv[1, :, : start + n].repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hjd->hnj", q, keys) / d**0.5
    allowed = torch.arange(start + n)[None, :] <= start + torch.arange(n)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnj,hjd->nhd", probs, values).reshape(n, q_dim)


def _rope(n: int, d: int, seed: int) -> torch.Tensor:
    angles = torch.randn(n, 1, d // 2, generator=torch.Generator().manual_seed(seed))
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 24), (4, 2, 128), (16, 1, 32), (14, 2, 64)])
def test_attention_kernel_matches_torch_for_every_sequence_of_a_pass(heads: int, kv_heads: int, d: int) -> None:
    """One call per layer for a whole batch: sequences with different cache lengths and row counts (one long enough
    to run on several threads), each row attending causally to its own cache. A task takes the query heads of a
    key / value head together: 3, 1, 2 of them, 16 (more than a task's 12 pairs: sets of 8) and 7."""
    starts, rows = [0, 5, 37, 700], [3, 1, 6, 2]  # 6 rows: two tasks of one head; 700: many key chunks
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(sum(rows), width + 8)[:, :width]  # a row stride wider than the row, as with adapter columns
    rope = _rope(sum(rows), d, seed=1)
    caches = [torch.randn(2, kv_heads, s + r + 3, d) for s, r in zip(starts, rows, strict=True)]
    expected_caches = [c.clone() for c in caches]
    expected, first = [], 0
    for start, n, kv in zip(starts, rows, expected_caches, strict=True):
        part = slice(first, first + n)
        expected.append(_reference_attention(qkv[part], rope[part], kv, start, heads, kv_heads, d))
        first += n
    out = torch.ops.agent_mtp_blockq.attend(qkv, rope, caches, starts, rows, heads, kv_heads, d, d**-0.5)
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-6, rtol=1e-5)
    for got, want, start, n in zip(caches, expected_caches, starts, rows, strict=True):
        torch.testing.assert_close(got[:, :, : start + n], want[:, :, : start + n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "rows", "start"),
    [(9, 3, 64, 1, 1300), (9, 3, 64, 4, 1300), (4, 2, 128, 2, 1300), (9, 3, 64, 3, 1022), (9, 3, 64, 1, 3100)],
)
def test_attention_over_a_long_cache_matches_torch(heads: int, kv_heads: int, d: int, rows: int, start: int) -> None:
    """One sequence, a cache past L2 and few tasks (the query heads of a key / value head together) on 2 threads;
    past 1,024 positions in segments of 1,024 merged (rows on both sides of a boundary; four segments)."""
    width = (heads + 2 * kv_heads) * d
    qkv, rope = torch.randn(rows, width), _rope(rows, d, seed=5)
    cache = torch.randn(2, kv_heads, start + rows + 3, d)
    want = _reference_attention(qkv.clone(), rope, cache.clone(), start, heads, kv_heads, d)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = torch.ops.agent_mtp_blockq.attend(
            qkv.clone(), rope, [cache], [start], [rows], heads, kv_heads, d, d**-0.5
        )
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("start", "n"), [(41, 4), (130, 11), (1020, 7), (2100, 3)])
def test_attention_of_a_row_does_not_depend_on_the_rows_beside_it(start: int, n: int) -> None:
    """A position attended in an n-row pass, alone, or batched beside another sequence gives the same bits (so
    ``verified`` equals ``ntp`` and batching changes nothing), also where the kernel shares key chunks of 64 between
    the rows of a task (several chunks, several tasks of up to 4 rows), and past 1,024 positions, where a row attends
    its cache in segments merged at the end (rows on both sides of the first boundary in one pass; three segments)."""
    heads, kv_heads, d = 6, 2, 32
    width = (heads + 2 * kv_heads) * d
    qkv, rope = torch.randn(n, width), _rope(n, d, seed=2)
    history = torch.randn(2, kv_heads, start + n + 8, d)
    together = torch.ops.agent_mtp_blockq.attend(
        qkv.clone(), rope, [history.clone()], [start], [n], heads, kv_heads, d, 0.25
    )
    for i in range(n):
        cache = history.clone()
        if i:  # rows before i are already in the cache, as after an earlier pass
            torch.ops.agent_mtp_blockq.attend(
                qkv[:i].clone(), rope[:i], [cache], [start], [i], heads, kv_heads, d, 0.25
            )
        other = torch.randn(2, kv_heads, 16, d)
        pair = torch.cat([torch.randn(2, width), qkv[i : i + 1]])
        alone = torch.ops.agent_mtp_blockq.attend(
            pair,
            torch.cat([_rope(2, d, seed=3), rope[i : i + 1]]),
            [other, cache],
            [5, start + i],
            [2, 1],
            heads,
            kv_heads,
            d,
            0.25,
        )
        assert torch.equal(alone[2], together[i]), i


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 24), (4, 2, 128), (14, 2, 64), (6, 2, 40)])
def test_attention_asks_for_its_next_chunks_without_changing_a_number(
    heads: int, kv_heads: int, d: int, half: bool
) -> None:
    """Attention's loops ask for the next chunk of keys / values as they go (a share per (row, head) pair of a task,
    or per group of pairs in the AVX-512 pair loops where the CPU has them), or all of it at each chunk's start, or
    the burst in the pair loops only: the same bits in the output and the caches, for heads of 64, narrower (24, 40:
    value loops of 3 and 5 vectors) and wider (128: two slices), float32 and float16 caches, chunks cut short, rows
    of one task attending different counts, a cache past 1,024 positions (segments), and 2 threads."""
    starts, rows = [0, 3, 61, 200, 1100], [2, 1, 5, 3, 1]
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(sum(rows), width)
    rope = _rope(sum(rows), d, seed=7)
    dtype = torch.float16 if half else torch.float32
    history = [torch.randn(2, kv_heads, s + r + 5, d).to(dtype) for s, r in zip(starts, rows, strict=True)]
    results = []
    before = torch.get_num_threads()
    switch = torch.ops.agent_mtp_blockq.attention_prefetch
    try:
        torch.set_num_threads(2)
        for form in (1, 0, 2):  # spread everywhere, a burst per chunk, a burst in the pair loops only
            caches = [c.clone() for c in history]
            switch(form)
            out = torch.ops.agent_mtp_blockq.attend(qkv.clone(), rope, caches, starts, rows, heads, kv_heads, d, 0.3)
            results.append((out, caches))
        switch(0)
        with blockq.attention_prefetch(True):
            assert switch(-1) == 1
        assert switch(-1) == 0  # the setting before the block, restored
    finally:
        switch(1)
        torch.set_num_threads(before)
    spread_out, spread_caches = results[0]
    for out, caches in results[1:]:
        assert torch.equal(spread_out, out)
        assert all(torch.equal(a, b) for a, b in zip(spread_caches, caches, strict=True))


def test_attention_prefetch_setting_rejects_an_unknown_form() -> None:
    with pytest.raises(RuntimeError, match=r"attention_prefetch takes -1 \(read\), 0 .* got 3"):
        torch.ops.agent_mtp_blockq.attention_prefetch(3)
    assert torch.ops.agent_mtp_blockq.attention_prefetch(-1) == 1


def test_attention_kernel_rejects_a_cache_without_room() -> None:
    heads, kv_heads, d = 2, 1, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d)
    with pytest.raises(RuntimeError, match=r"room for positions 10\.\.13"):
        torch.ops.agent_mtp_blockq.attend(
            qkv, _rope(3, d, seed=0), [torch.zeros(2, kv_heads, 12, d)], [10], [3], heads, kv_heads, d, 0.25
        )


def batched_against_single(
    fast: FastModel, passes: list[list[list[int]]]
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Three prompts prefilled alone and as a batch, then each pass of ``passes`` (one token list per sequence)
    batched and alone, in turn: (tokens, batched logits, single logits) per sequence and pass."""
    from agent_mtp.engine.fast.model import BatchItem

    prompts = [_random_ids(9 + 4 * i, seed=10 + i) for i in range(3)]
    single = [fast.new_cache() for _ in prompts]
    batched = [fast.new_cache() for _ in prompts]
    for ids, cache in zip(prompts, single, strict=True):
        fast.forward(ids, cache, 1)
    fast.forward_batch([BatchItem(ids, cache, 1) for ids, cache in zip(prompts, batched, strict=True)])
    for steps in passes:
        expected = [fast.forward(tokens, cache, len(tokens)) for tokens, cache in zip(steps, single, strict=True)]
        got = fast.forward_batch([BatchItem(t, c, len(t)) for t, c in zip(steps, batched, strict=True)])
        yield from zip(steps, got, expected, strict=True)


def test_fast_model_attends_with_the_kernel_and_batches_give_single_numbers(engine: MTPEngine) -> None:
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fast._attend_kernel
    steps = [[5], [7, engine.mask_token_id], [9, 3, 8, 2, 6, 1]]  # block passes and a float32 GEMM pass
    for _, a, b in batched_against_single(fast, [steps]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prefills_attend_in_the_kernel_as_sdpa_would(engine: MTPEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70-token prefill and a 40-row pass on it attend in the C++ kernel (SDPA is not called), with the logits of
    the ATen path (SDPA) and of HF."""
    import copy

    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    aten = copy.copy(fast)
    aten._attend_kernel = False
    ids, more = _random_ids(70, seed=5), _random_ids(40, seed=6)
    ca, cb = aten.new_cache(), fast.new_cache()
    expected = [aten.forward(ids, ca, 70), aten.forward(more, ca, 40)]

    def no_sdpa(*args: Any) -> torch.Tensor:
        raise AssertionError("SDPA ran where the attention kernel should have")

    monkeypatch.setattr(fast, "_attend_sdpa", no_sdpa)
    torch.testing.assert_close(fast.forward(ids, cb, 70), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast.forward(more, cb, 40), expected[1], atol=1e-4, rtol=1e-4)
    hf = engine.model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(expected[0], hf, atol=1e-4, rtol=1e-4)


def test_long_prefills_take_the_fused_pass_where_blocks_serve_every_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the blocks serving every pass, a 36-token prefill (past the old 32-row SDPA limit) runs the one-call
    fused pass, not the Python layer loop, with HF's logits."""
    engine = _engine("plain-llama", adapter=False)
    monkeypatch.setenv(blockq.ROWS_ENV, str(1 << 30))
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fast._fused is not None

    def no_loop(*args: Any) -> None:
        raise AssertionError("the Python layer loop ran where the fused pass should have")

    monkeypatch.setattr(fast, "_layer", no_loop)
    ids = _random_ids(36, seed=5)
    hf = engine.model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(fast.forward(ids, fast.new_cache(), 36), hf, atol=1e-4, rtol=1e-4)


def _block_linears(count: int) -> list[Any]:
    from agent_mtp.engine.fast.weights import PackedLinear

    return [PackedLinear(q4_1(torch.randn(64, 128)), prepack=False) for _ in range(count)]


@pytest.mark.parametrize(("slow", "expected"), [("blocks", 1), ("dense", 1 << 30)])
def test_crossover_measurement_picks_the_faster_path(monkeypatch: pytest.MonkeyPatch, slow: str, expected: int) -> None:
    """Blocks that lose from 2 rows on keep 1 row; a float32 GEMM that always loses leaves every pass to them."""
    import time

    from agent_mtp.engine.fast import weights

    linears = _block_linears(3)
    for linear in linears:
        product = getattr(linear, f"{slow}_product")

        def slowed(x: torch.Tensor, norm: Any = None, product: Any = product) -> torch.Tensor:
            time.sleep(0.005)
            return product(x, norm)

        monkeypatch.setattr(linear, f"{slow}_product", slowed)
    # two rounds: the faster counts, so a first call's one-off cost (oneDNN building a kernel for a new row count)
    # cannot pass for the slowed path's delay
    assert weights.measure_block_rows(linears, rounds=2) == expected
    assert expected in (1, weights.BLOCKS_EVERY_PASS)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_buffered_lane_passes_from_any_row_count_give_the_same_bits(kind: str) -> None:
    """Where AVX2 lane passes start buffering (5 rows on some machines, 9 on others) moves no bit: every pass size
    of a lane pass gives the same numbers in tiles and buffered; the kernel tag names a moved threshold."""
    blocks = blockq.block_weights((q4_1 if kind == "q4_1" else q8_0)(torch.randn(48, 256)))
    assert blocks is not None
    before = blockq.buffered_rows()
    x = torch.randn(13, 256)
    with blockq.avx_kernels(), blockq.avx512(False):  # the AVX2 lane kernels (no AMX / VNNI records)
        with blockq.buffered_from(1000):  # lane tiles for every lane pass
            tiles = [blocks(x[:n]) for n in range(blockq.LANE_ROWS[kind], 14)]
        with blockq.buffered_from(1) as rows:  # buffered for every lane pass
            assert blockq.buffered_rows() == rows == 1 and blockq.kernel_tag().endswith("-b1")
            buffered = [blocks(x[:n]) for n in range(blockq.LANE_ROWS[kind], 14)]
        with blockq.buffered_from(blockq.BUFFERED_ROWS):
            assert "-b" not in blockq.kernel_tag()
    assert all(torch.equal(a, b) for a, b in zip(tiles, buffered, strict=True))
    assert blockq.buffered_rows() == before  # each context restored the process's threshold
    tail = int(torch.ops.agent_mtp_blockq.tail_rows(-1))
    with blockq.vnni_tail(7 if tail != 7 else 6) as rows:
        assert torch.ops.agent_mtp_blockq.tail_rows(-1) == rows
    assert torch.ops.agent_mtp_blockq.tail_rows(-1) == tail
    with pytest.raises(ConfigError, match="rows=0"):
        blockq.buffered_from(0).__enter__()
    with pytest.raises(RuntimeError, match="buffered_rows takes"):
        torch.ops.agent_mtp_blockq.buffered_rows(0)


@pytest.mark.parametrize("buffered_faster", [True, False])
def test_the_buffered_threshold_is_the_faster_path_measured_once(
    monkeypatch: pytest.MonkeyPatch, buffered_faster: bool
) -> None:
    """measure_buffered_rows keeps the path that multiplies 6- and 8-row passes faster (buffered: from 5 rows, lane
    tiles: from 9), and settle_buffered_rows applies it once per process."""
    import time

    from agent_mtp.engine.fast import weights

    linears = _block_linears(2)
    for linear in linears:
        product = linear.blocks_product

        def delayed(x: torch.Tensor, norm: Any = None, product: Any = product) -> torch.Tensor:
            buffered = x.shape[0] >= blockq.buffered_rows()
            time.sleep(0.005 if buffered != buffered_faster else 0.0)
            return product(x, norm)

        monkeypatch.setattr(linear, "blocks_product", delayed)
    expected = blockq.BUFFERED_LOW_ROWS if buffered_faster else blockq.BUFFERED_ROWS
    # the AVX2 lane kernels; buffered_from restores the process's threshold afterwards
    with blockq.avx_kernels(), blockq.avx512(False), blockq.buffered_from(blockq.buffered_rows()):
        assert weights.measure_buffered_rows(linears, rounds=2) == expected
        monkeypatch.setattr(blockq, "_buffered_settled", [])
        calls: list[int] = []

        def measure() -> int:
            calls.append(1)
            return expected

        assert blockq.settle_buffered_rows(measure) == expected == blockq.buffered_rows()
        assert blockq.settle_buffered_rows(lambda: 7) == expected and calls == [1]  # measured once


def _crossover_with_blocks_delayed(monkeypatch: pytest.MonkeyPatch, delay: Callable[[int], float]) -> int:
    """The crossover measured on a float32 GEMM slowed by 10 ms a call and blocks slowed by ``delay(rows)`` s, two
    rounds each (the faster counts: a first call at a new row count may spend milliseconds building oneDNN's kernel
    for that shape, which once made a one-round scan see the blocks win where they were slowed)."""
    import time

    from agent_mtp.engine.fast import weights

    linears = _block_linears(1)
    blocks, dense = linears[0].blocks_product, linears[0].dense_product

    def delayed(x: torch.Tensor, norm: Any = None) -> torch.Tensor:
        time.sleep(delay(x.shape[0]))
        return blocks(x, norm)

    def slow(x: torch.Tensor, norm: Any = None) -> torch.Tensor:
        time.sleep(0.010)
        return dense(x, norm)

    monkeypatch.setattr(linears[0], "blocks_product", delayed)
    monkeypatch.setattr(linears[0], "dense_product", slow)
    return weights.measure_block_rows(linears, rounds=2)


def test_one_noisy_loss_does_not_end_the_crossover_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks that lose only at 5 rows (a noise spike) and from 16 rows on: the scan goes past 5 and stops at 12."""
    assert _crossover_with_blocks_delayed(monkeypatch, lambda rows: 0.030 if rows == 5 or rows >= 16 else 0.0) == 12


def test_blocks_that_lost_once_keep_the_largest_candidate_they_won(monkeypatch: pytest.MonkeyPatch) -> None:
    """One loss (at 48 rows) does not end the scan, but the blocks then serve up to the last candidate, not every
    pass: only blocks that never lost are trusted beyond what was measured."""
    from agent_mtp.engine.fast import weights

    last = weights.CROSSOVER_CANDIDATES[-1]
    assert _crossover_with_blocks_delayed(monkeypatch, lambda rows: 0.030 if rows == 48 else 0.0) == last


def test_long_crossover_candidates_are_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds per path below LONG_PASS_ROWS rows, one from there (long passes are past the timer's noise)."""
    import time
    from collections import Counter

    from agent_mtp.engine.fast import weights

    linears = _block_linears(1)
    blocks, seen = linears[0].blocks_product, Counter[int]()

    def counted(x: torch.Tensor, norm: Any = None) -> torch.Tensor:
        seen[x.shape[0]] += 1
        return blocks(x, norm)

    monkeypatch.setattr(linears[0], "blocks_product", counted)
    monkeypatch.setattr(linears[0], "dense_product", lambda x, norm=None: time.sleep(0.001) or blocks(x, norm))
    assert weights.measure_block_rows(linears, rounds=3) == weights.BLOCKS_EVERY_PASS
    assert all(seen[r] == (3 if r < weights.LONG_PASS_ROWS else 1) for r in weights.CROSSOVER_CANDIDATES)


def test_kernel_form_sample_holds_every_quantization_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The form measurement times the Q8_0 output head beside the Q4_1 layers (their lane kernels differ: on Zen 4
    one form of the Q8_0 kernel ran 2x slower than the other while the Q4_1 layers' forms were even), and reads past
    the caches when the model allows."""
    from agent_mtp.engine.fast import weights
    from agent_mtp.engine.fast.weights import PackedLinear

    layers = _block_linears(6)
    head = PackedLinear(q8_0(torch.randn(64, 128)), prepack=False)
    assert head.blocks is not None and head.blocks.kind == "q8_0"
    monkeypatch.setattr(weights, "FORM_BYTES", 1)  # the smallest budget: one linear of each kind
    assert weights._form_sample([*layers, head]) == [layers[0], head]
    monkeypatch.setattr(weights, "FORM_BYTES", 1 << 40)  # more than the model: all of it
    sample = weights._form_sample([*layers, head])
    assert len(sample) == 7 and all(any(x is y for y in sample) for x in [*layers, head])


@pytest.mark.parametrize("faster", FORMS)
def test_kernel_form_measurement_keeps_the_faster_form_per_class(monkeypatch: pytest.MonkeyPatch, faster: Any) -> None:
    """Each kernel class keeps its AVX-512 form where that multiplies faster than its AVX2 form, and drops it where
    it does not (as Zen 4's lane kernels did while its row kernels gained, before the Q8_0 lane kernel was fixed)."""
    import time

    from agent_mtp.engine.fast import weights

    _wide_or_skip()
    linears = _block_linears(2)
    for linear in linears:
        product = linear.blocks_product

        lane_rows = blockq.LANE_ROWS[linear.blocks.kind]

        def slowed(
            x: torch.Tensor, norm: Any = None, product: Any = product, lane_rows: int = lane_rows
        ) -> torch.Tensor:
            serving = blockq.Wide.ROWS if x.shape[0] < lane_rows else blockq.Wide.LANES
            if (serving in blockq.avx512_forms()) != (serving in faster):
                time.sleep(0.005)
            return product(x, norm)

        monkeypatch.setattr(linear, "blocks_product", slowed)
    assert weights.measure_avx512(linears, rounds=2) == faster


def test_kernel_form_is_settled_once_per_process_unless_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    _wide_or_skip()
    calls: list[int] = []

    def measure(result: blockq.Wide) -> Any:
        return lambda: calls.append(1) or result

    with blockq.avx512(blockq.avx512_forms()):  # restores the process's forms afterwards
        monkeypatch.delenv(blockq.AVX512_ENV, raising=False)
        monkeypatch.setattr(blockq, "_settled", [])
        assert blockq.settle_avx512(measure(blockq.Wide.ROWS)) == blockq.Wide.ROWS
        assert blockq.avx512_forms() == blockq.Wide.ROWS
        assert blockq.settle_avx512(measure(blockq.Wide.NONE)) == blockq.Wide.ROWS and calls == [1]  # measured once
        with blockq.buffered_from(blockq.BUFFERED_ROWS):
            assert blockq.kernel_tag() == "blockq14-avx512rows"
        monkeypatch.setattr(blockq, "_settled", [])
        monkeypatch.setenv(blockq.AVX512_ENV, "1")
        with blockq.avx512(True):
            assert blockq.settle_avx512(measure(blockq.Wide.NONE)) == blockq.Wide.ALL and calls == [1]  # pinned


def test_crossover_can_be_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine("plain-llama", adapter=False)
    monkeypatch.setenv(blockq.ROWS_ENV, "7")
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fast.block_rows == 7
    assert fast.layers[0].gate_up.linear.reads_blocks(7) and not fast.layers[0].gate_up.linear.reads_blocks(8)
    cache = fast.new_cache()
    fast.forward(_random_ids(12, seed=1), cache, 1)
    seven = _random_ids(7, seed=2)
    assert torch.equal(fast.forward(seven, cache, 7), _fused_off(fast).forward(seven, _replay(fast, cache), 7))
    monkeypatch.setenv(blockq.ROWS_ENV, "eight")
    with pytest.raises(ConfigError, match="AGENT_MTP_BLOCK_ROWS='eight' is not a whole number"):
        FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)


def test_blocks_serving_every_pass_release_the_float32_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the blocks serve every pass, the float32 copies are dropped and long passes (a 40-token prompt, the
    Python layer loop) read the blocks, as close to the float32 GEMM as short passes are, masks and adapter included;
    a call that would read the released copy names what happened."""
    from agent_mtp.engine.fast import weights

    engine = _engine("plain-llama", adapter=True)
    dense = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, blocks=False)
    monkeypatch.setenv(blockq.ROWS_ENV, str(weights.BLOCKS_EVERY_PASS))
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    linears = [p.linear for layer in fast.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(x.dense_released and x.weight.numel() == 0 and x.reads_blocks(10_000) for x in linears)
    assert fast.lm_head.dense_released and linears[0].release_dense() == 0  # released once
    with pytest.raises(RuntimeError, match="float32 weights were released"):
        linears[0].dense_product(torch.randn(2, linears[0].in_features))
    ids = _random_ids(40, seed=3)
    cf, cd = fast.new_cache(), dense.new_cache()
    torch.testing.assert_close(fast.forward(ids, cf, 40), dense.forward(ids, cd, 40), atol=1e-4, rtol=1e-4)
    tail = [5, engine.mask_token_id, 7, engine.mask_token_id] * 9  # 36 rows with masks: the adapter's delta
    torch.testing.assert_close(fast.forward(tail, cf, 36), dense.forward(tail, cd, 36), atol=1e-4, rtol=1e-4)


def _fused_off(model: FastModel) -> FastModel:
    import copy

    loop = copy.copy(model)
    loop._fused = None
    return loop


def _replay(model: FastModel, cache: Any) -> Any:
    """A fresh cache holding the same first 12 positions (the prompt of the test above)."""
    fresh = model.new_cache()
    model.forward(_random_ids(12, seed=1), fresh, 1)
    return fresh


def test_small_models_keep_the_default_crossover(engine: MTPEngine) -> None:
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fast.block_rows == blockq.MAX_ROWS  # far below the bytes worth measuring
    dense = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, blocks=False)
    assert dense.block_rows == 0


def same_bits_however_the_threads_split(compute: Callable[[], torch.Tensor]) -> None:
    """``compute()`` on 1, 2 and 3 torch threads, and on 2 while another thread keeps a core busy (so the kernels'
    threads take each other's tasks at varying points), gives the same bits every time."""
    before = torch.get_num_threads()
    stop = threading.Event()

    def neighbour() -> None:
        while not stop.is_set():
            sum(range(20_000))  # holds the GIL and a core in slices, as a server's Python does

    try:
        torch.set_num_threads(1)
        reference = compute()
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(compute(), reference), threads
        busy = threading.Thread(target=neighbour, daemon=True)
        busy.start()
        torch.set_num_threads(2)
        assert all(torch.equal(compute(), reference) for _ in range(20))
    finally:
        stop.set()
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_products_do_not_depend_on_how_the_threads_split_the_tasks(kind: str) -> None:
    blocks = blockq.block_weights({"q4_1": q4_1, "q8_0": q8_0}[kind](torch.randn(520, 256)))
    assert blocks is not None
    for rows in (1, 3, 6, 9, 23):  # row kernels, lane kernels (6; Q8_0 from 2), buffered lane passes (9+)
        x = torch.randn(rows, 256)
        same_bits_however_the_threads_split(lambda x=x: blocks(x))


@pytest.mark.parametrize(
    ("start", "n", "heads", "kv_heads"),
    [(300, 5, 9, 3), (1500, 1, 9, 3), (1500, 3, 9, 3), (300, 1, 8, 2), (40, 2, 15, 3)],
)
def test_attention_does_not_depend_on_how_the_threads_split_the_tasks(
    start: int, n: int, heads: int, kv_heads: int
) -> None:
    """Also for a long cache and few tasks (one per key / value head), which threads take from each other, and where
    on 2 or more threads a group's query heads split into sets of two and one (on one thread they stay together)."""
    d = 64
    width = (heads + 2 * kv_heads) * d
    qkv, rope, history = torch.randn(n, width), _rope(n, d, seed=4), torch.randn(2, kv_heads, start + n, d)

    def attend() -> torch.Tensor:
        return torch.ops.agent_mtp_blockq.attend(
            qkv.clone(), rope, [history.clone()], [start], [n], heads, kv_heads, d, d**-0.5
        )

    same_bits_however_the_threads_split(attend)


def test_silu_mul_matches_torch_within_a_few_ulps() -> None:
    """The MLP's activation in one kernel call: silu(gate) * up, close to torch's silu and mul_ (its exp is the
    attention's polynomial), also where e^-x under- or overflows, and NaN stays NaN."""
    inter = 48
    gate_up = torch.randn(5, 2 * inter + 8) * 6  # a row stride wider than 2 * inter, as with adapter columns
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0])
    gate_up[1, 0] = float("nan")
    got = torch.ops.agent_mtp_blockq.silu_mul(gate_up, inter)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter : 2 * inter]
    assert got.shape == (5, inter) and got.is_contiguous()
    assert torch.isnan(got[1, 0]) and torch.isnan(want[1, 0])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)


def test_silu_mul_of_a_prefill_splits_its_rows_without_changing_a_bit() -> None:
    """A prefill's activation (rows x inter past the kernel's grain) runs on every thread; each element is the
    same operations as on one thread, and as each row alone (a decode pass's size, kept on the calling thread)."""
    inter = 1536
    gate_up = torch.randn(96, 2 * inter, generator=torch.Generator().manual_seed(7)) * 4
    same_bits_however_the_threads_split(lambda: torch.ops.agent_mtp_blockq.silu_mul(gate_up, inter))
    whole = torch.ops.agent_mtp_blockq.silu_mul(gate_up, inter)
    rows = torch.cat([torch.ops.agent_mtp_blockq.silu_mul(gate_up[r : r + 1], inter) for r in range(96)])
    assert torch.equal(whole, rows)


def test_silu_mul_rejects_bad_shapes_with_a_message() -> None:
    with pytest.raises(RuntimeError, match="inter % 8 == 0"):
        torch.ops.agent_mtp_blockq.silu_mul(torch.randn(2, 20), 10)
    with pytest.raises(RuntimeError, match="silu_mul needs"):
        torch.ops.agent_mtp_blockq.silu_mul(torch.randn(2, 8), 8)


def test_kernel_choices_are_measured_once_per_machine_and_read_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A model past CROSSOVER_BYTES measures the kernel choices it settles and stores them; the next process (its
    once-per-process settles reset) reads them without timing anything, and ``measure`` mode times them again."""
    from collections import Counter

    from agent_mtp.engine.fast import model as fast_model
    from agent_mtp.engine.fast.choices import CHOICES_ENV

    engine = _engine("plain-llama", adapter=False)
    monkeypatch.setenv("AGENT_MTP_CACHE", str(tmp_path))
    for env in (blockq.ROWS_ENV, blockq.AVX512_ENV, blockq.AMX_ROWS_ENV, CHOICES_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(fast_model, "CROSSOVER_BYTES", 0)  # time the tiny model as a large one
    calls = Counter[str]()

    def counted(name: str, value: Callable[[], Any]) -> Callable[[Any], Any]:
        return lambda linears: calls.update([name]) or value()

    # each measurement returns what the process already runs, so settling it changes no kernel setting
    monkeypatch.setattr(fast_model, "measure_avx512", counted("avx512", blockq.avx512_forms))
    monkeypatch.setattr(fast_model, "measure_buffered_rows", counted("buffered_rows", blockq.buffered_rows))
    monkeypatch.setattr(fast_model, "measure_tile_rows", counted("tile_rows", blockq.tile_rows))
    monkeypatch.setattr(fast_model, "measure_block_rows", counted("block_rows", lambda: 6))

    def new_process() -> FastModel:
        for settled in ("_settled", "_buffered_settled", "_tiles_settled"):
            monkeypatch.setattr(blockq, settled, [])
        return FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)

    first = new_process()
    kinds = {"tile_rows"} if blockq.tiles_active() else {"avx512", "buffered_rows"}
    assert first.block_rows == 6 and set(calls) == {*kinds, "block_rows"} and set(calls.values()) == {1}
    assert first.stored_choices is not None and first.stored_choices.path.is_file()
    second = new_process()
    assert second.block_rows == 6 and set(calls.values()) == {1}  # read back: nothing timed
    assert second.stored_choices is not None and set(second.stored_choices.read) == {*kinds, "block_rows"}
    monkeypatch.setenv(CHOICES_ENV, "measure")
    new_process()
    assert set(calls.values()) == {2}


def test_block_linears_pack_their_float32_weights_only_when_a_pass_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear with blocks lays its float32 weights out for oneDNN at the first pass that reads them (or when the
    fast model's crossover leaves long passes to them), never where the blocks serve every pass; without blocks at
    once. Same products either way."""
    from agent_mtp.engine.fast import weights
    from agent_mtp.engine.fast.weights import PackedLinear

    if not weights._can_prepack(torch.zeros(1, 1)):
        pytest.skip("oneDNN cannot pre-pack float32 weights here")
    packs: list[int] = []
    reorder = weights._reorder
    monkeypatch.setattr(weights, "_reorder", lambda dense, hint: packs.append(1) or reorder(dense, hint))
    w = q4_1(torch.randn(64, 128))
    x = torch.randn(5, 128)
    lazy = PackedLinear(w)
    assert lazy.blocks is not None and not lazy.packed and not packs
    torch.testing.assert_close(lazy.dense_product(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert lazy.packed and packs == [1]
    lazy.dense_product(x)
    assert packs == [1]  # once
    released = PackedLinear(w)
    released.release_dense()
    released.pack()
    assert packs == [1] and not released.packed  # the blocks serve every pass: never packed
    eager = PackedLinear(torch.randn(64, 128))  # no blocks
    assert eager.blocks is None and eager.packed and packs == [1, 1]
    engine = _engine("plain-llama", adapter=False)
    monkeypatch.setenv(blockq.ROWS_ENV, "7")  # long passes read the float32 weights: packed with the model
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert all(linear.packed for linear in fast._linears() if linear.blocks is not None)
