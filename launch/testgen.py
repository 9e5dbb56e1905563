"""python launch/testgen.py --input problems.jsonl --output kept.jsonl

Generates test cases for coding problems with CYaRon generators and
ground-truth submissions (Kimi k1.5 report, sec. 2.3.5), keeping the problems
whose generated tests survive the agreement filters. Input lines:
{"id", "statement", "generator", "submissions": [{"language", "source"}]}.
Kept problems are appended to --output as code-reward records
({"id", "prompt", "tests": [{"input", "output"}], "testgen": stats}); a rerun
skips ids already there. Malformed lines are reported (file:line: field) and
skipped; the exit status is 1 when any line was malformed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kimi_jax.rewards.code import CodeRewardConfig
from kimi_jax.rewards.testgen import TestGenConfig, process_file


def build_config(args: argparse.Namespace) -> TestGenConfig:
  return TestGenConfig(
      num_inputs=args.num_inputs, votes_per_input=args.votes_per_input,
      min_agree=args.min_agree, min_valid_cases=args.min_valid_cases,
      check_submissions=args.check_submissions, min_passing=args.min_passing,
      seed=args.seed, generator_time_limit_s=args.generator_time_limit,
      code=CodeRewardConfig(time_limit_s=args.time_limit,
                            memory_limit_mb=args.memory_limit_mb))


def main(argv: list[str]) -> int:
  d = TestGenConfig()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
  parser.add_argument("--input", required=True, help="problems JSONL")
  parser.add_argument("--output", required=True,
                      help="kept problems JSONL (appended to)")
  parser.add_argument("--num-inputs", type=int, default=d.num_inputs)
  parser.add_argument("--votes-per-input", type=int, default=d.votes_per_input)
  parser.add_argument("--min-agree", type=int, default=d.min_agree)
  parser.add_argument("--min-valid-cases", type=int, default=d.min_valid_cases)
  parser.add_argument("--check-submissions", type=int,
                      default=d.check_submissions)
  parser.add_argument("--min-passing", type=int, default=d.min_passing)
  parser.add_argument("--seed", type=int, default=d.seed)
  parser.add_argument("--generator-time-limit", type=float,
                      default=d.generator_time_limit_s)
  parser.add_argument("--time-limit", type=float, default=d.code.time_limit_s,
                      help="per-case CPU seconds for submissions")
  parser.add_argument("--memory-limit-mb", type=int,
                      default=d.code.memory_limit_mb)
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                      help="concurrent sandboxes (local sandbox only)")
  parser.add_argument("--sandbox-url", default="",
                      help="use a sandbox server instead of a local sandbox")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  if not os.path.isfile(args.input):
    parser.error(f"--input {args.input}: no such file")
  config = build_config(args)
  if args.sandbox_url:
    from kimi_jax.sandbox import SandboxClient
    executor = SandboxClient(args.sandbox_url)
  else:
    from kimi_jax.sandbox import Sandbox
    executor = Sandbox(max_workers=args.workers)
  summary = process_file(args.input, args.output, executor, config,
                         progress=not args.no_progress,
                         log=lambda m: print(m, file=sys.stderr))
  print(f"kept {summary.kept}, rejected {summary.rejected}, "
        f"skipped (already done) {summary.skipped}, "
        f"malformed {len(summary.errors)}; config "
        f"{dataclasses.asdict(config)}", file=sys.stderr)
  return 1 if summary.errors else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
