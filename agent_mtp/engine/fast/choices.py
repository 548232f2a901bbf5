"""The fast runtime's kernel choices, measured once per machine and kept on disk.

Preparing the fast runtime times which forms of the block kernels are the faster on this CPU: the AVX-512 or AVX2
form of each kernel class, from how many rows AVX2 lane passes multiply buffered weights, from which pass sizes the
AMX tiles serve rather than VNNI, and up to how many rows the blocks beat the float32 GEMM (the crossover). Every
choice gives the same bits; only speed depends on it. Measured in every process, that cost ~0.8-2 s of each start,
and near a tie the noise of one measurement flipped a choice from one process to the next, which renamed the
cached cost curve (its key names the kernels' form) and made the next process measure that too (3-4 s more). Two
replicas starting at once measured while the other loaded, and kept what the contention said.

So the first process on a machine measures and stores what it chose, in ``$AGENT_MTP_CACHE/kernel_choices/`` (a
JSON file per machine, model shape and thread count), and later ones read it. The machine is named by a hash of the
CPU's identity (vendor, family, model, stepping, name, flags, logical CPUs) and the compiled kernels' build key, so
another CPU, another kernel build or another torch measures afresh. Measure again on an idle machine with
``agent-mtp measure-machine`` (or ``AGENT_MTP_KERNEL_CHOICES=measure`` for one process); a file that cannot be read or
holds a value that is not a choice is measured over, never trusted."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent_mtp.engine.files import exclusive, write_atomically
from agent_mtp.errors import ConfigError

log = logging.getLogger("agent_mtp.engine.fast")

CHOICES_ENV = "AGENT_MTP_KERNEL_CHOICES"
"""``stored`` (default): read this machine's stored choices, measure and store the missing ones; ``measure``:
measure every choice this process settles and store the results (what ``agent-mtp measure-machine`` does)."""
CHOICE_MODES = ("stored", "measure")
CHOICES_FORMAT = 1
"""Bumped when a stored value's meaning changes: files of another format are measured over."""
_IDENTITY_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")
"""The lines of /proc/cpuinfo that name a CPU (not its clock, microcode or load)."""

T = TypeVar("T")


def choices_mode() -> str:
    """``$AGENT_MTP_KERNEL_CHOICES`` (``stored`` where unset); a :class:`ConfigError` naming the value otherwise."""
    raw = os.environ.get(CHOICES_ENV, "").strip().lower() or "stored"
    if raw not in CHOICE_MODES:
        raise ConfigError(
            f"{CHOICES_ENV}={raw!r} is not a mode: set it to 'stored' (read the machine's measured kernel choices) or "
            "'measure' (measure them again and store them), or unset it."
        )
    return raw


@functools.cache
def cpu_identity() -> str:
    """What names this CPU: the identity lines of the first processor in /proc/cpuinfo and the logical CPU count
    (``platform`` where there is no /proc/cpuinfo)."""
    lines: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if lines:
                    break
                continue
            key, _, value = line.partition(":")
            if key.strip() in _IDENTITY_FIELDS:
                lines.append(
                    f"{key.strip()}={' '.join(sorted(value.split())) if key.strip() == 'flags' else value.strip()}"
                )
    if not lines:
        lines = [f"machine={platform.machine()}", f"processor={platform.processor()}"]
    return "\n".join([*lines, f"cpus={os.cpu_count()}"])


def machine_key(build: str) -> str:
    """A short hash of :func:`cpu_identity` and ``build`` (the compiled kernels' key)."""
    return hashlib.sha256(f"{cpu_identity()}\nbuild={build}".encode()).hexdigest()[:16]


def shape_key(shapes: Sequence[tuple[Any, ...]]) -> str:
    """A short hash of the measured weights' shapes and kinds (models of the same shapes share their choices)."""
    return hashlib.sha256(repr(list(shapes)).encode()).hexdigest()[:12]


@dataclass
class StoredChoices:
    """One machine's choices for one model shape and thread count: read at :meth:`open`, completed by :meth:`get`,
    written by :meth:`save` when anything was measured."""

    path: Path
    measure_all: bool = False
    """Measure every choice asked for (``measure`` mode), ignoring what the file holds."""
    values: dict[str, Any] = field(default_factory=dict)
    measured: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, root: Path, *, build: str, shapes: Sequence[tuple[Any, ...]], threads: int) -> StoredChoices:
        """The stored choices of this machine (:func:`machine_key` of ``build``) for weights of ``shapes`` passed on
        ``threads`` threads, under ``root``; empty where there are none yet. In ``measure`` mode every choice asked
        for is measured again, and those not asked (settled by another block of the same process: the output head's
        screen is timed on the finished model) are kept as stored."""
        stored = cls(_path(root, build, shapes, threads), measure_all=choices_mode() == "measure")
        stored.values = _read(stored.path)
        return stored

    @classmethod
    @contextlib.contextmanager
    def settling(
        cls, root: Path, *, build: str, shapes: Sequence[tuple[Any, ...]], threads: int
    ) -> Iterator[StoredChoices]:
        """:meth:`open` and, after the block, :meth:`save`, holding the file's lock (:func:`exclusive`) throughout:
        processes preparing the same model at once (replicas) measure one at a time, and one that waited reads what
        the other stored."""
        with exclusive(_path(root, build, shapes, threads)):
            stored = cls.open(root, build=build, shapes=shapes, threads=threads)
            yield stored
            stored.save()

    def get(self, name: str, measure: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T]) -> T:
        """The stored choice ``name`` (``decode`` of its JSON value), else ``measure()``'s, kept for :meth:`save` as
        ``encode`` of it. A stored value ``decode`` refuses (ValueError, TypeError) is measured over."""
        if name in self.values and not self.measure_all:
            try:
                value = decode(self.values[name])
            except (ValueError, TypeError, KeyError) as e:
                log.warning(
                    "Stored kernel choice %s=%r in %s is unusable (%s): measuring it",
                    name,
                    self.values[name],
                    self.path,
                    e,
                )
            else:
                self.read.append(name)
                return value
        value = measure()
        self.values[name] = encode(value)
        self.measured.append(name)
        return value

    def save(self) -> None:
        """Write the choices where anything was measured (atomically: processes starting at once never read half a
        file); an unwritable cache only logs."""
        if self.read:
            log.info(
                "Kernel choices read from %s (%s); `agent-mtp measure-machine` measures them again",
                self.path,
                ", ".join(self.read),
            )
        if not self.measured:
            return
        body = json.dumps({"format": CHOICES_FORMAT, "choices": self.values}, indent=1, sort_keys=True)
        try:
            write_atomically(self.path, body + "\n")
        except OSError as e:
            log.warning(
                "Could not store the kernel choices in %s (%s): the next process measures them again", self.path, e
            )
            return
        log.info("Kernel choices measured and stored in %s (%s)", self.path, ", ".join(self.measured))


def _path(root: Path, build: str, shapes: Sequence[tuple[Any, ...]], threads: int) -> Path:
    return root / "kernel_choices" / f"{machine_key(build)}-{shape_key(shapes)}-t{threads}.json"


def _read(path: Path) -> dict[str, Any]:
    """The choices a file holds; empty where it is missing, unreadable or of another format."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("Ignoring unreadable kernel choices in %s (%s): measuring them", path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != CHOICES_FORMAT or not isinstance(data.get("choices"), dict):
        log.warning("Ignoring kernel choices of another format in %s: measuring them", path)
        return {}
    return dict(data["choices"])


def whole_number(value: Any) -> int:
    """A stored count of rows: a whole number >= 1 (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a whole number of rows >= 1")
    return value


def rows_or_never(value: Any) -> int:
    """A stored threshold of rows that may be 0 (never): a whole number >= 0 (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a whole number of rows >= 0")
    return value


def row_pair(value: Any) -> tuple[int, int]:
    """A stored pair of row counts (the tiles' exact and drafted pass sizes): two whole numbers >= 0."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"{value!r} is not a pair of row counts")
    exact, drafted = value
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (exact, drafted)):
        raise ValueError(f"{value!r} is not a pair of whole numbers >= 0")
    return exact, drafted
