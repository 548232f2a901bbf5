"""`agent-mtp serve` (the OpenAI-compatible server) and `agent-mtp loadtest` (concurrent agent clients against it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from agent_mtp.cli_common import console

log = logging.getLogger("agent_mtp.server")


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``loadtest`` to ``app`` (only when the serve extra is installed)."""
    try:  # without the serve extra the commands are left out
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError:
        return
    app.command("serve")(serve)
    app.command("loadtest")(loadtest)


def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000; 0 picks a free one).")] = None,
    model: Annotated[str | None, typer.Option(help='"default", a hub id or a local directory.')] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The name clients send as model.")] = None,
    policy: Annotated[str | None, typer.Option(help="default | latency | exact | a YAML path | none")] = None,
    mode: Annotated[str | None, typer.Option(help="Decode mode with --policy none.")] = None,
    runtime: Annotated[str | None, typer.Option(help="auto | fast | hf")] = None,
    kv_cache: Annotated[str | None, typer.Option(help="fp32 (exact) | fp16 (half the KV bytes per pass)")] = None,
    row_grid: Annotated[
        str | None, typer.Option(help="int24 (exact) | int16 (fewer products per real row on VNNI)")
    ] = None,
    concurrency: Annotated[str | None, typer.Option(help="batched (continuous batching) | serial")] = None,
    max_active: Annotated[int | None, typer.Option(help="Requests decoding at once.")] = None,
    max_queue: Annotated[int | None, typer.Option(help="Requests waiting; beyond: 429.")] = None,
    request_timeout: Annotated[float | None, typer.Option(help="Deadline per request, seconds.")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    ray: Annotated[bool, typer.Option("--ray", help="Serve N replicas on Ray Serve (the ray extra).")] = False,
    replicas: Annotated[int | None, typer.Option(help="--ray: number of replicas.")] = None,
    ray_config: Annotated[Path | None, typer.Option(help="--ray: a YAML RayDeployment file.")] = None,
    max_ongoing_requests: Annotated[int | None, typer.Option(help="--ray: requests per replica at once.")] = None,
    min_replicas: Annotated[int | None, typer.Option(help="--ray: autoscaling lower bound.")] = None,
    max_replicas: Annotated[int | None, typer.Option(help="--ray: autoscaling upper bound.")] = None,
    ray_address: Annotated[
        str | None, typer.Option(help='--ray: cluster to join ("auto"; default: a local one).')
    ] = None,
    ray_high_throughput: Annotated[
        bool | None,
        typer.Option(
            "--ray-high-throughput/--no-ray-high-throughput",
            help="--ray: HAProxy ingress and gRPC between deployments (default on; a local cluster).",
        ),
    ] = None,
) -> None:
    """Serve the model over the OpenAI chat-completions API (POST /v1/chat/completions, GET /v1/models,
    GET /health). The API key comes from $AGENT_MTP_SERVE_API_KEY (never a command-line argument: it would show
    in the process list); every option is also $AGENT_MTP_SERVE_<OPTION>."""
    from agent_mtp.server.settings import ServerSettings

    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "model": model,
        "served_model_name": served_model_name,
        "policy": policy,
        "mode": mode,
        "runtime": runtime,
        "kv_cache": kv_cache,
        "row_grid": row_grid,
        "concurrency": concurrency,
        "max_active": max_active,
        "max_queue": max_queue,
        "request_timeout_s": request_timeout,
        "threads": threads,
    }
    try:
        settings = ServerSettings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if ray:
        _serve_on_ray(
            settings,
            ray_config,
            replicas,
            max_ongoing_requests,
            min_replicas,
            max_replicas,
            ray_address,
            ray_high_throughput,
        )
        return
    warn_if_exposed(settings.host, settings)
    run_server(settings, log_level=log_level)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def warn_if_exposed(host: str, settings: Any) -> None:
    """Warn when the server listens beyond loopback and /v1 takes requests without an API key."""
    if host not in LOOPBACK and settings.api_key is None:
        console.print(f"[yellow]warning:[/yellow] binding {host} without an API key (AGENT_MTP_SERVE_API_KEY)")


def _serve_on_ray(
    settings: Any,
    config: Path | None,
    replicas: int | None,
    max_ongoing: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    address: str | None,
    high_throughput: bool | None = None,
) -> None:
    """The Ray Serve fleet (agent_mtp.server.ray_serve); --threads is the torch threads of each replica."""
    from agent_mtp.errors import ConfigError
    from agent_mtp.server.ray_serve import load_deployment, run_ray

    try:
        deployment = load_deployment(
            config,
            replicas=replicas,
            max_ongoing_requests=max_ongoing,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            address=address,
            high_throughput=high_throughput,
            threads_per_replica=settings.threads,
            http_host=settings.host if "host" in settings.model_fields_set else None,
            http_port=settings.port if "port" in settings.model_fields_set else None,
        )
        warn_if_exposed(deployment.http_host, settings)  # the proxy's host: --host, else the YAML file's
        run_ray(settings, deployment)
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None


def run_server(settings: Any, *, log_level: str = "info") -> None:
    """Run uvicorn until SIGINT/SIGTERM; in-flight requests get ``shutdown_grace_s`` to finish."""
    import uvicorn

    from agent_mtp.server.app import create_app

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    uvicorn.Server(config).run()


def loadtest(
    base_url: Annotated[
        str | None, typer.Option(help="A running server (default: start one here on a free port).")
    ] = None,
    clients: Annotated[str, typer.Option(help="Comma-separated concurrency levels.")] = "1,4,8,16",
    policies: Annotated[str, typer.Option(help="Comma-separated: ntp, verified, confadapt, or shipped policies.")] = (
        "ntp,verified,confadapt"
    ),
    suite: Annotated[str, typer.Option(help="Bench suite of prompts.")] = "agent",
    requests_per_client: Annotated[
        int, typer.Option(help="Requests each client sends per cell (with --duration 0).")
    ] = 3,
    duration: Annotated[
        float,
        typer.Option(
            help="Seconds each cell runs at its concurrency (tokens streamed inside the window count); "
            "0: a fixed number of requests per client instead."
        ),
    ] = 30.0,
    max_tokens: Annotated[int | None, typer.Option(help="Cap on each prompt's own max_tokens.")] = None,
    rounds: Annotated[
        int,
        typer.Option(
            help="Run the whole sweep this many times, interleaved; figures pooled, ratios to NTP with their "
            "spread over the rounds."
        ),
    ] = 1,
    threads: Annotated[int | None, typer.Option(help="torch threads of the server started here.")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for JSON, Markdown and PNG.")] = Path(
        "runs/loadtest"
    ),
) -> None:
    """Drive 1/4/8/16 concurrent agent clients over the agent suite against the server with NTP, verified and
    ConfAdapt: aggregate tokens/s, P50/P95 latency, TTFT, error and timeout ratio; a table and a plot."""
    from agent_mtp.server.loadtest import LoadtestConfig, run_loadtest

    if duration < 0:
        raise typer.BadParameter(f"--duration {duration} is invalid; use seconds > 0, or 0 for a request count.")
    if rounds < 1:
        raise typer.BadParameter(f"--rounds {rounds} is invalid; use a whole number of sweeps >= 1.")
    config = LoadtestConfig(
        clients=tuple(int(c) for c in clients.split(",") if c.strip()),
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        suite=suite,
        requests_per_client=requests_per_client,
        max_tokens=max_tokens,
        duration_s=duration if duration > 0 else None,
        rounds=rounds,
    )
    run_loadtest(config, base_url=base_url, threads=threads, out_dir=out_dir)
