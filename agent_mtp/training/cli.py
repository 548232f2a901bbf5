"""`agent-mtp distill`: build the teacher data and train an MTP adapter by online self-distillation."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agent_mtp.errors import AgentMTPError, TrainingError
from agent_mtp.training.evaluate import EvalPrompt

if TYPE_CHECKING:
    from agent_mtp.training.trainer import TrainConfig


def register(app: typer.Typer) -> None:
    """Add `distill` to the `agent-mtp` app."""
    app.command("distill")(distill_command)
    app.command("distill-speed")(distill_speed_command)


def parse_layers(text: str | None, option: str = "--layers") -> tuple[int, ...] | None:
    """ "all" / None -> None; "8-29" -> 8..29; "0,5,7" -> (0, 5, 7)."""
    if text is None or text.strip().lower() in ("", "all"):
        return None
    layers: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                layers += range(lo, hi + 1)
            else:
                layers.append(int(part))
    except ValueError as e:
        raise TrainingError(f"{option} {text!r}: use 'all', a range like '8-29', or a list like '0,4,8'.") from e
    return tuple(sorted(set(layers)))


def distill_command(
    model: Annotated[str, typer.Option(help="Base model: 'default', a local dir or a hub id.")] = "default",
    adapter: Annotated[str, typer.Option(help="gated-lora | full")] = "gated-lora",
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 16,
    target_modules: Annotated[str, typer.Option("--target-modules", help="Comma-separated linear names.")] = (
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    ),
    layers: Annotated[str, typer.Option(help="Layers with LoRA: 'all', '8-29' or '0,4,8'.")] = "all",
    k_max: Annotated[int, typer.Option("--k-max", help="Largest block k trained (>= 2).")] = 8,
    k_sampling: Annotated[str, typer.Option("--k-sampling", help="expected | random")] = "expected",
    teacher: Annotated[str, typer.Option(help="hard (CE on teacher argmax) | soft (KL)")] = "hard",
    slots: Annotated[str, typer.Option(help="all | prefix (ablation: slots up to the first miss)")] = "all",
    steps: Annotated[int, typer.Option(help="Optimizer steps (cosine schedule length).")] = 1000,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-4,
    warmup: Annotated[int, typer.Option(help="Warmup steps.")] = 20,
    regions: Annotated[int, typer.Option(help="MTP regions per packed sequence.")] = 64,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Real tokens per packed sequence.")] = 384,
    agent_fraction: Annotated[float, typer.Option("--agent-fraction")] = 0.8,
    freeze_embedding_after: Annotated[int | None, typer.Option("--freeze-embedding-after")] = None,
    train_layers: Annotated[
        str,
        typer.Option(
            "--train-layers",
            help="LoRA layers the optimizer updates ('all' or e.g. '16-29'); the others keep their (resumed) values.",
        ),
    ] = "all",
    real_pass_cache: Annotated[
        str,
        typer.Option(
            "--real-pass-cache",
            help="auto | on | off: compute each record's real-token pass once and read it back on later draws "
            "(gated-lora, hard teacher; auto: on for CPU, off for CUDA, where that pass is cheap).",
        ),
    ] = "auto",
    real_pass_dir: Annotated[
        Path | None,
        typer.Option("--real-pass-dir", help="Keep that cache on disk here too, for later and resumed runs."),
    ] = None,
    real_pass_memory_gb: Annotated[
        float | None,
        typer.Option(
            "--real-pass-memory-gb",
            help="In-memory budget of the real-pass cache (default: a quarter of RAM, at most 8).",
        ),
    ] = None,
    bf16: Annotated[bool, typer.Option("--bf16/--fp32", help="bf16 autocast for the student pass.")] = False,
    model_dtype: Annotated[
        str, typer.Option("--model-dtype", help="fp32 | bf16: base weights of the training steps (bf16 twin).")
    ] = "fp32",
    out: Annotated[Path, typer.Option(help="Output folder (checkpoint/, adapter/, best/, log.jsonl).")] = Path(
        "runs/distill"
    ),
    resume: Annotated[Path | None, typer.Option(help="A checkpoint folder to continue from.")] = None,
    data_dir: Annotated[Path, typer.Option("--data-dir", help="Folder with responses.jsonl.")] = Path("runs/data"),
    build_data: Annotated[bool, typer.Option("--build-data", help="Generate missing teacher responses first.")] = False,
    data_only: Annotated[
        bool, typer.Option("--data-only", help="With --build-data: stop after the data is built (no training).")
    ] = False,
    agent_prompts: Annotated[int, typer.Option("--agent-prompts", help="Agent prompts (with --build-data).")] = 800,
    sharegpt_prompts: Annotated[int, typer.Option("--sharegpt-prompts", help="ShareGPT prompts.")] = 200,
    max_response_tokens: Annotated[int, typer.Option("--max-response-tokens")] = 96,
    gen_batch: Annotated[int, typer.Option("--gen-batch", help="Teacher generation batch size.")] = 32,
    data_minutes: Annotated[float | None, typer.Option("--data-minutes", help="Cap on generation time.")] = None,
    eval_every: Annotated[int, typer.Option("--eval-every")] = 100,
    eval_prompts: Annotated[int, typer.Option("--eval-prompts")] = 8,
    eval_max_new_tokens: Annotated[int, typer.Option("--eval-max-new-tokens")] = 48,
    checkpoint_minutes: Annotated[float, typer.Option("--checkpoint-minutes")] = 5.0,
    max_minutes: Annotated[float | None, typer.Option("--max-minutes", help="Stop training after this long.")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's choice).")] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    seed: int = 0,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="JSON lines instead of a bar.")] = False,
) -> None:
    """Train an MTP adapter by online self-distillation (the paper's hard-teacher recipe)."""
    try:
        _distill(**locals())
    except AgentMTPError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except KeyboardInterrupt:
        typer.echo(
            f"interrupted: checkpoint saved in {out / 'checkpoint'}; continue with --resume {out / 'checkpoint'}"
        )
        raise typer.Exit(130) from None


def unseen_tool_prompts(tokenizer: object, n: int) -> list[EvalPrompt]:
    """Tool-call prompts from a seed the training data never uses (the hash split may leave none held out)."""
    from agent_mtp.engine.prompt import render_messages
    from agent_mtp.training.agent_prompts import agent_prompts

    prompts = [p for p in agent_prompts(7 * n, seed=EVAL_SEED) if p.kind == "tool_call"][:n]
    return [EvalPrompt(p.kind, render_messages(tokenizer, p.messages)) for p in prompts]


EVAL_SEED = 7919


def _distill(**o: Any) -> None:
    import torch

    from agent_mtp.engine.loading import load_model
    from agent_mtp.engine.threads import use_caller_thread
    from agent_mtp.training.data import build_prompts, generate_responses
    from agent_mtp.training.trainer import Trainer, check_resume_base, load_data

    use_caller_thread()  # training and its evaluations share one thread's OpenMP pool (engine/threads.py)
    if o["threads"]:
        torch.set_num_threads(int(o["threads"]))
    if o["real_pass_cache"] not in ("auto", "on", "off"):
        raise TrainingError(f"--real-pass-cache {o['real_pass_cache']!r}: use one of auto, on, off.")
    if o["real_pass_cache"] == "on" and (o["adapter"] != "gated-lora" or o["teacher"] != "hard"):
        raise TrainingError(
            "--real-pass-cache on needs --adapter gated-lora and --teacher hard (a full fine-tune changes the real "
            "tokens' pass, and the soft teacher needs logits the cache does not keep); use auto or off."
        )
    device = str(o["device"])
    cfg = _train_config(o, device)
    cfg.validate()  # every bad value fails here, before the data or the model is loaded
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("--device cuda: no CUDA device is visible; use --device cpu.")
    data_dir = Path(o["data_dir"])
    if o["data_only"] and not o["build_data"]:
        raise TrainingError("--data-only builds data and stops; add --build-data (and the prompt counts) to use it.")
    if not o["build_data"]:
        load_data(data_dir)  # fail before the model loads when the data is missing
    lm = load_model(str(o["model"]))
    model = lm.model.to(device)
    if o["build_data"]:
        prompts = build_prompts(
            n_agent=int(o["agent_prompts"]), n_sharegpt=int(o["sharegpt_prompts"]), seed=int(o["seed"])
        )
        t0 = time.monotonic()
        generate_responses(
            model,
            lm.tokenizer,
            prompts,
            data_dir,
            max_new_tokens=int(o["max_response_tokens"]),
            batch_size=int(o["gen_batch"]),
            max_minutes=o["data_minutes"],
            progress=lambda d, n: typer.echo(f"teacher responses {d}/{n} ({time.monotonic() - t0:.0f}s)", err=True),
        )
        if o["data_only"]:
            train, heldout = load_data(data_dir)
            typer.echo(json.dumps({"data_dir": str(data_dir), "train": len(train), "heldout": len(heldout)}))
            return
    train, heldout = load_data(data_dir)
    if o["resume"] is not None:
        check_resume_base(o["resume"], model, lm.mask_token_id)
    trainer = Trainer(
        dataclasses.replace(lm, model=model),
        config=cfg,
        train=train,
        heldout=heldout,
        out_dir=o["out"],
        progress=not o["no_progress"],
        extra_eval=unseen_tool_prompts(lm.tokenizer, 2) if int(o["eval_prompts"]) > 0 else (),
        real_pass_dir=o["real_pass_dir"],
    )
    if o["resume"] is not None:
        trainer.resume(o["resume"])
    metrics = trainer.run()
    typer.echo(json.dumps({"out": str(o["out"]), "summary": trainer.summary(), "eval": metrics}, indent=2))


def _train_config(o: dict[str, Any], device: str) -> TrainConfig:
    """The training settings the ``distill`` options describe (validated by :meth:`TrainConfig.validate`)."""
    from agent_mtp.training.objective import ObjectiveConfig
    from agent_mtp.training.trainer import TrainConfig

    return TrainConfig(
        adapter=o["adapter"],
        rank=int(o["rank"]),
        model_dtype=o["model_dtype"],
        target_modules=tuple(t.strip() for t in str(o["target_modules"]).split(",") if t.strip()),
        layers=parse_layers(str(o["layers"])),
        objective=ObjectiveConfig(
            k_max=int(o["k_max"]),
            k_sampling=o["k_sampling"],
            teacher=o["teacher"],
            slots=o["slots"],
            bf16=bool(o["bf16"]),
        ),
        steps=int(o["steps"]),
        lr=float(o["lr"]),
        warmup=int(o["warmup"]),
        regions=int(o["regions"]),
        seq_len=int(o["seq_len"]),
        agent_fraction=float(o["agent_fraction"]),
        freeze_embedding_after=o["freeze_embedding_after"],
        train_layers=parse_layers(str(o["train_layers"]), "--train-layers"),
        real_pass_cache=o["real_pass_cache"] == "on" or (o["real_pass_cache"] == "auto" and device == "cpu"),
        real_pass_memory_gb=o["real_pass_memory_gb"],
        eval_every=int(o["eval_every"]),
        eval_prompts=int(o["eval_prompts"]),
        eval_max_new_tokens=int(o["eval_max_new_tokens"]),
        checkpoint_minutes=float(o["checkpoint_minutes"]),
        max_minutes=o["max_minutes"],
        seed=int(o["seed"]),
    )


DEFAULT_SPEED_VARIANTS = (
    "prototype:regions=64,k_max=8,bf16=0,reuse=0,attn=dense",
    "first-recipe:regions=160,k_max=4,bf16=1,reuse=0,attn=dense",
    "fast-k8:regions=256,k_max=8,dtype=bf16,embedding=0",
    "fast-k4:regions=256,k_max=4,dtype=bf16,embedding=0",
    "cached-k8:regions=256,k_max=8,dtype=bf16,embedding=0,cache=1",
    "cached-k4:regions=256,k_max=4,dtype=bf16,embedding=0,cache=1",
    "cached-k4-768:regions=512,seq_len=768,k_max=4,dtype=bf16,embedding=0,cache=1",
    "cached-k4-768-upper:regions=512,seq_len=768,k_max=4,dtype=bf16,embedding=0,cache=1,train_layers=16-29",
)
"""The prototype's recipe, the first shipped recipe, the fast path of phases 2-4 (k_max 8 and 4), the same with the
real-pass cache, and phase 5's recipe (768 real tokens, up to 512 regions per step) with all or the upper layers."""


def distill_speed_command(
    variant: Annotated[
        list[str] | None,
        typer.Option(
            help="name:key=value,... (regions, seq_len, k_max, bf16, reuse, embedding, dtype, attn, train_layers, "
            "cache); repeatable."
        ),
    ] = None,
    adapter_dir: Annotated[
        Path | None, typer.Option("--adapter-dir", help="Adapter to start from (default: the shipped one).")
    ] = None,
    data_dir: Annotated[Path, typer.Option("--data-dir", help="Folder with responses.jsonl.")] = Path("runs/data"),
    rank: Annotated[int, typer.Option(help="LoRA rank when no adapter exists to load.")] = 8,
    layers: Annotated[str, typer.Option(help="Layers with LoRA when no adapter exists to load.")] = "8-29",
    rounds: Annotated[int, typer.Option(help="Timed rounds (each runs every variant once).")] = 5,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's choice).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Supervised mask slots per second of trainer step variants, side by side in one process (CPU)."""
    try:
        results = _speed(
            variants=variant or list(DEFAULT_SPEED_VARIANTS),
            adapter_dir=adapter_dir,
            data_dir=data_dir,
            rank=rank,
            layers=layers,
            rounds=rounds,
            threads=threads,
        )
    except AgentMTPError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in results], indent=2))
        return
    from rich.table import Table

    from agent_mtp.cli_common import out

    table = Table(title="trainer steps side by side (objective + backward)")
    for i, column in enumerate(("variant", "s/step", "slots/step", "slots/s", "vs first", "teacher share")):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    base = results[0].slots_per_s
    for r in results:
        ratio = r.slots_per_s / base if base else float("nan")
        table.add_row(
            r.name,
            f"{r.seconds_per_step:.2f}",
            f"{r.slots_per_step:.0f}",
            f"{r.slots_per_s:.1f}",
            f"{ratio:.2f}x",
            f"{r.teacher_share:.2f}",
        )
    out.print(table)


def _speed(
    *,
    variants: list[str],
    adapter_dir: Path | None,
    data_dir: Path,
    rank: int,
    layers: str,
    rounds: int,
    threads: int | None,
) -> list[Any]:
    import torch

    from agent_mtp.engine.adapter import new_adapter
    from agent_mtp.engine.engine import MTPEngine
    from agent_mtp.engine.threads import use_caller_thread
    from agent_mtp.training.speed import measure_speed, parse_variant
    from agent_mtp.training.trainer import load_data

    use_caller_thread()  # training steps and engine passes are timed on one thread (engine/threads.py)
    if threads:
        torch.set_num_threads(threads)
    parsed = [parse_variant(v) for v in variants]
    train, _ = load_data(data_dir)
    engine = MTPEngine.from_pretrained("default", adapter=adapter_dir if adapter_dir is not None else "auto")
    adapter = engine.adapter or new_adapter(
        engine.model,
        base_model=engine.model_id,
        mask_token=engine.mask_token,
        mask_token_id=engine.mask_token_id,
        rank=rank,
        layers=parse_layers(layers),
    )
    for p in adapter.trainable_parameters():
        p.requires_grad_(True)
    return measure_speed(
        engine.model,
        adapter,
        train,
        parsed,
        rounds=rounds,
        mask_token_id=engine.mask_token_id,
        on_round=lambda r: typer.echo(f"round {r + 1} done", err=True),
    )
