"""The engine on the real embedded default model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from agent_mtp.engine import DecodeConfig

PROMPTS = [
    "What's the weather in Paris? Answer with a JSON tool call to get_weather.",
    "List three fruits as a markdown list.",
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Add 17 and 25. Think step by step."},
    ],
]


def test_default_model_loads(default_engine):
    assert default_engine.model_id == "SmolLM2-135M-Instruct"
    assert default_engine.mask_token == "<mask>"
    assert default_engine.eos_token_ids == frozenset({2})
    assert default_engine.context_window >= 2048


@pytest.mark.parametrize("prompt", PROMPTS, ids=["tool", "list", "messages"])
def test_ntp_equals_hf_generate(bare_default_engine, prompt):
    engine = bare_default_engine
    ids = engine.encode_prompt(prompt)
    with torch.no_grad():
        hf = engine.model.generate(
            torch.tensor([ids]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
            suppress_tokens=[engine.mask_token_id],
        )[0, len(ids) :].tolist()
    ours = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=24)).token_ids
    assert ours == hf


@pytest.mark.parametrize("prompt", PROMPTS, ids=["tool", "list", "messages"])
def test_verified_equals_ntp(default_engine, prompt):
    ntp = default_engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=32))
    verified = default_engine.generate(prompt, DecodeConfig(mode="verified", k_max=8, max_new_tokens=32))
    assert verified.token_ids == ntp.token_ids
    assert verified.text == ntp.text
    assert verified.stats.forward_passes <= ntp.stats.forward_passes


def test_cli_generate_json(default_engine, monkeypatch):
    from agent_mtp import cli

    monkeypatch.setattr(cli, "load_engine", lambda *a, **k: default_engine)
    result = CliRunner().invoke(
        cli.app, ["generate", "Say hi.", "--mode", "verified", "--max-new-tokens", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"text", "token_ids", "finish_reason", "stats"}
    assert data["stats"]["mode"] == "verified" and len(data["token_ids"]) <= 8


def test_engine_example_runs(default_engine, monkeypatch, capsys):
    import runpy

    from agent_mtp.engine import MTPEngine

    monkeypatch.setattr(MTPEngine, "from_pretrained", classmethod(lambda cls, *a, **k: default_engine))
    module = runpy.run_path("examples/engine_basics.py")
    module["main"](max_new_tokens=16)
    out = capsys.readouterr().out
    assert "identical to NTP: True" in out
