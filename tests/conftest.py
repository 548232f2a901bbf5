"""Shared test configuration: tiny random models for unit tests, the default model for integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Tests must not fight each other (or a background job) for the 2 cores.
torch.set_num_threads(int(os.environ.get("AGENT_MTP_TEST_THREADS", "1")))
# Planners read the curve a test sets as it is: the live correction by the process's own pass times
# (engine/cost.py PassTimes, on by default) would make their choices depend on the tests that ran before them;
# tests/unit/test_live_cost_curve.py turns it on where it is tested.
os.environ.setdefault("AGENT_MTP_COST_CURVE", "stored")

pytest_plugins: list[str] = ["tests.fixtures.redis_server"]


@pytest.fixture
def fresh_process_telemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that sets AGENT_MTP_REDIS_URL gets its own process-wide telemetry, closed when the test ends (so no
    flush to a Redis that is gone is left for interpreter exit)."""
    from agent_mtp.telemetry import recorder

    monkeypatch.setattr(recorder, "_process_telemetry", None)
    yield
    created = recorder._process_telemetry
    if created is not None:
        created.close(timeout_s=0.5)
