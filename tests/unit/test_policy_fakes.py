"""Deterministic test doubles for the policy layer's own logic: a scripted engine, a fake clock, scripted
monitors.

The engine double implements the policy's engine protocol (generate / encode_prompt / score / model_id): it
returns
a fixed text per decode mode, honours ``max_time`` against a fake clock (one tick per token), and scores the
NTP
text as likely and anything else as unlikely. The policy logic under test (classification, breaker, retries,
deadlines, events) is real.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.results import DecodeStats, GenerationResult
from agent_mtp.policy.monitors import MonitorInput, MonitorVerdict
from agent_mtp.policy.schema import LOSSY_MODES, StepSettings

NTP_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BAD_TEXT = '{"name": "get_weather", "arguments": {"city": "Par'


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class Call:
    config: DecodeConfig
    constraint: Any


@dataclass
class FakeEngine:
    """``texts`` maps a mode to its output (or is a function of the config); unknown modes give the NTP
    text."""

    texts: dict[str, str] | Callable[[DecodeConfig], str] = field(default_factory=dict)
    ntp_text: str = NTP_TEXT
    clock: FakeClock | None = None
    seconds_per_token: float = 0.0
    errors: list[BaseException] = field(default_factory=list)
    model_id: str = "fake-model"
    calls: list[Call] = field(default_factory=list)
    scored: list[list[int]] = field(default_factory=list)

    def text_for(self, config: DecodeConfig) -> str:
        if callable(self.texts):
            return self.texts(config)
        return self.texts.get(config.mode, self.ntp_text)

    def generate(self, prompt: Any, config: DecodeConfig | None = None, *, constraint: Any = None) -> GenerationResult:
        config = config or DecodeConfig()
        self.calls.append(Call(config, constraint))
        if self.errors:
            raise self.errors.pop(0)
        text = self.text_for(config)
        n = min(len(text), config.max_new_tokens)
        finish = "stop" if n == len(text) else "length"
        if self.seconds_per_token and config.max_time is not None:
            fit = int(config.max_time / self.seconds_per_token)
            if fit < n:
                n, finish = fit, "timeout"
        if self.clock is not None:
            self.clock.advance(n * self.seconds_per_token)
        ids = [ord(c) for c in text[:n]]
        per_pass = 1 if config.mode == "ntp" else (config.k_max if isinstance(config.k_max, int) else 4)
        stats = DecodeStats(
            mode=config.mode,
            forward_passes=math.ceil(n / per_pass) if n else 0,
            new_tokens=n,
            wall_s=n * self.seconds_per_token,
        )
        return GenerationResult(text[:n], ids, finish, stats)  # type: ignore[arg-type]

    def encode_prompt(self, prompt: Any) -> list[int]:
        return [ord(c) for c in str(prompt)]

    def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        self.scored.append(list(continuation_ids))
        text = "".join(chr(i) for i in continuation_ids)
        good = self.ntp_text.startswith(text)
        return [-0.2 if good else -3.0] * len(continuation_ids)

    @property
    def modes(self) -> list[str]:
        return [c.config.mode for c in self.calls]


class FlagMonitor:
    """Fails every lossy-mode output while ``broken`` is True; passes everything else."""

    name = "flag"
    costly = False

    def __init__(self, broken: bool = True) -> None:
        self.broken = broken
        self.seen: list[str] = []

    def sample_rate(self, settings: StepSettings) -> float:
        return 1.0

    def check(self, sample: MonitorInput) -> MonitorVerdict | None:
        self.seen.append(sample.config.mode)
        failed = self.broken and sample.config.mode in LOSSY_MODES
        return MonitorVerdict(self.name, not failed, detail="scripted failure" if failed else "")


def test_fake_engine_honours_deadline_against_its_clock() -> None:
    clock = FakeClock()
    engine = FakeEngine(clock=clock, seconds_per_token=1.0)
    result = engine.generate("p", DecodeConfig(mode="ntp", max_time=5))
    assert result.finish_reason == "timeout"
    assert result.text == NTP_TEXT[:5]
    assert clock.now == 1005.0
