"""Telemetry configuration: key-part validation, URL checks and redaction, windows, environment."""

from __future__ import annotations

import pytest

from agent_mtp.errors import TelemetryError
from agent_mtp.redis_url import scrub, url_secrets
from agent_mtp.telemetry import TelemetryConfig, parse_window, redact_url, validate_key_part
from agent_mtp.telemetry.config import load_env, validate_namespace

SECRET = "pa55-w0rd%21"

MALICIOUS_PARTS = [
    "",
    "tool_call:*",
    "*",
    "a b",
    "line\nbreak",
    "nul\x00byte",
    "{agent_mtp}",
    "x]",
    "?",
    "_invalid_",
    "-leading-dash",
    "ünïcode",
    "a" * 129,
    "semi;colon",
    "quote'",
]


@pytest.mark.parametrize("part", MALICIOUS_PARTS)
def test_malicious_key_parts_are_rejected_with_the_value_named(part: str) -> None:
    with pytest.raises(TelemetryError, match="invalid telemetry step type") as info:
        validate_key_part("step type", part)
    assert repr(part)[:40] in str(info.value)


@pytest.mark.parametrize(
    "part", ["tool_call", "final_answer", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen3-4B.v2", "a" * 128]
)
def test_ordinary_key_parts_are_accepted(part: str) -> None:
    assert validate_key_part("model", part) == part


@pytest.mark.parametrize("namespace", ["", "a:b", "prod/eu", "{x}", "a b", "_x", "n" * 65])
def test_bad_namespaces_are_rejected(namespace: str) -> None:
    with pytest.raises(TelemetryError, match="namespace"):
        validate_namespace(namespace)
    with pytest.raises(TelemetryError):
        TelemetryConfig(namespace=namespace)


def test_redact_url_hides_passwords_in_every_form() -> None:
    assert redact_url(f"redis://alice:{SECRET}@host:6379/0") == "redis://alice:***@host:6379/0"
    assert redact_url(f"rediss://:{SECRET}@host:6380") == "rediss://:***@host:6380"
    assert redact_url(f"redis://{SECRET}@host") == "redis://***@host"
    assert SECRET not in redact_url(f"unix:///tmp/redis.sock?password={SECRET}&db=1")
    assert redact_url("redis://host:6379/2") == "redis://host:6379/2"


def test_url_secrets_cover_the_password_and_its_decoded_form() -> None:
    secrets = url_secrets(f"redis://alice:{SECRET}@host:6379/0")
    text = scrub(f"error with {SECRET} and pa55-w0rd! inside", secrets)
    assert SECRET not in text and "pa55-w0rd!" not in text


def test_config_repr_and_errors_never_show_the_password() -> None:
    config = TelemetryConfig(redis_url=f"redis://alice:{SECRET}@host:6379/0")
    assert SECRET not in repr(config) and "alice:***@host" in repr(config)
    for bad in (
        f"http://alice:{SECRET}@host",
        f"redis://alice:{SECRET}@host:notaport",
        f"redis://:{SECRET}@",
    ):
        with pytest.raises(TelemetryError) as info:
            TelemetryConfig(redis_url=bad)
        assert SECRET not in str(info.value)


def test_rediss_and_unix_urls_are_accepted() -> None:
    TelemetryConfig(redis_url="rediss://user:pw@redis.example.com:6380/1")
    TelemetryConfig(redis_url="unix:///var/run/redis.sock")


@pytest.mark.parametrize(("window", "seconds"), [("1m", 60), ("5m", 300), ("1h", 3600), ("90s", 90), (600, 600)])
def test_parse_window(window: str | int, seconds: int) -> None:
    assert parse_window(window) == seconds


@pytest.mark.parametrize("window", ["", "5", "1d", "0m", "-1m", "5 m", "1s", "25h", "m5"])
def test_bad_windows_name_the_allowed_values(window: str) -> None:
    with pytest.raises(TelemetryError, match="window"):
        parse_window(window)


def test_environment_is_read_by_load_env_only() -> None:
    env = {"AGENT_MTP_REDIS_URL": " redis://h:1/0 ", "AGENT_MTP_TELEMETRY_NAMESPACE": "fleet-a"}
    assert load_env(env) == {"redis_url": "redis://h:1/0", "namespace": "fleet-a"}
    config = TelemetryConfig.from_env(env, flush_interval_s=0.5)
    assert (config.redis_url, config.namespace, config.flush_interval_s) == ("redis://h:1/0", "fleet-a", 0.5)
    assert TelemetryConfig.from_env({}).redis_url is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"flush_interval_s": 0},
        {"flush_interval_s": float("nan")},
        {"retention_s": 60},
        {"max_backlog_buckets": 0},
        {"dedupe_ttl_s": 3700},
        {"socket_timeout_s": -1.0},
    ],
)
def test_bad_settings_are_rejected(overrides: dict[str, float]) -> None:
    with pytest.raises(TelemetryError, match=next(iter(overrides))):
        TelemetryConfig(**overrides)  # type: ignore[arg-type]
