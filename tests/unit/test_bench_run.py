"""Bench and A/B runs end to end on a tiny random model: real engine, real HF generate, real grammar, real plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from agent_mtp.bench.ab import run_ab, side_label
from agent_mtp.bench.cli import ab_table
from agent_mtp.bench.core import (
    QUICK_VARIANTS,
    Variant,
    run_bench,
    run_once,
    score_runs,
    variants_from_names,
)
from agent_mtp.bench.hf import bare_model
from agent_mtp.bench.markdown import report_markdown, suite_markdown, suite_ratio_markdown
from agent_mtp.bench.plots import write_plots
from agent_mtp.bench.suites import load_suite, parse_suite
from agent_mtp.engine import DecodeConfig
from agent_mtp.events import MemoryRecorder, StepEvent
from tests.tiny import tiny_engine

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SUITE = "\n".join(
    json.dumps(item)
    for item in [
        {"id": "t", "suite": "tool_call", "score": "tool_call", "tools": [TOOL], "max_new_tokens": 24,
         "messages": [{"role": "user", "content": "Weather in Paris?"}],
         "expected": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "j", "suite": "formatting", "score": "json", "max_new_tokens": 16, "expected": {"keys": ["a"]},
         "response_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
         "messages": [{"role": "user", "content": "a is 1"}]},
        {"id": "c", "suite": "chat", "score": "free", "max_new_tokens": 16,
         "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]},
    ]
)  # fmt: skip


def _engine(*, adapter: bool = True) -> Any:
    engine = tiny_engine(adapter=adapter)
    engine.model.config.max_position_embeddings = 2048  # room for the tool block (RoPE needs no table)
    return engine


@pytest.fixture(scope="module")
def engine() -> Any:
    return _engine()


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    return parse_suite(SUITE)


def test_bench_runs_every_variant_and_lossless_ones_equal_ntp(engine: Any, prompts: list[Any]):
    before = engine.generate("The quick brown", DecodeConfig(mode="verified", max_new_tokens=12)).token_ids
    names = ["hf-generate-fp32", "hf-generate-bf16", "hf-prompt-lookup", "ntp", "static-3", "confadapt-0.5",
             "verified", "verified-mtp", "verified-auto"]  # fmt: skip
    seen: list[str] = []
    report = run_bench(engine, prompts, variants_from_names(names, k_max=4), on_run=lambda r: seen.append(r.variant))
    assert len(seen) == len(report.runs) == len(names) * len(prompts)
    assert [s.variant for s in report.summaries] == names
    by = {s.variant: s for s in report.summaries}
    # The oracle: greedy HF generate, engine NTP and every verified variant write the same tokens (grammar too).
    for name in ("hf-generate-fp32", "hf-prompt-lookup", "ntp", "verified", "verified-mtp", "verified-auto"):
        assert by[name].ntp_match == 1.0, name
        assert by[name].token_agreement == 1.0 and by[name].task_agreement == 1.0
    assert by["hf-generate-fp32"].tokens_per_forward == 1.0  # one pass per token, prefill included
    assert by["hf-generate-fp32"].speedup_vs_hf == 1.0
    assert by["static-3"].tokens_per_forward > 1.5  # accepts every proposal: (almost) 3 per pass
    for s in report.summaries:
        assert s.tokens > 0 and s.tokens_per_s > 0 and s.p50_latency_s <= s.p95_latency_s
        assert 0 <= s.repetition <= 1 and math.isfinite(s.nll) and s.nll > 0
        assert not math.isnan(s.tool_call_valid)
    assert set(report.suite_summaries) == {"tool_call", "formatting", "chat"}
    assert report.summary("ntp", "chat") is not None
    # HF runs detach the adapter and put it back: MTP output is unchanged afterwards.
    assert engine.model._agent_mtp_adapter is engine.adapter
    after = engine.generate("The quick brown", DecodeConfig(mode="verified", max_new_tokens=12)).token_ids
    assert after == before
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["settings"]["variants"] == names and len(data["runs"]) == len(report.runs)
    # per suite over the engine's NTP (what the targets read): NTP itself 1.00 everywhere
    ratios = suite_ratio_markdown(report, "decode_tokens_per_s")
    assert ratios is not None
    lines = {line.split(" | ")[0]: line.strip("| ").split(" | ")[1:] for line in ratios.splitlines()[2:]}
    assert lines["| `ntp`"] == ["1.00"] * 4
    chat = report.summary("verified", "chat")
    assert chat is not None
    expected = chat.decode_tokens_per_s / report.summary("ntp", "chat").decode_tokens_per_s  # type: ignore[union-attr]
    assert lines["| `verified`"][list(report.suite_summaries).index("chat")] == f"{expected:.2f}"
    without_ntp = run_bench(engine, prompts[2:], variants_from_names(["verified"], k_max=4))
    assert suite_ratio_markdown(without_ntp, "tokens_per_s") is None
    assert "over the engine's NTP" in report_markdown(report)
    shares = suite_markdown(report, "prefill_share", lambda v: f"{100 * v:.0f}%")
    assert "before the first token" in report_markdown(report) and shares in report_markdown(report)
    assert all(0 < s.prefill_share < 1 for s in report.summaries)
    assert "over the engine's NTP" not in report_markdown(without_ntp)


def test_constrained_prompts_stay_inside_the_grammar(engine: Any, prompts: list[Any]):
    for variant in variants_from_names(["hf-generate-fp32", "hf-prompt-lookup", "verified"]):
        run = run_once(engine, variant, prompts[0])
        text = engine.decode_tokens(run.token_ids)
        assert text.startswith("<tool_call>\n{"), (variant.name, text)
        schema_run = run_once(engine, variant, prompts[1])
        assert engine.decode_tokens(schema_run.token_ids).startswith('{"a":'), variant.name
    unconstrained = run_once(engine, Variant("ntp", DecodeConfig(mode="ntp")), prompts[0], grammar=False)
    assert not engine.decode_tokens(unconstrained.token_ids).startswith("<tool_call>")


def test_scoring_without_an_ntp_variant_decodes_the_reference(engine: Any, prompts: list[Any]):
    runs = [run_once(engine, v, p) for p in prompts for v in variants_from_names(["verified", "static-3"], k_max=4)]
    score_runs(engine, prompts, runs)
    verified = [r for r in runs if r.variant == "verified"]
    assert all(r.exact == 1.0 and r.task_agreement == 1.0 for r in verified)
    assert all(r.text == engine.decode_tokens(r.token_ids) for r in runs)


def test_bare_model_detaches_and_restores_the_adapter(engine: Any):
    with bare_model(engine) as model:
        assert model._agent_mtp_adapter is None
    assert engine.model._agent_mtp_adapter is engine.adapter
    with pytest.raises(RuntimeError), bare_model(engine):
        raise RuntimeError("boom")
    assert engine.model._agent_mtp_adapter is engine.adapter


def test_plots_are_pngs(engine: Any, prompts: list[Any], tmp_path: Path):
    report = run_bench(engine, prompts[2:], variants_from_names(["hf-generate-fp32", "ntp", "confadapt-0.5",
                                                                 "confadapt-0.9", "verified"], k_max=4))  # fmt: skip
    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == ["frontier.png", "suites.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and tokenizer saved like a local checkpoint, for the command line."""
    engine = _engine(adapter=False)
    path = tmp_path_factory.mktemp("tiny-model")
    engine.model.save_pretrained(path)
    engine.tokenizer.save_pretrained(path)
    return path


def test_cli_quick_run_writes_json_and_plots(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from agent_mtp.cli import app
    from agent_mtp.engine.loading import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the measured cost curve of this throwaway model

    out = tmp_path / "out"
    threads = torch.get_num_threads()
    result = CliRunner().invoke(
        app, ["bench", "--quick", "--model", str(tiny_model_dir), "--adapter", "none", "--out", str(out),
              "--threads", "1"],
    )  # fmt: skip
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    # llama-cpp is left out (with a note) for a model without a GGUF file
    assert [s["variant"] for s in data["summaries"]] == [v for v in QUICK_VARIANTS if v != "llama-cpp"]
    assert "llama-cpp peer skipped" in result.output
    assert data["settings"]["prompts"] == len(load_suite("quick"))
    assert (out / "frontier.png").is_file() and (out / "suites.png").is_file()
    markdown = (out / "bench.md").read_text()
    assert "## Speed" in markdown and "`verified`" in markdown and "## Per suite" in markdown
    assert "tokens/fwd" in result.output or "tokens" in result.output


# -- A/B -------------------------------------------------------------------------------------------------------------
def test_ab_runs_both_policies_and_records_labelled_events(engine: Any, prompts: list[Any]):
    recorder = MemoryRecorder()
    report = run_ab(engine, prompts, "exact", "latency", recorder=recorder)
    events = [e for e in recorder.events if isinstance(e, StepEvent)]
    assert len(events) == 2 * len(prompts) == len(report.steps)
    labels = {e.model for e in events}
    assert labels == {side_label("tiny", "a", "exact"), side_label("tiny", "b", "latency")}
    a, b = report.sides["a"], report.sides["b"]
    assert a.policy == "exact" and b.policy == "latency"
    assert a.requests == b.requests == len(prompts)
    assert a.summary.ntp_match == 1.0  # the exact policy is lossless
    assert set(a.modes) == {"verified"}
    for side in (a, b):
        assert 0 <= side.timeout_ratio <= 1 and 0 <= side.retry_rate <= 1 and side.error_rate == 0
        assert side.summary.p95_latency_s >= side.summary.p50_latency_s > 0
    # Alternating order: the first prompt runs A first, the second B first.
    assert [s.side for s in report.steps[:4]] == ["a", "b", "b", "a"]
    json.dumps(report.to_dict(), allow_nan=False)
    console = Console(record=True, width=200)
    console.print(ab_table(report))
    text = console.export_text()
    for row in ("task agreement with NTP", "P95 latency s", "timeout ratio", "retry rate", "A: exact", "B: latency"):
        assert row in text


def test_side_label_is_a_valid_telemetry_key_part():
    from agent_mtp.telemetry import validate_key_part

    label = side_label("org/My Model:v1", "a", "my policy!")
    assert validate_key_part("model", label) == label == "org/My-Model-v1/ab-a-my-policy-"


@pytest.mark.redis
def test_ab_writes_its_runs_to_redis(engine: Any, prompts: list[Any], redis_server: Any):
    from agent_mtp.telemetry import Telemetry, TelemetryConfig

    config = TelemetryConfig(redis_url=redis_server.url, namespace="abtest")
    telemetry = Telemetry(config=config)
    run_ab(engine, prompts[2:], "exact", "default", recorder=telemetry)
    assert telemetry.close(timeout_s=10.0)
    stats = Telemetry(config=config, start=False).query("5m")
    assert stats.select(model=side_label("tiny", "a", "exact")).requests == 1
    assert stats.select(model=side_label("tiny", "b", "default")).requests == 1


@pytest.mark.redis
def test_cli_ab_prints_both_sides_and_flushes_to_redis(
    tiny_model_dir: Path, tmp_path: Path, redis_server: Any, monkeypatch: pytest.MonkeyPatch
):
    from agent_mtp.cli import app
    from agent_mtp.engine.loading import CACHE_ENV
    from agent_mtp.telemetry import Telemetry, TelemetryConfig

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    suite = tmp_path / "suite.jsonl"
    suite.write_text(SUITE + "\n")
    threads = torch.get_num_threads()
    result = CliRunner().invoke(
        app,
        ["ab", "--a", "exact", "--b", "latency", "--suite", str(suite), "--model", str(tiny_model_dir),
         "--adapter", "none", "--redis-url", redis_server.url, "--json-out", str(tmp_path / "ab.json"),
         "--threads", "1"],
    )  # fmt: skip
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "timeout ratio" in result.output and "flushed" in result.output
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["sides"]["a"]["policy"] == "exact" and data["sides"]["b"]["requests"] == 3
    stats = Telemetry(config=TelemetryConfig(redis_url=redis_server.url), start=False).query("5m")
    assert stats.total.requests == 6
    models = {key.model for key, _ in stats.series}
    assert any(m.endswith("/ab-a-exact") for m in models) and any(m.endswith("/ab-b-latency") for m in models)


# -- runtimes and peers ----------------------------------------------------------------------------------------------
def test_runtime_variants_run_side_by_side_with_equal_greedy_output(engine: Any, prompts: list[Any]):
    names = ["ntp@hf", "ntp@fast", "verified@hf", "verified", "verified@fast-fp32", "verified@fast-avx2"]
    variants = variants_from_names(names, k_max=4)
    assert [v.runtime for v in variants] == ["hf", "fast", "hf", None, "fast-fp32", "fast-avx2"]
    assert engine.runtime == "fast"
    report = run_bench(engine, prompts, variants, score=False)
    outputs: dict[str, dict[str, list[int]]] = {}
    for run in report.runs:
        outputs.setdefault(run.prompt_id, {})[run.variant] = run.token_ids
    for prompt_id, by_variant in outputs.items():
        assert len({tuple(ids) for ids in by_variant.values()}) == 1, prompt_id
    assert set(report.settings["cost_curves"]) == {"fast", "hf", "fast-fp32", "fast-avx2"}


def test_fast_avx2_variants_run_the_avx2_kernels():
    from agent_mtp.bench.hf import FAST_AVX2, kernels_for
    from agent_mtp.engine.fast import blockq

    if not blockq.kernels_available():
        pytest.skip("block-weight kernels unavailable here")
    before = blockq.avx512_active()
    with kernels_for(FAST_AVX2), blockq.buffered_from(blockq.BUFFERED_ROWS):
        assert not blockq.avx512_active() and blockq.kernel_tag() == "blockq14"  # its own cost curve
    assert blockq.avx512_active() == before
    with kernels_for("fast"):
        assert blockq.avx512_active() == before


def test_peer_and_runtime_names_are_validated():
    from agent_mtp.bench.core import variant_from_name
    from agent_mtp.errors import ConfigError

    assert variant_from_name("llama-cpp").peer == "llama-cpp"
    assert not variant_from_name("llama-cpp").is_hf
    assert variant_from_name("confadapt-0.8@hf").config.threshold == 0.8  # type: ignore[union-attr]
    assert variant_from_name("ntp@fast-fp32").runtime == "fast-fp32"
    assert variant_from_name("verified@fast-avx2").runtime == "fast-avx2"
    assert variant_from_name("ntp@fast-avx512").runtime == "fast-avx512"
    assert variant_from_name("verified@fast-exact-masks").runtime == "fast-exact-masks"
    assert variant_from_name("ntp@fast-int16").runtime == "fast-int16"
    drafts = {name: variant_from_name(name).config.drafts for name in ("verified", "verified-ngram-grammar")}  # type: ignore[union-attr]
    assert drafts == {"verified": ("mtp", "ngram", "grammar"), "verified-ngram-grammar": ("ngram", "grammar")}
    assert variant_from_name("verified-mtp-auto@hf").config.drafts == ("mtp",)  # type: ignore[union-attr]
    for bad in ("hf-generate-fp32@hf", "llama-cpp@fast", "ntp@gpu", "hf-generate-fp32@fast-fp32", "verified-ngram-mtp"):
        with pytest.raises(ConfigError, match="Unknown bench variant"):
            variant_from_name(bad)


def test_transcripts_with_and_without_prefix_cache(tmp_path: Path):
    from agent_mtp.bench.transcript import load_transcripts, run_transcripts
    from agent_mtp.errors import ConfigError

    shipped = load_transcripts("agent")
    assert len(shipped) >= 3 and all(t.turns and t.tools for t in shipped)
    line = {"id": "x", "tools": [TOOL], "max_new_tokens": 12,
            "messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}],
            "turns": [{"role": "tool", "content": "18 degrees"},
                      {"role": "user", "content": "And tomorrow?"}]}  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    engine = _engine()
    report = run_transcripts(engine, load_transcripts(str(path)), DecodeConfig(mode="verified", k_max=4))
    assert [r.step for r in report.rows] == [1, 2, 3]
    assert all(r.equal for r in report.rows)
    assert report.rows[0].cached_prompt_tokens == 0
    assert all(r.cached_prompt_tokens > r.prompt_tokens // 2 for r in report.rows[1:])
    summary = report.summary()
    assert set(summary) == {"step 1", "steps 2+"} and summary["steps 2+"]["equal"] == 1.0
    path.write_text('{"id": "x", "messages": "nope", "turns": []}\n')
    with pytest.raises(ConfigError, match=r"t\.jsonl:1"):
        load_transcripts(str(path))


def test_cli_demo_runs_every_mode_side_by_side(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from agent_mtp.cli import app
    from agent_mtp.engine.loading import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    args = ["demo", "--model", str(tiny_model_dir), "--adapter", "none", "--threads", "1"]
    result = CliRunner().invoke(app, [*args, "--rounds", "2"])
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    for label in ("HF generate", "verified", "confadapt", "fast runtime", "vs ntp", "median of 2 interleaved"):
        assert label in " ".join(result.output.split())
    for step in ("tool call", "reasoning step", "formatted list", "summary of a tool"):  # every step's rows
        assert step in " ".join(result.output.split())
    refused = CliRunner().invoke(app, [*args, "--rounds", "0"])
    assert refused.exit_code == 2 and "--rounds" in refused.output


def test_bench_runs_prefill_every_prompt_in_full(engine: Any, prompts: list[Any]):
    """Engine variants never read the prefix cache (HF generate and llama.cpp cannot): a fair comparison."""
    before = engine.prefix_cache.stats.lookups
    variant = variants_from_names(["verified"], k_max=4)[0]
    for _ in range(2):
        run_once(engine, variant, prompts[0])
    assert engine.prefix_cache.stats.lookups == before


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it() -> None:
    from agent_mtp.bench.core import Run, summarise

    runs = [
        # HF: 11 tokens in 2.5 s, the first after 0.5 s -> 10 tokens in 2.0 s
        Run("hf", "a", list(range(11)), wall_s=2.5, ttft_s=0.5, forward_passes=11),
        # engine: two runs pooled, 21 + 5 tokens; (20 + 4) tokens in (1.0 + 0.2) s after their first ones
        Run("ntp", "a", list(range(21)), wall_s=1.5, ttft_s=0.5, forward_passes=21),
        Run("ntp", "b", list(range(5)), wall_s=0.6, ttft_s=0.4, forward_passes=5),
        # a run without a TTFT is left out of the decode rate (not of tokens/s)
        Run("ntp", "c", list(range(7)), wall_s=0.3, ttft_s=math.nan, forward_passes=7),
    ]
    hf, ntp = summarise(runs, [Variant("hf"), Variant("ntp", config=DecodeConfig(mode="ntp"))])
    assert hf.decode_tokens_per_s == pytest.approx(5.0) and hf.decode_speedup_vs_hf == pytest.approx(1.0)
    assert ntp.decode_tokens_per_s == pytest.approx(24 / 1.2)
    assert ntp.decode_speedup_vs_hf == pytest.approx(4.0)
    assert ntp.tokens_per_s == pytest.approx(33 / 2.4)  # the prefill counted
    # the share of the time before the first token, pooled over the timed runs: (0.5 + 0.4) s of (1.5 + 0.6) s
    assert hf.prefill_share == pytest.approx(0.2) and ntp.prefill_share == pytest.approx(0.9 / 2.1)
    untimed = summarise([Run("ntp", "c", [1, 2], wall_s=0.3, ttft_s=math.nan, forward_passes=2)], [Variant("ntp")])
    assert math.isnan(untimed[0].prefill_share)
