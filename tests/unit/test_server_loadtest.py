"""`agent-mtp loadtest` pieces on a tiny model: request bodies from suite prompts, a cell against a real server,
ratios and the table."""

from __future__ import annotations

import asyncio

from agent_mtp.bench.suites import load_suite
from agent_mtp.engine.cost import CostCurve
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.server.loadtest import LoadtestConfig, markdown, ratios, request_body, run_cell
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


def test_a_cell_against_a_tiny_server() -> None:
    engine = tiny_engine(adapter=True, max_positions=2048)
    engine.set_cost_curve(CostCurve(((1, 1.0), (8, 1.5), (32, 3.0))))
    service = Service(engine, concurrency="batched")
    settings = ServerSettings(model="tiny", served_model_name="default", policy="none")
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
