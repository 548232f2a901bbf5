"""`Telemetry`: the recorder the policy layer feeds, with a background flusher to Redis (or memory)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, get_args

import redis

from agent_mtp.errors import TelemetryError
from agent_mtp.events import InterventionEvent, InterventionKind, StepEvent
from agent_mtp.redis_url import url_secrets
from agent_mtp.telemetry.aggregate import RECORD_ERRORS, Pending
from agent_mtp.telemetry.config import ENV_REDIS_URL, TelemetryConfig, parse_window, replica_namespace
from agent_mtp.telemetry.flusher import Flusher
from agent_mtp.telemetry.store import MemoryStore, RedisStore, Store

if TYPE_CHECKING:
    from agent_mtp.telemetry.queries import StatsReport

logger = logging.getLogger("agent_mtp.telemetry")

_INSTANCES: weakref.WeakSet[Telemetry] = weakref.WeakSet()
_memory_notice_logged = False
_EXIT_FLUSH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TelemetryStats:
    """This process's view of its recorder (the fleet view comes from :meth:`Telemetry.query`)."""

    backend: str
    """``redis`` or ``memory``."""
    target: str
    """Where data goes (password redacted)."""
    recorded_events: int
    pending_series: int
    backlog_batches: int
    backlog_buckets: int
    flushed_batches: int
    duplicate_batches: int
    """Batches Redis had already applied (a retry after an ambiguous failure): not counted twice."""
    failed_flushes: int
    dropped_buckets: int
    healthy: bool
    last_error: str | None
    lost_requests: int = 0
    """Steps this process had flushed that Redis later no longer held (also in the fleet's health counters)."""


class Telemetry:
    """Records step and intervention events (:mod:`agent_mtp.events`) for a fleet of workers.

    ``record()`` only updates in-memory counters under a short lock (no I/O, never raises); a daemon thread
    flushes them every ``flush_interval_s`` to Redis in one pipelined, idempotent batch, or keeps them in
    memory when no Redis is configured::

        telemetry = Telemetry()                                   # AGENT_MTP_REDIS_URL, else in memory
        telemetry = Telemetry("rediss://user:password@host:6380/0")
        telemetry = Telemetry(redis.Redis(host="..."), config=TelemetryConfig(namespace="prod"))
        telemetry.record(step_event)
        telemetry.report_intervention("manual_intervention", step_type="tool_call", run_id="r1", note="...")
        telemetry.query("5m").total.p95_s

    Pending data is flushed at interpreter exit (``atexit``) and at the exit of ``multiprocessing`` children.
    After ``fork`` the child starts empty (the parent flushes what it had recorded) with its own flusher
    thread. A child that leaves through ``os._exit`` must call :meth:`close` first.
    """

    def __init__(
        self,
        target: str | redis.Redis | Store | None = None,
        *,
        config: TelemetryConfig | None = None,
        start: bool = True,
    ) -> None:
        """``target``: a Redis URL, a ``redis.Redis`` client, a :class:`Store`, or ``None`` for the URL in
        ``config`` (default: :meth:`TelemetryConfig.from_env`). ``start=False``: the caller flushes."""
        config = config if config is not None else TelemetryConfig.from_env()
        if isinstance(target, str):
            config = config.with_overrides(redis_url=target)
        elif target is not None and not isinstance(target, (redis.Redis, Store)):
            msg = f"target must be a Redis URL, a redis.Redis client or a Store, got {type(target).__name__}"
            raise TelemetryError(msg)
        self.config = config
        self._store = _make_store(target, config)
        self._secrets = url_secrets(config.redis_url)
        self._start_enabled = start
        self._closed = False
        self._replica = _replica_telemetry(self._store, config, start=start)
        """With ``config.replica``: the same events again, under the replica's own namespace."""
        self._init_process_state()
        _INSTANCES.add(self)
        _register_child_finalizer(self)  # when created inside a multiprocessing child
        multiprocessing.util.register_after_fork(self, _register_child_finalizer)  # when inherited by one
        if start:
            self._ensure_thread()

    def _init_process_state(self) -> None:
        """Everything that belongs to one process (rebuilt in a forked child)."""
        self._lock = threading.Lock()
        self._pending = Pending(
            max_series=self.config.max_series_per_flush,
            retention_s=self.config.retention_s,
            note_limit=self.config.intervention_log_size,
        )
        self._flusher = Flusher(
            self._store,
            config=self.config,
            writer=_writer_id(self.config.replica),
            secrets=self._secrets,
            count_health=self._count_health,
        )
        self._recorded = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the generation path --------------------------------------------------------------------------------
    def record(self, event: StepEvent | InterventionEvent) -> None:
        """Add one event to the in-memory aggregates. O(1), no I/O, never raises."""
        try:
            now = time.time()
            with self._lock:
                self._pending.add(event, now)
                self._recorded += 1
            if self._replica is not None:
                self._replica.record(event)
            if self._thread is None and self._start_enabled:
                self._ensure_thread()
        except Exception:  # a bug here must never fail a generation
            self._count_health(RECORD_ERRORS, 1)

    def report_intervention(
        self,
        kind: InterventionKind,
        *,
        step_type: str = "unknown",
        run_id: str | None = None,
        note: str = "",
        model: str = "default",
    ) -> None:
        """Report that a person stepped in (``manual_intervention``) or a user saw a failure for a run."""
        if kind not in get_args(InterventionKind):
            msg = f"unknown intervention kind {kind!r}: use one of {', '.join(get_args(InterventionKind))}"
            raise TelemetryError(msg)
        self.record(InterventionEvent(kind=kind, step_type=step_type, model=model, run_id=run_id, note=note))

    def _count_health(self, name: str, value: int) -> None:
        try:
            with self._lock:
                self._pending.count_health(name, value)
        except Exception:
            return

    # -- flushing -------------------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, name="agent-mtp-telemetry", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush(timeout_s=None)
            except Exception:  # never let the flusher thread die
                logger.exception("telemetry flusher failed; retrying at the next interval")

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send everything recorded so far; True when Redis (or memory) acknowledged all of it.

        Blocks for at most about one store timeout per pipelined round trip, plus ``timeout_s`` waiting for a
        flush already in progress (``None`` waits for it).
        """
        if self._replica is not None:
            self._replica.flush(timeout_s)
        flusher = self._flusher
        acquired = flusher.lock.acquire(timeout=-1 if timeout_s is None else timeout_s)
        if not acquired:
            return False
        try:
            with self._lock:
                batch = self._pending.take()
            return flusher.flush(batch)
        finally:
            flusher.lock.release()

    def close(self, timeout_s: float = _EXIT_FLUSH_TIMEOUT_S) -> bool:
        """Stop the flusher thread and flush what is left; True when nothing was left unsent.

        Closing again only flushes when something was recorded since (use :meth:`flush` to retry)."""
        if self._replica is not None:
            self._replica.close(timeout_s)
        if self._closed and self._nothing_pending():
            return not self._flusher.backlog
        self._closed = True
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        done = self.flush(timeout_s=timeout_s)
        if not done:
            counters = self._flusher.counters()
            logger.warning(
                "telemetry closed with %d buckets not written to %s (%s)",
                counters.backlog_buckets,
                self._store.target,
                counters.last_error,
            )
        return done

    def _nothing_pending(self) -> bool:
        with self._lock:
            return self._pending.empty

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fork -----------------------------------------------------------------------------------------------
    def _reset_after_fork(self) -> None:
        """In a forked child: drop the parent's pending data (the parent flushes it) and start afresh."""
        if isinstance(self._store, MemoryStore):
            self._store.reset_lock()
        self._init_process_state()
        self._closed = False

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "redis" if isinstance(self._store, RedisStore) else "memory"

    @property
    def store(self) -> Store:
        return self._store

    def query(self, window: str | int = "5m", *, flush: bool = True, now: float | None = None) -> StatsReport:
        """Fleet-wide metrics over the window (this process only when in memory). Flushes first by default."""
        from agent_mtp.telemetry.queries import query_stats

        if flush:
            self.flush()
        return query_stats(self._store, window=parse_window(window), namespace=self.config.namespace, now=now)

    def stats(self) -> TelemetryStats:
        counters = self._flusher.counters()
        with self._lock:
            pending = len(self._pending.series)
            recorded = self._recorded
        return TelemetryStats(
            backend=self.backend,
            target=self._store.target,
            recorded_events=recorded,
            pending_series=pending,
            backlog_batches=counters.backlog_batches,
            backlog_buckets=counters.backlog_buckets,
            flushed_batches=counters.flushed_batches,
            duplicate_batches=counters.duplicate_batches,
            failed_flushes=counters.failed_flushes,
            dropped_buckets=counters.dropped_buckets,
            healthy=counters.healthy,
            last_error=counters.last_error,
            lost_requests=counters.lost_requests,
        )

    def __repr__(self) -> str:
        return f"Telemetry(target={self._store.target!r}, namespace={self.config.namespace!r})"


_process_telemetry: Telemetry | None = None
_process_lock = threading.Lock()


def process_telemetry(environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """The process-wide recorder of front ends that were given none: a :class:`Telemetry` writing to
    ``AGENT_MTP_REDIS_URL`` (built on first use and shared, so one flusher thread per process; a forked child gets
    its own), or None when the variable is unset. A bad URL raises :class:`~agent_mtp.errors.RedisURLError`."""
    global _process_telemetry
    config = TelemetryConfig.from_env(environ)
    if config.redis_url is None:
        return None
    with _process_lock:
        if _process_telemetry is None or _process_telemetry.config != config:  # the environment changed
            _process_telemetry = Telemetry(config=config)
        return _process_telemetry


def _writer_id(replica: str | None) -> str:
    """``host:pid``, or ``replica@host:pid`` for a replica (how the fleet's writer sets list its replicas)."""
    writer = f"{socket.gethostname()[:64]}:{os.getpid()}"
    return writer if replica is None else f"{replica}@{writer}"


def _replica_telemetry(store: Store, config: TelemetryConfig, *, start: bool) -> Telemetry | None:
    """A second recorder on the same Redis (or memory) under ``<namespace>.r.<replica>``; None without a replica
    id or on a custom store."""
    if config.replica is None:
        return None
    own = replace(config, namespace=replica_namespace(config.namespace, config.replica), replica=None)
    if isinstance(store, RedisStore):
        copy = RedisStore(store.client, config=own, target=store.target)
        copy.secrets = store.secrets
        return Telemetry(copy, config=own, start=start)
    if isinstance(store, MemoryStore):
        return Telemetry(MemoryStore(config=own), config=own, start=start)
    return None


def _make_store(target: str | redis.Redis | Store | None, config: TelemetryConfig) -> Store:
    if isinstance(target, redis.Redis):
        return RedisStore(target, config=config)
    if target is not None and not isinstance(target, str):
        return target
    if config.redis_url:
        return RedisStore.from_url(config.redis_url, config=config)
    global _memory_notice_logged
    if not _memory_notice_logged:
        _memory_notice_logged = True
        logger.warning("no Redis configured (set %s): telemetry stays in this process's memory", ENV_REDIS_URL)
    return MemoryStore(config=config)


_held_over_fork: list[Telemetry] = []


def _before_fork() -> None:
    """Hold every recorder lock across fork so that the child never inherits a half-updated aggregate."""
    for telemetry in list(_INSTANCES):
        telemetry._lock.acquire()
        _held_over_fork.append(telemetry)


def _after_fork_in_parent() -> None:
    while _held_over_fork:
        _held_over_fork.pop()._lock.release()


def _after_fork_in_child() -> None:
    _held_over_fork.clear()
    for telemetry in list(_INSTANCES):
        telemetry._reset_after_fork()


def _register_child_finalizer(telemetry: Telemetry) -> None:
    """multiprocessing children end with os._exit (no atexit): flush through its finalizers instead.

    In the process that registers it, the finalizer runs at exit only (multiprocessing ignores it elsewhere);
    closing twice is harmless."""
    multiprocessing.util.Finalize(telemetry, _close_ref, args=(weakref.ref(telemetry),), exitpriority=100)


def _close_ref(ref: weakref.ref[Telemetry]) -> None:
    telemetry = ref()
    if telemetry is not None:
        telemetry.close()


def _close_all() -> None:
    for telemetry in list(_INSTANCES):
        try:
            telemetry.close()
        except Exception:
            logger.exception("telemetry flush at exit failed")


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
atexit.register(_close_all)
