"""Redis URLs: the one parser, validation and redaction used by every setting that names a Redis (telemetry's
``AGENT_MTP_REDIS_URL`` / ``Telemetry(url)``, the policy breaker's ``breaker_store``, ``agent-mtp stats``).

    validate_redis_url("redis://user:pw@host:6379/0", setting="breaker_store")   # returns the URL, or raises
    redact_url("redis://user:pw@host:6379/0")                                      # "redis://user:***@host:6379/0"
    scrub(message, url_secrets(url))                                               # an error text without the password

A bad URL raises :class:`~agent_mtp.errors.RedisURLError` (a ``ConfigError`` and a ``TelemetryError``) naming the
setting and the redacted URL. No heavy imports: redis-py is not needed to check a URL.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from agent_mtp.errors import RedisURLError

SCHEMES = ("redis", "rediss", "unix")
_EXPECTED = "expected redis://[user:password@]host:port/db, rediss://... (TLS) or unix:///path/to/socket"


def validate_redis_url(url: object, *, setting: str = "Redis URL") -> str:
    """``url`` if it is a usable Redis URL, else :class:`RedisURLError` naming ``setting`` (password redacted).

    Refused: anything but a string, an empty string, another scheme (``http://``), no host (``redis://:@``), a
    port that is not a number in 1-65535, a ``unix://`` URL without a socket path."""
    if not isinstance(url, str):
        raise RedisURLError(f"{setting} must be a Redis URL string, got {type(url).__name__}; {_EXPECTED}.")
    parts = _split(url, setting)
    if parts.scheme not in SCHEMES:
        msg = f"{setting}={redact_url(url)!r} has the unsupported scheme {parts.scheme!r}; {_EXPECTED}."
        raise RedisURLError(msg)
    if parts.scheme == "unix":
        if not parts.path:
            raise RedisURLError(f"{setting}={redact_url(url)!r} names no socket path; {_EXPECTED}.")
        return url
    if not parts.hostname:
        raise RedisURLError(f"{setting}={redact_url(url)!r} has no host; {_EXPECTED}.")
    if parts.port == 0:
        raise RedisURLError(f"{setting}={redact_url(url)!r} has port 0; use the server's port (6379 by default).")
    return url


def _split(url: str, setting: str) -> SplitResult:
    try:
        parts = urlsplit(url.strip())
        _ = parts.port  # raises ValueError on a port that is not a number in 0-65535
    except ValueError as e:
        raise RedisURLError(f"{setting}={redact_url(url)!r} cannot be parsed ({e}); {_EXPECTED}.") from None
    return parts


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``password=`` query value) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        # A lone userinfo (redis://secret@host) is hidden too: people put passwords there by mistake.
        netloc = f"{user}:***@{hostport}" if has_password else f"***@{hostport}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_secrets(url: str | None) -> tuple[str, ...]:
    """Secret strings in ``url`` (password, lone userinfo, ``password=`` values), to scrub from messages."""
    if not url:
        return ()
    secrets: list[str] = []
    try:
        parts = urlsplit(url)
    except ValueError:
        return (url,)
    if parts.password:
        secrets.append(parts.password)
    elif parts.username:
        secrets.append(parts.username)
    secrets.extend(re.findall(r"(?i)password=([^&]*)", parts.query))
    secrets.extend([unquote(s) for s in secrets])
    return tuple(s for s in dict.fromkeys(secrets) if s)


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every secret replaced by ``***`` (for exception messages that might echo a URL)."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
