"""Integration fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest

from agent_mtp.engine import MTPEngine


@pytest.fixture(scope="session")
def default_engine() -> MTPEngine:
    """SmolLM2-135M-Instruct with the shipped MTP adapter (if one ships), fp32."""
    return MTPEngine.from_pretrained("default")


@pytest.fixture(scope="session")
def bare_default_engine(default_engine: MTPEngine) -> MTPEngine:
    """The same weights without the MTP adapter (shares nothing mutable with default_engine)."""
    return MTPEngine.from_pretrained("default", adapter=None)
