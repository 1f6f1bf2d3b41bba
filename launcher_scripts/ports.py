"""Free TCP ports for servers we start (Triton, a rendezvous store, test servers).

Binding port 0 returns a port from the kernel's ephemeral range, and that port is free only until
the socket closes: any outgoing connection on the machine may take it as its source port before
the server binds it (a CI run lost a Triton start to exactly that). A port below the ephemeral
range is never handed out as a source port, so only another listener can take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A port nothing listens on now, outside the ephemeral range where the kernel allows it."""
    start = _ephemeral_start()
    if start > _LOWEST + 100:
        for port in random.sample(range(_LOWEST, start), 50):
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
