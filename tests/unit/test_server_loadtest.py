"""`agent-mtp loadtest` pieces on a tiny model: request bodies from suite prompts, a cell against a real server,
ratios and the table."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent_mtp.bench.suites import load_suite
from agent_mtp.engine.cost import CostCurve
from agent_mtp.errors import ConfigError
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.server.loadtest import (
    Cell,
    LoadtestConfig,
    RequestRecord,
    check_base_url,
    markdown,
    pooled_summaries,
    ratios,
    request_body,
    run_cell,
    run_loadtest,
)
from agent_mtp.service import Service
from tests.fixtures.uvicorn_server import serving
from tests.tiny import tiny_engine


def test_request_bodies_carry_tools_choice_and_schema() -> None:
    prompts = load_suite("agent")
    tool = next(p for p in prompts if p.tools)
    body = request_body(tool, "verified", 32)
    assert body["tools"] and body["tool_choice"] == "required" and body["agent_mtp"]["mode"] == "verified"
    assert body["max_tokens"] == 32 and body["stream"] is True
    schema = next(p for p in prompts if p.response_schema is not None)
    assert request_body(schema, "default", 32)["response_format"]["type"] == "json_schema"
    assert request_body(schema, "default", 32)["agent_mtp"]["policy"] == "default"


def _tiny_service() -> tuple[Service, ServerSettings]:
    engine = tiny_engine(adapter=True, max_positions=2048)
    engine.set_cost_curve(CostCurve(((1, 1.0), (8, 1.5), (32, 3.0))))
    return Service(engine, concurrency="batched"), ServerSettings(
        model="tiny", served_model_name="default", policy="none"
    )


def test_a_cell_against_a_tiny_server() -> None:
    service, settings = _tiny_service()
    prompts = load_suite("agent")[:4]
    config = LoadtestConfig(requests_per_client=2, min_requests=4, max_tokens=8)
    with serving(create_app(settings, service=service)) as server:
        cells = [asyncio.run(run_cell(server.base_url, prompts, v, 2, config)) for v in ("ntp", "verified")]
    service.close()
    summaries = [c.summary() for c in cells]
    assert all(s["requests"] == 4 and s["error_ratio"] == 0 and s["tokens"] > 0 for s in summaries)
    assert all(r.ttft_s is not None for c in cells for r in c.records)
    report = {"ratios": ratios(summaries)}
    assert report["ratios"]["vs_ntp"][2]["ntp"] == 1.0
    assert "| 2 | verified |" in markdown(summaries, report)


def test_a_steady_state_cell_counts_only_tokens_inside_its_window() -> None:
    service, settings = _tiny_service()
    prompts = load_suite("agent")[:4]
    config = LoadtestConfig(max_tokens=8, duration_s=1.0)
    with serving(create_app(settings, service=service)) as server:
        cell = asyncio.run(run_cell(server.base_url, prompts, "ntp", 2, config))
    service.close()
    assert cell.window_end is not None and cell.wall_s == 1.0
    ended = [r for r in cell.records if r.chunk_times]
    assert ended and all(r.error is None for r in cell.records)
    # clients kept sending until the window closed: the last request of each started before it and some
    # request's chunks ran past it (their tokens are counted in part)
    summary = cell.summary()
    total = sum(r.tokens for r in cell.records)
    assert 0 < summary["tokens"] <= total
    assert summary["tokens_per_s"] == round(summary["tokens"] / 1.0, 3)


def test_tokens_before_a_deadline_spread_over_chunks() -> None:
    record = RequestRecord("p", tokens=10, chunk_times=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert record.tokens_before(0.5) == 0
    assert record.tokens_before(2.5) == 4
    assert record.tokens_before(9.0) == 10
    assert RequestRecord("q", tokens=3).tokens_before(0.0) == 3  # no chunk times (non-streaming): all of it


def _cell(policy: str, rounds_index: int, tokens: list[int], *, window_end: float | None = None) -> Cell:
    records = [
        RequestRecord(f"p{i}", latency_s=1.0 + i, tokens=t, chunk_times=[1.0, 2.0]) for i, t in enumerate(tokens)
    ]
    return Cell(policy, 8, 2.0, records, window_end, round_index=rounds_index)


def test_rounds_are_pooled_and_each_ratio_comes_with_its_spread() -> None:
    """Two rounds of two variants: pooled tokens/s over the summed time, each round's ratio to the same round's
    NTP, and the table shows the pooled ratio with the rounds' range."""
    cells = [
        _cell("ntp", 0, [10, 10]),
        _cell("verified", 0, [12, 10]),
        _cell("ntp", 1, [20, 20]),
        _cell("verified", 1, [18, 20], window_end=1.5),  # a steady-state cell: half of each request's chunks count
    ]
    pooled = pooled_summaries(cells)
    assert [(s["policy"], s["rounds"]) for s in pooled] == [("ntp", 2), ("verified", 2)]
    ntp, verified = pooled
    assert ntp["tokens"] == 60 and ntp["wall_s"] == 4.0 and ntp["tokens_per_s"] == 15.0
    assert verified["round_tokens_per_s"] == [11.0, 9.5] and verified["tokens"] == 22 + 19
    assert ntp["requests"] == 4 and ntp["p95_latency_s"] == 2.0  # latencies over every round's requests
    report = {"ratios": ratios(pooled)}
    assert report["ratios"]["vs_ntp"][8]["verified"] == round(41 / 60, 3)
    assert report["ratios"]["vs_ntp_rounds"][8]["verified"] == [1.1, 0.475]
    table = markdown(pooled, report)
    assert "Pooled over 2 rounds" in table and "0.68x (0.47-1.10)" in table


def test_a_single_round_keeps_the_plain_table() -> None:
    pooled = pooled_summaries([_cell("ntp", 0, [10]), _cell("verified", 0, [12])])
    report = {"ratios": ratios(pooled)}
    assert report["ratios"]["vs_ntp_rounds"] == {}
    table = markdown(pooled, report)
    assert "Pooled" not in table and "| 8 | verified | 6.0 | 1.20x |" in table


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True])
def test_a_bad_number_of_rounds_is_refused(rounds: object) -> None:
    with pytest.raises(ConfigError, match="rounds="):
        LoadtestConfig(rounds=rounds)  # type: ignore[arg-type]


def test_rounds_against_a_tiny_server_alternate_and_pool(tmp_path: Path) -> None:
    service, settings = _tiny_service()
    config = LoadtestConfig(
        clients=(1, 2), policies=("ntp", "verified"), suite="quick", requests_per_client=1, max_tokens=4, rounds=2
    )
    with serving(create_app(settings, service=service)) as server:
        report = run_loadtest(config, base_url=server.base_url, threads=None, out_dir=tmp_path)
    service.close()
    order = [(c["round"], c["clients"], c["policy"]) for c in report["round_cells"]]
    assert order == [(r, c, p) for r in (1, 2) for c in (1, 2) for p in ("ntp", "verified")]
    assert [(s["policy"], s["clients"], s["rounds"]) for s in report["cells"]] == [
        ("ntp", 1, 2),
        ("verified", 1, 2),
        ("ntp", 2, 2),
        ("verified", 2, 2),
    ]
    assert set(report["requests"]) == {f"{p}@{c}#{r}" for p in ("ntp", "verified") for c in (1, 2) for r in (1, 2)}
    written = json.loads((tmp_path / "loadtest.json").read_text())
    assert (
        written["ratios"]["vs_ntp_rounds"]["2"]["verified"]
        and "Pooled over 2 rounds" in (tmp_path / "loadtest.md").read_text()
    )
    assert (written["server_at_end"]["kv_cache"], written["server_at_end"]["row_grid"]) == ("fp32", "int24")
    assert "Server runtime: fast, KV cache fp32, real rows on the int24 grid." in (tmp_path / "loadtest.md").read_text()


def test_a_base_url_that_is_not_the_api_root_is_refused_before_any_cell(tmp_path: Path) -> None:
    """The server's root instead of its /v1 answered every request with an instant 404, and the cells ran their whole
    duration at 100% errors: the URL is checked first, and the message names the fix."""
    service, settings = _tiny_service()
    config = LoadtestConfig(clients=(1,), policies=("ntp",), suite="quick", requests_per_client=1, max_tokens=4)
    with serving(create_app(settings, service=service)) as server:
        root = server.base_url.removesuffix("/v1")
        assert check_base_url(server.base_url + "/") == server.base_url
        with pytest.raises(ConfigError, match=r"HTTP 404 \(did you mean .*/v1\?\)"):
            run_loadtest(config, base_url=root, threads=None, out_dir=tmp_path)
    service.close()
    assert not (tmp_path / "loadtest.json").exists()
    with pytest.raises(ConfigError, match="no server answered"):
        check_base_url(root)  # stopped


def test_a_server_that_asks_for_a_key_is_named_as_such() -> None:
    service, settings = _tiny_service()
    keyed = ServerSettings(**{**settings.model_dump(), "api_key": "s3cret-key"})
    with serving(create_app(keyed, service=service)) as server, pytest.raises(ConfigError, match="API key") as caught:
        check_base_url(server.base_url)
    service.close()
    assert "s3cret" not in str(caught.value)
