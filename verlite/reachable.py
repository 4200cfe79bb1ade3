"""Whether a TCP service accepts connections, found out within a bound: what a run checks
before it would wait minutes on a Ray head or an MLflow server that is not there; and
whether a host is this machine."""

from __future__ import annotations

import ipaddress
import socket


def connection_problem(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts a TCP connection at ``host:port`` within ``timeout_s``
    seconds; else why not, in a few words ("Connection refused", "timed out")."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
    return None


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's hostname) names this machine: localhost or a loopback IP."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
