"""Training data: ShareGPT streaming (truncated JSON), the split, the JSONL cache, agent prompts, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent_mtp.errors import TrainingError
from agent_mtp.training.agent_prompts import KINDS, agent_prompts
from agent_mtp.training.cli import parse_layers, register
from agent_mtp.training.data import RESPONSES_FILE, read_records, sharegpt_prompts, split_of


def conversation(i: int, text: str) -> dict[str, object]:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}


def test_sharegpt_stream_survives_a_truncated_tail(tmp_path: Path) -> None:
    records = [conversation(i, f"question number {i} about something") for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.rfind("question number 4") + 5]  # the file ends inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    got = list(sharegpt_prompts(100, path=path))
    assert [p.id for p in got] == ["sharegpt-c0", "sharegpt-c1", "sharegpt-c2", "sharegpt-c3"]
    assert got[0].messages == [{"role": "user", "content": "question number 0 about something"}]
    assert len(list(sharegpt_prompts(2, path=path))) == 2


def test_sharegpt_stream_reads_across_chunk_boundaries(tmp_path: Path) -> None:
    from agent_mtp.training import data

    records = [conversation(i, "x" * 50 + str(i)) for i in range(40)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(records))
    got = list(data._stream_json_array(path, json.JSONDecoder(), chunk=64))
    assert [r["id"] for r in got] == [f"c{i}" for i in range(40)]


def test_split_is_stable_and_roughly_the_fraction() -> None:
    ids = [f"agent-0-{i}" for i in range(2000)]
    held = [i for i in ids if split_of(i, 0.1) == "heldout"]
    assert 140 < len(held) < 260
    assert held == [i for i in ids if split_of(i, 0.1) == "heldout"]


def test_agent_prompts_are_deterministic_and_cover_every_kind() -> None:
    a, b = list(agent_prompts(21, seed=3)), list(agent_prompts(21, seed=3))
    assert a == b
    assert {p.kind for p in a} == set(KINDS)
    assert list(agent_prompts(7, seed=4)) != list(agent_prompts(7, seed=3))


def test_read_records_errors_and_truncated_last_line(tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="--build-data"):
        read_records(tmp_path)
    rec = {"id": "a", "source": "agent", "kind": "list", "split": "train", "prompt_ids": [1, 2], "response_ids": [3]}
    (tmp_path / RESPONSES_FILE).write_text(json.dumps(rec) + "\n" + '{"id": "b", "sour')
    assert [r.id for r in read_records(tmp_path)] == ["a"]
    (tmp_path / RESPONSES_FILE).write_text("not json\n" + json.dumps(rec) + "\n")
    with pytest.raises(TrainingError, match=":1:"):
        read_records(tmp_path)


def test_parse_layers() -> None:
    assert parse_layers("all") is None
    assert parse_layers("8-11") == (8, 9, 10, 11)
    assert parse_layers("3,1,1") == (1, 3)
    with pytest.raises(TrainingError, match="--layers"):
        parse_layers("top")


def test_cli_rejects_bad_input_before_loading_a_model(tmp_path: Path) -> None:
    import typer

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `distill` a subcommand
    runner = CliRunner()
    result = runner.invoke(app, ["distill", "--k-max", "1", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--k-max 1" in result.output
    result = runner.invoke(app, ["distill", "--adapter", "lora", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "gated-lora" in result.output
    result = runner.invoke(app, ["distill", "--data-dir", str(tmp_path / "none")])
    assert result.exit_code == 2 and "No training data" in result.output
    result = runner.invoke(app, ["distill", "--data-only", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--build-data" in result.output
    result = runner.invoke(app, ["distill", "--real-pass-cache", "yes", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--real-pass-cache 'yes'" in result.output
    result = runner.invoke(
        app, ["distill", "--real-pass-cache", "on", "--teacher", "soft", "--data-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and "--teacher hard" in result.output


def test_speed_variants_parse_and_reject_bad_keys() -> None:
    from agent_mtp.errors import TrainingError
    from agent_mtp.training.speed import parse_variant

    v = parse_variant("fast:regions=128,k_max=8,dtype=bf16,reuse=0,attn=dense,embedding=0")
    assert (v.name, v.regions, v.objective.k_max, v.model_dtype) == ("fast", 128, 8, "bf16")
    assert not v.real_cache and parse_variant("c:cache=1").real_cache
    assert not v.objective.reuse_real_pass and not v.objective.banded_attention and not v.train_embedding
    for bad in ("fast:regionz=1", "fast:dtype=fp16", "fast:attn=sparse", ":regions=1", "fast:regions"):
        with pytest.raises(TrainingError):
            parse_variant(bad)


def test_interleave_spreads_sources_so_a_capped_build_has_both() -> None:
    from agent_mtp.training.data import PromptItem, interleave

    agent = [PromptItem(f"a{i}", "agent", "list", []) for i in range(8)]
    chat = [PromptItem(f"c{i}", "sharegpt", "chat", []) for i in range(2)]
    merged = interleave(agent, chat)
    assert [p.id for p in merged if p.source == "agent"] == [p.id for p in agent]  # order kept
    assert sorted(p.id for p in merged) == sorted(p.id for p in agent + chat)
    assert any(p.source == "sharegpt" for p in merged[:5])  # the first half already holds a chat prompt


def test_cli_leaves_value_checks_to_train_config() -> None:
    """Each bad option is refused once, by TrainConfig.validate (named with its option), before anything loads."""
    import inspect

    from agent_mtp.training import cli
    from agent_mtp.training.objective import ObjectiveConfig
    from agent_mtp.training.trainer import TrainConfig

    source = inspect.getsource(cli._distill)
    assert "k_max < 2" not in source and '("adapter", ("gated-lora", "full"))' not in source
    for field, value in (("teacher", "warm"), ("slots", "some"), ("k_sampling", "odd"), ("model_dtype", "fp8")):
        if field == "model_dtype":
            config = TrainConfig(model_dtype=value)  # type: ignore[arg-type]
        else:
            config = TrainConfig(objective=ObjectiveConfig(**{field: value}))
        with pytest.raises(TrainingError, match=f"--{field.replace('_', '-')} {value}"):
            config.validate()
