"""`agent-mtp serve --ray` with real processes: a local Ray cluster of 2 replicas of a tiny random model, a private
redis-server for telemetry and the shared breakers.

- both replicas answer the OpenAI routes behind Ray Serve's proxy, and each records under its replica id;
- SIGKILL one replica under load: no request hangs, the failed ones get a retryable status (5xx or a dropped
  connection, which the openai client retries), the other replica keeps serving, Ray starts a replacement, and the
  fleet's counts in Redis lose nothing they had recorded;
- stop Redis under load: serving continues (telemetry buffered, breakers on local state) and the buffered steps
  reach Redis when it returns.

Skipped (with the reason) when Ray is not installed: `pip install 'agent-mtp[ray]'` (`.ci/run` does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from agent_mtp.telemetry import redis_store
from agent_mtp.telemetry.config import replica_namespace
from agent_mtp.telemetry.queries import query_stats
from tests.fixtures.redis_server import RedisServer, _started, free_port

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'agent-mtp[ray]')")
pytestmark = pytest.mark.redis

NAMESPACE = "rayfleet"
RETRYABLE = {500, 502, 503, 504}
"""What the openai client retries (besides connection errors)."""
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}


@dataclass
class Fleet:
    base: str
    redis: RedisServer
    process: subprocess.Popen[bytes]
    log: Path

    def replicas(self, want: int = 2, timeout_s: float = 180.0) -> dict[str, int]:
        """Replica id -> pid of ``want`` distinct live replicas (polls /replica through the proxy)."""
        seen: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                reply = httpx.get(f"{self.base}/replica", timeout=5)
                if reply.status_code == 200:
                    body = reply.json()
                    if _alive(body["pid"]):
                        seen[body["replica"]] = body["pid"]
            except httpx.HTTPError:
                pass
            seen = {r: p for r, p in seen.items() if _alive(p)}
            if len(seen) >= want:
                return seen
            time.sleep(0.3)
        raise AssertionError(
            f"{want} replicas did not answer within {timeout_s} s: {seen}\n{self.log.read_text()[-3000:]}"
        )

    def requests(self, replica: str | None = None) -> int:
        namespace = NAMESPACE if replica is None else replica_namespace(NAMESPACE, replica)
        return query_stats(redis_store(self.redis.url, namespace=namespace), window="5m").total.requests


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.tiny import tiny_engine

    model_dir = tmp_path_factory.mktemp("tiny-model")
    engine = tiny_engine()
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    redis_gen = _started(tmp_path_factory.mktemp("fleet-redis") / "redis", tls=False)
    redis = next(redis_gen)
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = {
        **os.environ,
        "AGENT_MTP_REDIS_URL": redis.url,
        "AGENT_MTP_TELEMETRY_NAMESPACE": NAMESPACE,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    command = [sys.executable, "-m", "agent_mtp.cli", "serve", "--ray", "--replicas", "2", "--threads", "1"]
    command += ["--model", str(model_dir), "--served-model-name", "tiny", "--port", str(port), "--max-active", "4"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    fleet = Fleet(f"http://127.0.0.1:{port}", redis, process, log)
    try:
        fleet.replicas(2)
        yield fleet
    finally:
        process.send_signal(signal.SIGINT)  # serve.run shuts the application and the local cluster down
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        next(redis_gen, None)


@dataclass
class Load:
    """Clients sending requests back to back (no retries) until stopped; every outcome is kept."""

    base: str
    clients: int = 4
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    hung: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        self.hung = sum(t.is_alive() for t in self._threads)

    def _client(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    reply = client.post(f"{self.base}/v1/chat/completions", json=BODY)
                    outcome = "ok" if reply.status_code == 200 else f"{reply.status_code} {reply.text[:200]}"
                except httpx.TimeoutException as e:
                    outcome = f"timeout {e!r}"
                except httpx.TransportError as e:
                    outcome = f"connection {type(e).__name__}"
                with self._lock:
                    if outcome == "ok":
                        self.ok += 1
                    else:
                        self.failures.append(outcome)


def _retryable(outcome: str) -> bool:
    head = outcome.split(" ", 1)[0]
    return head == "connection" or (head.isdigit() and int(head) in RETRYABLE)


def _settle(fleet: Fleet, seconds: float = 5.0) -> None:
    """Long enough for every live replica's telemetry to flush (2 s interval)."""
    time.sleep(seconds)


def test_two_replicas_serve_the_openai_routes_and_record_apart(fleet: Fleet) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with Load(fleet.base, clients=4) as load:
        time.sleep(8)
    assert load.hung == 0 and not load.failures, load.failures[:5]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message is not None
    _settle(fleet)
    replicas = fleet.replicas(2)
    per_replica = {r: fleet.requests(r) for r in replicas}
    assert all(n > 0 for n in per_replica.values()), per_replica  # both replicas served
    assert fleet.requests() >= load.ok + 1


def test_a_replica_killed_under_load_fails_only_retryably_and_loses_no_recorded_count(fleet: Fleet) -> None:
    replicas = fleet.replicas(2)
    victim, victim_pid = sorted(replicas.items())[0]
    with Load(fleet.base, clients=4) as load:
        time.sleep(4)
        recorded_before = fleet.requests()
        os.kill(victim_pid, signal.SIGKILL)
        time.sleep(12)
        ok_after_kill_start = load.ok
        time.sleep(6)
        assert load.ok > ok_after_kill_start  # the other replica keeps serving
    assert load.hung == 0
    assert all(_retryable(f) for f in load.failures), load.failures[:5]
    after = fleet.replicas(2)  # Ray replaced the dead replica
    assert victim not in after
    _settle(fleet)
    assert fleet.requests() >= recorded_before  # nothing the fleet had recorded is lost
    print(f"replica kill: {load.ok} ok, {len(load.failures)} failed retryably: {sorted(set(load.failures))[:3]}")


def test_serving_continues_while_redis_is_down_and_the_steps_arrive_when_it_returns(fleet: Fleet) -> None:
    fleet.replicas(2)
    _settle(fleet)
    before = fleet.requests()
    with Load(fleet.base, clients=4) as load:
        time.sleep(2)
        fleet.redis.kill()
        time.sleep(8)
        ok_during_outage = load.ok
        time.sleep(4)
        assert load.ok > ok_during_outage  # still serving without Redis
        fleet.redis.start()
        time.sleep(4)
    assert load.hung == 0 and not load.failures, load.failures[:5]
    deadline = time.monotonic() + 30
    while fleet.requests() < before + load.ok and time.monotonic() < deadline:
        time.sleep(1)
    assert fleet.requests() >= before + load.ok  # the buffered steps reached Redis
