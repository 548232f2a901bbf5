"""The backlog of unacknowledged batches and the loop that ships them, one flush at a time.

Delivery guarantee. Each batch carries a random flush id and is retried until the store acknowledges it;
the Lua script records the id (for ``dedupe_ttl_s``) in the same atomic step that applies the batch, so a
retry after an ambiguous failure (timeout, connection reset after the script ran) is a no-op. While Redis
keeps what it acknowledged, every batch that is not dropped is therefore counted exactly once. Losses are
possible only when:
  - the backlog exceeds ``max_backlog_buckets``: the oldest batches lose their series, which are counted in
    the ``dropped_buckets`` / ``dropped_requests`` health counters (sent under the batch's own flush id, so a
    drop is counted exactly when the original batch was never applied);
  - more than ``MAX_UNCERTAIN_HUSKS`` such dropped batches wait for Redis at once: the oldest are forgotten
    and counted as ``unverified_batches`` (they may or may not have been applied);
  - the process dies (SIGKILL, ``os._exit``) before its last flush: one flush interval plus the backlog;
  - Redis itself loses acknowledged writes (no AOF fsync, failover to a lagging replica). This loss is *counted*:
    every batch tells Redis how many steps this process had acknowledged so far (a per-process epoch counter,
    see :mod:`agent_mtp.telemetry.lua`); Redis holding fewer adds the gap to the ``lost_requests`` health counter
    at the next flush, as long as the gap is younger than ``retention_s`` (older data would have expired anyway).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from agent_mtp.redis_url import scrub
from agent_mtp.telemetry.aggregate import SCRIPT_ERRORS, UNVERIFIED_BATCHES, Batch, Ledger
from agent_mtp.telemetry.config import TelemetryConfig
from agent_mtp.telemetry.store import STORE_ERRORS, Applied, Store

logger = logging.getLogger("agent_mtp.telemetry")

MAX_BATCHES_PER_PIPELINE = 64
MAX_UNCERTAIN_HUSKS = 1000
MAX_SCRIPT_FAILURES = 3
_REPEAT_WARNING_S = 60.0


@dataclass(frozen=True)
class FlushCounters:
    flushed_batches: int
    duplicate_batches: int
    failed_flushes: int
    dropped_buckets: int
    """Series aggregates removed from this backlog (Redis's health counters say which were really lost)."""
    backlog_batches: int
    backlog_buckets: int
    last_error: str | None
    healthy: bool
    lost_requests: int = 0
    """Steps this process had flushed that Redis later no longer held (restart without persistence, FLUSHALL)."""


class Flusher:
    """Holds the backlog; :meth:`flush` moves a new batch into it and tries to drain it."""

    def __init__(
        self,
        store: Store,
        *,
        config: TelemetryConfig,
        writer: str,
        secrets: tuple[str, ...],
        count_health: Callable[[str, int], None],
    ) -> None:
        self.store = store
        self.config = config
        self.writer = writer
        self.secrets = secrets
        self.count_health = count_health
        self.lock = threading.Lock()
        """Held for the whole of one flush: only one flush talks to the store at a time."""
        self.backlog: deque[Batch] = deque()
        self.healthy = True
        self._flushed = 0
        self._duplicates = 0
        self._failures = 0
        self._dropped = 0
        self._last_error: str | None = None
        self._last_warning = 0.0
        self._dropping_logged = False
        self.epoch = uuid.uuid4().hex
        """This process's id in the epoch counter (host:pid repeats across container restarts)."""
        self._acknowledged = 0
        self._ack_log: deque[tuple[float, int]] = deque()
        """(monotonic time, steps acknowledged by then): what falls out of the retention window."""
        self._floor = 0
        self._lost = 0

    # -- backlog bound --------------------------------------------------------------------------------------
    def submit(self, batch: Batch | None) -> None:
        if batch is not None:
            self.backlog.append(batch)
        self._enforce_bound()

    def _enforce_bound(self) -> None:
        total = sum(batch.size for batch in self.backlog)
        if total <= self.config.max_backlog_buckets:
            return
        for batch in self.backlog:
            if total <= self.config.max_backlog_buckets:
                break
            dropped = batch.husk()
            total -= dropped
            self._dropped += dropped
        self._compact_husks()
        if not self._dropping_logged:
            self._dropping_logged = True
            logger.warning(
                "telemetry backlog for %s is over %d buckets: dropping the oldest and counting them as "
                "dropped_buckets (dropped so far in this process: %d)",
                self.store.target,
                self.config.max_backlog_buckets,
                self._dropped,
            )

    def _compact_husks(self) -> None:
        """Merge never-sent husks into one; forget the oldest uncertain ones beyond MAX_UNCERTAIN_HUSKS."""
        kept: deque[Batch] = deque()
        spare: Batch | None = None
        for batch in self.backlog:
            if batch.size or batch.notes or batch.attempted:
                kept.append(batch)
            elif spare is None:
                spare = batch
                kept.append(batch)
            else:
                spare.absorb_health(batch)
        uncertain = [b for b in kept if b.attempted and not b.size]
        for batch in uncertain[: max(0, len(uncertain) - MAX_UNCERTAIN_HUSKS)]:
            kept.remove(batch)
            self.count_health(UNVERIFIED_BATCHES, 1)
        self.backlog = kept

    # -- sending --------------------------------------------------------------------------------------------
    def flush(self, batch: Batch | None) -> bool:
        """Submit ``batch`` and send the backlog; True when nothing is left waiting. Caller holds ``lock``."""
        self.submit(batch)
        if not self.backlog:
            return True
        if not self.healthy and not self._probe():
            return False
        while self.backlog:
            chunk = list(islice(self.backlog, MAX_BATCHES_PER_PIPELINE))
            self._stamp(chunk)
            try:
                results = self.store.write(chunk, self.writer)
            except STORE_ERRORS as e:
                self._failed(e)
                return False
            if not self._settle(chunk, results):
                return False
        self._recovered()
        return True

    def _probe(self) -> bool:
        """While unhealthy, PING first: if it fails nothing was sent, so batches stay certainly unapplied."""
        try:
            self.store.ping()
        except STORE_ERRORS as e:
            self._failed(e)
            return False
        return True

    def _settle(self, chunk: Sequence[Batch], results: Sequence[object]) -> bool:
        """Drop acknowledged batches from the head of the backlog; False when a script failed."""
        for batch, result in zip(chunk, results, strict=True):
            if isinstance(result, Exception):
                batch.script_failures += 1
                self.count_health(SCRIPT_ERRORS, 1)
                if batch.script_failures >= MAX_SCRIPT_FAILURES:
                    self._dropped += batch.husk()  # a poison batch must not block the backlog forever
                self._failed(result)
                return False
            self.backlog.popleft()
            if result == "duplicate":
                self._duplicates += 1
            else:
                self._flushed += 1
            if isinstance(result, Applied) and result.lost_requests:
                self._found_lost(result.lost_requests)
            self._acknowledged += batch.requests
            self._ack_log.append((time.monotonic(), self._acknowledged))
        return True

    def _stamp(self, chunk: Sequence[Batch]) -> None:
        """Mark the batches as sent and give each the ledger Redis checks it against (in pipeline order)."""
        horizon = time.monotonic() - self.config.retention_s
        while self._ack_log and self._ack_log[0][0] < horizon:
            self._floor = self._ack_log.popleft()[1]
        acknowledged = self._acknowledged
        for batch in chunk:
            batch.attempted = True
            batch.ledger = Ledger(self.epoch, acknowledged, self._floor)
            acknowledged += batch.requests

    def _found_lost(self, requests: int) -> None:
        self._lost += requests
        logger.warning(
            "telemetry: %s no longer holds %d steps this process had written (Redis restarted without "
            "persistence, or the keys were deleted); counted as lost_requests in the health counters",
            self.store.target,
            requests,
        )

    def _failed(self, error: BaseException) -> None:
        self._failures += 1
        self._last_error = scrub(f"{type(error).__name__}: {error}", self.secrets)
        now = time.monotonic()
        if self.healthy or now - self._last_warning >= _REPEAT_WARNING_S:
            self._last_warning = now
            logger.warning(
                "telemetry cannot write to %s (%s); keeping up to %d buckets in memory and retrying "
                "(backlog: %d buckets)",
                self.store.target,
                self._last_error,
                self.config.max_backlog_buckets,
                self.backlog_buckets,
            )
        else:
            logger.debug("telemetry flush to %s failed again: %s", self.store.target, self._last_error)
        self.healthy = False

    def _recovered(self) -> None:
        if not self.healthy:
            logger.info("telemetry writes to %s again (backlog drained)", self.store.target)
        self.healthy = True
        self._dropping_logged = False

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def backlog_buckets(self) -> int:
        return sum(batch.size for batch in self.backlog)

    def counters(self) -> FlushCounters:
        return FlushCounters(
            flushed_batches=self._flushed,
            duplicate_batches=self._duplicates,
            failed_flushes=self._failures,
            dropped_buckets=self._dropped,
            backlog_batches=len(self.backlog),
            backlog_buckets=self.backlog_buckets,
            last_error=self._last_error,
            healthy=self.healthy,
            lost_requests=self._lost,
        )
