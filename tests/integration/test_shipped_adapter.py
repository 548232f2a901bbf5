"""The shipped MTP adapter of the default model: it loads, stays lossless, and is faster than an untrained mask.

The floors sit below what the shipped (CPU-trained, 4.4 hours in four phases) adapter reaches on these prompts; see
docs/default-model.md for the measured numbers and the training it would take to reach the issue's targets.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_mtp.engine import DecodeConfig
from agent_mtp.engine.adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config
from agent_mtp.engine.engine import DEFAULT_ADAPTER_DIR

PROMPTS = [
    "Give me 5 fruits as a numbered list.",
    "Make a markdown table of 3 planets with columns name and colour.",
    "Return a JSON object describing a person named Alice with the fields name, age, city.",
    [
        {
            "role": "system",
            "content": 'You are an assistant that calls tools. Available tools: [{"name":"get_weather",'
            '"parameters":{"city":"string"}}]\nTo call a tool, reply with only a JSON object: '
            '{"name": <tool name>, "arguments": {...}}.',
        },
        {"role": "user", "content": "What's the weather in Oslo?"},
    ],
]
K_MAX = 4  # the block size the shipped adapter was trained for
VERIFIED_FLOOR = 2.1
"""Pooled verified tokens/forward on PROMPTS without the cost-aware planner (measured 2.36 with the shipped phase-4
adapter, 2.27 with phase 2's; the untrained mask ~1.0)."""
CONFADAPT_09_FLOOR = 1.5
"""ConfAdapt tau 0.9 pooled tokens/forward: the issue's floor (measured 1.62 with the shipped adapter; phase 2:
1.46)."""

SHIPPED = Path(DEFAULT_ADAPTER_DIR)
CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct"
"""The last training checkpoint (adapter + optimizer state), committed beside the package, not inside it."""


def pooled_tpf(engine, cfg: DecodeConfig) -> tuple[float, list[list[int]]]:
    tokens = passes = 0
    outputs = []
    for prompt in PROMPTS:
        r = engine.generate(prompt, cfg)
        tokens += r.stats.new_tokens
        passes += r.stats.forward_passes
        outputs.append(r.token_ids)
    return tokens / passes, outputs


def test_shipped_adapter_files() -> None:
    assert (SHIPPED / CONFIG_FILE).is_file() and (SHIPPED / WEIGHTS_FILE).is_file()
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size <= 25 * 2**20, f"shipped adapter is {size / 2**20:.1f} MB"
    config = read_adapter_config(SHIPPED)
    assert config.base_model == "SmolLM2-135M-Instruct"
    assert config.mask_token == "<mask>"
    assert config.training.get("steps", 0) > 0


def test_default_engine_loads_the_shipped_adapter(default_engine) -> None:
    assert default_engine.adapter is not None
    assert default_engine.adapter.config.k_max_trained == K_MAX


def test_verified_is_lossless_and_above_its_floor(default_engine) -> None:
    """The floor measures the adapter: the cost-aware planner is off (its choices follow this machine's measured
    cost curve), so every pass verifies the whole MTP draft, as in the trainer's evaluation."""
    base = DecodeConfig(mode="ntp", k_max=K_MAX, max_new_tokens=48)
    _, ntp = pooled_tpf(default_engine, base)
    tpf, verified = pooled_tpf(default_engine, base.replace(mode="verified", drafts=("mtp",), cost_aware=False))
    assert verified == ntp
    assert tpf >= VERIFIED_FLOOR


def test_confadapt_09_floor(default_engine) -> None:
    cfg = DecodeConfig(mode="confadapt", threshold=0.9, k_max=K_MAX, max_new_tokens=48)
    tpf, _ = pooled_tpf(default_engine, cfg)
    assert tpf >= CONFADAPT_09_FLOOR


@pytest.mark.skipif(not CHECKPOINT.is_dir(), reason="no committed training checkpoint")
def test_committed_checkpoint_resumes(tmp_path: Path) -> None:
    """Training can continue on another machine from the committed checkpoint."""
    from agent_mtp.engine.loading import load_model
    from agent_mtp.training.data import Record
    from agent_mtp.training.objective import ObjectiveConfig
    from agent_mtp.training.trainer import TrainConfig, Trainer, checkpoint_adapter_dir

    lm = load_model("default")
    size = sum(p.stat().st_size for p in CHECKPOINT.iterdir())
    assert size <= 25 * 2**20, f"checkpoint is {size / 2**20:.1f} MB"
    config = read_adapter_config(checkpoint_adapter_dir(CHECKPOINT))
    cfg = TrainConfig(
        rank=config.rank, layers=config.layers, objective=ObjectiveConfig(k_max=config.k_max_trained), eval_prompts=0
    )
    record = Record("r", "agent", "list", "train", [1, 2, 3], [4, 5, 6])
    trainer = Trainer(
        lm,
        config=cfg,
        train=[record],
        heldout=[],
        out_dir=tmp_path,
        progress=False,
    )
    trainer.resume(CHECKPOINT)
    assert trainer.state.step == config.training["steps"]
