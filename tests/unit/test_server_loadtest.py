"""`agent-mtp loadtest` pieces on a tiny model: request bodies from suite prompts, a cell against a real server,
ratios and the table."""

from __future__ import annotations

import asyncio

from agent_mtp.bench.suites import load_suite
from agent_mtp.engine.cost import CostCurve
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.server.loadtest import LoadtestConfig, RequestRecord, markdown, ratios, request_body, run_cell
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
