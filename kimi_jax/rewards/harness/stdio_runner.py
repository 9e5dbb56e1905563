"""Trusted stdin/stdout harness: compiles once, runs every case in a fresh
process group and prints `<nonce> <json report>`.

Runs inside the code sandbox under its Python 3 (standard library only).
"""

import json
import signal
import subprocess
import sys
import time

from harness_common import (PY_FLAGS, kill_group, lock_down, read_capped,
                            rlimits, take_job)

OOM = ("MemoryError", "bad_alloc", "heap out of memory",
       "Cannot allocate memory", "Allocation failed",
       "allocation failed", "could not allocate memory")

def command(job):
  lang = job["language"]
  if lang == "python":
    return [sys.executable] + PY_FLAGS + ["solution.py"], 0
  if lang == "javascript":
    mem = job["memory_mb"]
    return ["node", "--max-old-space-size=%d" % mem, "--v8-pool-size=1",
            "solution.js"], 4096
  return ["./solution_bin"], 0

def compile_cpp(job):
  cmd = ["g++"] + job["cpp_flags"] + ["-o", "solution_bin", "solution.cpp"]
  with open("compile.err", "wb") as err:
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err,
                         stderr=err, start_new_session=True,
                         preexec_fn=rlimits(job["compile_time_s"],
                                            job["compile_memory_mb"], 0))
    try:
      rc = p.wait(timeout=job["compile_time_s"] * 2)
    except subprocess.TimeoutExpired:
      rc = None
    kill_group(p.pid)
  text = read_capped("compile.err", 4000).decode("utf-8", "replace")
  return rc == 0, text

def run_case(cmd, extra_mb, data, job):
  with open("case.in", "wb") as f:
    f.write(data.encode("utf-8"))
  cap = job["max_output_bytes"]
  t0 = time.monotonic()
  timed_out = False
  with open("case.in", "rb") as fin, open("case.out", "wb") as fout, \
       open("case.err", "wb") as ferr:
    p = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                         start_new_session=True, close_fds=True,
                         # The file-size cap also bounds stderr; stdout's own
                         # cap is checked on the bytes read back.
                         preexec_fn=rlimits(job["time_limit_s"],
                                            job["memory_mb"],
                                            max(cap + 1, 1 << 20),
                                            job["memory_mb"] + extra_mb))
    try:
      rc = p.wait(timeout=job["time_limit_s"] * 2 + 0.5)
    except subprocess.TimeoutExpired:
      timed_out = True
      rc = None
    kill_group(p.pid)
    if rc is None:
      p.wait()
  wall = time.monotonic() - t0
  out = read_capped("case.out", cap)
  err = read_capped("case.err", 2000)[-2000:].decode("utf-8", "replace")
  if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
    status = "timeout"
  elif rc == -signal.SIGXFSZ or len(out) > cap:
    status = "output_limit"
  elif rc == 0:
    status = "ok"
  elif any(s in err for s in OOM):
    status = "memory_limit"
  else:
    status = "runtime_error"
  return {"status": status, "exit_code": rc, "wall_s": round(wall, 4),
          "stdout": out[:cap].decode("utf-8", "replace"), "stderr": err}

def main():
  job = take_job()
  lock_down()
  nonce = job.pop("nonce")
  report = {"compile_ok": True, "compile_error": "", "cases": []}
  if job["language"] == "cpp":
    ok, text = compile_cpp(job)
    report["compile_ok"], report["compile_error"] = ok, text
  if report["compile_ok"]:
    cmd, extra_mb = command(job)
    for data in job["inputs"]:
      report["cases"].append(run_case(cmd, extra_mb, data, job))
  sys.stdout.write("\n" + nonce + " " + json.dumps(report) + "\n")
  sys.stdout.flush()

main()
