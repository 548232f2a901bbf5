"""The recorder without Redis: exact counts, bad input, bounded memory, idempotent retries, never blocking.

A store that can be "down" or "lose replies" stands in for the network here; the same paths run against a real
redis-server in tests/integration/test_telemetry_redis.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

from agent_mtp.errors import TelemetryError
from agent_mtp.events import InterventionEvent, Recorder, StepEvent
from agent_mtp.telemetry import MemoryStore, Telemetry, TelemetryConfig
from agent_mtp.telemetry import recorder as recorder_module
from agent_mtp.telemetry.aggregate import Batch
from agent_mtp.telemetry.store import WriteResult


class FlakyStore(MemoryStore):
    """A memory store whose transport is down (nothing applied) or loses replies (applied, then an error)."""

    def __init__(self, *, config: TelemetryConfig) -> None:
        super().__init__(config=config)
        self.down = False
        self.lose_reply = False
        self.writes = 0

    def write(self, batches: Sequence[Batch], writer: str) -> list[WriteResult | Exception]:
        self.writes += 1
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        results = super().write(batches, writer)
        if self.lose_reply:
            raise redis.TimeoutError("Timeout reading from socket")
        return results

    def ping(self) -> None:
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")


def _config(**overrides: object) -> TelemetryConfig:
    return TelemetryConfig(**overrides)  # type: ignore[arg-type]


def _step(step_type: str = "tool_call", mode: str = "confadapt", **fields: object) -> StepEvent:
    values: dict[str, object] = {"outcome": "ok", "latency_s": 0.1, "new_tokens": 10, "forward_passes": 4}
    values.update(fields)
    return StepEvent(step_type=step_type, mode=mode, **values)  # type: ignore[arg-type]


@pytest.fixture
def memory() -> Iterator[Telemetry]:
    telemetry = Telemetry(MemoryStore(config=_config()), config=_config(), start=False)
    yield telemetry
    telemetry.close()


def test_counters_and_ratios_are_exact(memory: Telemetry) -> None:
    for i in range(40):
        memory.record(
            _step(
                outcome="timeout" if i % 10 == 0 else "ok",
                attempts=2 if i % 4 == 0 else 1,
                fallback=i % 5 == 0,
                monitor_failures=("json_valid",) if i % 8 == 0 else (),
                latency_s=0.5,
                ntp_equivalent_s=1.0,
                new_tokens=30,
                forward_passes=10,
            )
        )
    for _ in range(10):
        memory.record(_step(step_type="reasoning", mode="ntp", outcome="error", latency_s=2.0))
    report = memory.query("1m")
    tool = report.select(step_type="tool_call")
    assert tool.requests == 40
    assert tool.timeout_ratio == pytest.approx(4 / 40)
    assert tool.retry_rate == pytest.approx(10 / 40)
    assert tool.fallback_rate == pytest.approx(8 / 40)
    assert tool.monitor_failure_rates == {"json_valid": pytest.approx(5 / 40)}
    assert tool.tokens_per_forward == pytest.approx(3.0)
    assert tool.speedup_vs_ntp == pytest.approx(2.0)
    assert tool.p95_s == pytest.approx(0.51)  # the upper edge of the 0.50-0.51 s bucket
    reasoning = report.select(step_type="reasoning", mode="ntp")
    assert (reasoning.requests, reasoning.error_rate, reasoning.speedup_vs_ntp) == (10, 1.0, None)
    assert report.total.requests == 50
    assert [(row.step_type, row.mode) for row in report.rows] == [
        ("reasoning", "ntp"),
        ("tool_call", "confadapt"),
    ]


def test_record_never_raises_and_counts_bad_input(memory: Telemetry) -> None:
    bad_inputs: list[object] = [
        None,
        "not an event",
        _step(latency_s=float("nan")),
        _step(latency_s=-1.0),
        _step(new_tokens=-3),
        _step(attempts=0),
        _step(outcome="weird"),
        _step(timestamp=float("inf")),
        _step(timestamp=time.time() + 10 * 86400),
        _step(monitor_failures="json_valid"),  # a string, not a tuple: ignored
    ]
    for item in bad_inputs:
        memory.record(item)  # type: ignore[arg-type]
    report = memory.query("1m")
    assert report.total.requests == 8
    assert report.health["invalid_events"] == 2
    assert report.health["invalid_values"] == 7
    assert report.total.monitor_failures == {}


def test_malicious_key_parts_are_counted_under_invalid(memory: Telemetry) -> None:
    for step_type in ("tool_call:*", "{agent_mtp}:t:f:x", "a\nb", "ok_type"):
        memory.record(_step(step_type=step_type, model="../../x y", monitor_failures=("bad name!",)))
    report = memory.query("1m")
    assert {row.step_type for row in report.rows} == {"_invalid_", "ok_type"}
    assert report.select(step_type="_invalid_").requests == 3
    assert report.total.monitor_failures == {"_invalid_": 4}
    assert {key.model for key, _ in report.series} == {"_invalid_"}
    assert report.health["invalid_key_parts"] == 3 + 4 + 4  # step types, models, monitor names


def test_series_per_flush_are_bounded_and_totals_stay_exact() -> None:
    config = _config(max_series_per_flush=4)
    telemetry = Telemetry(MemoryStore(config=config), config=config, start=False)
    for i in range(10):
        telemetry.record(_step(step_type=f"type{i}"))
    report = telemetry.query("1m")
    assert report.total.requests == 10
    assert len(report.rows) == 5
    assert report.select(step_type="_overflow_").requests == 6
    assert report.health["overflow_series"] == 6


def test_interventions_are_counted_and_listed(memory: Telemetry) -> None:
    memory.report_intervention("manual_intervention", step_type="tool_call", run_id="run-7", note="fixed args")
    memory.report_intervention("user_visible_failure", step_type="final_answer", note="x" * 5000)
    memory.record(InterventionEvent(kind="manual_intervention", step_type="tool_call"))
    report = memory.query("1m")
    assert report.select(step_type="tool_call").count("manual_interventions") == 2
    assert report.total.count("user_visible_failures") == 1
    assert report.total.requests == 0
    notes = report.recent_interventions
    assert [n["kind"] for n in notes] == [
        "manual_intervention",
        "user_visible_failure",
        "manual_intervention",
    ]
    assert notes[2]["run_id"] == "run-7" and len(notes[1]["note"]) == 500
    with pytest.raises(TelemetryError, match="unknown intervention kind 'oops'"):
        memory.report_intervention("oops", step_type="tool_call")  # type: ignore[arg-type]


def test_backlog_is_bounded_and_every_loss_is_counted_exactly() -> None:
    config = _config(max_backlog_buckets=3)
    store = FlakyStore(config=config)
    telemetry = Telemetry(store, config=config, start=False)
    telemetry.record(_step(step_type="before"))
    assert telemetry.flush()
    store.down = True
    recorded = 1
    for round_ in range(6):
        for step_type in ("a", "b"):
            for _ in range(round_ + 1):
                telemetry.record(_step(step_type=step_type))
                recorded += 1
        assert not telemetry.flush()
        assert telemetry.stats().backlog_buckets <= 3
    assert telemetry.stats().dropped_buckets > 0
    store.down = False
    assert telemetry.flush()
    report = telemetry.query("1m")
    assert report.total.requests + report.health["dropped_requests"] == recorded
    assert report.health["dropped_buckets"] == telemetry.stats().dropped_buckets
    assert 0 < report.total.requests < recorded


def test_a_retry_after_a_lost_reply_is_not_counted_twice() -> None:
    store = FlakyStore(config=_config())
    telemetry = Telemetry(store, config=_config(), start=False)
    for _ in range(5):
        telemetry.record(_step())
    store.lose_reply = True
    assert not telemetry.flush()  # applied, but the reply was lost
    store.lose_reply = False
    assert telemetry.flush()
    assert telemetry.query("1m").total.requests == 5
    stats = telemetry.stats()
    assert (stats.duplicate_batches, stats.backlog_batches) == (1, 0)


def test_a_dropped_batch_that_was_applied_is_not_counted_as_lost() -> None:
    config = _config(max_backlog_buckets=1)
    store = FlakyStore(config=config)
    telemetry = Telemetry(store, config=config, start=False)
    telemetry.record(_step(step_type="applied"))
    store.lose_reply = True
    assert not telemetry.flush()  # applied by the store, unknown to the recorder
    store.lose_reply, store.down = False, True
    telemetry.record(_step(step_type="lost"))
    telemetry.record(_step(step_type="lost"))
    assert not telemetry.flush()
    telemetry.record(_step(step_type="kept"))
    assert not telemetry.flush()  # the bound (1 bucket) husks both older batches
    store.down = False
    assert telemetry.flush()
    report = telemetry.query("1m")
    assert report.select(step_type="applied").requests == 1
    assert report.select(step_type="kept").requests == 1
    assert report.health["dropped_requests"] == 2  # only the batch that never reached the store
    assert report.total.requests + report.health["dropped_requests"] == 4


def test_record_does_not_wait_for_a_hung_store() -> None:
    """While the flusher thread is stuck inside a write, record() calls still return at once."""
    release, entered = threading.Event(), threading.Event()

    class HungStore(MemoryStore):
        def write(self, batches: Sequence[Batch], writer: str) -> list[WriteResult | Exception]:
            entered.set()
            release.wait(30)
            return super().write(batches, writer)

    config = _config(flush_interval_s=0.01)
    telemetry = Telemetry(HungStore(config=config), config=config)
    telemetry.record(_step())
    assert entered.wait(10), "the flusher thread never started a write"
    slowest = 0.0
    for _ in range(2000):
        start = time.perf_counter()
        telemetry.record(_step())
        slowest = max(slowest, time.perf_counter() - start)
    blocked_calls = int(slowest >= 1.0)  # a blocked call would wait until release (30 s)
    release.set()
    assert blocked_calls == 0
    assert telemetry.close()
    assert telemetry.query("1m", flush=False).total.requests == 2001


def test_memory_mode_says_so_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("AGENT_MTP_REDIS_URL", raising=False)
    monkeypatch.setattr(recorder_module, "_memory_notice_logged", False)
    with caplog.at_level(logging.WARNING, logger="agent_mtp.telemetry"):
        first, second = Telemetry(start=False), Telemetry(start=False)
    notices = [r for r in caplog.records if "no Redis configured" in r.getMessage()]
    assert len(notices) == 1 and notices[0].name == "agent_mtp.telemetry"
    assert first.backend == second.backend == "memory"


def test_close_flushes_and_the_context_manager_closes() -> None:
    store = MemoryStore(config=_config())
    with Telemetry(store, config=_config(flush_interval_s=3600)) as telemetry:
        telemetry.record(_step())
    assert telemetry.query("1m", flush=False).total.requests == 1
    assert telemetry.stats().pending_series == 0


def test_target_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(TelemetryError, match="got int"):
        Telemetry(42, start=False)  # type: ignore[arg-type]


def test_public_surface_is_pinned() -> None:
    import agent_mtp.telemetry as telemetry_package

    assert sorted(telemetry_package.__all__) == [
        "BUCKET_S",
        "ENV_NAMESPACE",
        "ENV_REDIS_URL",
        "MemoryStore",
        "MetricsRow",
        "RedisStore",
        "StatsReport",
        "Store",
        "Telemetry",
        "TelemetryConfig",
        "TelemetryStats",
        "WINDOWS",
        "parse_window",
        "process_telemetry",
        "query_stats",
        "redact_url",
        "redis_store",
        "timeline",
        "validate_key_part",
    ]
    assert isinstance(Telemetry(MemoryStore(config=_config()), config=_config(), start=False), Recorder)
