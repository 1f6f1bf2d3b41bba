"""Watching a connection for its peer's hang-up while a request is worked on.

A client that closes its connection before its answer reads, on the server's side of it, as
end-of-file: the watch then calls `on_gone` once (the server stops the work for nobody). The
watch ends at the first thing the connection says, end-of-file or the client's next request
(it is there), or when stopped once the answer is sent.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable

POLL_SECONDS = 0.2


class HangupWatch:
    def __init__(self, connection: socket.socket, on_gone: Callable[[], None]) -> None:
        self._connection = connection
        self._on_gone = on_gone
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hangup-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            try:
                readable, _, _ = select.select([self._connection], [], [], POLL_SECONDS)
                if not readable:
                    continue
                ahead = self._connection.recv(1, socket.MSG_PEEK)
            except (OSError, ValueError):  # reset, or closed by the server meanwhile
                ahead = b""
            if not ahead and not self._stopped.is_set():
                self._on_gone()
            return  # gone, or it sent its next request: it is there

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
