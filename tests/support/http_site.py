"""A real HTTP file server on 127.0.0.1 for tests, with switches for the ways servers fail.

It answers Range requests like a file server would; a test can make it cut a connection
midway, ignore Range, answer 500 or 404, stall, or announce a size that does not match.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Behaviour:
    """What the test server serves, and how it misbehaves."""

    files: dict[str, bytes] = field(default_factory=dict)
    # name -> bytes of body sent by the next GET before the connection is closed (once).
    cut_after: dict[str, int] = field(default_factory=dict)
    # name -> bytes sent before the next GET stalls for `stall_s` seconds (once).
    stall_after: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0
    # Set when the test ends: a stall never outlasts its test.
    released: threading.Event = field(default_factory=threading.Event)
    # name -> number of GETs still to answer with 500.
    fail_500: dict[str, int] = field(default_factory=dict)
    ignore_range: bool = False
    # Added to the file size the server announces (Content-Length of 200s, Range totals).
    size_error: int = 0
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs for `name`, in order."""
        return [rng for method, path, rng in self.requests if method == "GET" and path == name]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep the test output clean

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, send_body: bool) -> None:
        behaviour = self.server.behaviour
        name = self.path.lstrip("/")
        requested = self.headers.get("Range")
        behaviour.requests.append((self.command, name, requested))
        if send_body and behaviour.fail_500.get(name, 0) > 0:
            behaviour.fail_500[name] -= 1
            self.send_error(500, "Simulated failure")
            return
        if name not in behaviour.files:
            self.send_error(404, "Not Found")
            return
        data = behaviour.files[name]
        announced = len(data) + behaviour.size_error
        start = 0
        if requested and not behaviour.ignore_range:
            start = int(requested.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self._unsatisfiable(announced)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{announced}")
            self.send_header("Content-Length", str(len(data) - start))
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(announced))
        self.end_headers()
        if send_body:
            self._send_body(name, data[start:])

    def _unsatisfiable(self, announced: int) -> None:
        self.send_response(416)
        self.send_header("Content-Range", f"bytes */{announced}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_body(self, name: str, body: bytes) -> None:
        behaviour = self.server.behaviour
        if name in behaviour.cut_after:
            # HTTP/1.0: returning closes the connection, so the client sees a short body.
            self.wfile.write(body[: behaviour.cut_after.pop(name)])
            return
        if name in behaviour.stall_after:
            self.wfile.write(body[: behaviour.stall_after.pop(name)])
            self.wfile.flush()
            behaviour.released.wait(behaviour.stall_s)
            return
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    behaviour: Behaviour


@dataclass
class Site:
    url: str
    behaviour: Behaviour


@pytest.fixture
def site() -> Iterator[Site]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.behaviour = Behaviour()
    # A short poll interval: shutdown() waits for the serving loop to notice.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Site(f"http://127.0.0.1:{server.server_address[1]}", server.behaviour)
    finally:
        server.behaviour.released.set()
        server.shutdown()
        server.server_close()
