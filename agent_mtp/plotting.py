"""Plots are optional (``pip install 'agent-mtp[plot]'``): matplotlib is imported here, on first use only."""

from __future__ import annotations

import importlib.util
from typing import Any

from agent_mtp.errors import ConfigError


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    if not plotting_available():
        raise ConfigError("Plots need matplotlib: pip install 'agent-mtp[plot]' (or pass no plot option).")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
