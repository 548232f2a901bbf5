"""Shared test configuration: tiny random models for unit tests, the default model for integration tests."""

from __future__ import annotations

import os

import torch

# Tests must not fight each other (or a background job) for the 2 cores.
torch.set_num_threads(int(os.environ.get("AGENT_MTP_TEST_THREADS", "1")))

pytest_plugins: list[str] = ["tests.fixtures.redis_server"]
