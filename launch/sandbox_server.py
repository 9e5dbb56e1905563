#!/usr/bin/env python3
"""HTTP code-execution sandbox (bubblewrap isolation); see docs/sandbox.md.

Example:
  python launch/sandbox_server.py --host 127.0.0.1 --port 8080 \\
      --max-concurrency 4 --max-request-bytes 33554432
  curl -s localhost:8080/health
  curl -s -XPOST localhost:8080/run -d '{"language":"python","source":"print(1)"}'
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.sandbox import Sandbox, SandboxLimits  # noqa: E402
from kimi_jax.sandbox.server import ServerConfig, make_server  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  d, lim = ServerConfig(), SandboxLimits()
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
  p.add_argument("--cpu-time-s", type=float, default=lim.cpu_time_s)
  p.add_argument("--wall-time-s", type=float, default=lim.wall_time_s)
  p.add_argument("--memory-mb", type=int, default=lim.memory_mb)
  p.add_argument("--max-processes", type=int, default=lim.max_processes)
  p.add_argument("--max-output-bytes", type=int, default=lim.max_output_bytes)
  p.add_argument("--tmpfs-size-mb", type=int, default=lim.tmpfs_size_mb)
  p.add_argument("--log-requests", action="store_true")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  a = parse_args(argv)
  limits = SandboxLimits(cpu_time_s=a.cpu_time_s, wall_time_s=a.wall_time_s,
                         memory_mb=a.memory_mb, max_processes=a.max_processes,
                         max_output_bytes=a.max_output_bytes,
                         tmpfs_size_mb=a.tmpfs_size_mb)
  config = ServerConfig(host=a.host, port=a.port,
                        max_concurrency=a.max_concurrency,
                        max_request_bytes=a.max_request_bytes,
                        queue_timeout_s=a.queue_timeout_s,
                        log_requests=a.log_requests)
  sandbox = Sandbox(limits=limits, max_workers=a.max_concurrency)
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
