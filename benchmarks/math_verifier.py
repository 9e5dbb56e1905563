#!/usr/bin/env python3
"""Math reward on its adversarial corpus: wrong answers accepted, right ones
rejected, and worst-case time on hostile answers.

Scores `tests/data/math_corpus.jsonl` (rows: category, gold, pred, correct,
required) with `make_reward("math")` through `score_all`, as the RL loop
calls it, each prediction wrapped in a response format (boxed, "Answer:"
line, boxed inside prose). Then times hostile answers one call at a time
(every call must return within `--timeout-s`, start-up of replacement
workers included).

  python benchmarks/math_verifier.py --json docs/results/math_verifier.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.rewards.base import score_all  # noqa: E402
from kimi_jax.rewards.registry import make_reward  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "tests", "data", "math_corpus.jsonl")
FORMATS = (r"Thus the answer is $\boxed{{{}}}$.", "We get...\nAnswer: ${}$",
           r"\boxed{{{}}}")


def hostile_answers() -> dict[str, str]:
  """Responses built to be slow to extract, parse or compare."""
  return {
      "power tower 10^10^10^10": r"\boxed{10^{10^{10^{10}}}}",
      "power tower 9^9^9^9": r"\boxed{9^{9^{9^{9}}}}",
      "2^2^2^2^2^2": r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
      "factorial 10^6": r"\boxed{1000000!}",
      "factorial tower": r"\boxed{(10^{6})!!}",
      "50k unclosed boxed": r"\boxed{" * 50_000,
      "50k unclosed braces": r"\boxed{" + "{" * 50_000,
      "450 nested parens": r"\boxed{" + "(" * 450 + "1" + ")" * 450 + "}",
      "5000 nested braces": r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
      "1 MB number boxed": r"\boxed{" + "7" * (1 << 20) + "}",
      "1 MB number answer line": "Answer: " + "1" * (1 << 20),
      "2 MB response of prose": "word " * ((2 << 20) // 5) + r"\boxed{5}",
      "2 MB of open brackets": "[" * (2 << 20),
      "long sum": r"\boxed{" + "+".join(["x"] * 400) + "}",
      "huge matrix power": r"\boxed{\begin{pmatrix}2&1\\1&1\end{pmatrix}^{100000}}",
      "repeating decimal 900 digits": r"\boxed{0." + "3" * 900 + r"\ldots}",
      "sqrt tower": r"\boxed{" + r"\sqrt{" * 300 + "2" + "}" * 300 + "}",
  }


def load_corpus(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = json.loads(line)
      for key in ("category", "gold", "pred", "correct"):
        if key not in row:
          raise ValueError(f"{path}:{n}: missing field {key!r}")
      rows.append(row)
  return rows


def score_corpus(reward, rows: list[dict]) -> dict:
  records = [{"id": f"c{i}", "prompt": "", "answer": r["gold"]}
             for i, r in enumerate(rows)]
  responses = [FORMATS[i % len(FORMATS)].format(r["pred"])
               for i, r in enumerate(rows)]
  start = time.perf_counter()
  results = score_all(reward, records, responses)
  elapsed = time.perf_counter() - start
  by_cat = collections.defaultdict(lambda: [0, 0])
  accepted_wrong, rejected_right = [], []
  for row, res in zip(rows, results):
    by_cat[(row["category"], row["correct"])][0] += 1
    if res.correct == row["correct"]:
      by_cat[(row["category"], row["correct"])][1] += 1
    elif row["correct"]:
      rejected_right.append({**row, "reason": res.info.get("reason"),
                             "error": res.error})
    else:
      accepted_wrong.append(row)
  n_right = sum(r["correct"] for r in rows)
  n_wrong = len(rows) - n_right
  required = [r for r in rows if r.get("required")]
  return {
      "right_pairs": n_right, "wrong_pairs": n_wrong,
      "accepted_wrong": len(accepted_wrong),
      "rejected_right": len(rejected_right),
      "right_accepted_fraction": (n_right - len(rejected_right)) / n_right,
      "required_forms": len(required),
      "required_forms_rejected": sum(
          1 for r in rejected_right if r.get("required")),
      "accepted_wrong_rows": accepted_wrong,
      "rejected_right_rows": rejected_right,
      "by_category": {f"{cat} ({'right' if ok else 'wrong'})": {
          "pairs": n, "judged_as_expected": good}
                      for (cat, ok), (n, good) in sorted(by_cat.items())},
      "corpus_seconds": elapsed,
  }


def time_hostile(reward, timeout_s: float) -> dict:
  rows = []
  for name, response in hostile_answers().items():
    start = time.perf_counter()
    res = reward({"id": name, "prompt": "", "answer": "5"}, response)
    wall = time.perf_counter() - start
    rows.append({"name": name, "wall_s": wall, "correct": res.correct,
                 "error": res.error, "within_budget": wall <= timeout_s})
  return {"rows": rows, "worst_s": max(r["wall_s"] for r in rows),
          "over_budget": sum(not r["within_budget"] for r in rows),
          "accepted": sum(r["correct"] for r in rows)}


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--corpus", default=CORPUS)
  p.add_argument("--timeout-s", type=float, default=5.0,
                 help="the math reward's per-answer budget (default 5, as "
                 "make_reward('math') with defaults)")
  p.add_argument("--num-workers", type=int, default=2)
  p.add_argument("--json", default=None, help="write results here")
  a = p.parse_args(argv)

  rows = load_corpus(a.corpus)
  reward = make_reward("math", timeout_s=a.timeout_s,
                       num_workers=a.num_workers)
  try:
    start = time.perf_counter()
    reward({"id": "warm", "prompt": "", "answer": "1"}, r"\boxed{1}")
    startup = time.perf_counter() - start
    corpus = score_corpus(reward, rows)
    hostile = time_hostile(reward, a.timeout_s)
  finally:
    reward.close()

  print(f"{'category':<42} {'pairs':>5} {'as expected':>11}")
  for cat, v in corpus["by_category"].items():
    print(f"{cat:<42} {v['pairs']:>5} {v['judged_as_expected']:>11}")
  print(f"\nwrong pairs accepted: {corpus['accepted_wrong']} of "
        f"{corpus['wrong_pairs']}")
  print(f"right pairs rejected: {corpus['rejected_right']} of "
        f"{corpus['right_pairs']} ({100 * corpus['right_accepted_fraction']:.1f}"
        f"% accepted; issue-listed forms rejected: "
        f"{corpus['required_forms_rejected']} of {corpus['required_forms']})")
  for row in corpus["accepted_wrong_rows"]:
    print(f"  ACCEPTED WRONG [{row['category']}] {row['gold']!r} <- "
          f"{row['pred']!r}")
  for row in corpus["rejected_right_rows"]:
    print(f"  rejected right [{row['category']}] {row['gold']!r} <- "
          f"{row['pred']!r} ({row['reason'] or row['error']})")
  print(f"\n{'hostile answer (gold 5)':<32} {'wall s':>7}  verdict")
  for row in hostile["rows"]:
    print(f"{row['name']:<32} {row['wall_s']:>7.3f}  "
          f"{'ACCEPTED' if row['correct'] else 'incorrect'}"
          f"{' (' + row['error'] + ')' if row['error'] else ''}")
  print(f"worst case {hostile['worst_s']:.3f} s against a {a.timeout_s} s "
        f"budget; over budget: {hostile['over_budget']}; verifier start-up "
        f"{startup:.2f} s (first call only); load avg "
        f"{os.getloadavg()[0]:.2f}")
  result = {"corpus": corpus, "hostile": hostile, "timeout_s": a.timeout_s,
            "num_workers": a.num_workers, "startup_s": startup,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg()}
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
