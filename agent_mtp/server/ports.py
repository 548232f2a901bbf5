"""TCP ports for the servers this package starts: a free one to listen on, and whether a given one is free."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now ("": all interfaces)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int, host: str = "") -> bool:
    """Whether ``port`` can be bound on ``host`` ("" or "0.0.0.0": all interfaces), with SO_REUSEADDR as servers
    bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if host in ("0.0.0.0", "::") else host, port))
        except OSError:
            return False
    return True
