"""Secure, fast execution of untrusted Python / C++ / JavaScript programs.

In-process: `Sandbox(limits=SandboxLimits(...), max_workers=N).run(req)`.
Over HTTP: `SandboxClient(url)` has the same `run` / `run_batch`.
See docs/sandbox.md.
"""

from kimi_jax.sandbox.types import (LANGUAGES, MAX_LIMITS, STATUSES,
                                    ExecRequest, ExecResult, RequestCaps,
                                    SandboxLimits, SandboxRequestError,
                                    SandboxUnavailableError)
from kimi_jax.sandbox.sandbox import Sandbox
from kimi_jax.sandbox.client import SandboxClient, SandboxClientError

__all__ = ["LANGUAGES", "MAX_LIMITS", "STATUSES", "ExecRequest", "ExecResult",
           "RequestCaps", "Sandbox", "SandboxClient", "SandboxClientError",
           "SandboxLimits", "SandboxRequestError", "SandboxUnavailableError"]
