"""Forward-pass cost curves side by side: the HF forward, the fast runtime and llama.cpp, in one process.

For each runtime, a pass of n new tokens (n = 1, 2, 4, 8, 16) is timed on a cached prefix of ``context`` tokens; the
sizes and runtimes are interleaved in rounds and the fastest sample of each is kept (contention only adds time).
The engine's passes carry mask tokens (adapter rows, as MTP passes do) and return every row's logits the decoder
reads; llama.cpp's passes return the last row's logits only (its default), which flatters it slightly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_mtp.engine import MTPEngine
from agent_mtp.engine.engine import Runtime
from agent_mtp.engine.fast import FastRunner, blockq, unsupported_reason

SIZES = (1, 2, 4, 8, 16)


@dataclass
class CurveReport:
    context: int
    threads: int
    ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """runtime -> tokens per pass -> fastest time in ms."""

    def relative(self, runtime: str) -> dict[int, float]:
        base = self.ms[runtime][1]
        return {n: t / base for n, t in self.ms[runtime].items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "threads": self.threads,
            "ms": {r: {str(n): round(t, 3) for n, t in c.items()} for r, c in self.ms.items()},
            "relative": {r: {str(n): round(x, 3) for n, x in self.relative(r).items()} for r in self.ms},
        }


def _engine_pass(engine: MTPEngine, prefix: list[int], *, draft_masks: bool = False) -> Callable[[int], None]:
    """n-token passes (one real token, then masks) on a runner holding ``prefix``; ``draft_masks``: the masks are
    draft-only, as ``verified``'s (an 8-bit grid where the record paths serve the pass)."""
    runner = engine.new_runner()
    if draft_masks and isinstance(runner, FastRunner):
        runner.coarse_masks = True
    runner.forward(prefix, 1)

    def run(n: int) -> None:
        runner.forward([prefix[-1]] + [engine.mask_token_id] * (n - 1), n)
        runner.drop(n)

    return run


def _on_avx(run: Callable[[int], None], *, wide: bool) -> Callable[[int], None]:
    """The same passes on the AVX block kernels (AMX tiles and VNNI off), in their AVX-512 (``wide``) or AVX2 forms."""

    def on_avx(n: int) -> None:
        with blockq.avx_kernels(), blockq.avx512(blockq.avx512_forms() if wide else False):
            run(n)

    return on_avx


def _on_tiles(run: Callable[[int], None]) -> Callable[[int], None]:
    """The same passes with the AMX tiles for every pass (no short pass on VNNI)."""

    def on_tiles(n: int) -> None:
        with blockq.tiles_from(blockq.TILES_EVERY_PASS):
            run(n)

    return on_tiles


def _llama_cpp_pass(peer: Any, prefix: list[int]) -> Callable[[int], None]:
    llm = peer.llm
    llm.reset()
    llm.eval(prefix)

    def run(n: int) -> None:
        llm.n_tokens = len(prefix)  # eval() removes every position from here on first
        llm.eval(prefix[-n:] if n <= len(prefix) else prefix[-1:] * n)

    return run


def measure_curves(
    engine: MTPEngine, *, context: int = 300, rounds: int = 5, llama_cpp: Any = None, seed: int = 0
) -> CurveReport:
    """Time n-token passes on every runtime (``engine``'s model on "hf", "fast" and, where the fast runtime reads
    block weights, "fast-fp32" (float32 GEMM only), where its passes run on AMX tiles or VNNI, "fast-draft-masks"
    (the masks draft-only, as ``verified``'s: on an 8-bit grid), "fast-int16" and "fast-int16-draft-masks" (real rows
    on the 16-bit grid, ``row_grid="int16"``) and "fast-avx512" (the AVX kernels instead), where
    short passes take VNNI beside the AMX tiles, "fast-amx" and "fast-amx-draft-masks" (the tiles for every pass) and,
    where its kernels run in AVX-512, "fast-avx2" (the AVX kernels in their AVX2 forms), plus ``llama_cpp`` if
    given)."""
    high = min(1000, engine.mask_token_id)
    prefix = [int(t) for t in torch.randint(3, high, (context,), generator=torch.Generator().manual_seed(seed))]
    runtimes: tuple[Runtime, ...] = ("hf", "fast") if unsupported_reason(engine.model) is None else ("hf",)
    passes: dict[str, Callable[[int], None]] = {r: _engine_pass(engine.with_runtime(r), prefix) for r in runtimes}
    if "fast" in runtimes and blockq.kernel_tag() != "fp32":
        passes["fast-fp32"] = _engine_pass(engine.with_runtime("fast", block_weights=False), prefix)
        if blockq.records_active():
            passes["fast-draft-masks"] = _engine_pass(engine.with_runtime("fast"), prefix, draft_masks=True)
            int16 = engine.with_runtime("fast", row_grid="int16")  # real rows on the 16-bit grid
            passes["fast-int16"] = _engine_pass(int16, prefix)
            passes["fast-int16-draft-masks"] = _engine_pass(int16, prefix, draft_masks=True)
            if blockq.tiles_active() and blockq.tile_rows() != blockq.TILES_EVERY_PASS:
                passes["fast-amx"] = _on_tiles(passes["fast"])
                passes["fast-amx-draft-masks"] = _on_tiles(passes["fast-draft-masks"])
            passes["fast-avx512"] = _on_avx(passes["fast"], wide=True)
        if blockq.avx512_active():
            passes["fast-avx2"] = _on_avx(passes["fast"], wide=False)
    if llama_cpp is not None:
        passes["llama.cpp"] = _llama_cpp_pass(llama_cpp, prefix)
    report = CurveReport(context, torch.get_num_threads(), {name: {} for name in passes})
    for run in passes.values():  # warm-up
        run(1)
        run(4)
    for _ in range(rounds):
        for n in SIZES:
            for name, run in passes.items():
                start = time.perf_counter()
                run(n)
                ms = 1000 * (time.perf_counter() - start)
                report.ms[name][n] = min(report.ms[name].get(n, ms), ms)
    return report


def plot_curves(report: CurveReport, path: Path) -> Path:
    """Pass cost in ms by tokens per pass, one line per runtime (PNG)."""
    from agent_mtp.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, curve in report.ms.items():
        ns = sorted(curve)
        ax.plot(ns, [curve[n] for n in ns], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(SIZES), [str(n) for n in SIZES])
    ax.set_xlabel("tokens per forward pass")
    ax.set_ylabel("ms per pass (fastest of rounds)")
    ax.set_title(f"Forward pass cost, {report.context}-token context, {report.threads} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
