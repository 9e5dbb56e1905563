"""Math reward: extract the final answer and check it with math-verify.

Every check (answer extraction, parsing, symbolic comparison) runs inside a
small pool of worker processes. math-verify's own timeout relies on
`signal.alarm`, which only works in the main thread and cannot interrupt long C
calls (a sympy power tower spends minutes in big-integer arithmetic), so the
pool enforces the deadline from outside: a worker that overruns is killed and
replaced, and its item scores incorrect with error "timeout".

Record fields: `answer` (the reference answer, LaTeX or plain text; numbers
are accepted too).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing.connection
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from kimi_jax.rewards.base import RewardResult

# Directory holding the `kimi_jax` package, put on the workers' PYTHONPATH.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# A final "Answer: ..." / "Final answer: ..." line. Greedy `.+` (not lazy with
# a trailing `\s*$`) keeps matching linear on long lines.
DEFAULT_ANSWER_PATTERNS = (
    r"(?im)^[ \t*#]*(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t*]*(?:is)?"
    r"[ \t]*[:：][ \t*]*(.+)$",
)


@dataclasses.dataclass(frozen=True)
class MathRewardConfig:
  """Options of the math reward.

  timeout_s: wall-clock budget of one check (extract + parse + verify) in a
    worker process; overrunning it scores incorrect with error "timeout".
  num_workers: worker processes checking in parallel.
  memory_limit_mb: address-space cap of each worker (None: no cap), so a
    runaway sympy computation fails with MemoryError instead of eating the host.
  max_response_chars: only the last this many characters of a response are
    searched (the final answer sits at the end).
  max_answer_chars: an extracted or reference answer longer than this scores
    incorrect without being parsed.
  boxed_commands: LaTeX commands whose argument is the answer; the last one
    in the response wins.
  answer_patterns: regexes tried (in order) when there is no boxed answer;
    group 1 of the last match is the answer.
  float_rounding, strict: passed to `math_verify.verify`.
  """

  timeout_s: float = 5.0
  num_workers: int = 2
  memory_limit_mb: int | None = 4096
  max_response_chars: int = 100_000
  max_answer_chars: int = 1_000
  boxed_commands: tuple[str, ...] = ("boxed", "fbox")
  answer_patterns: tuple[str, ...] = DEFAULT_ANSWER_PATTERNS
  float_rounding: int = 6
  strict: bool = True


# ----------------------------------------------------------------------------
# Answer extraction (pure functions; run inside the workers).


def _braced_argument(text: str, open_idx: int) -> str | None:
  """Returns the contents of the `{...}` group opening at `open_idx`.

  Escaped braces (`\\{`, `\\}`) are literal characters, not grouping. Returns
  None when the group never closes.
  """
  depth = 0
  i = open_idx
  n = len(text)
  while i < n:
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[open_idx + 1:i]
    i += 1
  return None


def extract_boxed(text: str,
                  commands: Sequence[str] = ("boxed", "fbox")) -> str | None:
  """Returns the argument of the last `\\boxed{...}` (balanced braces).

  `\\boxed 5` (argument without braces) is accepted too. A boxed group that
  never closes is skipped in favour of an earlier complete one.
  """
  if not commands:
    return None
  names = "|".join(re.escape(c) for c in commands)
  starts = [m for m in re.finditer(rf"\\(?:{names})(?![a-zA-Z])", text)]
  for m in reversed(starts):
    j = m.end()
    while j < len(text) and text[j] in " \t":
      j += 1
    if j < len(text) and text[j] == "{":
      arg = _braced_argument(text, j)
      if arg is not None:
        return arg.strip()
    elif j > m.end():
      token = re.match(r"[^\s$]+", text[j:])
      if token:
        return token.group(0)
  return None


def _clean_answer(answer: str) -> str:
  """Strips math delimiters and trailing punctuation around an answer."""
  answer = answer.strip().strip("*").strip().rstrip(".").strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if (len(answer) >= len(left) + len(right) and answer.startswith(left) and
        answer.endswith(right)):
      answer = answer[len(left):len(answer) - len(right)].strip()
  return answer.rstrip(".").strip()


def extract_answer(response: str,
                   boxed_commands: Sequence[str] = ("boxed", "fbox"),
                   answer_patterns: Sequence[str] = DEFAULT_ANSWER_PATTERNS
                   ) -> str | None:
  """The final answer of a response: last boxed group, else last answer line."""
  boxed = extract_boxed(response, boxed_commands)
  if boxed is not None:
    return _clean_answer(boxed)
  for pattern in answer_patterns:
    matches = list(re.finditer(pattern, response))
    if matches:
      line = matches[-1].group(1)
      inner = extract_boxed(line, boxed_commands)
      return _clean_answer(inner if inner is not None else line)
  return None


# ----------------------------------------------------------------------------
# The check itself (runs inside a worker process).


def _parse(latex: str) -> list[Any]:
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
  # The answer is already isolated, so present it as one inline-math span.
  return parse(f"${latex}$",
               extraction_config=[LatexExtractionConfig(),
                                  ExprExtractionConfig()],
               parsing_timeout=None)


def check_answer(gold: str, response: str,
                 config: MathRewardConfig) -> dict[str, Any]:
  """Extracts the response's answer and compares it with `gold`.

  Returns a dict with `correct`, `answer` and, on failure, `error`. Runs
  without any timeout of its own: call it through `MathVerifyPool`.
  """
  from math_verify import verify
  answer = extract_answer(response, config.boxed_commands,
                          config.answer_patterns)
  if answer is None:
    return {"correct": False, "answer": None, "error": "no answer found"}
  if len(answer) > config.max_answer_chars:
    return {"correct": False, "answer": answer[:64] + "...",
            "error": "answer too long"}
  if len(gold) > config.max_answer_chars:
    return {"correct": False, "answer": answer, "error": "reference too long"}
  gold_boxed = extract_boxed(gold, config.boxed_commands)
  gold_parsed = _parse(_clean_answer(gold_boxed if gold_boxed else gold))
  if not gold_parsed:
    return {"correct": False, "answer": answer,
            "error": "reference answer did not parse"}
  pred_parsed = _parse(answer)
  ok = verify(gold_parsed, pred_parsed, float_rounding=config.float_rounding,
              strict=config.strict, timeout_seconds=None)
  return {"correct": bool(ok), "answer": answer}


# Typical answers parsed once at worker start: the LaTeX parser (ANTLR) builds
# its prediction cache lazily, and the first parse of a shape costs seconds.
_WARM_UP_PAIRS = (("a^2-4", "\\boxed{(a+2)(a-2)}"),
                  ("\\frac{1}{2}", "\\boxed{0.5}"),
                  ("[1,3)", "\\boxed{[1, 3)}"),
                  ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),
                  ("x=2", "Answer: 2"))


def _warm_up() -> None:
  config = MathRewardConfig()
  for gold, response in _WARM_UP_PAIRS:
    check_answer(gold, response, config)


def _worker_main(conn: Any,
                 memory_limit_mb: int | None) -> None:
  """Worker loop: receive (gold, response, config), send the check's dict."""
  if memory_limit_mb:
    import resource
    limit = memory_limit_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  # math-verify warns once that its own timeout is off; the pool is the timeout.
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  _warm_up()
  conn.send("ready")
  while True:
    try:
      task = conn.recv()
    except EOFError:
      return
    if task is None:
      return
    gold, response, config = task
    try:
      out = check_answer(gold, response, config)
    except MemoryError:
      out = {"correct": False, "answer": None, "error": "memory limit"}
    except BaseException as exc:  # noqa: BLE001 - report, keep serving
      out = {"correct": False, "answer": None,
             "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    conn.send(out)


# ----------------------------------------------------------------------------
# Process pool with per-task deadlines.


def _worker_entry(read_fd: int, write_fd: int,
                  memory_limit_mb: int | None) -> None:
  """Entry point of a worker started with `python -c` (see `_Worker`)."""
  from multiprocessing.connection import Connection

  class _Duplex:
    def __init__(self):
      self.r = Connection(read_fd, writable=False)
      self.w = Connection(write_fd, readable=False)

    def recv(self):
      return self.r.recv()

    def send(self, obj):
      self.w.send(obj)

  _worker_main(_Duplex(), memory_limit_mb)


class _Worker:
  """One worker process and the parent's ends of its two pipes.

  Workers are plain `python -c` subprocesses rather than multiprocessing
  children: "spawn"/"forkserver" re-import the parent's `__main__`, which
  breaks scripts without a main guard and notebooks, and "fork" would copy a
  process that may hold JAX threads.
  """

  def __init__(self, memory_limit_mb: int | None):
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    code = ("import sys; from kimi_jax.rewards.math import _worker_entry; "
            "_worker_entry(int(sys.argv[1]), int(sys.argv[2]), "
            f"{memory_limit_mb!r})")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    self.process = subprocess.Popen(
        [sys.executable, "-c", code, str(to_child_r), str(from_child_w)],
        pass_fds=(to_child_r, from_child_w), env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    os.close(to_child_r)
    os.close(from_child_w)
    self.send_conn = multiprocessing.connection.Connection(
        to_child_w, readable=False)
    self.conn = multiprocessing.connection.Connection(
        from_child_r, writable=False)
    self.ready = False
    self.started_at = time.monotonic()
    self.task: int | None = None
    self.deadline = 0.0

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    try:
      self.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass
    self.send_conn.close()
    self.conn.close()


class MathVerifyPool:
  """Runs `check_answer` in worker processes, each call under a hard deadline.

  Thread-safe: calls from several threads are serialised by a lock (the
  pool already checks `num_workers` items in parallel). Workers start lazily
  on first use and are killed by `close()` or when the parent exits.
  """

  _STARTUP_TIMEOUT_S = 120.0

  def __init__(self, config: MathRewardConfig):
    self.config = config
    self._workers: list[_Worker] = []
    self._lock = threading.Lock()
    self._startup_failures = 0

  def _spawn(self) -> _Worker:
    return _Worker(self.config.memory_limit_mb)

  def _replace(self, worker: _Worker) -> None:
    worker.kill()
    self._workers[self._workers.index(worker)] = self._spawn()

  def run(self, tasks: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Checks (gold, response) pairs; results in order, no per-item raise."""
    with self._lock:
      return self._run_locked(tasks)

  def _run_locked(self, tasks: Sequence[tuple[str, str]]
                  ) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    pending = collections.deque(range(len(tasks)))
    while len(self._workers) < self.config.num_workers:
      self._workers.append(self._spawn())
    while pending or any(w.task is not None for w in self._workers):
      now = time.monotonic()
      for w in list(self._workers):
        if w.ready and w.task is None and pending:
          idx = pending.popleft()
          try:
            w.send_conn.send((tasks[idx][0], tasks[idx][1], self.config))
          except (BrokenPipeError, OSError):
            pending.appendleft(idx)
            self._replace(w)
            continue
          w.task, w.deadline = idx, now + self.config.timeout_s
        elif not w.ready and now - w.started_at > self._STARTUP_TIMEOUT_S:
          raise RuntimeError("math-verify worker failed to start")
      self._wait_and_collect(results)
    return [r if r is not None else {"correct": False, "error": "lost"}
            for r in results]

  def _wait_and_collect(self, results: list[dict[str, Any] | None]) -> None:
    """Waits for one event (result, ready, death, deadline) and handles it."""
    busy = [w for w in self._workers if w.task is not None]
    deadlines = [w.deadline for w in busy]
    wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
    conns = {w.conn: w for w in self._workers}
    for conn in multiprocessing.connection.wait(list(conns), timeout=wait_s):
      w = conns[conn]
      try:
        msg = conn.recv()
      except (EOFError, OSError):
        # The worker died (e.g. killed by the OS); its item scores incorrect.
        if not w.ready:
          self._startup_failures += 1
          if self._startup_failures >= 3:
            raise RuntimeError("math-verify workers die at startup; run "
                               "`python -c 'import math_verify'` to see why")
        if w.task is not None:
          results[w.task] = {"correct": False, "answer": None,
                             "error": "worker crashed"}
        self._replace(w)
        continue
      if msg == "ready":
        w.ready = True
        self._startup_failures = 0
      elif w.task is not None:
        results[w.task] = msg
        w.task = None
    now = time.monotonic()
    for w in list(self._workers):
      if w.task is not None and now >= w.deadline:
        results[w.task] = {"correct": False, "answer": None,
                           "error": "timeout"}
        self._replace(w)

  def close(self) -> None:
    with self._lock:
      for w in self._workers:
        try:
          w.send_conn.send(None)
        except (BrokenPipeError, OSError):
          pass
        w.kill()
      self._workers = []

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass


# ----------------------------------------------------------------------------
# The reward.


def _to_result(out: Mapping[str, Any]) -> RewardResult:
  correct = bool(out.get("correct"))
  return RewardResult(score=1.0 if correct else 0.0, correct=correct,
                      error=out.get("error"),
                      info={"answer": (out.get("answer") or "")[:200] or None})


class MathReward:
  """Reward 1 when the response's final answer equals the record's `answer`.

  Call it for one response or `batch` for many (checked in parallel). Use as a
  context manager, or call `close()`, to stop the worker processes.
  """

  def __init__(self, config: MathRewardConfig | None = None, **options: Any):
    self.config = config or MathRewardConfig(**options)
    self._pool = MathVerifyPool(self.config)

  def _task(self, record: Mapping[str, Any], response: str) -> tuple[str, str]:
    if "answer" not in record:
      raise KeyError(f"math record {record.get('id')!r} has no 'answer'")
    tail = response[-self.config.max_response_chars:]
    return str(record["answer"]), tail

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    return self.batch([record], [response])[0]

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    if len(records) != len(responses):
      raise ValueError(f"{len(records)} records but {len(responses)} responses")
    tasks: list[tuple[str, str] | None] = []
    early: dict[int, RewardResult] = {}
    for i, (record, response) in enumerate(zip(records, responses)):
      try:
        tasks.append(self._task(record, response))
      except Exception as exc:  # noqa: BLE001 - one bad record scores 0
        tasks.append(None)
        early[i] = RewardResult(0.0, False,
                                error=f"{type(exc).__name__}: {exc}")
    todo = [i for i, t in enumerate(tasks) if t is not None]
    outs = self._pool.run([tasks[i] for i in todo]) if todo else []
    results = dict(early)
    results.update({i: _to_result(out) for i, out in zip(todo, outs)})
    return [results[i] for i in range(len(records))]

  def close(self) -> None:
    self._pool.close()

  def __enter__(self) -> "MathReward":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
