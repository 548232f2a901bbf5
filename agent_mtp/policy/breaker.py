"""The per-step-type breaker: closed -> open -> (cooldown in NTP) -> half-open probes -> closed.

* closed: lossy-mode generations run as the policy says; each one adds a pass/fail sample (all monitors
  passed?) to a window kept in this process. With at least ``min_samples`` samples and a pass rate below
  ``baseline - margin`` the breaker trips.
* open: every generation of the step type runs in the fallback mode (NTP) for ``cooldown_s``.
* half-open: a ``probe_rate`` fraction of generations runs the policy's mode again as a probe;
  ``probes_to_close`` passing probes close the breaker, one failing probe opens it again. Without enough
  probes it closes by itself after ``half_open_ttl_s``.

The state lives in a :class:`BreakerStore`: :class:`MemoryBreakerStore` (this process) or
:class:`RedisBreakerStore` (two keys with TTLs, so a whole fleet falls back together; expiry is Redis' clock,
not the workers').
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agent_mtp.policy.schema import FallbackSettings
from agent_mtp.redis_url import scrub, url_secrets, validate_redis_url

log = logging.getLogger(__name__)

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerStatus:
    state: BreakerState
    probes_passed: int = 0
    trips: int = 0
    """Trips since the state was last closed (1 after the first trip, 2 after a failed probe ...)."""
    reason: str = ""
    remaining_s: float | None = None
    """Seconds left in the open state (None unless open)."""


CLOSED = BreakerStatus("closed")


class BreakerStore(Protocol):
    """Where breaker state lives. Implementations never raise on the generation path."""

    def status(self, key: str) -> BreakerStatus: ...

    def trip(self, key: str, *, cooldown_s: float, half_open_ttl_s: float, reason: str) -> BreakerStatus: ...

    def probe_passed(self, key: str, *, needed: int) -> BreakerStatus: ...

    def reset(self, key: str) -> None: ...


# ------------------------------------------------------------------------------------------------- in process
@dataclass
class _Entry:
    open_until: float
    expires: float
    probes: int
    trips: int
    reason: str


class MemoryBreakerStore:
    """Breaker state of this process. ``clock`` is injectable (tests drive the cooldown without sleeping)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def status(self, key: str) -> BreakerStatus:
        with self._lock:
            return self._status(key)

    def trip(self, key: str, *, cooldown_s: float, half_open_ttl_s: float, reason: str) -> BreakerStatus:
        with self._lock:
            now = self._clock()
            old = self._entries.get(key)
            trips = (old.trips if old is not None and old.expires > now else 0) + 1
            self._entries[key] = _Entry(now + cooldown_s, now + cooldown_s + half_open_ttl_s, 0, trips, reason)
            return self._status(key)

    def probe_passed(self, key: str, *, needed: int) -> BreakerStatus:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or self._status(key).state != "half_open":
                return self._status(key)
            entry.probes += 1
            if entry.probes >= needed:
                del self._entries[key]
            return self._status(key)

    def reset(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _status(self, key: str) -> BreakerStatus:
        entry = self._entries.get(key)
        now = self._clock()
        if entry is None or entry.expires <= now:
            self._entries.pop(key, None)
            return CLOSED
        if now < entry.open_until:
            return BreakerStatus("open", entry.probes, entry.trips, entry.reason, entry.open_until - now)
        return BreakerStatus("half_open", entry.probes, entry.trips, entry.reason)


# ------------------------------------------------------------------------------------------------------ Redis
_PROBE_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = redis.call('HINCRBY', KEYS[1], 'probes', 1)
if n >= tonumber(ARGV[1]) then redis.call('DEL', KEYS[1], KEYS[2]) end
return n
"""


class RedisBreakerStore:
    """Breaker state shared by every process that uses the same Redis and key prefix.

    Per breaker key two Redis keys: ``{prefix}:{key}:open`` (a string with the trip reason, TTL = cooldown)
    and ``{prefix}:{key}:state`` (a hash with probes/trips/reason, TTL = cooldown + half-open TTL). Open while
    the first exists, half-open while only the second exists, closed when neither does. A URL is checked at
    construction (:class:`~agent_mtp.errors.RedisURLError` for ``http://x``, ``""``, a bad port, no host). When
    Redis cannot be
    reached the store keeps working on a per-process :class:`MemoryBreakerStore` and tries Redis again after
    ``retry_after_s``.
    """

    def __init__(
        self,
        url_or_client: str | Any,
        *,
        prefix: str = "agent_mtp:breaker",
        socket_timeout_s: float = 0.5,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis

        self._secrets: tuple[str, ...] = ()
        if isinstance(url_or_client, str):
            url = validate_redis_url(url_or_client, setting="breaker_store")
            self._secrets = url_secrets(url)
            self._client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
            )
        else:
            self._client = url_or_client
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._prefix = prefix
        self._probe = self._client.register_script(_PROBE_SCRIPT)
        self._local = MemoryBreakerStore(clock=clock)
        self._clock = clock
        self._retry_after_s = retry_after_s
        self._down_until = 0.0

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable and the state is per process."""
        return self._clock() < self._down_until

    def status(self, key: str) -> BreakerStatus:
        return self._call(lambda: self._status(key), lambda: self._local.status(key))

    def trip(self, key: str, *, cooldown_s: float, half_open_ttl_s: float, reason: str) -> BreakerStatus:
        self._local.trip(key, cooldown_s=cooldown_s, half_open_ttl_s=half_open_ttl_s, reason=reason)
        return self._call(lambda: self._trip(key, cooldown_s, half_open_ttl_s, reason), lambda: self._local.status(key))

    def probe_passed(self, key: str, *, needed: int) -> BreakerStatus:
        def remote() -> BreakerStatus:
            self._probe(keys=[self._key(key, "state"), self._key(key, "open")], args=[needed])
            status = self._status(key)
            if status.state == "closed":
                self._local.reset(key)
            return status

        return self._call(remote, lambda: self._local.probe_passed(key, needed=needed))

    def reset(self, key: str) -> None:
        self._local.reset(key)
        self._call(lambda: self._client.delete(self._key(key, "open"), self._key(key, "state")), lambda: None)

    def _key(self, key: str, part: str) -> str:
        return f"{self._prefix}:{key}:{part}"

    def _status(self, key: str) -> BreakerStatus:
        pipe = self._client.pipeline(transaction=False)
        pipe.pttl(self._key(key, "open"))
        pipe.hgetall(self._key(key, "state"))
        open_ms, fields = pipe.execute()
        info = {_text(k): _text(v) for k, v in (fields or {}).items()}
        probes, trips, reason = int(info.get("probes", 0)), int(info.get("trips", 0)), info.get("reason", "")
        if open_ms is not None and (open_ms > 0 or open_ms == -1):
            remaining = open_ms / 1000 if open_ms > 0 else None
            return BreakerStatus("open", probes, max(trips, 1), reason, remaining)
        if info:
            return BreakerStatus("half_open", probes, trips, reason)
        return CLOSED

    def _trip(self, key: str, cooldown_s: float, half_open_ttl_s: float, reason: str) -> BreakerStatus:
        state_key = self._key(key, "state")
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._key(key, "open"), reason, px=_ms(cooldown_s))
        pipe.hset(state_key, mapping={"probes": 0, "reason": reason})
        pipe.hincrby(state_key, "trips", 1)
        pipe.pexpire(state_key, _ms(cooldown_s + half_open_ttl_s))
        pipe.execute()
        return self._status(key)

    def _call(self, remote: Callable[[], Any], local: Callable[[], Any]) -> Any:
        if self.degraded:
            return local()
        try:
            return remote()
        except self._errors as exc:
            self._down_until = self._clock() + self._retry_after_s
            log.warning(
                "breaker store: Redis unreachable (%s); using per-process state for %.0f s",
                scrub(f"{type(exc).__name__}: {exc}", self._secrets),
                self._retry_after_s,
            )
            return local()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------------------------------------------- the bank
class Breakers:
    """The breakers of one controller: a sample window per step type here, the state in ``store``."""

    def __init__(self, store: BreakerStore, *, namespace: str) -> None:
        self.store = store
        self._namespace = namespace
        self._windows: dict[str, deque[bool]] = {}
        self._lock = threading.Lock()

    def key(self, step_type: str) -> str:
        return f"{self._namespace}:{step_type}"

    def status(self, step_type: str) -> BreakerStatus:
        return self.store.status(self.key(step_type))

    def reset(self, step_type: str) -> None:
        self.store.reset(self.key(step_type))
        with self._lock:
            self._windows.pop(step_type, None)

    def pass_rate(self, step_type: str) -> tuple[float | None, int]:
        """(pass rate, samples) of the window of ``step_type`` in this process."""
        with self._lock:
            window = self._windows.get(step_type)
            if not window:
                return None, 0
            return sum(window) / len(window), len(window)

    def record(self, step_type: str, passed: bool, settings: FallbackSettings, *, probe: bool) -> str | None:
        """Add one lossy-mode sample; returns a decision text when the breaker changed state."""
        key = self.key(step_type)
        if probe:
            return self._record_probe(step_type, key, passed, settings)
        if self.store.status(key).state != "closed":
            return None  # a generation planned before another process tripped the breaker
        with self._lock:
            window = self._windows.get(step_type)
            if window is None or window.maxlen != settings.window:
                window = deque(window or (), maxlen=settings.window)
                self._windows[step_type] = window
            window.append(passed)
            rate, samples = sum(window) / len(window), len(window)
            limit = settings.baseline - settings.margin
            if samples < settings.min_samples or rate >= limit:
                return None
            window.clear()
        reason = f"pass rate {rate:.2f} < {limit:.2f} over {samples} samples"
        self.store.trip(key, cooldown_s=settings.cooldown_s, half_open_ttl_s=settings.half_open_ttl_s, reason=reason)
        return f"breaker opened: {reason}; {settings.mode} for {settings.cooldown_s:g} s"

    def _record_probe(self, step_type: str, key: str, passed: bool, settings: FallbackSettings) -> str:
        if not passed:
            reason = "half-open probe failed"
            self.store.trip(
                key, cooldown_s=settings.cooldown_s, half_open_ttl_s=settings.half_open_ttl_s, reason=reason
            )
            return f"breaker re-opened: {reason}; {settings.mode} for {settings.cooldown_s:g} s"
        status = self.store.probe_passed(key, needed=settings.probes_to_close)
        if status.state == "closed":
            with self._lock:
                self._windows.pop(step_type, None)
            return "breaker closed: probes passed"
        return f"probe passed ({status.probes_passed}/{settings.probes_to_close})"
