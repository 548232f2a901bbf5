"""The breaker shared through a real Redis: a fleet falls back together, and an outage degrades to per process."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent_mtp.policy import PolicyController, RedisBreakerStore, StepContext
from tests.unit.test_policy_fakes import FakeClock, FakeEngine, FlagMonitor

pytestmark = pytest.mark.redis

STEP = StepContext(step_type="reasoning")
POLICY: dict[str, Any] = {
    "version": 1,
    "name": "fleet",
    "defaults": {
        "mode": "static",
        "retries": {"attempts": 1},
        "fallback": {
            "window": 2,
            "min_samples": 2,
            "margin": 0.5,
            "cooldown_s": 0.5,
            "half_open_ttl_s": 30,
            "probe_rate": 1.0,
            "probes_to_close": 1,
        },
    },
}


def _worker(url: str, monitor: FlagMonitor, **store: Any) -> PolicyController:
    return PolicyController(FakeEngine(), POLICY, monitors=[monitor], breaker_store=RedisBreakerStore(url, **store))


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_fleet_falls_back_together_and_recovers(redis_server: Any) -> None:
    failing, healthy = FlagMonitor(broken=True), FlagMonitor(broken=False)
    a, b = _worker(redis_server.url, failing), _worker(redis_server.url, healthy)
    assert b.plan(STEP).config.mode == "static"

    a.run("q", STEP)
    a.run("q", STEP)  # two failing samples in worker A trip the breaker for everyone

    plan = b.plan(STEP)
    assert plan.config.mode == "ntp" and plan.breaker_open
    assert plan.breaker.reason == "pass rate 0.00 < 0.50 over 2 samples"
    with redis_server.client() as client:
        ttl_ms = client.pttl("agent_mtp:breaker:fake-model:fleet:reasoning:open")
        assert 0 < ttl_ms <= 500
        assert client.pttl("agent_mtp:breaker:fake-model:fleet:reasoning:state") > 500

    _wait_for(lambda: b.breaker_status("reasoning").state == "half_open")  # Redis expired the open key
    probe = b.run("q", STEP)  # worker B probes with a healthy output: closes the breaker for the fleet
    assert probe.plan.probe and "breaker closed: probes passed" in probe.decisions
    assert a.breaker_status("reasoning").state == "closed"
    assert a.plan(STEP).config.mode == "static"


def test_failed_probe_reopens_for_the_fleet(redis_server: Any) -> None:
    failing = FlagMonitor(broken=True)
    a, b = _worker(redis_server.url, failing), _worker(redis_server.url, FlagMonitor(broken=False))
    a.run("q", STEP)
    a.run("q", STEP)
    _wait_for(lambda: a.breaker_status("reasoning").state == "half_open")
    a.run("q", STEP)  # A's probe fails
    status = b.breaker_status("reasoning")
    assert (status.state, status.trips, status.reason) == ("open", 2, "half-open probe failed")


def test_redis_outage_keeps_generating_with_per_process_state(redis_server: Any) -> None:
    clock = FakeClock()
    monitor = FlagMonitor(broken=True)
    worker = _worker(redis_server.url, monitor, clock=clock, retry_after_s=5.0)
    store = worker.breakers.store
    assert isinstance(store, RedisBreakerStore)

    redis_server.kill()
    first = worker.run("q", STEP)  # no exception: the breaker works on local state
    assert first.outcome == "monitor_failed" and store.degraded
    worker.run("q", STEP)
    assert worker.breaker_status("reasoning").state == "open"  # tripped locally

    redis_server.start()
    clock.advance(6)  # past retry_after_s: Redis is asked again, and it holds no trip
    assert worker.breaker_status("reasoning").state == "closed"
    assert not store.degraded
    other = _worker(redis_server.url, FlagMonitor(broken=True))
    other.run("q", STEP)
    other.run("q", STEP)
    assert worker.breaker_status("reasoning").state == "open"  # shared again
