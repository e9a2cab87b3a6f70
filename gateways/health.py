"""A plaintext HTTP health listener for the HTTP gateways (``--health-port``), which the kubelet's probes ask.

This is the gRPC services' ``--health-port`` idea, over HTTP. The probes ask this port whatever the service port
speaks (HTTPS with ``--tls-cert``), and it answers nothing but health:

- ``GET /healthz`` → 200 while the process serves (liveness: it never depends on the trainer);
- ``GET /readyz`` → 200 when the gateway can reach the trainer (its gRPC channel connects within a second),
  otherwise 503 naming the reason, so a pod that cannot reach the trainer (a NetworkPolicy, a wrong address)
  takes no traffic. After ``draining()`` it always answers 503.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HealthServer:
    def __init__(self, host: str, port: int, ready: Callable[[], str | None]):
        """``ready()`` returns None when ready, else the reason it is not."""
        self._ready, self._draining = ready, False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/healthz":
                    outer._reply(self, 200, "ok")
                elif self.path == "/readyz":
                    why = "draining" if outer._draining else outer._check()
                    outer._reply(self, 503 if why else 200, why or "ready")
                else:
                    outer._reply(self, 404, "health only: /healthz, /readyz")

            def log_message(self, *args):  # probes every few seconds: not worth a log line each
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)

    def _check(self) -> str | None:
        try:
            return self._ready()
        except Exception as exc:  # a failing check is "not ready", never a dead listener
            return f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, text: str) -> None:
        body = (text + "\n").encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def draining(self) -> None:
        self._draining = True

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def trainer_reachable(client, timeout: float = 1.0) -> str | None:
    """A readiness check: None when ``client``'s (a strop SDK client) channel connects within ``timeout``."""
    from strop.client.errors import StropClientError

    try:
        client.wait_ready(timeout=timeout)
    except StropClientError as exc:
        return f"the trainer is not reachable: {exc.details}"
    return None
