"""Issue 16, item 6: data a Redis loses after acknowledging it is counted, not silent.

A private redis-server is SIGKILLed and restarted. With append-only persistence (fsync always) nothing is lost.
Without it the restart loads the last snapshot (or nothing): the steps written after it vanish, and the next
flush of the writer that wrote them reports exactly that many as ``lost_requests`` in the health counters (and in
``Telemetry.stats()``), so ``requests + lost_requests`` equals what was recorded.
"""

from __future__ import annotations

import time

import pytest

from agent_mtp.events import StepEvent
from agent_mtp.telemetry import Telemetry, TelemetryConfig
from agent_mtp.telemetry.queries import query_stats
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.redis


def _telemetry(server: RedisServer) -> Telemetry:
    return Telemetry(server.url, config=TelemetryConfig(socket_timeout_s=0.5), start=False)


def _record(telemetry: Telemetry, n: int) -> None:
    for i in range(n):
        telemetry.record(StepEvent(step_type="tool_call", mode="verified", outcome="ok", latency_s=0.01 * (1 + i)))
    assert telemetry.flush(), telemetry.stats().last_error


def _crash_and_restart(server: RedisServer, telemetry: Telemetry, *, forget_snapshot: bool = False) -> None:
    server.kill()
    _record_fails(telemetry)
    if forget_snapshot:
        (server.directory / "dump.rdb").unlink()
    server.start()


def _record_fails(telemetry: Telemetry) -> None:
    telemetry.record(StepEvent(step_type="tool_call", mode="verified", outcome="ok", latency_s=0.01))
    assert not telemetry.flush()  # the batch stays in the backlog and is sent after the restart


def _report(server: RedisServer) -> tuple[int, dict[str, int]]:
    report = query_stats(_store(server), window="5m", now=time.time())
    return report.total.requests, report.health


def _store(server: RedisServer):  # type: ignore[no-untyped-def]
    from agent_mtp.telemetry import redis_store

    return redis_store(server.url)


def test_sigkill_of_an_append_only_redis_loses_nothing(redis_server: RedisServer) -> None:
    telemetry = _telemetry(redis_server)
    _record(telemetry, 20)
    _crash_and_restart(redis_server, telemetry)
    _record(telemetry, 9)
    requests, health = _report(redis_server)
    assert requests == 20 + 1 + 9
    assert health.get("lost_requests", 0) == 0 and telemetry.stats().lost_requests == 0
    telemetry.close()


def test_sigkill_of_a_redis_without_persistence_reports_its_loss(redis_server_without_aof: RedisServer) -> None:
    server = redis_server_without_aof
    telemetry = _telemetry(server)
    _record(telemetry, 12)
    server.client().save()  # a snapshot with the first 12 steps: the restart loads it
    _record(telemetry, 7)  # acknowledged, in memory only
    _crash_and_restart(server, telemetry)
    _record(telemetry, 5)
    requests, health = _report(server)
    assert requests == 12 + 1 + 5  # the 7 steps after the snapshot are gone ...
    assert health["lost_requests"] == 7 and health["lost_data_events"] == 1  # ... and counted
    assert telemetry.stats().lost_requests == 7
    _crash_and_restart(server, telemetry, forget_snapshot=True)  # no snapshot at all: everything is gone
    _record(telemetry, 2)
    requests, health = _report(server)
    assert requests == 1 + 2 and health == {"lost_data_events": 1, "lost_requests": 12 + 7 + 1 + 5}
    telemetry.close()


def test_another_writer_restarting_is_no_loss(redis_server_without_aof: RedisServer) -> None:
    """Each process has its own epoch counter: a new writer (or a writer idle since before the retention) never
    reports the data of another as lost."""
    first = _telemetry(redis_server_without_aof)
    _record(first, 3)
    first.close()
    second = _telemetry(redis_server_without_aof)
    _record(second, 4)
    requests, health = _report(redis_server_without_aof)
    assert requests == 7 and "lost_requests" not in health
    second.close()
