"""A task where thinking longer pays: invert a pointer table by trying and
checking candidates (experiments/reflect_tiny.py, docs/reflect_task.md).

The prompt lists a permutation f of N digits as a table of pairs (`37` is
f(3) = 7, the sources in a random order) and asks for the x with
f^n(x) = y, one `>` per step: `37 14 02 71 ?>>4` asks for x with
f(f(x)) = 4. Exactly one digit of the table answers, since f is a
permutation.

A response is a sequence of attempts, then the answer. An attempt writes a
candidate, its n successors, `:`, the target y copied from the prompt and
a verdict: `+` when the last successor is y, `-` otherwise (the
backtrack: the next attempt takes the next candidate). `02:7- 37:7+ =3`
reads "try 0: f(0)=2, against 7: no; try 3: f(3)=7, against 7: yes;
answer 3". Candidates are tried in table order. The copied target puts
the two digits the verdict compares side by side (without it one vanilla
model copied the lookups right and guessed the verdicts;
docs/reflect_task.md).

- Checking a candidate forward is n table lookups (find the digit as a
  source, copy its target), the copying a small model learns.
- Answering directly (`=3` alone) needs the inverse, n backward lookups
  composed in one forward pass; the model is never shown one as a step
  (only bare answers show their result), so a bare answer is mostly a
  guess, right with probability about 1/N.
- Each checked candidate raises the chance of being right: with k
  candidates checked in table order and a guess among the rest, 1 in N of
  the problems is solved per candidate (a chance of (k + 1) / N), and a
  search that goes on until `+` is always right.
- Correct responses vary in length, and a shortest one exists: the search
  that stops at `+` writes (position of x in the table) attempts of n + 4
  characters each (`=x` alone is shorter still, but right only by luck).

Difficulty levels (`LEVELS`) grow the table (more candidates, so more
attempts; the code also takes more steps, longer checks): harder problems
need longer responses.

Records are items of a seeded stream of distinct problems (no two items
share a prompt), so sets cut from it by item index, as the gym pipeline
cuts train, held-out, validation and vanilla-SFT sets, never overlap.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

# The problem and the response format live with the verifier (the data
# layer builds on the rewards); re-exported for the task's users.
from kimi_jax.rewards.reflect import (  # noqa: F401
    AGAINST, ANSWER, DATASET, NO, YES, Parsed, Problem, attempt, parse,
    problem_of, response_stats, wrong_step)

DIGITS = "0123456789"
# level: (table size N, steps n).
# One lookup per check: the two-lookup checks of an earlier design were
# not learned in a vanilla stage that fits the experiment's time
# (docs/reflect_task.md); the problem, response and verifier code handles
# any n.
LEVELS = {1: (4, 1), 2: (5, 1), 3: (6, 1), 4: (8, 1)}
# A stream this many draws in a row without a new problem has run out of
# them (the smallest level holds 181,440 distinct prompts).
_MAX_REPEATS = 10_000
# Worked-solution styles of the vanilla SFT stage: a bare answer; a short
# search (up to `plain_budget` candidates, then the answer); a full search
# (until `+`), the long-CoT behaviour a cue asks for.
STYLES = ("direct", "plain", "cued")


def check_levels(levels: Sequence[int]) -> tuple[int, ...]:
  levels = tuple(int(l) for l in levels)
  unknown = sorted(set(levels) - set(LEVELS))
  if not levels or unknown:
    raise ValueError(f"reflect levels must be a non-empty list of "
                     f"{sorted(LEVELS)}, got {list(levels)}")
  return levels


def draw_problem(rng: np.random.Generator, level: int) -> Problem:
  """A random table of N distinct digits (a random permutation of them
  without fixed points, its sources listed in a random order) and a random
  target. A fixed point `yy` would answer its target at every n: a
  shortcut around the search."""
  size, steps = LEVELS[level]
  symbols = [int(d) for d in rng.choice(10, size, replace=False)]
  while True:
    perm = rng.permutation(size)
    if not np.any(perm == np.arange(size)):
      break
  images = [symbols[i] for i in perm]
  f = dict(zip(symbols, images))
  order = [symbols[i] for i in rng.permutation(size)]
  return Problem(table=tuple((s, f[s]) for s in order), steps=steps,
                 target=symbols[int(rng.integers(size))], level=level)


def to_record(problem: Problem, index: int, seed: int,
              prompt_suffix: str = "", plain_budget: int = 2) -> dict:
  return {
      "id": f"{DATASET}/{seed}/{index}",
      "prompt": problem.prompt() + prompt_suffix,
      "answer": str(problem.answer()),
      "difficulty": float(problem.level),
      "tags": [f"level{problem.level}"],
      DATASET: {"table": [list(p) for p in problem.table],
                "steps": problem.steps, "target": problem.target,
                "level": problem.level, "plain_budget": plain_budget},
  }


def make_records(size: int, seed: int = 0,
                 levels: Sequence[int] = tuple(LEVELS),
                 prompt_suffix: str = "", plain_budget: int = 2
                 ) -> list[dict]:
  """The first `size` items of the seeded stream of distinct problems;
  item i has level levels[i % len(levels)], so every slice of the stream
  holds the levels in equal shares (within one)."""
  levels = check_levels(levels)
  if plain_budget < 0:
    raise ValueError(f"reflect plain_budget must be >= 0, got "
                     f"{plain_budget}")
  rng = np.random.default_rng([seed, 23])
  seen: set[str] = set()
  out, repeats = [], 0
  while len(out) < size:
    level = levels[len(out) % len(levels)]
    problem = draw_problem(rng, level)
    if problem.prompt() in seen:
      repeats += 1
      if repeats > _MAX_REPEATS:
        raise ValueError(f"reflect: level {level} has no new problem after "
                         f"{len(out)} items; ask for fewer")
      continue
    repeats = 0
    seen.add(problem.prompt())
    out.append(to_record(problem, len(out), seed, prompt_suffix,
                         plain_budget))
  return out


# ---- worked solutions -------------------------------------------------------


def bare_answer(problem: Problem) -> str:
  """`=x`: the shortest response, right only by luck for a model that
  cannot invert the table in one pass."""
  return f"{ANSWER}{problem.answer()}"


def minimal_length(record: Mapping[str, Any]) -> int:
  """Tokens of the shortest correct response, eos included: the bare
  answer (one token per character under the pipeline's text tokenizer)
  and eos. The shortest *verified* one is the search that stops at `+`."""
  return len(bare_answer(problem_of(record))) + 1


def search(problem: Problem, budget: int) -> str:
  """Candidates in table order until `+` or `budget` attempts, then the
  answer (the right one: after a failed short search, a bare answer)."""
  parts = []
  for x in problem.candidates()[:budget]:
    parts.append(attempt(problem, x))
    if parts[-1].endswith(YES):
      break
  return " ".join(parts + [bare_answer(problem)])


def full_search(problem: Problem) -> str:
  """The search that stops at `+`: the shortest checked response that is
  always right."""
  return search(problem, len(problem.table))


def worked_solution(record: Mapping[str, Any], style: str,
                    rng: np.random.Generator) -> str:
  """A vanilla-SFT response in `style` (see STYLES); "plain" draws its
  budget uniformly from 1..plain_budget (0: a bare answer)."""
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")
  problem = problem_of(record)
  if style == "direct":
    return bare_answer(problem)
  if style == "cued":
    return full_search(problem)
  most = int(record[DATASET]["plain_budget"])
  return search(problem, int(rng.integers(1, most + 1)) if most else 0)
