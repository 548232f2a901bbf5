"""Benchmark core: prompt suites, variants (HF generate and engine modes), interleaved runs, summary ratios."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.errors import ConfigError


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    suite: str
    messages: tuple[dict[str, str], ...]
    max_new_tokens: int = 64


@dataclass(frozen=True)
class Variant:
    """One way of generating: HF ``generate`` (``config=None``) or an engine mode."""

    name: str
    config: DecodeConfig | None = None
    hf_dtype: torch.dtype | None = None


@dataclass
class Run:
    variant: str
    prompt_id: str
    token_ids: list[int]
    wall_s: float
    ttft_s: float
    forward_passes: int


@dataclass
class VariantSummary:
    variant: str
    tokens: int
    wall_s: float
    tokens_per_s: float
    tokens_per_forward: float
    ttft_s: float
    p50_latency_s: float
    p95_latency_s: float
    speedup_vs_hf: float = 0.0
    ntp_match: float = 0.0
    """Fraction of prompts whose output equals engine NTP token for token."""


@dataclass
class BenchReport:
    machine: dict[str, Any]
    summaries: list[VariantSummary]
    runs: list[Run] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "summaries": [asdict(s) for s in self.summaries],
            "runs": [asdict(r) for r in self.runs],
        }


def load_suite(name_or_path: str = "quick") -> list[BenchPrompt]:
    """A shipped suite by name (``agent_mtp/bench/suites/<name>.jsonl``) or a JSONL file path."""
    path = Path(name_or_path)
    if path.suffix == ".jsonl" and path.is_file():
        text = path.read_text()
    else:
        resource = resources.files("agent_mtp.bench").joinpath("suites", f"{name_or_path}.jsonl")
        if not resource.is_file():
            shipped = sorted(
                p.name.removesuffix(".jsonl") for p in resources.files("agent_mtp.bench").joinpath("suites").iterdir()
            )
            raise ConfigError(f"Unknown bench suite {name_or_path!r}; use one of {shipped} or a .jsonl path.")
        text = resource.read_text()
    prompts = []
    for line in text.splitlines():
        if line.strip():
            item = json.loads(line)
            prompts.append(
                BenchPrompt(
                    item["id"],
                    item.get("suite", "misc"),
                    tuple(item["messages"]),
                    item.get("max_new_tokens", 64),
                )
            )
    return prompts


def default_variants(*, thresholds: Sequence[float] = (0.9,), k_max: int = 8, include_hf: bool = True) -> list[Variant]:
    variants = [Variant("hf-generate-fp32", None, torch.float32)] if include_hf else []
    variants.append(Variant("ntp", DecodeConfig(mode="ntp")))
    for tau in thresholds:
        variants.append(Variant(f"confadapt-{tau:g}", DecodeConfig(mode="confadapt", threshold=tau, k_max=k_max)))
    variants.append(Variant("verified", DecodeConfig(mode="verified", k_max=k_max)))
    return variants


def _hf_generate(engine: MTPEngine, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = engine.model.generate(
            torch.tensor([ids], device=engine.model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=sorted(engine.eos_token_ids)[0],
            suppress_tokens=[engine.mask_token_id],
        )
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def run_once(engine: MTPEngine, variant: Variant, prompt: BenchPrompt) -> Run:
    ids = engine.encode_prompt(list(prompt.messages))
    if variant.config is None:
        tokens, wall = _hf_generate(engine, ids, prompt.max_new_tokens)
        return Run(variant.name, prompt.id, tokens, wall, float("nan"), len(tokens))
    result = engine.generate(ids, variant.config.replace(max_new_tokens=prompt.max_new_tokens))
    s = result.stats
    return Run(variant.name, prompt.id, result.token_ids, s.wall_s, s.ttft_s, s.forward_passes)


def run_bench(
    engine: MTPEngine,
    prompts: Sequence[BenchPrompt],
    variants: Sequence[Variant],
    *,
    repeats: int = 1,
    warmup: bool = True,
    on_run: Callable[[Run], None] | None = None,
) -> BenchReport:
    """Run every variant on every prompt, interleaved (prompt-major, variant order rotated each repeat)."""
    if warmup and prompts:
        for variant in variants:
            run_once(engine, variant, BenchPrompt("warmup", "warmup", prompts[0].messages, 8))
    runs: list[Run] = []
    for rep in range(repeats):
        for prompt in prompts:
            order = list(variants[rep % len(variants) :]) + list(variants[: rep % len(variants)])
            for variant in order:
                run = run_once(engine, variant, prompt)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    return BenchReport(machine_info(), summarise(runs, variants), runs)


def summarise(runs: Iterable[Run], variants: Sequence[Variant]) -> list[VariantSummary]:
    runs = list(runs)
    ntp_outputs = {r.prompt_id: r.token_ids for r in runs if r.variant == "ntp"}
    summaries = []
    for variant in variants:
        mine = [r for r in runs if r.variant == variant.name]
        if not mine:
            continue
        tokens = sum(len(r.token_ids) for r in mine)
        wall = sum(r.wall_s for r in mine)
        passes = sum(r.forward_passes for r in mine)
        latencies = sorted(r.wall_s for r in mine)
        ttfts = [r.ttft_s for r in mine if r.ttft_s == r.ttft_s]
        matches = [r.token_ids == ntp_outputs.get(r.prompt_id) for r in mine if r.prompt_id in ntp_outputs]
        summaries.append(
            VariantSummary(
                variant=variant.name,
                tokens=tokens,
                wall_s=wall,
                tokens_per_s=tokens / wall if wall else 0.0,
                tokens_per_forward=tokens / passes if passes else 0.0,
                ttft_s=statistics.median(ttfts) if ttfts else float("nan"),
                p50_latency_s=_percentile(latencies, 0.5),
                p95_latency_s=_percentile(latencies, 0.95),
                ntp_match=sum(matches) / len(matches) if matches else float("nan"),
            )
        )
    reference = next((s for s in summaries if s.variant.startswith("hf-generate")), None)
    for s in summaries:
        s.speedup_vs_hf = (
            s.tokens_per_s / reference.tokens_per_s if reference and reference.tokens_per_s else float("nan")
        )
    return summaries


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def machine_info() -> dict[str, Any]:
    import os
    import platform

    return {
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
