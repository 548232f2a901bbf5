"""`agent-mtp distill-speed` on the default model: real trainer steps of each variant, side by side."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agent_mtp.cli import app
from agent_mtp.engine import MTPEngine
from agent_mtp.engine.prompt import render_messages


def _write_data(directory: Path, engine: MTPEngine) -> None:
    """A few records in the trainer's format: chat-template prompts and hand-written answers (a speed measurement
    needs tokens to anchor regions on, not the model's own outputs)."""
    tok = engine.tokenizer
    rows = []
    for i, (question, answer) in enumerate(
        [
            ("List three colours.", "1. Red\n2. Green\n3. Blue"),
            ("What is 2 + 3?", "2 + 3 = 5."),
            ("Call the weather tool for Oslo.", '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
        ]
    ):
        prompt_ids = render_messages(tok, [{"role": "user", "content": question}])  # as the data builder does
        response = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(
            {"id": f"t{i}", "source": "agent", "kind": "list", "split": "train", "prompt_ids": prompt_ids,
             "response_ids": response}
        )  # fmt: skip
    (directory / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_distill_speed_measures_each_variant(tmp_path: Path, default_engine: MTPEngine) -> None:
    _write_data(tmp_path, default_engine)
    variants = [
        "plain:regions=12,seq_len=96,bf16=0,reuse=0,attn=dense",
        "fast:regions=12,seq_len=96,dtype=bf16",
        "cached:regions=12,seq_len=96,dtype=bf16,cache=1",
    ]
    args = ["distill-speed", "--data-dir", str(tmp_path), "--rounds", "1", "--threads", "2", "--json"]
    result = CliRunner().invoke(app, args + [a for v in variants for a in ("--variant", v)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout[result.stdout.index("[") :])
    assert [r["name"] for r in rows] == ["plain", "fast", "cached"]
    for r in rows:
        assert r["slots_per_step"] == 12 * 3  # 12 regions x (k_max 4 - 1) masks
        assert r["slots_per_s"] > 0
    assert rows[0]["teacher_share"] == 1.0


def test_distill_speed_bad_variant_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["distill-speed", "--data-dir", str(tmp_path), "--variant", "x:regions"])
    assert result.exit_code == 2
    assert "is not key=value" in result.output
