"""JSON-over-HTTP front end for `Sandbox` (stdlib only).

  GET  /health     -> {"status": "ok", "languages": [...], ...}
  POST /run        one ExecRequest object   -> one ExecResult object
  POST /run_batch  list of ExecRequest      -> list of ExecResult (same order)

At most `max_concurrency` requests are executed at once; further requests wait
up to `queue_timeout_s` for a slot and then get 503. Bodies larger than
`max_request_bytes` get 413, malformed JSON / bad fields get 400 naming the
field. Errors are always JSON: {"error": kind, "field": name, "message": text}.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kimi_jax.sandbox.sandbox import Sandbox
from kimi_jax.sandbox.types import (LANGUAGES, SandboxRequestError,
                                    request_from_dict)


@dataclass(frozen=True)
class ServerConfig:
  host: str = "127.0.0.1"
  port: int = 8080
  max_concurrency: int = 4
  max_request_bytes: int = 32 << 20
  queue_timeout_s: float = 60.0
  socket_timeout_s: float = 30.0  # slow / idle clients are dropped
  log_requests: bool = False


class _HTTPError(Exception):

  def __init__(self, code: int, kind: str, message: str, field: str = ""):
    super().__init__(message)
    self.code, self.kind, self.field = code, kind, field


class SandboxHTTPServer(ThreadingHTTPServer):
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, config: ServerConfig, sandbox: Sandbox):
    self.config = config
    self.sandbox = sandbox
    self.slots = threading.BoundedSemaphore(config.max_concurrency)
    self.in_flight = 0
    self._count_lock = threading.Lock()
    super().__init__((config.host, config.port), _Handler)

  @property
  def url(self) -> str:
    host, port = self.server_address[:2]
    return f"http://{host}:{port}"

  def count(self, delta: int) -> None:
    with self._count_lock:
      self.in_flight += delta


class _Handler(BaseHTTPRequestHandler):
  server: SandboxHTTPServer
  protocol_version = "HTTP/1.1"
  server_version = "kimi-sandbox/1"

  def setup(self) -> None:
    self.timeout = self.server.config.socket_timeout_s
    super().setup()

  def log_message(self, format: str, *args: Any) -> None:
    if self.server.config.log_requests:
      super().log_message(format, *args)

  # -- routing ---------------------------------------------------------------

  def do_GET(self) -> None:
    self._dispatch(self._get)

  def do_POST(self) -> None:
    self._dispatch(self._post)

  def _dispatch(self, handler) -> None:
    try:
      self._send(200, handler())
    except _HTTPError as e:
      message = f"{e.field}: {e}" if e.field else str(e)
      self._send(e.code, {"error": e.kind, "field": e.field,
                          "message": message})
    except SandboxRequestError as e:
      self._send(400, {"error": "bad_request", "field": e.field,
                       "message": str(e)})
    except Exception as e:  # the server must survive anything
      traceback.print_exc(file=sys.stderr)
      self._send(500, {"error": "internal", "field": "",
                       "message": f"{type(e).__name__}: {e}"})

  def _get(self) -> Any:
    if self.path != "/health":
      raise _HTTPError(404, "not_found", f"no such endpoint {self.path}")
    sb = self.server.sandbox
    return {"status": "ok",
            "languages": [l for l in LANGUAGES if sb.toolchain.runtime(l)],
            "max_concurrency": self.server.config.max_concurrency,
            "in_flight": self.server.in_flight,
            "limits": sb.limits.to_dict()}

  def _post(self) -> Any:
    if self.path not in ("/run", "/run_batch"):
      raise _HTTPError(404, "not_found", f"no such endpoint {self.path}")
    body = self._read_json()
    sb = self.server.sandbox
    if self.path == "/run":
      req = request_from_dict(body, sb.limits)
      return self._admitted(lambda: sb.run(req).to_dict())
    if isinstance(body, dict) and "requests" in body:
      body = body["requests"]
    if not isinstance(body, list):
      raise SandboxRequestError("requests", "must be a JSON list of requests")
    reqs = []
    for i, item in enumerate(body):
      try:
        reqs.append(request_from_dict(item, sb.limits))
      except SandboxRequestError as e:
        raise SandboxRequestError(f"requests[{i}].{e.field}",
                                  str(e).split(": ", 1)[1]) from e
    return self._admitted(lambda: [r.to_dict() for r in sb.run_batch(reqs)])

  # -- helpers ---------------------------------------------------------------

  def _admitted(self, work) -> Any:
    if not self.server.slots.acquire(timeout=self.server.config.queue_timeout_s):
      raise _HTTPError(503, "busy", "all sandbox slots busy; retry later")
    self.server.count(+1)
    try:
      return work()
    finally:
      self.server.count(-1)
      self.server.slots.release()

  def _read_json(self) -> Any:
    length_header = self.headers.get("Content-Length")
    if length_header is None:
      self.close_connection = True
      raise _HTTPError(411, "length_required", "Content-Length is required",
                       "Content-Length")
    try:
      length = int(length_header)
      if length < 0:
        raise ValueError
    except ValueError:
      self.close_connection = True
      raise _HTTPError(400, "bad_request", "invalid Content-Length",
                       "Content-Length") from None
    limit = self.server.config.max_request_bytes
    if length > limit:
      self.close_connection = True  # the unread body poisons the connection
      raise _HTTPError(413, "too_large",
                       f"request body of {length} bytes exceeds {limit}",
                       "body")
    raw = self.rfile.read(length)
    if len(raw) != length:
      self.close_connection = True
      raise _HTTPError(400, "bad_request", "truncated request body", "body")
    try:
      return json.loads(raw)
    except (ValueError, RecursionError) as e:
      raise _HTTPError(400, "bad_json", f"malformed JSON: {e}", "body") from None

  def _send(self, code: int, payload: Any) -> None:
    data = json.dumps(payload).encode("utf-8")
    try:
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      if self.close_connection:
        self.send_header("Connection", "close")
      self.end_headers()
      self.wfile.write(data)
    except OSError:  # client went away; nothing to tell it
      self.close_connection = True


def make_server(config: ServerConfig, sandbox: Sandbox | None = None) -> SandboxHTTPServer:
  """Binds the server (port 0 picks a free port); call serve_forever()."""
  sandbox = sandbox or Sandbox(max_workers=config.max_concurrency)
  return SandboxHTTPServer(config, sandbox)
