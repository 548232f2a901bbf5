"""The breaker, driven by deterministic monitors: closed -> open -> cooldown NTP -> half-open probes ->
closed."""

from __future__ import annotations

from typing import Any

import pytest

from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.policy import MemoryBreakerStore, PolicyController, StepContext
from agent_mtp.policy.breaker import Breakers
from agent_mtp.policy.schema import FallbackSettings
from tests.unit.test_policy_fakes import FakeClock, FakeEngine, FlagMonitor

STEP = StepContext(step_type="reasoning")


def _policy(**fallback: Any) -> dict[str, Any]:
    settings = {
        "window": 4,
        "min_samples": 4,
        "baseline": 1.0,
        "margin": 0.5,
        "cooldown_s": 10,
        "probe_rate": 1.0,
        "probes_to_close": 2,
        "half_open_ttl_s": 100,
        **fallback,
    }
    return {
        "version": 1,
        "name": "breaker-test",
        "defaults": {"mode": "static", "retries": {"attempts": 1}, "fallback": settings},
    }


def _setup(**fallback: Any) -> tuple[PolicyController, FakeEngine, FakeClock, FlagMonitor, MemoryRecorder]:
    clock = FakeClock()
    engine = FakeEngine()
    monitor = FlagMonitor(broken=True)
    recorder = MemoryRecorder()
    controller = PolicyController(
        engine,
        _policy(**fallback),
        monitors=[monitor],
        recorder=recorder,
        clock=clock,
        sleep=clock.sleep,
        seed=0,
    )
    return controller, engine, clock, monitor, recorder


def _events(recorder: MemoryRecorder) -> list[StepEvent]:
    return [e for e in recorder.events if isinstance(e, StepEvent)]


def test_breaker_walks_every_state_and_back() -> None:
    controller, engine, clock, monitor, recorder = _setup()

    # closed: failing samples accumulate; the 4th (min_samples) trips the breaker
    for _ in range(3):
        assert controller.run("q", STEP).mode == "static"
        assert controller.breaker_status("reasoning").state == "closed"
    tripping = controller.run("q", STEP)
    assert any(d.startswith("breaker opened: pass rate 0.00 < 0.50 over 4 samples") for d in tripping.decisions)
    status = controller.breaker_status("reasoning")
    assert (status.state, status.trips) == ("open", 1)
    assert status.remaining_s == pytest.approx(10)

    # open: the step type runs in NTP for the cooldown, flagged as fallback + breaker_open
    during = controller.run("q", STEP)
    assert during.mode == "ntp" and during.outcome == "ok"
    assert during.plan.breaker_open and during.fallback
    event = _events(recorder)[-1]
    assert event.breaker_open and event.fallback and event.mode == "ntp"
    clock.advance(9.9)
    assert controller.plan(STEP).config.mode == "ntp"

    # half-open: a probe runs the policy's mode again; still broken -> re-opened
    clock.advance(0.2)
    assert controller.breaker_status("reasoning").state == "half_open"
    probe = controller.run("q", STEP)
    assert probe.plan.probe and probe.mode == "static"
    assert "breaker re-opened: half-open probe failed; ntp for 10 s" in probe.decisions
    status = controller.breaker_status("reasoning")
    assert (status.state, status.trips) == ("open", 2)

    # quality recovers: after the cooldown two passing probes close the breaker
    monitor.broken = False
    clock.advance(10.1)
    first = controller.run("q", STEP)
    assert first.plan.probe and "probe passed (1/2)" in first.decisions
    assert controller.breaker_status("reasoning").state == "half_open"
    second = controller.run("q", STEP)
    assert "breaker closed: probes passed" in second.decisions
    assert controller.breaker_status("reasoning").state == "closed"

    # closed again: the policy's mode, and a fresh window (one failure does not trip)
    monitor.broken = True
    after = controller.run("q", STEP)
    assert after.mode == "static" and not after.plan.probe
    assert controller.breaker_status("reasoning").state == "closed"
    assert engine.modes.count("ntp") == 1


def test_breaker_trips_relative_to_baseline_and_margin_only_with_enough_samples() -> None:
    controller, _, _, monitor, _ = _setup(window=10, min_samples=6, baseline=0.9, margin=0.2)
    pattern = [True, False, True, True, False]  # pass rate 0.6 < 0.7, but only 5 samples
    for broken in pattern:
        monitor.broken = not broken
        controller.run("q", STEP)
    assert controller.breaker_status("reasoning").state == "closed"
    monitor.broken = False
    controller.run("q", STEP)  # 6 samples, pass rate 4/6 = 0.67 < 0.7
    assert controller.breaker_status("reasoning").state == "open"


def test_breaker_stays_closed_when_quality_is_within_margin() -> None:
    controller, _, _, monitor, _ = _setup(min_samples=4, window=4, baseline=1.0, margin=0.3)
    for broken in [False, True, False, False, False, False]:  # rate 0.75 >= 0.7 in every window
        monitor.broken = broken
        controller.run("q", STEP)
    assert controller.breaker_status("reasoning").state == "closed"
    assert controller.breakers.pass_rate("reasoning") == (1.0, 4)


def test_breakers_are_per_step_type() -> None:
    controller, _, _, _, _ = _setup()
    for _ in range(4):
        controller.run("q", STEP)
    assert controller.breaker_status("reasoning").state == "open"
    assert controller.breaker_status("final_answer").state == "closed"
    assert controller.run("q", StepContext(step_type="final_answer")).mode == "static"


def test_half_open_probes_only_a_fraction() -> None:
    controller, engine, clock, monitor, _ = _setup(probe_rate=0.25, probes_to_close=100)
    for _ in range(4):
        controller.run("q", STEP)
    clock.advance(11)
    monitor.broken = False
    engine.calls.clear()
    plans = [controller.run("q", STEP).plan for _ in range(200)]
    probes = sum(p.probe for p in plans)
    assert 25 <= probes <= 75  # seeded draw around 25%
    assert engine.modes.count("static") == probes
    assert all(p.config.mode == "ntp" for p in plans if not p.probe)


def test_half_open_without_enough_probes_closes_after_its_ttl() -> None:
    controller, _, clock, _, _ = _setup(half_open_ttl_s=30)
    for _ in range(4):
        controller.run("q", STEP)
    clock.advance(10 + 29)
    assert controller.breaker_status("reasoning").state == "half_open"
    clock.advance(2)
    assert controller.breaker_status("reasoning").state == "closed"


def test_exact_modes_and_disabled_fallback_never_feed_the_breaker() -> None:
    clock = FakeClock()
    monitor = FlagMonitor(broken=True)
    policy = _policy()
    policy["defaults"]["mode"] = "verified"
    controller = PolicyController(FakeEngine(), policy, monitors=[monitor], clock=clock)
    for _ in range(6):
        controller.run("q", STEP)
    assert controller.breakers.pass_rate("reasoning") == (None, 0)
    policy = _policy(enabled=False)
    controller = PolicyController(FakeEngine(), policy, monitors=[monitor], clock=clock)
    for _ in range(6):
        assert controller.run("q", STEP).mode == "static"
    assert controller.breaker_status("reasoning").state == "closed"


def test_reset_closes_the_breaker() -> None:
    controller, _, _, _, _ = _setup()
    for _ in range(4):
        controller.run("q", STEP)
    controller.reset_breaker("reasoning")
    assert controller.breaker_status("reasoning").state == "closed"


def test_memory_store_state_machine() -> None:
    clock = FakeClock()
    store = MemoryBreakerStore(clock=clock)
    assert store.status("k").state == "closed"
    assert store.probe_passed("k", needed=1).state == "closed"  # no effect when closed
    assert store.trip("k", cooldown_s=5, half_open_ttl_s=20, reason="why").state == "open"
    assert store.probe_passed("k", needed=1).state == "open"  # probes only count when half-open
    clock.advance(5)
    assert store.status("k").state == "half_open"
    assert store.status("k").reason == "why"
    assert store.probe_passed("k", needed=2).probes_passed == 1
    assert store.trip("k", cooldown_s=5, half_open_ttl_s=20, reason="again").trips == 2
    clock.advance(5)
    assert store.probe_passed("k", needed=1).state == "closed"
    assert store.trip("k", cooldown_s=5, half_open_ttl_s=20, reason="new").trips == 1


def test_breakers_window_follows_settings() -> None:
    clock = FakeClock()
    breakers = Breakers(MemoryBreakerStore(clock=clock), namespace="m:p")
    settings = FallbackSettings(window=3, min_samples=3, baseline=1.0, margin=0.5)
    assert breakers.record("s", False, settings, probe=False) is None
    assert breakers.record("s", True, settings, probe=False) is None
    assert breakers.record("s", True, settings, probe=False) is None  # 2/3 >= 0.5
    assert breakers.record("s", False, settings, probe=False) is None  # window [T, T, F]
    decision = breakers.record("s", False, settings, probe=False)  # [T, F, F] -> 0.33 < 0.5
    assert decision is not None and decision.startswith("breaker opened")
    assert breakers.key("s") == "m:p:s"
