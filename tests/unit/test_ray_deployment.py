"""The Ray deployment settings (no Ray needed): YAML file with command-line overrides, extra="forbid", autoscaling
bounds, fleet settings that carry Redis as a secret; a bad value on the command line names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from agent_mtp.errors import ConfigError
from agent_mtp.server.ray_serve import HIGH_THROUGHPUT_ENV, RayDeployment, fleet_settings, load_deployment, ray_env
from agent_mtp.server.settings import ServerSettings


def test_yaml_file_with_command_line_overrides(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("replicas: 3\nmax_ongoing_requests: 8\nthreads_per_replica: 2\nnum_gpus: 1\n")
    deployment = load_deployment(path, replicas=4, max_ongoing_requests=None)
    assert (deployment.replicas, deployment.max_ongoing_requests, deployment.threads_per_replica) == (4, 8, 2)
    assert deployment.num_gpus == 1 and deployment.autoscaling is None


def test_autoscaling_bounds() -> None:
    deployment = load_deployment(None, min_replicas=1, max_replicas=4)
    assert deployment.autoscaling == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 8.0,
    }
    with pytest.raises(ConfigError, match="both min_replicas and max_replicas"):
        load_deployment(None, min_replicas=1)
    with pytest.raises(ConfigError, match="swap them"):
        load_deployment(None, min_replicas=5, max_replicas=2)


def test_unknown_or_bad_fields_are_refused_with_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("replica: 2\n")  # a typo of replicas
    with pytest.raises(ConfigError, match=r"fleet.yaml.*replica: Extra inputs are not permitted"):
        load_deployment(path)
    path.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_deployment(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_deployment(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"replicas: .*got 0"):
        load_deployment(None, replicas=0)


def test_fleet_settings_carry_redis_as_a_secret_and_share_the_breakers() -> None:
    fleet = fleet_settings(
        ServerSettings(), RayDeployment(threads_per_replica=2), {"AGENT_MTP_REDIS_URL": "redis://h:6379/0"}
    )
    assert fleet.threads == 2
    assert isinstance(fleet.redis_url, SecretStr) and fleet.breaker_store == fleet.redis_url
    assert "redis://h" not in repr(fleet)
    apart = fleet_settings(
        ServerSettings(breaker_store=SecretStr("redis://b:6379/1")),
        RayDeployment(),
        {"AGENT_MTP_REDIS_URL": "redis://h"},
    )
    assert apart.breaker_store is not None and apart.breaker_store.get_secret_value() == "redis://b:6379/1"
    assert fleet_settings(ServerSettings(), RayDeployment(), {}).redis_url is None


def test_a_local_cluster_runs_ray_serves_high_throughput_mode_unless_told_otherwise(tmp_path: Path) -> None:
    on = RayDeployment()
    assert on.high_throughput

    def free(port: int) -> bool:
        return True

    expected = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert ray_env(on, {}, haproxy=True, port_free=free) == expected == HIGH_THROUGHPUT_ENV
    # what the environment sets explicitly wins, either way
    off = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    assert ray_env(on, off, haproxy=True, port_free=free) == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    # without Ray's HAProxy binary, or turned off in the YAML file or on the command line: Ray's defaults
    assert ray_env(on, {}, haproxy=False, port_free=free) == {}
    path = tmp_path / "fleet.yaml"
    path.write_text("high_throughput: false\n")
    assert ray_env(load_deployment(path), {}, haproxy=True, port_free=free) == {}
    assert load_deployment(path, high_throughput=True).high_throughput


def test_haproxy_takes_free_ports_where_rays_defaults_are_taken() -> None:
    import socket

    from agent_mtp.server.ports import port_is_free

    on = RayDeployment()
    taken = {9101}
    env = ray_env(on, {}, haproxy=True, port_free=lambda port: port not in taken)
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env  # 8404 free: Ray's default
    metrics = int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])
    assert metrics not in (9101, 8404) and port_is_free(metrics)
    # a port the environment names is left to it; without HAProxy no port is chosen
    named = {"RAY_SERVE_HAPROXY_METRICS_PORT": "9200", "RAY_SERVE_HAPROXY_STATS_PORT": "9201"}
    assert set(ray_env(on, named, haproxy=True, port_free=lambda port: False)) == set(HIGH_THROUGHPUT_ENV)
    assert ray_env(on, {"RAY_SERVE_ENABLE_HA_PROXY": "0"}, haproxy=True, port_free=lambda port: False) == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"
    }
    # the real probe sees a listening socket
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        assert not port_is_free(int(listener.getsockname()[1]))


def test_a_taken_http_port_is_refused_before_ray_starts() -> None:
    import socket

    from agent_mtp.server.ray_serve import check_http_port, run_ray

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        taken = RayDeployment(http_port=port)
        with pytest.raises(ConfigError, match=rf"port {port} on 127.0.0.1 is in use.*--port.*pkill"):
            check_http_port(taken)
        check_http_port(RayDeployment(http_port=0))  # any port: nothing to check
        pytest.importorskip("ray")
        with pytest.raises(ConfigError, match="is in use"):  # before ray.init: no cluster starts
            run_ray(ServerSettings(), taken)
    check_http_port(RayDeployment(http_port=port))  # free again


def test_serve_ray_high_throughput_flag_reaches_the_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import agent_mtp.server.ray_serve as ray_serve
    from agent_mtp.cli import app

    deployed: list[RayDeployment] = []
    monkeypatch.setattr(ray_serve, "run_ray", lambda settings, deployment: deployed.append(deployment))
    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--ray", "--no-ray-high-throughput"]).exit_code == 0
    assert runner.invoke(app, ["serve", "--ray"]).exit_code == 0
    assert [d.high_throughput for d in deployed] == [False, True]


def test_serve_ray_options_are_checked_before_ray_starts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent_mtp.cli import app

    runner = CliRunner()
    help_text = runner.invoke(app, ["serve", "--help"]).output
    assert "--ray" in help_text and "--replicas" in help_text
    bad = runner.invoke(app, ["serve", "--ray", "--min-replicas", "3", "--max-replicas", "1"])
    assert bad.exit_code != 0 and "swap them" in bad.output


def test_serve_ray_without_ray_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from typer.testing import CliRunner

    from agent_mtp.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    result = CliRunner().invoke(app, ["serve", "--ray", "--replicas", "2"])
    assert result.exit_code != 0 and "agent-mtp[ray]" in result.output


@pytest.mark.parametrize("where", ["yaml", "flag"])
def test_serve_ray_on_a_non_loopback_host_without_a_key_warns_as_plain_serve_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    from typer.testing import CliRunner

    import agent_mtp.server.cli as server_cli
    import agent_mtp.server.ray_serve as ray_serve
    from agent_mtp.cli import app

    deployed: list[RayDeployment] = []
    monkeypatch.setattr(ray_serve, "run_ray", lambda settings, deployment: deployed.append(deployment))
    monkeypatch.setattr(server_cli, "run_server", lambda settings, log_level: None)
    monkeypatch.delenv("AGENT_MTP_SERVE_API_KEY", raising=False)
    monkeypatch.delenv("AGENT_MTP_SERVE_HOST", raising=False)
    path = tmp_path / "fleet.yaml"
    path.write_text("http_host: 0.0.0.0\n" if where == "yaml" else "replicas: 1\n")
    command = ["serve", "--ray", "--ray-config", str(path)] + (["--host", "0.0.0.0"] if where == "flag" else [])
    runner = CliRunner()

    def warnings(args: list[str]) -> list[str]:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        return [line for line in text.split("warning:")[1:] if "without an API key" in line]

    expected = "binding 0.0.0.0 without an API key (AGENT_MTP_SERVE_API_KEY)"
    on_ray = warnings(command)
    assert len(on_ray) == 1 and expected in on_ray[0]  # once, even when --host sets both
    assert deployed[-1].http_host == "0.0.0.0"
    plain = warnings(["serve", "--host", "0.0.0.0"])  # the same warning as the plain server's
    assert len(plain) == 1 and expected in plain[0]
    assert not warnings(["serve", "--ray", "--ray-config", str(tmp_path / "fleet.yaml"), "--host", "127.0.0.1"])
    monkeypatch.setenv("AGENT_MTP_SERVE_API_KEY", "k")
    assert not warnings(command) and not warnings(["serve", "--host", "0.0.0.0"])
