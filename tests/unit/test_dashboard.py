"""The web dashboard against a real private redis-server: the page's JSON equals ``agent-mtp stats --json``,
``/metrics`` parses and its counts equal the Redis aggregates, no password in any response, read-only, token,
mounting under another app, the A/B view."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the dashboard needs the [dashboard] extra (fastapi)")
pytest.importorskip("prometheus_client", reason="the dashboard needs the [dashboard] extra (prometheus-client)")

import typer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from typer.testing import CliRunner

from agent_mtp.events import StepEvent
from agent_mtp.telemetry import Telemetry, TelemetryConfig, redis_store
from agent_mtp.telemetry.cli import register as register_stats
from agent_mtp.telemetry.queries import StatsReport, query_stats
from agent_mtp.telemetry.web import DashboardSettings, DashboardSource, create_dashboard_app
from agent_mtp.telemetry.web.app import static_dir
from agent_mtp.telemetry.web.cli import register as register_dashboard
from agent_mtp.telemetry.web.data import Fleet
from agent_mtp.telemetry.web.metrics import FleetCollector, metrics_registry, render_metrics
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.redis

PASSWORD = "Dashb0ard-Secret-Pw"
TOKEN = "t0ken-For-The-Page"
COUNTED = ("requests", "timeouts", "retried", "retries", "fallbacks", "breaker_open", "errors")


def _event(i: int, *, ago_s: float = 20.0) -> StepEvent:
    return StepEvent(
        step_type=("tool_call", "reasoning", "final_answer")[i % 3],
        mode=("verified", "confadapt", "ntp")[i % 2 if i % 7 else 2],
        outcome="timeout" if i % 5 == 0 else ("error" if i % 11 == 0 else "ok"),
        latency_s=0.004 * (1 + i % 40),
        new_tokens=6 + i % 5,
        forward_passes=2 + i % 3,
        attempts=1 + (i % 4 == 0),
        fallback=i % 6 == 0,
        breaker_open=i % 9 == 0,
        monitor_failures=("json_valid",) if i % 8 == 0 else (),
        ntp_equivalent_s=0.02,
        ttft_s=0.002,
        prompt_tokens=100,
        cached_prompt_tokens=60 if i % 2 else 0,
        run_id=f"run-{i}",
        timestamp=_now() - ago_s - (i % 3) * 10,
    )


def _now() -> float:
    import time

    return time.time()


def _record(url: str, namespace: str, count: int, *, offset: int = 0) -> None:
    telemetry = Telemetry(url, config=TelemetryConfig(namespace=namespace, flush_interval_s=0.05))
    for i in range(offset, offset + count):
        telemetry.record(_event(i))
    telemetry.report_intervention(
        "manual_intervention", step_type="tool_call", run_id="run-7", note="fixed <b>city</b>"
    )
    telemetry.report_intervention("user_visible_failure", step_type="final_answer", run_id="run-9", note="empty answer")
    assert telemetry.close()


def _settings(url: str, *namespaces: str, token: str | None = None) -> DashboardSettings:
    sources = tuple(DashboardSource(label=ns, namespace=ns) for ns in namespaces) or (
        DashboardSource(label="agent_mtp"),
    )
    return DashboardSettings(
        redis_url=SecretStr(url), sources=sources, token=None if token is None else SecretStr(token)
    )


@pytest.fixture
def fleet_url(redis_server: RedisServer) -> Iterator[str]:
    _record(redis_server.url, "ns-a", 60)
    yield redis_server.url


def _stats_json(url: str, namespace: str, window: str) -> dict[str, Any]:
    app = typer.Typer()
    register_stats(app)
    app.command("noop", hidden=True)(lambda: None)
    result = CliRunner().invoke(
        app, ["stats", "--json", "--redis-url", url, "--namespace", namespace, "--window", window]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("window", ["1m", "5m", "1h"])
def test_page_json_equals_stats_json(fleet_url: str, window: str) -> None:
    client = TestClient(create_dashboard_app(_settings(fleet_url, "ns-a")))
    for _ in range(3):  # the two reads must fall into the same 10-s bucket to cover the same window
        view = client.get(f"/api/stats?window={window}").json()
        expected = _stats_json(fleet_url, "ns-a", window)
        page = view["fleets"][0]["report"]
        if page["start"] == expected["start"]:
            break
    assert page == expected
    assert page["total"]["requests"] == (60 if window != "1m" else page["total"]["requests"])
    assert page["total"]["requests"] > 0


def test_page_serves_the_vendored_chart_library(fleet_url: str) -> None:
    client = TestClient(create_dashboard_app(_settings(fleet_url, "ns-a")))
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    assert '<base href="/">' in html
    assert 'src="static/uplot/uPlot.iife.min.js"' in html
    assert "default-src 'self'" in page.headers["content-security-policy"]  # the browser loads nothing else
    for text in (html, (static_dir() / "dashboard.js").read_text(), (static_dir() / "dashboard.css").read_text()):
        assert "http://" not in text and "https://" not in text and "//cdn" not in text  # nothing from a CDN
    for name in ("uplot/uPlot.iife.min.js", "uplot/uPlot.min.css", "dashboard.js", "dashboard.css"):
        response = client.get(f"/static/{name}")
        assert response.status_code == 200
        assert response.content == (static_dir() / name).read_bytes()
    assert "MIT License" in (static_dir() / "uplot" / "LICENSE").read_text()
    assert "1.6.32" in (static_dir() / "uplot" / "VENDORED.md").read_text()
    config = client.get("/api/config").json()
    assert config["fleets"] == [{"label": "ns-a", "namespace": "ns-a", "target": fleet_url}]
    assert config["windows"] == ["1m", "5m", "1h"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _labels(policy: str, step_type: str, mode: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"policy": policy, "replica": "all", "step_type": step_type, "mode": mode, **extra}.items()))


def test_metrics_counts_equal_the_redis_aggregates(fleet_url: str) -> None:
    client = TestClient(create_dashboard_app(_settings(fleet_url, "ns-a")))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    report = query_stats(redis_store(fleet_url, namespace="ns-a"), window="1h", namespace="ns-a")
    assert report.rows
    names = {
        "requests": "agent_mtp_steps_total",
        "timeouts": "agent_mtp_step_timeouts_total",
        "retried": "agent_mtp_steps_retried_total",
        "retries": "agent_mtp_step_retries_total",
        "fallbacks": "agent_mtp_step_fallbacks_total",
        "breaker_open": "agent_mtp_steps_breaker_open_total",
        "errors": "agent_mtp_step_errors_total",
        "manual_interventions": "agent_mtp_manual_interventions_total",
        "user_visible_failures": "agent_mtp_user_visible_failures_total",
        "new_tokens": "agent_mtp_new_tokens_total",
        "forward_passes": "agent_mtp_forward_passes_total",
        "prompt_tokens": "agent_mtp_prompt_tokens_total",
        "cached_prompt_tokens": "agent_mtp_cached_prompt_tokens_total",
    }
    for row in report.rows:
        labels = _labels("ns-a", row.step_type, row.mode)
        for field, name in names.items():
            assert samples[(name, labels)] == row.count(field), (name, labels)
        for monitor, count in row.monitor_failures.items():
            assert (
                samples[("agent_mtp_monitor_failures_total", _labels("ns-a", row.step_type, row.mode, monitor=monitor))]
                == count
            )
        if row.requests:
            hist = sum(row.latency_histogram.values())
            assert samples[("agent_mtp_step_latency_seconds_count", labels)] == hist == row.requests
            assert math.isclose(samples[("agent_mtp_step_latency_seconds_sum", labels)], row.fields["latency_s"])
            assert (
                samples[("agent_mtp_step_latency_seconds_bucket", _labels("ns-a", row.step_type, row.mode, le="+Inf"))]
                == hist
            )
    assert sum(v for (name, _), v in samples.items() if name == "agent_mtp_steps_total") == 60
    for window in ("5m", "1h"):
        windowed = query_stats(redis_store(fleet_url, namespace="ns-a"), window=window, namespace="ns-a")
        for row in windowed.rows:
            if row.requests:
                labels = _labels("ns-a", row.step_type, row.mode, window=window)
                assert samples[("agent_mtp_window_steps", labels)] == row.requests
                assert math.isclose(samples[("agent_mtp_window_timeout_ratio", labels)], row.timeout_ratio or 0.0)
                assert math.isclose(samples[("agent_mtp_window_fallback_rate", labels)], row.fallback_rate or 0.0)
                hit_rate = samples[("agent_mtp_window_prefix_cache_hit_rate", labels)]
                assert math.isclose(hit_rate, row.prefix_cache_hit_rate or 0.0)
                quantile = _labels("ns-a", row.step_type, row.mode, window=window, quantile="0.95")
                p95 = samples[("agent_mtp_window_latency_seconds", quantile)]
                assert math.isclose(p95, row.p95_s or 0.0)
        total = _labels("ns-a", "all", "all", window=window)
        assert samples[("agent_mtp_window_steps", total)] == windowed.total.requests
    assert samples[("agent_mtp_dashboard_redis_up", (("policy", "ns-a"),))] == 1.0
    assert any(name == "agent_mtp_replica_last_seen_timestamp_seconds" for name, _ in samples)


def test_counters_never_go_down_when_buckets_leave_the_hour(fleet_url: str) -> None:
    now = _now()
    clock = [now]
    fleet = Fleet("ns-a", "ns-a", redis_store(fleet_url, namespace="ns-a"))
    registry = metrics_registry([fleet], clock=lambda: clock[0])
    first = _samples(render_metrics(registry).decode())
    clock[0] = now + 2 * 3600  # every bucket written now is older than the hour the collector re-reads
    later = _samples(render_metrics(registry).decode())
    steps = {k: v for k, v in first.items() if k[0] == "agent_mtp_steps_total"}
    assert steps and all(later[key] == value for key, value in steps.items())
    assert sum(steps.values()) == 60
    assert isinstance(registry, object) and FleetCollector  # the collector is public for a server's own registry


def test_no_password_in_any_response_and_nothing_written(redis_server: RedisServer) -> None:
    _record(redis_server.url, "ns-a", 30)
    # A read-only ACL user: any write the dashboard tried would fail (and show up as an error below).
    with redis_server.client() as admin:
        admin.acl_setuser(
            "viewer",
            enabled=True,
            passwords=[f"+{PASSWORD}"],
            keys=["*"],
            commands=["-@all", "+@read", "+@connection", "+client|setname"],
        )
        before = _dump(admin)
    url = redis_server.url_for("viewer", PASSWORD)
    client = TestClient(create_dashboard_app(_settings(url, "ns-a")))
    responses = [
        client.get("/"),
        client.get("/api/config"),
        *[client.get(f"/api/stats?window={w}") for w in ("1m", "5m", "1h")],
        client.get("/metrics"),
        client.get("/api/stats?window=banana"),
        client.get("/nothing-here"),
    ]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 200, 200, 400, 404]
    stats = responses[3].json()["fleets"][0]
    assert "error" not in stats and stats["report"]["total"]["requests"] == 30
    assert stats["target"] == f"redis://viewer:***@127.0.0.1:{redis_server.port}/0"
    for response in responses:
        assert PASSWORD not in response.text
    with redis_server.client() as admin:
        assert _dump(admin) == before  # read-only: nothing added, changed or removed

    # Redis down: the page says so, naming the redacted URL, never the password
    redis_server.kill()
    down = [client.get("/api/stats?window=5m"), client.get("/metrics"), client.get("/")]
    assert down[0].status_code == 503
    assert "viewer:***@" in down[0].json()["fleets"][0]["error"]
    assert 'agent_mtp_dashboard_redis_up{policy="ns-a"} 0.0' in down[1].text
    for response in down:
        assert PASSWORD not in response.text


def _dump(client: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key in client.scan_iter("*"):
        kind = client.type(key).decode()
        value: Any = {
            "hash": lambda k: client.hgetall(k),
            "set": lambda k: sorted(client.smembers(k)),
            "list": lambda k: client.lrange(k, 0, -1),
            "string": lambda k: client.get(k),
        }[kind](key)
        state[key.decode()] = (kind, value)
    return state


def test_token_guards_every_route_but_static(fleet_url: str) -> None:
    client = TestClient(create_dashboard_app(_settings(fleet_url, "ns-a", token=TOKEN)))
    for path in ("/", "/api/config", "/api/stats", "/metrics"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
    assert client.get("/static/dashboard.js").status_code == 200
    # a browser: /?token= sets an HttpOnly cookie and redirects to the page without the token in the address
    opened = client.get(f"/?token={TOKEN}", follow_redirects=False)
    assert opened.status_code == 303 and "token" not in opened.headers["location"]
    assert "httponly" in opened.headers["set-cookie"].lower()
    page = client.get("/")
    assert page.status_code == 200 and TOKEN not in page.text
    assert client.get("/api/stats").status_code == 200
    assert client.get("/?token=wrong", follow_redirects=False).status_code == 401


def test_mounts_under_another_app(fleet_url: str) -> None:
    server = FastAPI()
    server.mount("/dashboard", create_dashboard_app(_settings(fleet_url, "ns-a")))
    client = TestClient(server)
    page = client.get("/dashboard/")
    assert page.status_code == 200 and '<base href="/dashboard/">' in page.text
    assert client.get("/dashboard/static/uplot/uPlot.iife.min.js").status_code == 200
    assert client.get("/dashboard/api/stats").json()["fleets"][0]["report"]["total"]["requests"] == 60
    assert "agent_mtp_steps_total" in client.get("/dashboard/metrics").text


def test_ab_view_two_namespaces_side_by_side(redis_server: RedisServer) -> None:
    _record(redis_server.url, "policy-fast", 40)
    _record(redis_server.url, "policy-safe", 25, offset=100)
    settings = DashboardSettings(
        redis_url=SecretStr(redis_server.url),
        sources=(
            DashboardSource(label="fast", namespace="policy-fast"),
            DashboardSource(label="safe", namespace="policy-safe"),
        ),
    )
    client = TestClient(create_dashboard_app(settings))
    fleets = client.get("/api/stats?window=5m").json()["fleets"]
    assert [f["label"] for f in fleets] == ["fast", "safe"]
    assert [f["report"]["total"]["requests"] for f in fleets] == [40, 25]
    assert fleets[0]["timeline"]["t"] == fleets[1]["timeline"]["t"]  # the same x axis: one chart, two lines
    assert sum(v or 0 for v in fleets[1]["timeline"]["series"]["all"]["requests"]) == 25
    samples = _samples(client.get("/metrics").text)
    for policy, count in (("fast", 40), ("safe", 25)):
        total = sum(
            v for (n, labels), v in samples.items() if n == "agent_mtp_steps_total" and ("policy", policy) in labels
        )
        assert total == count


def test_timeline_and_breakers_match_the_report(fleet_url: str) -> None:
    report: StatsReport = query_stats(redis_store(fleet_url, namespace="ns-a"), window="5m", namespace="ns-a")
    fleet = (
        TestClient(create_dashboard_app(_settings(fleet_url, "ns-a"))).get("/api/stats?window=5m").json()["fleets"][0]
    )
    series = fleet["timeline"]["series"]
    assert sum(v or 0 for v in series["all"]["requests"]) == report.total.requests
    for step_type in ("tool_call", "reasoning", "final_answer"):
        assert sum(v or 0 for v in series[step_type]["requests"]) == report.select(step_type=step_type).requests
        assert fleet["breakers"][step_type]["breaker_open_steps"] == report.select(step_type=step_type).count(
            "breaker_open"
        )
    assert fleet["replicas"] and fleet["replicas"][0]["replica"].endswith(tuple("0123456789"))


def test_settings_and_cli_refuse_bad_values(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="must differ"):
        DashboardSettings(
            redis_url=SecretStr(redis_server.url),
            sources=(DashboardSource(label="a", namespace="x"), DashboardSource(label="a", namespace="y")),
        )
    with pytest.raises(ValueError, match="unsupported scheme"):
        DashboardSettings(redis_url=SecretStr("http://user:pw@host"))
    with pytest.raises(ValueError, match="extra"):
        DashboardSettings(redis_url=SecretStr(redis_server.url), colour="red")  # type: ignore[call-arg]
    app = typer.Typer()
    register_dashboard(app)
    app.command("noop", hidden=True)(lambda: None)
    runner = CliRunner()
    bad = runner.invoke(app, ["dashboard", "--redis", f"redis://u:{PASSWORD}@h:1/0", "--namespace", "bad:ns"])
    assert bad.exit_code == 2 and "bad:ns" in bad.output and PASSWORD not in bad.output
    missing = runner.invoke(app, ["dashboard"], env={"AGENT_MTP_REDIS_URL": ""})
    assert missing.exit_code == 2 and "--redis" in missing.output


def test_sample_grafana_dashboard_uses_only_exported_metrics(fleet_url: str) -> None:
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    exported = {
        name
        for name, _ in _samples(TestClient(create_dashboard_app(_settings(fleet_url, "ns-a"))).get("/metrics").text)
    }
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b(agent_mtp_[a-z0-9_]+)", expr)}
    assert used and used <= exported, used - exported


def test_the_dashboard_reads_telemetry_only() -> None:
    """Imports point one way: the dashboard sits on the telemetry query functions, never on the layers that feed
    them (engine, policy, service, front ends)."""
    import ast
    from pathlib import Path

    import agent_mtp.telemetry.web as web

    forbidden = ("agent_mtp.engine", "agent_mtp.policy", "agent_mtp.service", "agent_mtp.langchain", "agent_mtp.server")
    bad = []
    for path in sorted(Path(web.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{path.name}: {n}" for n in names if n.startswith(forbidden)]
    assert not bad
