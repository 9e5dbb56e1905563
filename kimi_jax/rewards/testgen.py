"""Test-case generation for coding problems (Kimi k1.5 report, sec. 2.3.5).

For a problem with ground-truth submissions and a CYaRon-based input
generator:

1. run the generator `num_inputs` (50) times with different seeds, each run
   printing one test input (duplicates are dropped);
2. for every input, run `votes_per_input` (10) randomly sampled submissions;
   the input is valid when at least `min_agree` (7) of them print the same
   output (after trailing-whitespace normalisation), which becomes the
   expected output;
3. the problem is kept when at least `min_valid_cases` (40) inputs are valid
   and at least `min_passing` (9) of `check_submissions` (10) freshly sampled
   submissions pass every valid case.

With fewer submissions than a sample asks for, all are used and the
threshold scales with the sample (e.g. 6 voters need ceil(7 * 6 / 10) = 5).

Generators and submissions both run in the sandbox. The sandbox's Python is
the system interpreter and cannot see this venv (its prefix is private), so
the pure-Python sources of cyaron and its dependencies (colorful, xeger) are
shipped into each generator run as one JSON file that a small bootstrap
unpacks onto `sys.path` before running the generator.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import math
import os
import random
from typing import Any, Callable, Iterable, Mapping, Sequence

from kimi_jax.rewards import harness
from kimi_jax.rewards.code import (CodeRewardConfig, LANGUAGES,
                                   normalize_output, run_programs)
from kimi_jax.sandbox import ExecRequest, SandboxLimits

GENERATOR_DEPS = ("cyaron", "colorful", "xeger")



@dataclasses.dataclass(frozen=True)
class TestGenConfig:
  """Thresholds (report defaults) and limits of test-case generation."""

  __test__ = False  # not a pytest test class despite the name

  num_inputs: int = 50
  votes_per_input: int = 10
  min_agree: int = 7
  min_valid_cases: int = 40
  check_submissions: int = 10
  min_passing: int = 9
  seed: int = 0
  generator_time_limit_s: float = 10.0
  generator_memory_mb: int = 512
  max_input_bytes: int = 1 << 20
  code: CodeRewardConfig = CodeRewardConfig(time_limit_s=2.0)


@dataclasses.dataclass(frozen=True)
class TestGenResult:
  __test__ = False
  kept: bool
  reason: str
  tests: tuple[Mapping[str, str], ...]
  stats: Mapping[str, Any]


class ProblemFormatError(ValueError):
  """A problem line the pipeline cannot use; names the offending field."""

  def __init__(self, field: str, message: str):
    super().__init__(f"field {field!r}: {message}")
    self.field = field


# ----------------------------------------------------------------------------
# Input validation.


def validate_problem(obj: Any) -> None:
  """Raises ProblemFormatError for the first missing or malformed field."""
  if not isinstance(obj, dict):
    raise ProblemFormatError("<line>", "expected a JSON object")
  for key in ("id", "statement", "generator"):
    if key not in obj:
      raise ProblemFormatError(key, "missing")
    if not isinstance(obj[key], str):
      raise ProblemFormatError(key, "must be a string")
  subs = obj.get("submissions")
  if subs is None:
    raise ProblemFormatError("submissions", "missing")
  if not isinstance(subs, list) or not subs:
    raise ProblemFormatError("submissions", "must be a non-empty list")
  for i, sub in enumerate(subs):
    name = f"submissions[{i}]"
    if not isinstance(sub, dict):
      raise ProblemFormatError(name, "must be an object")
    if sub.get("language") not in LANGUAGES:
      raise ProblemFormatError(
          f"{name}.language", f"unknown language {sub.get('language')!r}; "
          f"expected one of {list(LANGUAGES)}")
    if not isinstance(sub.get("source"), str):
      raise ProblemFormatError(f"{name}.source", "missing or not a string")


# ----------------------------------------------------------------------------
# Running generators.


def dependency_bundle(packages: Sequence[str] = GENERATOR_DEPS,
                      max_file_bytes: int = 1 << 17) -> dict[str, str]:
  """{relative path: text} of the packages' source and small data files.

  Larger data files (colorful's 700 KB colour-name palette, never loaded by
  cyaron) are left out to keep every generator request small.
  """
  bundle = {}
  for package in packages:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise ImportError(f"generator dependency {package!r} is not installed")
    root = list(spec.submodule_search_locations)[0]
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "tests")]
      for name in filenames:
        if name.endswith((".pyc", ".so")):
          continue
        path = os.path.join(dirpath, name)
        if os.path.getsize(path) > max_file_bytes:
          continue
        try:
          with open(path, encoding="utf-8") as f:
            bundle[os.path.relpath(path, base)] = f.read()
        except UnicodeDecodeError:
          continue  # binary data files are never needed to generate text
  return bundle


_BUNDLE: str | None = None


def _bundle_json() -> str:
  global _BUNDLE
  if _BUNDLE is None:
    _BUNDLE = json.dumps(dependency_bundle())
  return _BUNDLE


def generator_seeds(config: TestGenConfig) -> list[int]:
  return [config.seed * 1_000_003 + i for i in range(config.num_inputs)]


def run_generator(executor: Any, generator: str, seeds: Sequence[int],
                  config: TestGenConfig) -> list[str | None]:
  """One generated input per seed (None where the generator failed)."""
  limits = SandboxLimits(
      cpu_time_s=config.generator_time_limit_s,
      wall_time_s=2 * config.generator_time_limit_s + 5,
      memory_mb=config.generator_memory_mb,
      max_output_bytes=config.max_input_bytes)
  bundle = _bundle_json()
  requests = [
      ExecRequest(language="python",
                  source=harness.source(harness.GENERATOR_BOOTSTRAP),
                  files={"generator.py": generator, "pydeps.json": bundle,
                         "generator_job.json": json.dumps({"seed": seed})},
                  limits=limits)
      for seed in seeds]
  results = executor.run_batch(requests)
  return [r.stdout if r.status == "ok" and not r.truncated else None
          for r in results]


# ----------------------------------------------------------------------------
# Voting and filtering (pure).


def scaled_threshold(threshold: int, wanted: int, available: int) -> int:
  """`threshold` of `wanted`, scaled to a smaller sample of `available`."""
  if available >= wanted:
    return threshold
  return math.ceil(threshold * available / wanted)


def majority_output(outputs: Iterable[str | None]) -> tuple[str | None, int]:
  """The most common normalised output and how many gave it."""
  counts = collections.Counter(normalize_output(o) for o in outputs
                               if o is not None)
  if not counts:
    return None, 0
  (output, count), = counts.most_common(1)
  return output, count


def vote(outputs_per_input: Sequence[Sequence[str | None]],
         min_agree: int) -> list[str | None]:
  """Expected output per input, None where fewer than min_agree agree."""
  expected = []
  for outputs in outputs_per_input:
    output, count = majority_output(outputs)
    expected.append(output if count >= min_agree else None)
  return expected


def passes_all(outputs: Sequence[str | None],
               expected: Sequence[str]) -> bool:
  return all(o is not None and normalize_output(o) == e
             for o, e in zip(outputs, expected))


# ----------------------------------------------------------------------------
# The pipeline for one problem.


def _outputs(cases: list[dict[str, Any]] | str, n: int) -> list[str | None]:
  """Per-input stdout of a submission, None where it did not run cleanly."""
  if isinstance(cases, str):
    return [None] * n
  return [c.get("stdout") if c.get("status") == "ok" else None
          for c in cases]


def generate_tests(problem: Mapping[str, Any], executor: Any,
                   config: TestGenConfig = TestGenConfig()) -> TestGenResult:
  """Generates, votes and filters test cases for one validated problem."""
  rng = random.Random(f"{config.seed}/{problem['id']}")
  raw = run_generator(executor, problem["generator"],
                      generator_seeds(config), config)
  inputs = list(dict.fromkeys(x for x in raw if x is not None and x.strip()))
  stats: dict[str, Any] = {"generated": len(inputs),
                           "generator_failures": sum(x is None for x in raw)}
  if not inputs:
    return TestGenResult(False, "generator produced no inputs", (), stats)
  subs = problem["submissions"]
  voters = [rng.sample(range(len(subs)), min(config.votes_per_input,
                                             len(subs)))
            for _ in inputs]
  checkers = rng.sample(range(len(subs)), min(config.check_submissions,
                                              len(subs)))
  # Every submission involved runs once on all inputs (compiled once);
  # identical sources run once.
  needed = sorted(set(checkers).union(*voters))
  programs = list(dict.fromkeys((subs[s]["language"], subs[s]["source"])
                                for s in needed))
  runs = run_programs(executor, programs, inputs, config.code)
  by_program = {p: _outputs(r, len(inputs)) for p, r in zip(programs, runs)}
  outputs = {s: by_program[(subs[s]["language"], subs[s]["source"])]
             for s in needed}
  min_agree = scaled_threshold(config.min_agree, config.votes_per_input,
                               len(voters[0]))
  expected = vote([[outputs[s][i] for s in voters[i]]
                   for i in range(len(inputs))], min_agree)
  kept = [i for i, e in enumerate(expected) if e is not None]
  tests = tuple({"input": inputs[i], "output": expected[i] + "\n"}
                for i in kept)
  stats["valid"] = len(kept)
  if len(kept) < config.min_valid_cases:
    return TestGenResult(False, f"only {len(kept)} valid cases (< "
                         f"{config.min_valid_cases})", tests, stats)
  passing = sum(passes_all([outputs[s][i] for i in kept],
                           [expected[i] for i in kept]) for s in checkers)
  need = scaled_threshold(config.min_passing, config.check_submissions,
                          len(checkers))
  stats["passing_submissions"] = f"{passing}/{len(checkers)}"
  if passing < need:
    return TestGenResult(False, f"only {passing} of {len(checkers)} "
                         f"submissions pass (< {need})", tests, stats)
  return TestGenResult(True, "ok", tests, stats)


# ----------------------------------------------------------------------------
# JSONL files.


@dataclasses.dataclass
class FileSummary:
  kept: int = 0
  rejected: int = 0
  skipped: int = 0
  errors: list[str] = dataclasses.field(default_factory=list)


def _read_lines(path: str) -> list[tuple[int, str]]:
  with open(path, encoding="utf-8") as f:
    return [(n, line) for n, line in enumerate(f, 1) if line.strip()]


def _done_ids(path: str) -> set[str]:
  """Ids already in the output file (so a rerun resumes)."""
  if not os.path.exists(path):
    return set()
  done = set()
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        done.add(json.loads(line)["id"])
      except (ValueError, KeyError, TypeError):
        continue  # a line cut short by a crash: redo that problem
  return done


def kept_record(problem: Mapping[str, Any],
                result: TestGenResult) -> dict[str, Any]:
  """The output line: a code-reward record with generated `tests`."""
  return {"id": problem["id"], "prompt": problem["statement"],
          "tests": list(result.tests), "testgen": dict(result.stats)}


def process_file(input_path: str, output_path: str, executor: Any,
                 config: TestGenConfig = TestGenConfig(),
                 progress: bool = True,
                 log: Callable[[str], None] = print) -> FileSummary:
  """Runs `generate_tests` over a JSONL file, appending kept problems.

  A malformed line is reported as "<file>:<line>: <field>: <message>" and
  skipped; every kept problem is appended and flushed as soon as it is done,
  and ids already present in the output are skipped.
  """
  summary = FileSummary()
  lines = _read_lines(input_path)
  done = _done_ids(output_path)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(lines), desc="testgen", unit="problem")
  with open(output_path, "a", encoding="utf-8") as out:
    for lineno, line in lines:
      where = f"{input_path}:{lineno}"
      try:
        problem = json.loads(line)
        validate_problem(problem)
      except json.JSONDecodeError as exc:
        summary.errors.append(f"{where}: malformed JSON: {exc}")
        log(summary.errors[-1])
      except ProblemFormatError as exc:
        summary.errors.append(f"{where}: {exc}")
        log(summary.errors[-1])
      else:
        if problem["id"] in done:
          summary.skipped += 1
        else:
          try:
            result = generate_tests(problem, executor, config)
          except Exception as exc:  # noqa: BLE001 - keep going with the rest
            result = TestGenResult(False, f"{type(exc).__name__}: {exc}",
                                   (), {})
          if result.kept:
            out.write(json.dumps(kept_record(problem, result)) + "\n")
            out.flush()
            os.fsync(out.fileno())
            summary.kept += 1
          else:
            summary.rejected += 1
            log(f"{where}: {problem['id']} rejected: {result.reason}")
      if bar is not None:
        bar.update(1)
        bar.set_postfix(kept=summary.kept, rejected=summary.rejected,
                        errors=len(summary.errors))
  if bar is not None:
    bar.close()
  return summary
