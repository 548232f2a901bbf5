"""Telemetry against a real redis-server: exact fleet totals, crashes, slow or unreachable Redis, secrets.

Each test gets its own redis-server from tests/fixtures/redis_server.py (append-only file, fsync always, so a
SIGKILL loses nothing Redis acknowledged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agent_mtp.errors import TelemetryError
from agent_mtp.events import NullRecorder, Recorder, StepEvent
from agent_mtp.telemetry import Telemetry, TelemetryConfig, histogram, redis_store
from agent_mtp.telemetry.cli import register
from agent_mtp.telemetry.queries import StatsReport, query_stats
from tests.fixtures.redis_server import RedisServer, free_port

pytestmark = pytest.mark.redis

REPO_ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "Sup3r-S3cret-Pw"
WRONG_PASSWORD = "Wr0ng-Pa55-Guess"


def _config(**overrides: object) -> TelemetryConfig:
    values: dict[str, object] = {"flush_interval_s": 0.05, "socket_timeout_s": 0.5}
    values.update(overrides)
    return TelemetryConfig(**values)  # type: ignore[arg-type]


def _event(worker: int, i: int) -> StepEvent:
    """Deterministic events, so the parent can compute what every worker recorded."""
    return StepEvent(
        step_type=("tool_call", "reasoning", "formatting")[i % 3],
        mode=("confadapt", "verified")[worker % 2],
        outcome="timeout" if i % 11 == 0 else "ok",
        latency_s=0.003 * (1 + (i * 7 + worker) % 97),
        new_tokens=5 + i % 7,
        forward_passes=2 + i % 3,
        attempts=1 + (i % 5 == 0),
        fallback=i % 13 == 0,
        monitor_failures=("json_valid",) if i % 17 == 0 else (),
        ntp_equivalent_s=0.01,
    )


def _spawned_worker(url: str, namespace: str, worker: int, count: int) -> None:
    """Runs in a fresh interpreter; relies on the exit flush (no close())."""
    telemetry = Telemetry(url, config=_config(namespace=namespace))
    for i in range(count):
        telemetry.record(_event(worker, i))


def _forked_worker(telemetry: Telemetry, worker: int, count: int) -> None:
    """Runs in a forked child that inherited the parent's recorder with unflushed data."""
    for i in range(count):
        telemetry.record(_event(worker, i))


def _report(server: RedisServer, namespace: str = "agent_mtp", window: str = "5m") -> StatsReport:
    return query_stats(redis_store(server.url, namespace=namespace), window=window, namespace=namespace)


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _expected(events: list[StepEvent]) -> dict[str, object]:
    latency_hist: dict[int, int] = {}
    for event in events:
        index = histogram.bucket_index(event.latency_s)
        latency_hist[index] = latency_hist.get(index, 0) + 1
    return {
        "requests": len(events),
        "timeouts": sum(e.outcome == "timeout" for e in events),
        "retried": sum(e.attempts > 1 for e in events),
        "fallbacks": sum(e.fallback for e in events),
        "new_tokens": sum(e.new_tokens for e in events),
        "forward_passes": sum(e.forward_passes for e in events),
        "monitor_failed_steps": sum(bool(e.monitor_failures) for e in events),
        "p95": histogram.percentile(latency_hist, 0.95),
        "p99": histogram.percentile(latency_hist, 0.99),
    }


def _observed(report: StatsReport) -> dict[str, object]:
    total = report.total
    names = (
        "requests",
        "timeouts",
        "retried",
        "fallbacks",
        "new_tokens",
        "forward_passes",
        "monitor_failed_steps",
    )
    observed: dict[str, object] = {name: total.count(name) for name in names}
    observed.update(p95=total.p95_s, p99=total.p99_s)
    return observed


def test_several_processes_writing_at_once_give_exact_totals(redis_server: RedisServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    counts = {0: 400, 1: 300, 2: 250}
    workers = [ctx.Process(target=_spawned_worker, args=(redis_server.url, "fleet", w, n)) for w, n in counts.items()]
    for process in workers:
        process.start()
    local = Telemetry(redis_server.url, config=_config(namespace="fleet"))
    for i in range(200):  # this process writes concurrently with the others
        local.record(_event(3, i))
    for process in workers:
        process.join(120)
        assert process.exitcode == 0
    assert local.close()
    events = [_event(w, i) for w, n in {**counts, 3: 200}.items() for i in range(n)]
    report = _report(redis_server, "fleet")
    assert _observed(report) == _expected(events)
    assert report.writers == 4
    assert report.health == {}
    by_mode = {row.mode: row.requests for row in report.rows if row.step_type == "tool_call"}
    assert by_mode == {
        mode: sum(1 for e in events if e.mode == mode and e.step_type == "tool_call") for mode in by_mode
    }


def test_fork_children_do_not_resend_the_parents_data(redis_server: RedisServer) -> None:
    parent = Telemetry(redis_server.url, config=_config(flush_interval_s=3600))
    for i in range(7):
        parent.record(_event(0, i))  # still pending when the children fork
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_forked_worker, args=(parent, w, 50)) for w in (1, 2, 3)]
    for child in children:
        child.start()
    pid = os.fork()
    if pid == 0:  # a bare os.fork child must close() before os._exit
        code = 0
        try:
            _forked_worker(parent, 4, 5)
            code = 0 if parent.close() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert parent.close()
    events = [_event(0, i) for i in range(7)] + [_event(w, i) for w in (1, 2, 3) for i in range(50)]
    events += [_event(4, i) for i in range(5)]
    report = _report(redis_server)
    assert _observed(report) == _expected(events)
    assert report.writers == 5


def test_sigkill_and_restart_lose_nothing(redis_server: RedisServer) -> None:
    telemetry = Telemetry(redis_server.url, config=_config(socket_timeout_s=0.3))
    events: list[StepEvent] = []

    def produce(n: int) -> None:
        for _ in range(n):
            event = _event(1, len(events))
            events.append(event)
            telemetry.record(event)
            time.sleep(0.001)

    for _ in range(3):
        produce(150)
        flushed = telemetry.stats().flushed_batches
        _wait_for(lambda: telemetry.stats().flushed_batches > flushed, "a flush")  # noqa: B023
        redis_server.kill()
        failures = telemetry.stats().failed_flushes
        produce(150)
        _wait_for(lambda: telemetry.stats().failed_flushes > failures, "a failed flush")  # noqa: B023
        redis_server.start()
    produce(150)
    assert telemetry.close()
    report = _report(redis_server)
    assert _observed(report) == _expected(events)
    assert report.health.get("dropped_buckets", 0) == 0
    assert telemetry.stats().dropped_buckets == 0


def test_an_outage_longer_than_the_backlog_bound_counts_exactly_what_was_dropped(
    redis_server: RedisServer,
) -> None:
    telemetry = Telemetry(redis_server.url, config=_config(max_backlog_buckets=4), start=False)
    recorded = 0
    for step_type in ("before_a", "before_b"):
        telemetry.record(_step(step_type))
        recorded += 1
    assert telemetry.flush()
    redis_server.kill()
    for round_ in range(5):
        for step_type in ("a", "b", "c"):
            for _ in range(round_ + 1):
                telemetry.record(_step(step_type))
                recorded += 1
        assert not telemetry.flush()
        assert telemetry.stats().backlog_buckets <= 4
    redis_server.start()
    assert telemetry.flush()
    report = _report(redis_server)
    assert report.health["dropped_buckets"] == telemetry.stats().dropped_buckets > 0
    assert report.total.requests + report.health["dropped_requests"] == recorded
    assert report.select(step_type="before_a").requests == 1


def test_a_flush_that_timed_out_inside_redis_is_not_counted_twice(redis_server: RedisServer) -> None:
    telemetry = Telemetry(redis_server.url, config=_config(socket_timeout_s=0.2), start=False)
    for i in range(20):
        telemetry.record(_event(0, i))
    redis_server.pause(1000, mode="WRITE")  # scripts wait; the client times out, the script may run later
    assert not telemetry.flush()
    time.sleep(1.2)
    assert telemetry.flush()
    assert _report(redis_server).total.requests == 20


class ReplyDroppingProxy:
    """A TCP proxy in front of Redis that, when armed, forwards the next EVALSHA and swallows its reply
    (then closes the connection): the flush was applied, but the writer cannot know."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.armed = False
        self.swallowed = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            state = {"drop": False}
            threading.Thread(target=self._requests, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._replies, args=(client, upstream, state), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                if self.armed and b"EVALSHA" in data:
                    self.armed, state["drop"] = False, True
                upstream.sendall(data)

    def _replies(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 16):
                if state["drop"]:
                    self.swallowed += 1
                    break
                client.sendall(data)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_flush_whose_reply_was_lost_is_not_counted_twice(redis_server: RedisServer) -> None:
    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        telemetry = Telemetry(proxy.url, config=_config(), start=False)
        for i in range(20):
            telemetry.record(_event(0, i))
        proxy.armed = True
        assert not telemetry.flush()  # Redis applied the batch; its reply never arrived
        assert proxy.swallowed == 1
        assert _report(redis_server).total.requests == 20
        assert telemetry.flush()  # the retry carries the same flush id
        assert telemetry.stats().duplicate_batches == 1
        assert _report(redis_server).total.requests == 20
    finally:
        proxy.close()


def _step(step_type: str) -> StepEvent:
    return StepEvent(step_type=step_type, mode="ntp", outcome="ok", latency_s=0.05)


def _count_blocked_calls(recorder: Recorder, steps: int, *, blocked_after_s: float) -> int:
    """Run a fake generation loop; count record() calls that took longer than ``blocked_after_s``."""
    blocked = 0
    for i in range(steps):
        sum(range(2000))  # the "generation" work of one step
        start = time.perf_counter()
        recorder.record(_event(0, i))
        if time.perf_counter() - start >= blocked_after_s:
            blocked += 1
        time.sleep(0.01)
    return blocked


def test_a_paused_redis_does_not_block_generation(redis_server: RedisServer) -> None:
    # A synchronous write would block each call for socket_timeout_s (1.5 s) or the pause (3 s).
    telemetry = Telemetry(redis_server.url, config=_config(socket_timeout_s=1.5))
    redis_server.pause(3000)
    failures_before = telemetry.stats().failed_flushes
    blocked_with_telemetry = _count_blocked_calls(telemetry, 300, blocked_after_s=0.5)
    blocked_without = _count_blocked_calls(NullRecorder(), 300, blocked_after_s=0.5)
    assert blocked_with_telemetry == blocked_without == 0
    assert telemetry.stats().failed_flushes > failures_before, "the flusher never ran into the pause"
    assert telemetry.close()
    assert _report(redis_server).total.requests == 300


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers: a hung Redis."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


@pytest.mark.parametrize("target", ["blackhole", "closed_port"])
def test_an_unreachable_redis_does_not_block_generation(target: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("blackhole") if target == "blackhole" else f"redis://127.0.0.1:{free_port()}/0"
    telemetry = Telemetry(url, config=_config(socket_timeout_s=0.5))
    blocked = _count_blocked_calls(telemetry, 100, blocked_after_s=0.25)
    assert blocked == _count_blocked_calls(NullRecorder(), 100, blocked_after_s=0.25) == 0
    _wait_for(lambda: telemetry.stats().failed_flushes > 0, "a failed flush")
    assert not telemetry.close(timeout_s=2.0)
    stats = telemetry.stats()
    assert stats.backlog_buckets > 0 and not stats.healthy


def _cli_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """agent-mtp (test app)."""

    register(app)
    return app


def test_credentials_never_appear_in_logs_reprs_errors_or_cli_output(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    url = redis_server.add_user("alice", PASSWORD)
    texts: list[str] = []
    telemetry = Telemetry(url, config=_config())
    telemetry.record(_event(0, 0))
    assert telemetry.flush()
    texts += [repr(telemetry), repr(telemetry.config), str(telemetry.stats()), repr(telemetry.store.target)]
    wrong = Telemetry(redis_server.url_for("alice", WRONG_PASSWORD), config=_config(), start=False)
    wrong.record(_event(0, 1))
    assert not wrong.flush()
    texts += [repr(wrong), str(wrong.stats())]
    runner = CliRunner()
    ok = runner.invoke(_cli_app(), ["stats", "--redis-url", url, "--window", "1m"])
    bad = runner.invoke(_cli_app(), ["stats", "--json", "--redis-url", redis_server.url_for("alice", WRONG_PASSWORD)])
    assert ok.exit_code == 0, ok.output
    assert bad.exit_code == 1 and "alice:***@" in bad.output
    texts += [ok.output, bad.output]
    redis_server.kill()
    telemetry.record(_event(0, 2))
    assert not telemetry.flush()
    texts.append(str(telemetry.stats()))
    assert not telemetry.close(timeout_s=1.0) and not wrong.close(timeout_s=1.0)
    with pytest.raises(TelemetryError) as info:
        Telemetry(f"http://alice:{PASSWORD}@127.0.0.1:1/0", start=False)
    texts.append(str(info.value))
    captured = capsys.readouterr()
    texts += [caplog.text, captured.out, captured.err]
    assert "alice:***@" in caplog.text  # the warnings did name the target, redacted
    for text in texts:
        assert PASSWORD not in text and WRONG_PASSWORD not in text


def test_malicious_key_parts_never_reach_redis_keys(redis_server: RedisServer) -> None:
    with pytest.raises(TelemetryError, match="namespace"):
        TelemetryConfig(namespace="evil:*")
    telemetry = Telemetry(redis_server.url, config=_config(namespace="safe"), start=False)
    hostile = ["x:*", "{safe}:t:f:deadbeef", "a\r\nFLUSHALL\r\n", "../../etc", "KEYS *", "_invalid_", ""]
    for part in hostile:
        telemetry.record(StepEvent(step_type=part, mode=part, model=part, outcome="ok", latency_s=0.1))
        telemetry.report_intervention("manual_intervention", step_type=part, run_id=part, note=part)
    telemetry.record(StepEvent(step_type="tool_call", mode="ntp", outcome="ok", latency_s=0.1))
    assert telemetry.flush()
    part = r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*"
    allowed = re.compile(rf"\{{safe\}}:t:(s:\d+:{part}:{part}:({part}|-)|[ihw]:\d+|n|[fe]:[0-9a-f]{{32}})")
    client = redis_server.client(decode_responses=True)
    keys: list[str] = list(client.keys("*"))  # type: ignore[arg-type]
    assert keys and all(allowed.fullmatch(key) for key in keys), keys
    members = {m for key in keys if ":t:i:" in key for m in client.smembers(key)}
    assert members == {"_invalid_:_invalid_:_invalid_", "default:_invalid_:-", "default:tool_call:ntp"}
    report = _report(redis_server, "safe")
    assert report.select(step_type="_invalid_").requests == len(hostile)
    assert report.select(step_type="tool_call").requests == 1
    assert report.health["invalid_key_parts"] == 3 * len(hostile) + len(hostile)
    assert client.dbsize() == len(keys)  # nothing was flushed away by the injected text


def test_stats_command_reports_json_table_and_plot(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    telemetry = Telemetry(redis_server.url, config=_config(namespace="cli"), start=False)
    for i in range(30):
        telemetry.record(
            StepEvent(
                step_type="tool_call" if i < 20 else "final_answer",
                mode="verified",
                outcome="timeout" if i in (3, 4) else "ok",
                latency_s=0.2,
                new_tokens=12,
                forward_passes=4,
                attempts=2 if i == 5 else 1,
                fallback=i == 6,
                monitor_failures=("json_valid",) if i == 7 else (),
            )
        )
    telemetry.report_intervention("manual_intervention", step_type="tool_call", run_id="r1", note="fixed")
    assert telemetry.flush()
    runner = CliRunner()
    base = ["stats", "--redis-url", redis_server.url, "--namespace", "cli", "--window", "1m"]

    result = runner.invoke(_cli_app(), [*base, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["window_s"] == 60 and data["writers"] == 1
    total = data["total"]
    assert (total["requests"], total["timeouts"], total["retried"], total["fallbacks"]) == (30, 2, 1, 1)
    assert total["monitor_failures"] == {"json_valid": 1} and total["manual_interventions"] == 1
    assert total["tokens_per_forward"] == pytest.approx(3.0)
    assert total["latency_s"]["p95"] == pytest.approx(0.21)
    rows = {(row["step_type"], row["mode"]): row for row in data["rows"]}
    assert rows["tool_call", "verified"]["timeout_ratio"] == pytest.approx(0.1)
    assert rows["final_answer", "verified"]["requests"] == 10
    assert data["recent_interventions"][0]["run_id"] == "r1"

    plot = tmp_path / "out.png"
    table = runner.invoke(_cli_app(), [*base, "--plot", str(plot)])
    assert table.exit_code == 0, table.output
    assert "tool_call" in table.stdout and "final_answer" in table.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    by_model = runner.invoke(_cli_app(), [*base, "--json", "--by-model"])
    assert {row["model"] for row in json.loads(by_model.stdout)["rows"]} == {"default"}

    watch = runner.invoke(_cli_app(), [*base, "--watch", "--json", "--interval", "0.01", "--refreshes", "2"])
    assert watch.exit_code == 0, watch.output
    assert [json.loads(line)["total"]["requests"] for line in watch.stdout.splitlines()] == [30, 30]

    monkeypatch.delenv("AGENT_MTP_REDIS_URL", raising=False)
    missing = runner.invoke(_cli_app(), ["stats"])
    assert missing.exit_code == 2 and "AGENT_MTP_REDIS_URL" in missing.output
    bad_window = runner.invoke(_cli_app(), [*base, "--window", "3d"])
    assert bad_window.exit_code == 2 and "invalid window '3d'" in bad_window.output


def test_a_worker_flushes_at_exit_configured_by_environment(redis_server: RedisServer) -> None:
    script = (
        "from agent_mtp.events import StepEvent\n"
        "from agent_mtp.telemetry import Telemetry\n"
        "t = Telemetry()\n"
        "for i in range(25):\n"
        "    t.record(StepEvent(step_type='tool_call', mode='ntp', outcome='ok', latency_s=0.01))\n"
    )
    env = {
        **os.environ,
        "AGENT_MTP_REDIS_URL": redis_server.url,
        "AGENT_MTP_TELEMETRY_NAMESPACE": "envns",
        "PYTHONPATH": str(REPO_ROOT),
    }
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    report = _report(redis_server, "envns")
    assert (report.total.requests, report.writers) == (25, 1)


def test_tls_with_an_acl_user_writes_and_reads(redis_tls_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = redis_tls_server.add_user("tls-user", PASSWORD)
    assert url.startswith("rediss://tls-user:")
    telemetry = Telemetry(url, config=_config(namespace="tls"), start=False)
    for i in range(12):
        telemetry.record(_event(0, i))
    assert telemetry.flush()
    assert "rediss://tls-user:***@" in repr(telemetry)
    result = CliRunner().invoke(_cli_app(), ["stats", "--json", "--redis-url", url, "--namespace", "tls"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["total"]["requests"] == 12
    assert PASSWORD not in caplog.text + result.output + repr(telemetry) + str(telemetry.stats())
