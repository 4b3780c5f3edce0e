"""A local HTTP server on a thread that answers JSON: the stand-in engine of the CPU tests of fleetrl's HTTP
clients (a real socket and a real HTTP exchange; only the answers are the test's)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# answer(method, path, body) -> (reply, HTTP status); body is the request's JSON (None for a GET or no body)
Answer = Callable[[str, str, object], tuple[object, int]]


@contextmanager
def json_http_server(answer: Answer) -> Iterator[str]:
    """Serve ``answer`` on 127.0.0.1 (a free port) while the block runs; yields the server's URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _serve(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            reply, code = answer(method, self.path, json.loads(raw) if raw else None)
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

    class Server(ThreadingHTTPServer):
        request_queue_size = 1024  # socketserver's 5 resets a burst of connections (a fleet's groups at once)

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
