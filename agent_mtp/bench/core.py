"""Benchmark core: variants (HF generate peers and engine modes), interleaved runs, scoring, summaries.

    prompts = load_suite("agent")
    variants = variants_from_names(DEFAULT_VARIANTS)
    report = run_bench(engine, prompts, variants)          # timed runs, then (untimed) quality scoring
    report.summaries                                       # one VariantSummary per variant, all prompts
    report.suite_summaries["tool_call"]                    # the same per suite

Speed is measured per run (wall time, TTFT, forward passes) and pooled per variant; ratios are to the first
HF ``generate`` variant measured in the same process. Quality is scored after all timed runs (see
:mod:`agent_mtp.bench.scoring`), against plain NTP decoding of the same prompt.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

import torch

from agent_mtp.bench.hf import BaselineModels, HFOutput, hf_generate, kernels_for
from agent_mtp.bench.scoring import mean_nll, repetition_rate, score_item, token_agreement
from agent_mtp.bench.suites import BenchPrompt, load_suite, prompt_grammar
from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.threads import compute, compute_threads
from agent_mtp.errors import ConfigError

__all__ = [
    "DEFAULT_THRESHOLDS",
    "DEFAULT_VARIANTS",
    "QUICK_VARIANTS",
    "BenchPrompt",
    "BenchReport",
    "Run",
    "Variant",
    "VariantSummary",
    "default_variants",
    "load_suite",
    "run_bench",
    "run_once",
    "score_runs",
    "summarise",
    "variant_from_name",
    "variants_from_names",
]

DEFAULT_THRESHOLDS = (0.6, 0.8, 0.9, 0.95)
HF_PROMPT_LOOKUP_TOKENS = 10
DEFAULT_VARIANTS = (
    "hf-generate-fp32",
    "hf-generate-bf16",
    "hf-prompt-lookup",
    "llama-cpp",
    "ntp@hf",
    "verified@hf",
    "ntp",
    "static-4",
    *(f"confadapt-{t:g}" for t in DEFAULT_THRESHOLDS),
    "verified",
    "verified-mtp",
    "verified-auto",
)
QUICK_VARIANTS = ("hf-generate-fp32", "llama-cpp", "ntp@hf", "verified@hf", "ntp", "confadapt-0.9", "verified")
REFERENCE_VARIANT = "ntp"


@dataclass(frozen=True)
class Variant:
    """One way of generating: HF ``generate`` (``config=None``) or an engine mode."""

    name: str
    config: DecodeConfig | None = None
    hf_dtype: torch.dtype | None = None
    """HF variants: the model's dtype (None: the engine's)."""
    prompt_lookup: int | None = None
    """HF variants: ``prompt_lookup_num_tokens`` (prompt lookup decoding)."""
    runtime: str | None = None
    """Engine variants: the runtime that runs them ("fast", "fast-fp32", "fast-avx2", "fast-avx512", "fast-amx",
    "fast-exact-masks", "fast-int16" or "hf"; None: the engine's own)."""
    peer: str | None = None
    """Peers outside transformers: "llama-cpp"."""

    @property
    def is_hf(self) -> bool:
        return self.config is None and self.peer is None


_VARIANT_NAMES = re.compile(
    r"^(?:(?P<hf>hf-generate-(?P<dtype>fp32|bf16))|(?P<lookup>hf-prompt-lookup)|(?P<llamacpp>llama-cpp)"
    r"|(?:(?P<ntp>ntp)|static-(?P<static>\d+)|confadapt-(?P<tau>\d+(?:\.\d+)?)(?P<cauto>-auto)?"
    r"|verified(?P<drafts>(?:-mtp)?(?:-ngram)?(?:-grammar)?)(?P<vauto>-auto)?)"
    r"(?:@(?P<runtime>fast-fp32|fast-avx2|fast-avx512|fast-amx|fast-exact-masks|fast-int16|fast|hf))?)$"
)


def variant_from_name(name: str, *, k_max: int = 8) -> Variant:
    """A variant from its name: ``hf-generate-fp32``, ``hf-generate-bf16``, ``hf-prompt-lookup``, ``llama-cpp``,
    ``ntp``, ``static-<k>``, ``confadapt-<tau>[-auto]``, ``verified[-mtp][-ngram][-grammar][-auto]`` (only the
    draft sources named, in that order, e.g. ``verified-ngram-grammar``; none named: all three; ``-auto``:
    ``k_max="auto"``); an engine variant may end in ``@fast`` or ``@hf`` to pick the
    runtime that runs it, ``@fast-fp32`` for the fast runtime without block weights (float32 GEMM only), or
    ``@fast-avx2`` for the fast runtime with its kernels in their AVX2 forms (on a CPU with AVX-512), ``@fast-avx512``
    for its AVX kernels instead of AMX tiles (on a CPU with AMX), ``@fast-amx`` for AMX tiles on every pass (on a CPU
    with AMX and VNNI, where short passes otherwise take VNNI), ``@fast-exact-masks`` for the fast runtime with
    ``verified``'s mask rows computed exactly (``draft_masks="exact"``), ``@fast-int16`` for real rows on the 16-bit
    grid (``row_grid="int16"``)."""
    m = _VARIANT_NAMES.match(name.strip())
    if m is None:
        msg = (
            f"Unknown bench variant {name!r}; use hf-generate-fp32, hf-generate-bf16, hf-prompt-lookup, llama-cpp, "
            "ntp, static-<k>, confadapt-<tau>[-auto] or verified[-mtp][-ngram][-grammar][-auto], engine variants "
            "optionally with @fast, @fast-fp32, @fast-avx2, @fast-avx512, @fast-amx, @fast-exact-masks, @fast-int16 "
            "or @hf."
        )
        raise ConfigError(msg)
    if m["llamacpp"]:
        return Variant(name, peer="llama-cpp")
    if m["runtime"]:
        base = variant_from_name(name.strip().rsplit("@", 1)[0], k_max=k_max)
        return dc_replace(base, name=name, runtime=m["runtime"])
    if m["hf"]:
        return Variant(name, None, torch.float32 if m["dtype"] == "fp32" else torch.bfloat16)
    if m["lookup"]:
        return Variant(name, None, torch.float32, HF_PROMPT_LOOKUP_TOKENS)
    if m["ntp"]:
        return Variant(name, DecodeConfig(mode="ntp"))
    if m["static"]:
        return Variant(name, DecodeConfig(mode="static", k_max=int(m["static"])))
    if m["tau"]:
        k: int | str = "auto" if m["cauto"] else k_max
        return Variant(name, DecodeConfig(mode="confadapt", threshold=float(m["tau"]), k_max=k))  # type: ignore[arg-type]
    named = tuple(m["drafts"].split("-")[1:]) if m["drafts"] else ()
    drafts = named or DecodeConfig().drafts
    k = "auto" if m["vauto"] else k_max
    return Variant(name, DecodeConfig(mode="verified", k_max=k, drafts=drafts))  # type: ignore[arg-type]


def variants_from_names(names: Iterable[str], *, k_max: int = 8) -> list[Variant]:
    variants = [variant_from_name(n, k_max=k_max) for n in names if n.strip()]
    seen = [v.name for v in variants]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"Bench variants {seen} name one variant twice; list each once.")
    if not variants:
        raise ConfigError("No bench variants given; name at least one (e.g. ntp,verified).")
    return variants


def default_variants(*, thresholds: Sequence[float] = (0.9,), k_max: int = 8, include_hf: bool = True) -> list[Variant]:
    """HF generate (fp32), engine ntp, ConfAdapt at each threshold and verified."""
    names = (["hf-generate-fp32"] if include_hf else []) + ["ntp"]
    names += [f"confadapt-{t:g}" for t in thresholds] + ["verified"]
    return variants_from_names(names, k_max=k_max)


# -- runs -------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One timed generation, and (after :func:`score_runs`) its quality."""

    variant: str
    prompt_id: str
    token_ids: list[int]
    wall_s: float
    ttft_s: float
    forward_passes: int
    suite: str = ""
    kind: str = ""
    """How the item is scored (``BenchPrompt.score``)."""
    jump_forward_tokens: int = 0
    text: str = ""
    # quality (filled by score_runs)
    valid: bool | None = None
    success: bool | None = None
    task_output: str = ""
    nll: float = math.nan
    repetition: float = math.nan
    token_agreement: float = math.nan
    task_agreement: float = math.nan
    exact: float = math.nan

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def run_once(
    engine: MTPEngine,
    variant: Variant,
    prompt: BenchPrompt,
    *,
    grammar: bool = True,
    baselines: BaselineModels | None = None,
) -> Run:
    """Generate once for ``prompt`` with ``variant`` (constrained like AgentMTPChat when the prompt has tools or
    a response schema and ``grammar`` is on)."""
    ids = engine.encode_prompt(prompt.prompt_messages())
    models = baselines if baselines is not None else BaselineModels(engine)
    if variant.peer is not None:  # peers run on the engine's compute thread: one OpenMP pool (engine/threads.py)
        out = compute().run(lambda: models.llama_cpp().generate(ids, prompt.max_new_tokens, engine.eos_token_ids))
        return _peer_run(variant, prompt, out)
    compiled = prompt_grammar(engine, prompt) if grammar else None
    constraint = compiled.constraint() if compiled is not None else None
    if variant.config is None:
        return _peer_run(variant, prompt, compute().run(_hf_run, engine, models, variant, prompt, ids, constraint))
    # every prompt prefilled in full, as HF generate does (agent-mtp bench-prefix measures the prefix cache)
    config = variant.config.replace(max_new_tokens=prompt.max_new_tokens, prefix_cache=False)
    runner_engine = models.engine(variant.runtime)
    with kernels_for(variant.runtime):
        start = time.perf_counter()  # timed from outside, like HF generate: what the caller waits for
        result = runner_engine.generate(ids, config, constraint=constraint)
        wall = time.perf_counter() - start
    s = result.stats
    return Run(
        variant.name,
        prompt.id,
        result.token_ids,
        wall,
        s.ttft_s,
        s.forward_passes,
        prompt.suite,
        prompt.score,
        jump_forward_tokens=s.jump_forward_tokens,
    )


def _hf_run(
    engine: MTPEngine,
    models: BaselineModels,
    variant: Variant,
    prompt: BenchPrompt,
    ids: list[int],
    constraint: TokenConstraint | None,
) -> HFOutput:
    with models.use(variant.hf_dtype) as model:
        return hf_generate(
            engine, model, ids, prompt.max_new_tokens, prompt_lookup=variant.prompt_lookup, constraint=constraint
        )


def _peer_run(variant: Variant, prompt: BenchPrompt, out: HFOutput) -> Run:
    """A timed run of a peer (HF generate, llama.cpp), timed by the peer itself."""
    return Run(
        variant.name, prompt.id, out.token_ids, out.wall_s, out.ttft_s, out.forward_passes, prompt.suite, prompt.score
    )


def run_bench(
    engine: MTPEngine,
    prompts: Sequence[BenchPrompt],
    variants: Sequence[Variant],
    *,
    repeats: int = 1,
    warmup: bool = True,
    grammar: bool = True,
    score: bool = True,
    fresh_cost_curve: bool = True,
    gguf: str | Path | None = None,
    on_run: Callable[[Run], None] | None = None,
    on_score: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """Run every variant on every prompt, interleaved to cancel drift (prompt-major; the variant order is rotated
    by one for every prompt and repeat), then score the outputs (untimed) and summarise.

    ``fresh_cost_curve``: measure the forward cost curve now (in memory only) instead of using the one cached on
    disk, which may have been measured under other conditions; ``verified`` and ``-auto`` variants plan with it.
    ``gguf``: the model's GGUF file for the ``llama-cpp`` variant (found by itself for the default model)."""
    if repeats < 1:
        raise ConfigError(f"repeats={repeats}; use an int >= 1.")
    machine = machine_info()
    baselines = BaselineModels(engine, gguf=gguf)
    if warmup and prompts:
        probe = dc_replace(prompts[0], id="warmup", max_new_tokens=8)
        for variant in variants:
            run_once(engine, variant, probe, grammar=grammar, baselines=baselines)
    if fresh_cost_curve:
        for runtime in sorted({v.runtime or engine.runtime for v in variants if v.config and v.config.mode != "ntp"}):
            sibling = baselines.engine(runtime)
            with kernels_for(runtime):
                sibling.set_cost_curve(sibling.measure_cost_curve())
    runs: list[Run] = []
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            shift = (i + rep) % len(variants)
            for variant in [*variants[shift:], *variants[:shift]]:
                run = run_once(engine, variant, prompt, grammar=grammar, baselines=baselines)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    if score:
        score_runs(engine, prompts, runs, grammar=grammar, progress=on_score)
    by_suite: dict[str, list[Run]] = {}
    for r in runs:
        by_suite.setdefault(r.suite, []).append(r)
    machine["load_avg_1m_end"] = _load_average()
    return BenchReport(
        machine=machine,
        settings={
            "model": engine.model_id,
            "dtype": str(engine.model.dtype).replace("torch.", ""),
            "runtime": engine.runtime,
            "adapter": _adapter_info(engine),
            "prompts": len(prompts),
            "repeats": repeats,
            "grammar": grammar,
            "variants": [v.name for v in variants],
            "cost_curves": baselines.cost_curves(),
        },
        summaries=summarise(runs, variants),
        suite_summaries={suite: summarise(rs, variants) for suite, rs in by_suite.items()},
        runs=runs,
    )


def _adapter_info(engine: MTPEngine) -> dict[str, Any] | None:
    if engine.adapter is None:
        return None
    cfg = engine.adapter.config
    return {"rank": cfg.rank, "k_max_trained": cfg.k_max_trained, "training": cfg.training}


# -- scoring -------------------------------------------------------------------------------------------------------
def score_runs(
    engine: MTPEngine,
    prompts: Sequence[BenchPrompt],
    runs: Sequence[Run],
    *,
    grammar: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Fill the quality fields of ``runs``: item score, base-model NLL, repetition, agreement with NTP (the ``ntp``
    variant's output when it ran, else an extra untimed NTP decode)."""
    by_id = {p.id: p for p in prompts}
    reference: dict[str, list[int]] = {}
    for r in runs:
        if r.variant == REFERENCE_VARIANT:
            reference.setdefault(r.prompt_id, r.token_ids)
    ntp = Variant(REFERENCE_VARIANT, DecodeConfig(mode="ntp"))
    for p in prompts:
        if p.id not in reference:
            reference[p.id] = run_once(engine, ntp, p, grammar=grammar).token_ids
    prompt_ids = {p.id: engine.encode_prompt(p.prompt_messages()) for p in prompts}
    nll_cache: dict[tuple[str, tuple[int, ...]], float] = {}
    ref_scores = {pid: score_item(by_id[pid], engine.decode_tokens(ids), ids) for pid, ids in reference.items()}
    for done, r in enumerate(runs, 1):
        prompt = by_id[r.prompt_id]
        r.text = engine.decode_tokens(r.token_ids)
        item = score_item(prompt, r.text, r.token_ids)
        r.valid, r.success, r.task_output = item.valid, item.success, item.task_output
        key = (r.prompt_id, tuple(r.token_ids))
        if key not in nll_cache:
            nll_cache[key] = mean_nll(engine.score(prompt_ids[r.prompt_id], r.token_ids))
        r.nll = nll_cache[key]
        r.repetition = repetition_rate(r.token_ids)
        ref = reference[r.prompt_id]
        r.token_agreement = token_agreement(r.token_ids, ref)
        r.task_agreement = float(item.task_output == ref_scores[r.prompt_id].task_output)
        r.exact = float(r.token_ids == ref)
        if progress is not None:
            progress(done, len(runs))


# -- summaries -------------------------------------------------------------------------------------------------------
@dataclass
class VariantSummary:
    """Speed and quality of one variant over a set of runs (pooled: total tokens / total time or passes)."""

    variant: str
    runs: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    tokens_per_forward: float
    """Generated tokens / forward passes (prefill included; grammar jump-forward tokens count as generated)."""
    ttft_s: float
    """Median time to first token."""
    p50_latency_s: float
    p95_latency_s: float
    jump_forward_share: float = 0.0
    decode_tokens_per_s: float = math.nan
    """Tokens after the first / the time after the first token (pooled over runs that report a TTFT): the rate of the
    decode loop alone, where multi-token prediction acts; tokens/s also counts the prefill, which every variant of
    the engine pays alike (a long tool-calling prompt's prefill can take most of a short answer's time)."""
    prefill_share: float = math.nan
    """Time to the first token / wall time (pooled over runs that report a TTFT): the share of the time spent on the
    prompt's prefill, which no decoding speedup touches. Over a variant with this share, a decode loop that cost
    nothing at all would run at most 1 / share times as fast: the bound a per-suite target over the engine's NTP
    meets where prompts are long and answers short (a tool call's schemas)."""
    speedup_vs_hf: float = math.nan
    """tokens/s relative to the HF generate reference (>1 = faster)."""
    decode_speedup_vs_hf: float = math.nan
    """decode tokens/s relative to the HF generate reference's."""
    ttft_vs_hf: float = math.nan
    p50_vs_hf: float = math.nan
    p95_vs_hf: float = math.nan
    """Latency ratios to the HF reference (<1 = faster)."""
    ntp_match: float = math.nan
    """Fraction of outputs equal to NTP token for token."""
    token_agreement: float = math.nan
    task_agreement: float = math.nan
    valid_rate: float = math.nan
    """Well-formed outputs among items with a syntax (tool calls, JSON, ReAct)."""
    success_rate: float = math.nan
    """Outputs that match their item's reference, among items that have one."""
    tool_call_valid: float = math.nan
    tool_call_exact_vs_ntp: float = math.nan
    tool_call_exact_vs_ref: float = math.nan
    nll: float = math.nan
    """Base-model NLL per output token (pooled)."""
    repetition: float = math.nan


def summarise(runs: Iterable[Run], variants: Sequence[Variant]) -> list[VariantSummary]:
    """One summary per variant that has runs; ratios are to the first HF variant among them."""
    runs = list(runs)
    pairs = [(v, _summary(v.name, [r for r in runs if r.variant == v.name])) for v in variants]
    present = [(v, s) for v, s in pairs if s is not None]
    reference = next((s for v, s in present if v.is_hf), None)
    if reference is not None:
        for _, s in present:
            s.speedup_vs_hf = _ratio(s.tokens_per_s, reference.tokens_per_s)
            s.decode_speedup_vs_hf = _ratio(s.decode_tokens_per_s, reference.decode_tokens_per_s)
            s.ttft_vs_hf = _ratio(s.ttft_s, reference.ttft_s)
            s.p50_vs_hf = _ratio(s.p50_latency_s, reference.p50_latency_s)
            s.p95_vs_hf = _ratio(s.p95_latency_s, reference.p95_latency_s)
    return [s for _, s in present]


def _summary(name: str, mine: list[Run]) -> VariantSummary | None:
    if not mine:
        return None
    tokens = sum(r.tokens for r in mine)
    wall = sum(r.wall_s for r in mine)
    passes = sum(r.forward_passes for r in mine)
    latencies = sorted(r.wall_s for r in mine)
    ttfts = [r.ttft_s for r in mine if not math.isnan(r.ttft_s)]
    timed = [r for r in mine if not math.isnan(r.ttft_s)]
    decode_wall = sum(max(0.0, r.wall_s - r.ttft_s) for r in timed)
    timed_wall = sum(r.wall_s for r in timed)
    decode_tokens = sum(max(0, r.tokens - 1) for r in timed)
    tool = [r for r in mine if r.kind == "tool_call"]
    scored_tokens = [(r.nll, r.tokens) for r in mine if not math.isnan(r.nll) and r.tokens]
    return VariantSummary(
        variant=name,
        runs=len(mine),
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall else 0.0,
        tokens_per_forward=tokens / passes if passes else 0.0,
        ttft_s=statistics.median(ttfts) if ttfts else math.nan,
        p50_latency_s=percentile(latencies, 0.5),
        p95_latency_s=percentile(latencies, 0.95),
        jump_forward_share=sum(r.jump_forward_tokens for r in mine) / tokens if tokens else 0.0,
        decode_tokens_per_s=decode_tokens / decode_wall if decode_wall > 0 else math.nan,
        prefill_share=min(1.0, sum(ttfts) / timed_wall) if timed_wall > 0 else math.nan,
        ntp_match=_mean(r.exact for r in mine),
        token_agreement=_mean(r.token_agreement for r in mine),
        task_agreement=_mean(r.task_agreement for r in mine),
        valid_rate=_mean(float(r.valid) for r in mine if r.valid is not None),
        success_rate=_mean(float(r.success) for r in mine if r.success is not None),
        tool_call_valid=_mean(float(bool(r.valid)) for r in tool),
        tool_call_exact_vs_ntp=_mean(r.task_agreement for r in tool),
        tool_call_exact_vs_ref=_mean(float(bool(r.success)) for r in tool if r.success is not None),
        nll=sum(n * t for n, t in scored_tokens) / sum(t for _, t in scored_tokens) if scored_tokens else math.nan,
        repetition=_mean(r.repetition for r in mine),
    )


def _mean(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (nan when empty)."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# -- the report ------------------------------------------------------------------------------------------------------
@dataclass
class BenchReport:
    machine: dict[str, Any]
    summaries: list[VariantSummary]
    runs: list[Run] = field(default_factory=list)
    suite_summaries: dict[str, list[VariantSummary]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self, variant: str, suite: str | None = None) -> VariantSummary | None:
        rows = self.summaries if suite is None else self.suite_summaries.get(suite, [])
        return next((s for s in rows if s.variant == variant), None)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "machine": self.machine,
                "settings": self.settings,
                "summaries": [asdict(s) for s in self.summaries],
                "suite_summaries": {k: [asdict(s) for s in v] for k, v in self.suite_summaries.items()},
                "runs": [asdict(r) for r in self.runs],
            }
        )


def json_safe(value: Any) -> Any:
    """NaN/inf -> None, so the JSON is standard (``json.dumps`` would write NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _load_average() -> float | None:
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    import os
    import platform

    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "torch_threads": compute_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "load_avg_1m": _load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
