"""The dashboard as an operator sees it: a fleet of two worker processes records steps (some time out, some fall
back) through the real telemetry into a private redis-server; the page, opened in headless Chromium, shows their
counts in its tables and charts.

Skipped with a reason when Chromium (Debian's ``chromium`` package) or redis-server is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the dashboard needs the [dashboard] extra (fastapi)")
pytest.importorskip("prometheus_client", reason="the dashboard needs the [dashboard] extra (prometheus-client)")

from pydantic import SecretStr

from agent_mtp.events import StepEvent
from agent_mtp.telemetry.web import DashboardSettings, DashboardSource, create_dashboard_app
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.uvicorn_server import serving

pytestmark = pytest.mark.redis

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS_PER_WORKER = 45
NAMESPACE = "fleet-e2e"
STEP_TYPES = ("tool_call", "reasoning", "final_answer")


def fleet_event(worker: int, i: int, now: float) -> StepEvent:
    """Deterministic steps, so the test knows what every worker recorded: every 4th times out, every 5th falls
    back to NTP (a retry escalation), tool calls run verified, the rest confadapt."""
    step_type = STEP_TYPES[(i + worker) % 3]
    fallback = i % 5 == 0
    mode = "ntp" if fallback else ("verified" if step_type == "tool_call" else "confadapt")
    return StepEvent(
        step_type=step_type,
        mode=mode,
        outcome="timeout" if i % 4 == 0 else "ok",
        latency_s=0.02 + 0.001 * ((i * 7 + worker) % 50),
        new_tokens=12,
        forward_passes=4 if mode != "ntp" else 12,
        attempts=2 if fallback else 1,
        fallback=fallback,
        ntp_equivalent_s=0.05,
        ttft_s=0.004,
        run_id=f"w{worker}-{i}",
        timestamp=now - 15 - 10 * (i % 6),
    )


def run_worker(url: str, worker: int) -> None:
    """One worker process: record its steps and one intervention through the real telemetry, flush, exit."""
    from agent_mtp.telemetry import Telemetry, TelemetryConfig

    telemetry = Telemetry(url, config=TelemetryConfig(namespace=NAMESPACE, flush_interval_s=0.1))
    now = time.time()
    for i in range(STEPS_PER_WORKER):
        telemetry.record(fleet_event(worker, i, now))
    kind = "manual_intervention" if worker == 0 else "user_visible_failure"
    telemetry.report_intervention(kind, step_type="tool_call", run_id=f"w{worker}-3", note=f"worker {worker} <note>")
    if not telemetry.close():
        raise SystemExit("telemetry did not flush")


def expected_counts() -> dict[tuple[str, str], dict[str, int]]:
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for worker in (0, 1):
        for i in range(STEPS_PER_WORKER):
            event = fleet_event(worker, i, 0.0)
            row = counts.setdefault((event.step_type, event.mode), {"requests": 0, "timeouts": 0, "fallbacks": 0})
            row["requests"] += 1
            row["timeouts"] += event.outcome == "timeout"
            row["fallbacks"] += event.fallback
    return counts


class _Dom(HTMLParser):
    """Table rows (``tr`` with ``data-fleet``: their cells' attributes and text), chart holders and canvases."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self.charts: dict[str, dict[str, list[float | None]]] = {}
        self.canvases = 0
        self.body: dict[str, str] = {}
        self._cell: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "tr" and "data-fleet" in a:
            self.rows.append({"attrs": a, "cells": []})
        elif tag == "td" and self.rows:
            self._cell = {"attrs": a, "text": ""}
            self.rows[-1]["cells"].append(self._cell)
        elif tag == "canvas":
            self.canvases += 1
        elif tag == "div" and a.get("id", "").startswith("chart-") and "data-series" in a:
            self.charts[a["id"][len("chart-") :]] = json.loads(a["data-series"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")


def _browser(binary: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=4000"]
    return subprocess.run([*command, *args, url], capture_output=True, text=True, timeout=120, check=False)


def test_the_page_shows_what_the_fleet_recorded(redis_server: RedisServer, tmp_path: Path) -> None:
    binary = _chromium()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import run_worker; run_worker({redis_server.url!r}, {worker})"],
            cwd=REPO_ROOT,
        )
        for worker in (0, 1)
    ]
    assert [w.wait(timeout=120) for w in workers] == [0, 0]

    settings = DashboardSettings(
        redis_url=SecretStr(redis_server.url), sources=(DashboardSource(label="prod", namespace=NAMESPACE),)
    )
    with serving(create_dashboard_app(settings)) as server:
        page_url = f"http://127.0.0.1:{server.port}/"
        dumped = _browser(binary, page_url, "--dump-dom")
        shot = tmp_path / "dashboard.png"
        _browser(binary, page_url, "--window-size=1400,1800", f"--screenshot={shot}")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Dom()
    dom.feed(dumped.stdout)
    assert dom.body.get("data-loaded") == "1", "the page never rendered its data"

    # the table: one row per (step type, mode) with the workers' counts, and the fleet total
    expected = expected_counts()
    shown = {
        (r["attrs"]["data-step-type"], r["attrs"]["data-mode"]): {
            c["attrs"]["data-field"]: int(c["attrs"]["data-count"]) for c in r["cells"] if "data-count" in c["attrs"]
        }
        for r in dom.rows
        if "data-mode" in r["attrs"]
    }
    total = shown.pop(("all", "all"))
    for key, counts in expected.items():
        for field, value in counts.items():
            assert shown[key][field] == value, (key, field)
    assert set(shown) == set(expected)
    assert total["requests"] == 2 * STEPS_PER_WORKER
    assert total["timeouts"] == sum(c["timeouts"] for c in expected.values()) > 0
    assert total["fallbacks"] == sum(c["fallbacks"] for c in expected.values()) > 0

    # the charts: drawn (canvases) from series whose points add up to the same counts
    assert dom.canvases >= 11
    assert sum(v or 0 for v in dom.charts["steps"]["prod"]) == 2 * STEPS_PER_WORKER
    assert any(v for v in dom.charts["fallback"]["prod"] if v)
    assert any(v for v in dom.charts["timeout"]["prod"] if v)

    # two replicas (one row each), both interventions with their notes (escaped text, not markup)
    replica_rows = [r for r in dom.rows if len(r["cells"]) == 4 and ":" in r["cells"][1]["text"]]
    assert len(replica_rows) == 2
    notes = [r["cells"][-1]["text"] for r in dom.rows if r["attrs"].get("class") == "intervention"]
    assert sorted(notes) == ["worker 0 <note>", "worker 1 <note>"]
    assert shot.exists() and shot.stat().st_size > 10_000


def test_the_command_serves_the_page_and_metrics(redis_server: RedisServer) -> None:
    """``agent-mtp dashboard`` as an operator starts it: loopback by default, a token from the environment."""
    import os
    import signal
    import urllib.error
    import urllib.request

    from tests.fixtures.redis_server import free_port

    run_worker(redis_server.url, 0)
    port = free_port()
    env = {**os.environ, "AGENT_MTP_DASHBOARD_TOKEN": "op-token-1", "AGENT_MTP_REDIS_URL": redis_server.url}
    command = [sys.executable, "-c", "from agent_mtp.cli import main; main()", "dashboard", "--namespace", NAMESPACE]
    command += ["--port", str(port)]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/metrics", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 401  # up, and guarded by the token
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.2)
        request = urllib.request.Request(f"{base}/metrics", headers={"Authorization": "Bearer op-token-1"})
        body = urllib.request.urlopen(request, timeout=10).read().decode()
        labels = f'mode="all",policy="{NAMESPACE}",replica="all",step_type="all",window="5m"'
        assert f"agent_mtp_window_steps{{{labels}}} {float(STEPS_PER_WORKER)}" in body
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert f"http://localhost:{port}/" in output
