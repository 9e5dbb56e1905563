"""Trusted function-mode harness: runs the record's `check` against a proxy
of the candidate process and prints `<nonce> {}` when every assert passed.

Runs inside the code sandbox under its Python 3 (standard library only).
"""

import json
import os
import select
import subprocess
import sys
import time

from harness_codec import decode, encode
from harness_common import (PY_FLAGS, kill_group, lock_down, rlimits,
                            take_job)

class CandidateError(Exception):
  pass

class Oracle:
  def __init__(self, job):
    req_r, self.req_w = os.pipe()
    self.resp_r, resp_w = os.pipe()
    self.timeout = job["call_timeout_s"]
    self.proc = subprocess.Popen(
        [sys.executable] + PY_FLAGS + ["oracle.py", str(req_r), str(resp_w)],
        pass_fds=(req_r, resp_w), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=open("oracle.err", "wb"),
        start_new_session=True,
        preexec_fn=rlimits(job["time_limit_s"], job["memory_mb"], 1 << 24))
    os.close(req_r)
    os.close(resp_w)
    self.buf = b""

  def recv(self):
    deadline = time.monotonic() + self.timeout
    while b"\n" not in self.buf:
      left = deadline - time.monotonic()
      if left <= 0:
        raise CandidateError("call timed out")
      ready, _, _ = select.select([self.resp_r], [], [], left)
      if ready:
        chunk = os.read(self.resp_r, 1 << 16)
        if not chunk:
          raise CandidateError("candidate process exited")
        self.buf += chunk
        if len(self.buf) > (64 << 20):
          raise CandidateError("reply too large")
    line, self.buf = self.buf.split(b"\n", 1)
    return json.loads(line)

  def call(self, name, args, kwargs):
    data = json.dumps({"name": name, "args": encode(list(args)),
                       "kwargs": encode(dict(kwargs))}) + "\n"
    try:
      os.write(self.req_w, data.encode("utf-8"))
    except OSError:
      raise CandidateError("candidate process exited")
    msg = self.recv()
    if "error" in msg:
      raise CandidateError(msg["error"])
    return decode(msg["value"])

def main():
  job = take_job()
  lock_down()
  nonce = job.pop("nonce")
  oracle = Oracle(job)
  try:
    hello = oracle.recv()
    if "error" in hello:
      raise CandidateError(hello["error"])
    name = job["entry_point"]
    def candidate(*args, **kwargs):
      return oracle.call(name, args, kwargs)
    ns = {"__name__": "__harness__"}
    exec(compile(job["code_prefix"], "prefix", "exec"), ns)
    # Tests may call the function by name too (HumanEval/33 does).
    ns[name] = candidate
    exec(compile(job["test"], "test", "exec"), ns)
    ns["check"](candidate)
  except BaseException as e:
    sys.stderr.write("FAILED %s: %s\n" % (type(e).__name__, str(e)[:500]))
    sys.exit(1)
  finally:
    kill_group(oracle.proc.pid)
  sys.stdout.write("\n" + nonce + " {}\n")
  sys.stdout.flush()

main()
