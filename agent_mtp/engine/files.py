"""Files the engine writes into its cache folder, written so that no reader ever sees half of one, and measured by
one process at a time."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock (each process may measure for itself, as before)
    fcntl = None  # type: ignore[assignment]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it that then replaces it: processes starting at once
    (replicas) read the old file or the new one, never a torn one. Creates the folder; OSError where it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    staging = Path(name)
    try:
        staging.write_text(text)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for ``path`` (on ``.<name>.lock`` beside it) for the block: another process, or thread,
    that asks for it waits. Replicas starting together on a machine with nothing stored then measure one after the
    other, the second reading what the first stored, instead of both timing passes while the other loads. The lock
    goes with its holder (a process that dies releases it). Where the folder cannot be written, or on a system
    without ``fcntl``, the block runs unlocked."""
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
