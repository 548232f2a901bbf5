"""`agent-mtp serve --ray` with real processes: a local Ray cluster of 2 replicas of a tiny random model behind the
router, a private redis-server for telemetry and the shared breakers.

- both replicas answer the OpenAI routes through Ray Serve's proxy and the router, and each records under its
  replica id;
- a breaker tripped on one replica sends its step type to NTP on both (the state is in Redis), and a half-open
  probe on either closes it for both;
- SIGKILL one replica under load (plain and streaming clients): no request hangs, every failed one got the
  retryable 503 (Retry-After, error code ``replica_unavailable``) or, mid-stream, that error as the stream's last
  event; the other replica keeps serving, Ray starts a replacement, and the fleet's counts in Redis lose nothing
  they had recorded;
- stop Redis under load: serving continues (telemetry buffered, breakers on local state) and the buffered steps
  reach Redis when it returns.

Skipped (with the reason) when Ray is not installed: `pip install 'agent-mtp[ray]'` (`.ci/run` does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agent_mtp.policy.loading import resolve_policy_path
from agent_mtp.server.ray_app import REPLICA_HEADER
from agent_mtp.telemetry import redis_store
from agent_mtp.telemetry.config import replica_namespace
from agent_mtp.telemetry.queries import query_stats
from tests.fixtures.redis_server import RedisServer, _started, free_port

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'agent-mtp[ray]')")
pytestmark = pytest.mark.redis

NAMESPACE = "rayfleet"
RETRYABLE = ("503 replica_unavailable", "sse replica_unavailable")
"""The two ways a request whose replica died may fail (the openai client retries the 503 by itself)."""
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
BRITTLE = {**BODY, "agent_mtp": {"step_type": "brittle"}}
"""A step type whose outputs always fail their monitor (JSON required, the tiny model writes noise)."""
_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
PROBE = {
    **BRITTLE,
    "max_tokens": 32,
    "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": _SCHEMA, "strict": True}},
}
"""The same step type under a JSON grammar: its output passes the monitor."""


def fleet_policy(path: Path) -> Path:
    """The default policy plus the step type ``brittle``: ConfAdapt, one attempt, a breaker that trips after 2
    failed samples on a replica, stays open until the test ends its cooldown, and closes after 1 passing probe."""
    policy = yaml.safe_load(resolve_policy_path("default").read_text())
    policy["name"] = "fleet"
    policy["steps"]["brittle"] = {
        "mode": "confadapt",
        "retries": {"attempts": 1},
        "monitors": {
            "validity": {"require_json": True},
            "ntp_agreement": {"enabled": False},
            "likelihood": {"enabled": False},
        },
        "fallback": {
            "window": 2,
            "min_samples": 2,
            "margin": 0.5,
            "cooldown_s": 3600,
            "probe_rate": 1.0,
            "probes_to_close": 1,
        },
    }
    path.write_text(yaml.safe_dump(policy))
    return path


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
    command += ["--policy", str(fleet_policy(model_dir / "fleet-policy.yaml"))]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    fleet = Fleet(f"http://127.0.0.1:{port}", redis, process, log)
    try:
        fleet.replicas(2)
        yield fleet
    finally:
        process.send_signal(signal.SIGTERM)  # as a service manager stops it: the graceful path, exit status 0
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            raise
        finally:
            next(redis_gen, None)
        assert code == 0, f"agent-mtp serve --ray exited with {code} on SIGTERM; see {log}"


@dataclass
class Load:
    """Clients sending requests back to back (no retries) until stopped, every ``stream_every``-th one streaming;
    every outcome is kept."""

    base: str
    clients: int = 4
    body: dict[str, Any] = field(default_factory=lambda: dict(BODY))
    stream_every: int = 0
    """0: no client streams; 2: every second client streams."""
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    hung: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _streaming: dict[int, str] = field(default_factory=dict)
    """Client index -> the replica whose stream it is reading now (its first event came, its last not yet)."""
    _events: dict[int, int] = field(default_factory=dict)
    """Client index -> events its current stream has delivered so far."""

    def replica_mid_stream(self, timeout_s: float = 30.0, early: int = 24) -> str:
        """A replica streaming to a client right now, early in its stream (at most ``early`` events delivered, so
        most of it is still to generate): killing it meets a request in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for index, replica in self._streaming.items():
                    if self._events.get(index, 0) <= early:
                        return replica
            time.sleep(0.002)
        raise AssertionError(f"no stream was under way within {timeout_s} s")

    def __enter__(self) -> Load:
        for i in range(self.clients):
            stream = self.stream_every > 0 and i % self.stream_every == self.stream_every - 1
            thread = threading.Thread(target=self._client, args=(i, stream), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        self.hung = sum(t.is_alive() for t in self._threads)

    def _client(self, index: int, stream: bool) -> None:
        def streaming_from(replica: str | None) -> None:
            with self._lock:
                if replica is None:
                    self._streaming.pop(index, None)
                    self._events.pop(index, None)
                else:
                    self._streaming[index] = replica
                    self._events[index] = self._events.get(index, 0) + 1

        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    body = {**self.body, "stream": stream}
                    outcome = _send(client, f"{self.base}/v1/chat/completions", body, streaming_from)
                except httpx.TimeoutException as e:
                    outcome = f"timeout {e!r}"
                except httpx.TransportError as e:
                    outcome = f"connection {type(e).__name__}"
                with self._lock:
                    self._streaming.pop(index, None)
                    self._events.pop(index, None)
                    if outcome == "ok":
                        self.ok += 1
                    else:
                        self.failures.append(outcome)


def _send(client: httpx.Client, url: str, body: dict[str, Any], streaming_from: Callable[[str | None], None]) -> str:
    """ "ok", or how the request failed: "503 replica_unavailable" (with Retry-After and the OpenAI error body),
    "sse replica_unavailable" (the error event ended the stream), or what else came back. A stream's replica is
    reported to ``streaming_from`` from its first event until its last (then None)."""
    with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            return _refusal(reply)
        if not body.get("stream"):
            reply.read()
            return "ok"
        events: list[str] = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                done = events[-1] == "[DONE]" or '"error"' in events[-1]
                streaming_from(None if done else reply.headers.get(REPLICA_HEADER))
    if events and events[-1] == "[DONE]":
        return "ok"
    errors = [i for i, e in enumerate(events) if e != "[DONE]" and "error" in json.loads(e)]
    if errors == [len(events) - 1]:  # one error event, the last one
        error = json.loads(events[-1])["error"]
        if error.get("type") == "server_error" and "may be retried" in error.get("message", ""):
            return f"sse {error.get('code')}"
        return f"sse error {error}"
    return f"stream cut after {len(events)} events: {events[-2:]}"


def _refusal(reply: httpx.Response) -> str:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{reply.status_code} {reply.text[:200]}"
    retry_after = reply.headers.get("retry-after", "")
    if reply.status_code == 503 and retry_after.isdigit() and error.get("type") == "server_error":
        return f"503 {error.get('code')}"
    return f"{reply.status_code} retry-after={retry_after!r} {error}"


def _retryable(outcome: str) -> bool:
    return outcome in RETRYABLE


def _chat(fleet: Fleet, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the replica that answered, the response body) of one request."""
    reply = httpx.post(f"{fleet.base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.headers[REPLICA_HEADER], reply.json()


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


def test_a_breaker_tripped_on_one_replica_sends_the_step_type_to_ntp_on_all_and_a_probe_restores_it(
    fleet: Fleet,
) -> None:
    import redis

    replicas = fleet.replicas(2)
    store = redis.Redis.from_url(fleet.redis.url)
    tripped_by = None
    for _ in range(20):  # every output fails its monitor: the replica that sees 2 failures trips the breaker
        replica, body = _chat(fleet, BRITTLE)
        if any(d.startswith("breaker opened") for d in body["agent_mtp"]["policy"]["decisions"]):
            tripped_by = replica
            break
    assert tripped_by in replicas
    open_keys = store.keys("agent_mtp:breaker:*:fleet:brittle:open")
    assert len(open_keys) == 1  # the trip is in Redis, for the fleet

    seen = _until_every_replica_answered(fleet, BRITTLE, replicas)
    other = next(r for r in replicas if r != tripped_by)
    assert seen[other] and all(s == ("open", "ntp") for states in seen.values() for s in states), seen

    store.delete(open_keys[0])  # end the cooldown (the key's TTL) now: the breaker is half-open for the fleet
    _, body = _chat(fleet, PROBE)  # probe_rate 1: a probe in ConfAdapt, whose JSON passes the monitor
    policy = body["agent_mtp"]["policy"]
    assert (policy["breaker"], policy["probe"], policy["mode"]) == ("half_open", True, "confadapt"), policy
    assert "breaker closed: probes passed" in policy["decisions"]
    assert not store.keys("agent_mtp:breaker:*:fleet:brittle:*")
    seen = _until_every_replica_answered(fleet, PROBE, replicas)
    assert all(s == ("closed", "confadapt") for states in seen.values() for s in states), seen


def _until_every_replica_answered(
    fleet: Fleet, body: dict[str, Any], replicas: dict[str, int], tries: int = 60
) -> dict[str, list[tuple[str, str]]]:
    """Replica -> (breaker state, mode) of each answer, sending ``body`` until every replica answered."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for _ in range(tries):
        replica, reply = _chat(fleet, body)
        policy = reply["agent_mtp"]["policy"]
        seen.setdefault(replica, []).append((policy["breaker"], policy["mode"]))
        if set(replicas) <= set(seen):
            return seen
    raise AssertionError(f"not every replica answered in {tries} requests: {seen}")


def test_a_replica_killed_under_load_fails_only_retryably_and_loses_no_recorded_count(fleet: Fleet) -> None:
    replicas = fleet.replicas(2)
    # longer requests, half of them streaming; the victim is a replica streaming to a client at that moment, and a
    # stream is long enough (hundreds of tokens, the tiny model rarely stops early) to still be generating when the
    # kill lands: the kill always meets a request in flight
    with Load(fleet.base, clients=6, body={**BODY, "max_tokens": 320}, stream_every=2) as load:
        time.sleep(4)
        recorded_before = fleet.requests()
        victim = load.replica_mid_stream()
        os.kill(replicas[victim], signal.SIGKILL)
        time.sleep(12)
        ok_after_kill_start = load.ok
        time.sleep(6)
        assert load.ok > ok_after_kill_start  # the other replica keeps serving
    assert load.hung == 0
    assert load.failures, "the kill met no request in flight"
    assert all(_retryable(f) for f in load.failures), load.failures[:5]  # the 503 or the stream's error event
    after = fleet.replicas(2)  # Ray replaced the dead replica
    assert victim not in after
    _settle(fleet)
    assert fleet.requests() >= recorded_before  # nothing the fleet had recorded is lost
    print(f"replica kill: {load.ok} ok, {len(load.failures)} failed retryably: {sorted(set(load.failures))}")


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
