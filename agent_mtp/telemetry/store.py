"""Where batches go and where queries read from: Redis (shared by a fleet) or an in-process memory store.

Redis key schema (all keys share the hash tag ``{namespace}``, so a Redis Cluster keeps them in one slot):

    {ns}:t:s:<bucket>:<model>:<step_type>:<mode>  hash    counters, float sums, h:<i> latency histogram
    {ns}:t:i:<bucket>                             set     members "<model>:<step_type>:<mode>" of a bucket
    {ns}:t:h:<bucket>                             hash    health counters (dropped buckets, bad input, ...)
    {ns}:t:w:<bucket>                             set     writer ids ("host:pid") that flushed in a bucket
    {ns}:t:n                                      list    recent interventions (JSON, newest first)
    {ns}:t:f:<flush_id>                           string  marker that makes a flush idempotent
    {ns}:t:e:<epoch>                              string  steps of one writer process that Redis holds (loss check)

``<bucket>`` is the bucket start in whole epoch seconds. Every key has a TTL (``retention_s``; markers
``dedupe_ttl_s``).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agent_mtp.redis_url import redact_url, url_secrets
from agent_mtp.telemetry.aggregate import Aggregate, Batch, Ledger, SeriesKey
from agent_mtp.telemetry.config import TelemetryConfig
from agent_mtp.telemetry.lua import FLUSH_SCRIPT


@dataclass(frozen=True)
class Applied:
    """A batch applied now; ``lost_requests``: steps of this writer that Redis had acknowledged and no longer holds
    (found by the epoch counter, see :mod:`agent_mtp.telemetry.lua`)."""

    lost_requests: int = 0


WriteResult = Literal["applied", "duplicate"] | Applied
"""Per batch: applied now, or applied before under the same flush id (a failed script is an Exception)."""
STORE_ERRORS = (redis.RedisError, OSError)
"""What a failing store raises (connection refused, timeout, auth, read-only replica, ...)."""


@dataclass
class WindowData:
    """Raw contents of a range of buckets, the same shape from Redis and from memory."""

    series: list[tuple[SeriesKey, dict[str, float]]] = field(default_factory=list)
    per_bucket_health: dict[int, dict[str, int]] = field(default_factory=dict)
    writers: set[str] = field(default_factory=set)
    notes: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class Store(Protocol):
    target: str
    """Where the data goes, for messages (a Redis URL with its password redacted, or ``memory``)."""

    def write(self, batches: Sequence[Batch], writer: str) -> list[WriteResult | Exception]: ...

    def ping(self) -> None: ...

    def read(self, buckets: Sequence[int]) -> WindowData: ...


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: bytes | str) -> float:
    return float(_text(value))


def _payload(batch: Batch) -> str:
    series = [
        {
            "m": key.member,
            "i": {name: str(value) for name, value in agg.counts.items()},
            "f": {name: repr(value) for name, value in agg.sums.items()},
        }
        for key, agg in batch.series.items()
    ]
    health = {name: str(value) for name, value in batch.health.items()}
    return json.dumps({"health": health, "notes": batch.notes, "series": series}, separators=(",", ":"))


def build_client(url: str, *, socket_timeout_s: float) -> redis.Redis:
    """A client whose every command is bounded by ``socket_timeout_s`` and never retried inside redis-py."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        client_name="agent-mtp-telemetry",
    )


class RedisStore:
    """Writes batches with one pipelined EVALSHA per batch; reads a window with two pipelined round trips."""

    def __init__(self, client: redis.Redis, *, config: TelemetryConfig, target: str | None = None) -> None:
        self.client = client
        self.config = config
        self.prefix = "{" + config.namespace + "}:t"
        self.target = target or _describe_client(client)
        self.secrets: tuple[str, ...] = ()
        """Strings scrubbed from error messages (the password of the URL this store was built from)."""
        self._script = client.register_script(FLUSH_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, config: TelemetryConfig) -> RedisStore:
        client = build_client(url, socket_timeout_s=config.socket_timeout_s)
        store = cls(client, config=config, target=redact_url(url))
        store.secrets = url_secrets(url)
        return store

    # -- keys -----------------------------------------------------------------------------------------------
    def series_key(self, key: SeriesKey) -> str:
        return f"{self.prefix}:s:{key.bucket}:{key.member}"

    def index_key(self, bucket: int) -> str:
        return f"{self.prefix}:i:{bucket}"

    def health_key(self, bucket: int) -> str:
        return f"{self.prefix}:h:{bucket}"

    def writers_key(self, bucket: int) -> str:
        return f"{self.prefix}:w:{bucket}"

    def notes_key(self) -> str:
        return f"{self.prefix}:n"

    def flush_key(self, flush_id: str) -> str:
        return f"{self.prefix}:f:{flush_id}"

    def epoch_key(self, epoch: str) -> str:
        """Keyed by the writer's random epoch alone (hex): no host name ever becomes part of a key."""
        return f"{self.prefix}:e:{epoch}"

    # -- writing --------------------------------------------------------------------------------------------
    def _script_call(self, batch: Batch, writer: str) -> tuple[list[str], list[str]]:
        ledger = batch.ledger or Ledger("-", 0, 0)
        keys = [
            self.flush_key(batch.flush_id),
            self.health_key(batch.health_bucket),
            self.writers_key(batch.health_bucket),
            self.notes_key(),
            self.epoch_key(ledger.epoch),
        ]
        for key in batch.series:
            keys += [self.series_key(key), self.index_key(key.bucket)]
        args = [
            str(self.config.dedupe_ttl_s),
            str(self.config.retention_s),
            writer,
            str(self.config.intervention_log_size),
            _payload(batch),
            str(ledger.acknowledged),
            str(ledger.floor),
            str(batch.requests),
            str(self.config.dedupe_ttl_s),
        ]
        return keys, args

    def write(self, batches: Sequence[Batch], writer: str) -> list[WriteResult | Exception]:
        """Apply batches in one pipeline; raises redis/OS errors if the connection fails (outcome unknown)."""
        pipe = self.client.pipeline(transaction=False)
        for batch in batches:
            keys, args = self._script_call(batch, writer)
            self._script(keys=keys, args=args, client=pipe)
        replies = pipe.execute(raise_on_error=False)
        return [_write_result(reply) for reply in replies]

    def ping(self) -> None:
        self.client.ping()

    # -- reading --------------------------------------------------------------------------------------------
    def read(self, buckets: Sequence[int]) -> WindowData:
        pipe = self.client.pipeline(transaction=False)
        for bucket in buckets:
            pipe.smembers(self.index_key(bucket))
            pipe.hgetall(self.health_key(bucket))
            pipe.smembers(self.writers_key(bucket))
        pipe.lrange(self.notes_key(), 0, self.config.intervention_log_size - 1)
        replies = pipe.execute()
        data = WindowData()
        found: list[SeriesKey | None] = []
        for i, bucket in enumerate(buckets):
            members, health, writers = replies[3 * i : 3 * i + 3]
            found += [_series_key(bucket, _text(m)) for m in members]
            if health:
                data.per_bucket_health[bucket] = {_text(k): int(_number(v)) for k, v in health.items()}
            data.writers.update(_text(w) for w in writers)
        data.notes = [_parse_note(raw) for raw in replies[-1]]
        keys = [key for key in found if key is not None]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self.series_key(key))
        for key, fields in zip(keys, pipe.execute(), strict=True):
            if fields:
                data.series.append((key, {_text(k): _number(v) for k, v in fields.items()}))
        return data


def _write_result(reply: object) -> WriteResult | Exception:
    if isinstance(reply, Exception):
        return reply
    if isinstance(reply, list):
        return Applied(int(reply[1]))
    return "applied" if reply == 1 else "duplicate"


def _series_key(bucket: int, member: str) -> SeriesKey | None:
    parts = member.split(":")
    return SeriesKey(bucket, *parts) if len(parts) == 3 else None


def _parse_note(raw: bytes | str) -> dict[str, Any]:
    try:
        note = json.loads(_text(raw))
    except ValueError:
        return {"note": "<unreadable>"}
    return note if isinstance(note, dict) else {"note": "<unreadable>"}


def _describe_client(client: redis.Redis) -> str:
    """host:port/db of a user-supplied client (never its credentials)."""
    kwargs: Mapping[str, Any] = getattr(client.connection_pool, "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


class MemoryStore:
    """The same data model in this process only (used when no Redis is configured, and by unit tests)."""

    target = "memory"

    def __init__(self, *, config: TelemetryConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._applied: dict[str, None] = {}
        self._series: dict[SeriesKey, dict[str, float]] = {}
        self._health: dict[int, dict[str, int]] = {}
        self._writers: dict[int, set[str]] = {}
        self._notes: deque[str] = deque(maxlen=config.intervention_log_size)

    def reset_lock(self) -> None:
        """After fork: the parent's flusher may have held the lock at that moment."""
        self._lock = threading.Lock()

    def write(self, batches: Sequence[Batch], writer: str) -> list[WriteResult | Exception]:
        with self._lock:
            return [self._apply(batch, writer) for batch in batches]

    def _apply(self, batch: Batch, writer: str) -> WriteResult:
        if batch.flush_id in self._applied:
            return "duplicate"
        self._applied[batch.flush_id] = None
        if len(self._applied) > 100_000:
            self._applied.pop(next(iter(self._applied)))
        health = self._health.setdefault(batch.health_bucket, {})
        for name, value in batch.health.items():
            health[name] = health.get(name, 0) + value
        self._writers.setdefault(batch.health_bucket, set()).add(writer)
        self._notes.extendleft(batch.notes)
        for key, agg in batch.series.items():
            _merge_into(self._series.setdefault(key, {}), agg)
        self._prune(batch.health_bucket)
        return "applied"

    def _prune(self, newest: int) -> None:
        oldest = newest - self.config.retention_s
        for key in [k for k in self._series if k.bucket < oldest]:
            del self._series[key]
        for table in (self._health, self._writers):
            for bucket in [b for b in table if b < oldest]:
                del table[bucket]

    def ping(self) -> None:
        return None

    def read(self, buckets: Sequence[int]) -> WindowData:
        wanted = set(buckets)
        with self._lock:
            return WindowData(
                series=[(key, dict(fields)) for key, fields in self._series.items() if key.bucket in wanted],
                per_bucket_health={b: dict(h) for b, h in self._health.items() if b in wanted},
                writers={w for b, ws in self._writers.items() if b in wanted for w in ws},
                notes=[_parse_note(raw) for raw in self._notes],
            )


def _merge_into(fields: dict[str, float], agg: Aggregate) -> None:
    for name, count in agg.counts.items():
        fields[name] = fields.get(name, 0) + count
    for name, value in agg.sums.items():
        fields[name] = fields.get(name, 0.0) + value
