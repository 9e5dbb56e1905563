"""HTTP client with the same `run` / `run_batch` as the in-process Sandbox."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence

from kimi_jax.sandbox.types import ExecRequest, ExecResult, SandboxRequestError


class SandboxClientError(RuntimeError):
  """The server could not be reached or answered something unexpected."""


class SandboxClient:
  """Talks to `launch/sandbox_server.py`; a 400 re-raises SandboxRequestError
  so callers handle bad requests the same way as with the local Sandbox."""

  def __init__(self, url: str, timeout_s: float = 600.0):
    self.url = url.rstrip("/")
    self.timeout_s = timeout_s

  def health(self) -> dict[str, Any]:
    return self._call("GET", "/health", None)

  def run(self, request: ExecRequest) -> ExecResult:
    return ExecResult.from_dict(self._call("POST", "/run", request.to_dict()))

  def run_batch(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
    body = [r.to_dict() for r in requests]
    reply = self._call("POST", "/run_batch", body)
    if not isinstance(reply, list) or len(reply) != len(body):
      raise SandboxClientError("run_batch: malformed reply from server")
    return [ExecResult.from_dict(r) for r in reply]

  def _call(self, method: str, path: str, body: Any) -> Any:
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        self.url + path, data=data, method=method,
        headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
        return json.loads(resp.read())
    except urllib.error.HTTPError as e:
      try:
        err = json.loads(e.read())
      except ValueError:
        err = {}
      if e.code == 400 and isinstance(err, dict):
        raise SandboxRequestError(str(err.get("field", "request")),
                                  str(err.get("message", err))) from e
      raise SandboxClientError(f"HTTP {e.code} from {path}: {err}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
      raise SandboxClientError(f"{path}: {e}") from e
