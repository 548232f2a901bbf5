"""Replica ids in telemetry: a replica's steps count in the fleet's aggregates (unchanged keys) and again under
its own namespace; ``agent-mtp stats --by-replica`` shows the fleet and each replica."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agent_mtp.cli import app as cli
from agent_mtp.errors import TelemetryError
from agent_mtp.events import StepEvent
from agent_mtp.telemetry import Telemetry, TelemetryConfig, redis_store
from agent_mtp.telemetry.config import replica_namespace
from agent_mtp.telemetry.queries import query_stats
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.redis


def _step(latency_s: float) -> StepEvent:
    return StepEvent(
        step_type="tool_call", mode="verified", outcome="ok", latency_s=latency_s, new_tokens=8, forward_passes=4
    )


def _write(url: str, replica: str | None, steps: int, latency_s: float) -> None:
    with Telemetry(config=TelemetryConfig(redis_url=url, namespace="fleet", replica=replica)) as telemetry:
        for _ in range(steps):
            telemetry.record(_step(latency_s))


def test_replica_steps_count_in_the_fleet_and_apart(redis_server: RedisServer) -> None:
    url = redis_server.url
    _write(url, "r1", 3, 0.1)
    _write(url, "r2", 5, 0.4)
    _write(url, None, 2, 0.2)  # a worker without a replica id: fleet only, as before
    fleet = query_stats(redis_store(url, namespace="fleet"), window="5m", namespace="fleet")
    assert fleet.total.requests == 10
    one = query_stats(redis_store(url, namespace=replica_namespace("fleet", "r1")), window="5m")
    two = query_stats(redis_store(url, namespace=replica_namespace("fleet", "r2")), window="5m")
    assert (one.total.requests, two.total.requests) == (3, 5)
    assert one.total.p95_s is not None and two.total.p95_s is not None and one.total.p95_s < two.total.p95_s

    result = CliRunner().invoke(
        cli, ["stats", "--redis-url", url, "--namespace", "fleet", "--by-replica", "--json", "--window", "5m"]
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["fleet"]["total"]["requests"] == 10
    assert {name: r["total"]["requests"] for name, r in body["replicas"].items()} == {"r1": 3, "r2": 5}
    table = CliRunner().invoke(cli, ["stats", "--redis-url", url, "--namespace", "fleet", "--by-replica"])
    assert table.exit_code == 0 and "replica r1" in table.output and "replica r2" in table.output


def test_a_replica_id_that_is_not_a_key_part_is_refused() -> None:
    with pytest.raises(TelemetryError, match="replica id"):
        TelemetryConfig(replica="bad id")
