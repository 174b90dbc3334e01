"""Plain HTTP servers on loopback for the tests and benchmarks that play another party (an OIDC
issuer, an OTLP collector, a webhook receiver): a handler that answers in one call and logs
nothing, served by a daemon thread on a free port."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    """A quiet handler with `answer`: status, content type and length written the same way by all."""

    def answer(self, body: bytes = b"", content_type: str | None = None, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def body(self) -> bytes:
        """The request's body, as long as its Content-Length says."""
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def log_message(self, *args: object) -> None:
        pass


def serve(handler: type[Handler], port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """The server (stop it with `shutdown` and `server_close`) and its base URL, serving already."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
