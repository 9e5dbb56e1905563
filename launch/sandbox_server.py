#!/usr/bin/env python3
"""HTTP code-execution sandbox (bubblewrap isolation); see docs/sandbox.md.

Example:
  python launch/sandbox_server.py --host 127.0.0.1 --port 8080 \\
      --max-concurrency 4 --max-request-bytes 33554432 --memory-mb 1024
  curl -s localhost:8080/health
  curl -s -XPOST localhost:8080/run -d '{"language":"python","source":"print(1)"}'
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.sandbox import Sandbox  # noqa: E402
from kimi_jax.sandbox.flags import (add_limit_flags, add_sandbox_flags,  # noqa: E402
                                    limits_from_args)
from kimi_jax.sandbox.server import ServerConfig, make_server  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  d = ServerConfig()
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
  p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
  p.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                 help="sandboxes running at once; extra requests wait up to "
                 "--queue-timeout-s, then get 503 (default %(default)s)")
  p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                 help="larger bodies get 413 (default %(default)s)")
  p.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s,
                 help="how long a request waits for a slot (default %(default)s)")
  add_limit_flags(p)
  add_sandbox_flags(p)
  p.add_argument("--log-requests", action="store_true")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  a = parse_args(argv)
  limits = limits_from_args(a)
  config = ServerConfig(host=a.host, port=a.port,
                        max_concurrency=a.max_concurrency,
                        max_request_bytes=a.max_request_bytes,
                        queue_timeout_s=a.queue_timeout_s,
                        log_requests=a.log_requests)
  extra = {} if a.host_uid is None else {"host_uid": a.host_uid}
  sandbox = Sandbox(limits=limits, max_workers=a.max_concurrency,
                    seccomp_filter=not a.no_seccomp,
                    memory_poll_s=a.memory_poll_s, **extra)
  server = make_server(config, sandbox)
  # SIGTERM (e.g. from a process manager) shuts down like Ctrl-C, so the
  # prepared sandbox root in the temp dir is removed.
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  print(f"sandbox server listening on {server.url}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    sandbox.close()


if __name__ == "__main__":
  main()
