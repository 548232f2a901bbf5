"""Files the engine writes into its cache folder, written so that no reader ever sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
