"""The `agent-mtp` command line: generate, demo, bench, and the commands each part registers."""

from __future__ import annotations

import importlib
import json
import logging
import os
import statistics
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from agent_mtp.cli_common import (
    AdapterOpt,
    DtypeOpt,
    ModelOpt,
    RuntimeOpt,
    ThreadsOpt,
    console,
    load_engine,
    out,
    set_threads,
    threads_in_use,
)
from agent_mtp.errors import AgentMTPError

if TYPE_CHECKING:
    from agent_mtp.engine.fast.roofline import Roofline

app = typer.Typer(help="agent-mtp: multi-token prediction for agents on local models.", no_args_is_help=True)

# Parts register their own commands (kept out of this module so it stays small).
PART_CLIS = (
    "agent_mtp.policy.cli",
    "agent_mtp.telemetry.cli",
    "agent_mtp.telemetry.web.cli",
    "agent_mtp.training.cli",
    "agent_mtp.bench.cli",
    "agent_mtp.server.cli",
)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="User message (rendered with the chat template).")],
    mode: Annotated[str, typer.Option(help="ntp | static | confadapt | verified")] = "verified",
    threshold: float = 0.9,
    k_max: Annotated[str, typer.Option("--k-max", help='int or "auto"')] = "8",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 128,
    temperature: float = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    max_time: Annotated[float | None, typer.Option("--max-time", help="Seconds.")] = None,
    seed: int | None = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print {text, token_ids, finish_reason, stats}.")] = False,
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    runtime: RuntimeOpt = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Generate one answer and print it (or the stable JSON object with --json)."""
    from agent_mtp.engine import DecodeConfig

    set_threads(threads)
    cfg = DecodeConfig(
        mode=mode,  # type: ignore[arg-type]
        threshold=threshold,
        k_max="auto" if k_max == "auto" else _int_option("--k-max", k_max),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=tuple(stop or ()),
        max_time=max_time,
        seed=seed,
    )
    engine = load_engine(model, adapter, dtype, runtime)
    if as_json:
        out.print_json(json.dumps(engine.generate(prompt, cfg).to_dict()))
        return
    last = None
    for chunk in engine.stream(prompt, cfg):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if last is not None and last.stats is not None:
        s = last.stats
        console.print(
            f"[dim]{s.new_tokens} tokens, {s.forward_passes} passes, {s.tokens_per_forward:.2f} tokens/forward, "
            f"{s.tokens_per_second:.1f} tokens/s, finish={last.finish_reason}[/dim]"
        )


DEMO_PROMPTS = (
    ("tool call (JSON)", "tool-weather"),
    ("reasoning step", "reason-math"),
    ("formatted list", "format-list"),
    ("summary of a tool result", "summary-agent"),
)
"""The demo's agent steps: where drafting helps little (a tool call whose prefill is most of its time, a reasoning step
whose text drafts rarely predict) and where it helps most (restating a tool's output, which drafts copy from the
prompt)."""


@app.command()
def demo(
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    runtime: RuntimeOpt = "auto",
    threads: ThreadsOpt = None,
    threshold: float = 0.9,
    k_max: Annotated[int, typer.Option("--k-max", help="Most tokens per pass of verified (ConfAdapt picks k).")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved runs per cell; the table shows their median.")] = 3,
) -> None:
    """Agent-like prompts with HF generate, the engine's NTP loop and its MTP modes side by side: tokens/forward,
    tokens/s, speedup over HF generate and over the engine's NTP, exactness. ConfAdapt runs with k_max="auto"
    (k per pass from the measured cost curve). Each cell is the median of ``rounds`` runs, the variants and steps
    interleaved, so that one slow moment of the machine does not decide a ratio."""
    from agent_mtp.bench.core import Run, Variant, load_suite, run_once
    from agent_mtp.bench.hf import BaselineModels
    from agent_mtp.engine import DecodeConfig

    set_threads(threads)
    engine = load_engine(model, adapter, dtype, runtime)
    prompts = {p.id: p for p in load_suite("quick")}
    variants = [
        Variant("HF generate", None, engine.model.dtype),
        Variant("ntp", DecodeConfig(mode="ntp")),
        Variant("verified", DecodeConfig(mode="verified", k_max=k_max)),
        Variant(f"confadapt {threshold:g}", DecodeConfig(mode="confadapt", threshold=threshold, k_max="auto")),
    ]
    adapter_name = "shipped MTP adapter" if engine.adapter is not None else "no adapter (untrained mask)"
    console.print(
        f"[bold]{engine.model_id}[/bold] with {adapter_name}, {dtype}, {engine.runtime} runtime, "
        f"{threads_in_use()} threads"
    )
    models = BaselineModels(engine)
    with console.status("Warming up (weights, cost curve, every variant once) ..."):
        _ = engine.cost_curve
        for variant in variants:
            run_once(engine, variant, next(iter(prompts.values())), baselines=models)
    runs: dict[tuple[str, str], list[Run]] = {}
    with console.status(f"Running {rounds} interleaved round(s) ...") as status:
        for done in range(rounds):
            status.update(f"Round {done + 1} of {rounds} ...")
            for _, prompt_id in DEMO_PROMPTS:
                for variant in variants:
                    run = run_once(engine, variant, prompts[prompt_id], baselines=models)
                    runs.setdefault((prompt_id, variant.name), []).append(run)
    table = Table(title=f"agent-mtp demo: HF generate vs the engine ({engine.runtime} runtime) on agent-like steps")
    for col in ("step", "mode", "tokens", "tok/pass", "tok/s", "vs HF", "vs ntp", "= ntp"):
        table.add_column(col, justify="right" if col not in ("step", "mode") else "left")
    for label, prompt_id in DEMO_PROMPTS:
        cells = [runs[(prompt_id, v.name)] for v in variants]
        rates = [statistics.median(len(r.token_ids) / r.wall_s for r in cell) for cell in cells]
        reference = cells[1][0].token_ids
        for variant, cell, rate in zip(variants, cells, rates, strict=True):
            first = cell[0]
            table.add_row(
                label if variant is variants[0] else "",
                variant.name,
                str(len(first.token_ids)),
                f"{len(first.token_ids) / max(first.forward_passes, 1):.2f}",
                f"{rate:.1f}",
                f"{rate / rates[0]:.2f}x",
                "-" if variant.config is None else f"{rate / rates[1]:.2f}x",
                "-" if variant is variants[1] else ("yes" if all(r.token_ids == reference for r in cell) else "no"),
            )
        out.print(f"\n[bold]{label}[/bold]: {engine.decode_tokens(cells[2][0].token_ids).strip()[:300]}")
    out.print(table)
    out.print(
        "[dim]verified is lossless (= ntp token for token); confadapt trades exactness for speed. tok/s: the median "
        f"of {rounds} interleaved run(s) per cell; timings still vary +-10-30% between demo runs; `agent-mtp bench` "
        "runs more prompts, with pooled ratios.[/dim]"
    )


@app.command("measure-machine")
def measure_machine(
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    runtime: RuntimeOpt = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Measure this machine's kernel choices and forward cost curve again and store them (run it on an idle
    machine). Every process measures them once where none are stored and later ones read them; this replaces
    what a busy moment measured. The engine's settings from the environment (AGENT_MTP_ROW_GRID, AGENT_MTP_KV_CACHE,
    AGENT_MTP_DRAFT_MASKS) select the curve that is measured."""
    from agent_mtp.engine.fast.choices import CHOICES_ENV

    os.environ[CHOICES_ENV] = "measure"  # this process only: its runtime is prepared below
    set_threads(threads)
    engine = load_engine(model, adapter, dtype, runtime)
    with console.status("Measuring the kernel choices and the forward cost curve ..."):
        try:
            done = engine.measure_machine()
        except OSError as e:
            console.print(f"[red]Could not store the measurements ({e}); set AGENT_MTP_CACHE to a writable folder.")
            raise typer.Exit(2) from None
    table = Table(title=f"{engine.model_id}: {engine.runtime} runtime, {threads_in_use()} threads, {done.kernels}")
    table.add_column("measured")
    table.add_column("value", justify="right")
    for name, value in sorted(done.kernel_choices.items()):
        table.add_row(*_kernel_choice_row(name, value))
    curve = done.curve
    rows = (("points", "cost curve (1 real token + masks)"), ("draft", "draft-only masks"), ("real", "real tokens"))
    for attr, label in rows:
        points = getattr(curve, attr)
        if points:
            table.add_row(label, ", ".join(f"{n}: {c:.2f}" for n, c in points))
    if done.roofline is not None:
        for label, value in _roofline_rows(done.roofline):
            table.add_row(label, value)
    out.print(table)
    if done.choices_path is not None:
        out.print(f"kernel choices stored in {done.choices_path}")
    out.print(f"cost curve stored in {done.curve_path}")


def _roofline_rows(roofline: Roofline) -> list[tuple[str, str]]:
    """What the machine allows a pass, as table rows: the two rates, then per pass size the pass as measured and
    at the rates (engine/fast/roofline.py), each also relative to a one-token pass."""
    rates = roofline.rates
    threads = f"{rates.threads} thread{'' if rates.threads == 1 else 's'}"
    rows = [
        (f"memory read rate ({threads})", f"{rates.read_gb_s:.1f} GB/s"),
        (f"float32 GEMM rate ({threads}, in cache)", f"{rates.gemm_gmac_s:.0f} G multiply-adds/s"),
    ]
    base = dict(roofline.measured).get(1)
    for n, seconds in roofline.measured:
        measured = f"{seconds * 1e3:.1f} ms" + (f" ({seconds / base:.2f}x)" if base else "")
        at_rates = f"at the rates {roofline.at_rates(n) * 1e3:.1f} ms ({roofline.ratio_at_rates(n):.2f}x)"
        rows.append((f"{n}-token pass at {roofline.context} positions", f"{measured}, {at_rates}"))
    return rows


def _kernel_choice_row(name: str, value: object) -> tuple[str, str]:
    """A stored kernel choice as a table row a reader can follow (engine/fast/choices.py)."""
    from agent_mtp.engine.fast import blockq
    from agent_mtp.engine.fast.weights import BLOCKS_EVERY_PASS

    if name == "avx512" and isinstance(value, int) and 0 <= value <= blockq.Wide.ALL:
        return "kernels in their AVX-512 form", blockq.forms_name(blockq.Wide(value))
    if name == "buffered_rows":
        return "AVX2 lane passes multiply buffered weights", f"from {value} rows"
    if name == "block_rows" and isinstance(value, int):
        return (
            "passes that read the quantization blocks",
            "every pass" if value >= BLOCKS_EVERY_PASS else f"up to {value} rows",
        )
    if name.startswith("screen_rows") and isinstance(value, int):
        grid = name.removeprefix("screen_rows").removeprefix("_") or "int24"
        return (
            f"output head screens greedy rows ({grid} grid)",
            f"from {value} rows a pass" if value else "never (its exact rows were as fast)",
        )
    if name == "tile_rows" and isinstance(value, list):
        return "passes on the AMX tiles (else VNNI)", str(blockq.TileRows(*value))
    return f"kernel choice {name}", str(value)


def _int_option(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f'{name} must be an int or "auto", got {value!r}') from None


def _register_parts() -> None:
    for module_name in PART_CLIS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue
            raise
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_parts()


def main() -> None:
    logging.basicConfig(level=os.environ.get("AGENT_MTP_LOG_LEVEL", "WARNING"))
    try:
        app()
    except AgentMTPError as e:
        console.print(f"[red]error:[/red] {e}")
        raise SystemExit(2) from e


if __name__ == "__main__":
    main()
