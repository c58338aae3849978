"""A small HTTP proxy on 127.0.0.1 in front of the GCS emulator that fails requests on demand.

Point STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL at `proxy.url` and every GCS client of
a run (gcsfs, tensorstore through Orbax) goes through it. A fault is armed with `fail(...)`: from
the first request whose URL matches `when` (or at once), for `window_s` seconds, requests whose
method, URL and body start match `only` get `status` (a 503 by default). Everything else is
forwarded as is.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Hop-by-hop headers are the proxy's own business; bodies are re-sent with a Content-Length.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-connection", "content-length"}  # fmt: skip


@dataclass
class FaultPlan:
    status: int = 503
    window_s: float | None = None  # how long the fault lasts once it started (None: no limit)
    when: re.Pattern | None = None  # starts at the first request matching this (None: at once)
    only: re.Pattern | None = None  # hits only requests matching this (None: every request)
    started: float | None = None
    hits: int = 0
    seen: list[str] = field(default_factory=list)  # URLs it hit, for the test to check


class GcsFaultProxy:
    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self._up_host, self._up_port = u.hostname or "127.0.0.1", u.port or 80
        self._lock = threading.Lock()
        self.plan: FaultPlan | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args) -> None:  # quiet: tests read their own output
                pass

            def _any(self) -> None:
                body = self._read_body()
                # A multipart upload names its object in the body's metadata, not in the URL.
                head = body[:2048].decode("latin-1")
                status = proxy._decide(f"{self.command} {self.path} {head}")
                if status is not None:
                    msg = (
                        b'{"error": {"code": %d, "message": "injected by the test proxy"}}' % status
                    )
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                self._forward(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline().strip():  # trailers, then the blank line
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(proxy._up_host, proxy._up_port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up on a failed request: nothing to report

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> GcsFaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def fail(self, **plan) -> FaultPlan:
        for key in ("when", "only"):
            if isinstance(plan.get(key), str):
                plan[key] = re.compile(plan[key])
        with self._lock:
            self.plan = FaultPlan(**plan)
            return self.plan

    def _decide(self, what: str) -> int | None:
        """The status to answer, or None to forward the request."""
        with self._lock:
            p = self.plan
            if p is None:
                return None
            now = time.monotonic()
            if p.started is None:
                if p.when is not None and not p.when.search(what):
                    return None
                p.started = now
            if p.window_s is not None and now - p.started > p.window_s:
                return None
            if p.only is not None and not p.only.search(what):
                return None
            p.hits += 1
            p.seen.append(what)
            return p.status
