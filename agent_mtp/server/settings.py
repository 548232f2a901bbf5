"""Server settings: one pydantic-settings object, read from ``AGENT_MTP_SERVE_*`` environment variables and the
``agent-mtp serve`` options (options win)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServerSettings(BaseSettings):
    """How a deployment serves: model, policy, limits, security. Every field is also ``AGENT_MTP_SERVE_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="AGENT_MTP_SERVE_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    """Interface to bind (loopback by default; 0.0.0.0 exposes the server: set an api_key then)."""
    port: int = Field(default=8000, ge=0, le=65535)
    model: str = "default"
    """The model to load: "default" (embedded SmolLM2-135M-Instruct), a hub id or a local directory."""
    served_model_name: str | None = None
    """The name clients pass as ``model`` (default: ``model``)."""
    adapter: str | None = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    runtime: Literal["auto", "fast", "hf"] = "auto"
    kv_cache: Literal["fp32", "fp16"] | None = None
    """What the fast runtime's KV caches hold: fp32 (exact) or fp16 (half the bytes each batched pass reads from
    them; output may differ from the float32 model's at near-ties). None: ``$AGENT_MTP_KV_CACHE``, else fp32."""
    row_grid: Literal["int24", "int16"] | None = None
    """The fast runtime's grid for real rows on its record paths (AMX, VNNI): int24 (exact) or int16 (16 integer
    products a weight block instead of 24 on VNNI, which batched passes are bound by; output may differ from the
    float32 model's at near-ties). None: ``$AGENT_MTP_ROW_GRID``, else int24."""
    policy: str = "default"
    """The deployment's policy: a shipped name (default, latency, exact), a YAML path, or "none" (fixed decoding
    with ``mode``)."""
    mode: Literal["ntp", "static", "confadapt", "verified"] = "verified"
    """Decode mode when the policy is "none" (or a request asks for fixed decoding without naming a mode)."""
    allow_policy_override: bool = True
    """Requests may pick a shipped policy or a fixed mode in their ``agent_mtp`` field."""
    api_key: SecretStr | None = None
    """When set, every /v1 request needs ``Authorization: Bearer <api_key>`` (never logged)."""
    concurrency: Literal["batched", "serial"] = "batched"
    """batched: concurrent requests share forward passes (continuous batching); serial: one at a time."""
    max_active: int = Field(default=16, ge=1, le=256)
    """Requests decoding at once (the batch)."""
    max_queue: int = Field(default=64, ge=0)
    """Requests waiting for a slot; beyond it a request gets 429 with Retry-After."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline per request from its arrival (queueing included): the output so far, finish_reason "length"
    and ``agent_mtp.finish_reason`` "timeout"; a request may ask for less (``agent_mtp.timeout``)."""
    redis_url: SecretStr | None = None
    """Telemetry to this Redis (else the process-wide telemetry of ``AGENT_MTP_REDIS_URL``, else none), as for
    AgentMTPChat."""
    breaker_store: SecretStr | None = None
    """Redis URL for the policy breakers shared by a fleet (None: in this process)."""
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM/SIGINT: stop accepting, let in-flight requests finish this long, then cancel them."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (None: torch's default)."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
