"""Math reward: answer extraction, math-verify equivalence, process timeouts."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.math import MathReward, extract_answer, extract_boxed

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def reward():
  with MathReward(timeout_s=TIMEOUT_S, num_workers=2) as r:
    yield r


# -- extraction ---------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"first \boxed{3}, wait, actually \boxed{4}", "4"),
    (r"\boxed{\{1, 2\}} done", r"\{1, 2\}"),
    (r"\boxed{a^{2}-\left\{x\right\}}", r"a^{2}-\left\{x\right\}"),
    (r"\fbox{7}", "7"),
    (r"the value is \boxed 5 here", "5"),
    ("work...\nAnswer: $x = 3$.", "x = 3"),
    ("work...\n**Final Answer:** 42\n", "42"),
    ("Answer: 1\nmore thinking\nanswer: 2", "2"),
    (r"\boxed{12} then an unclosed \boxed{13", "12"),
    ("no final answer here", None),
])
def test_extract_answer(response, expected):
  assert extract_answer(response) == expected


def test_extract_boxed_is_linear_on_long_unbalanced_input():
  text = r"\boxed{" + "{" * 200_000
  start = time.monotonic()
  assert extract_boxed(text) is None
  assert time.monotonic() - start < 2.0


# -- equivalence table (what math-verify 0.9 actually decides) ----------------

EQUIVALENT = [
    ("a^2-4", "(a+2)(a-2)"),  # the report's own example
    ("x^2+2x+1", "(x+1)^2"),
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"\frac12"),
    (r"\frac{1}{2}", "1/2"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"\frac{1}{3}", "0.3333333"),  # within 6-digit float rounding
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    ("[1,3)", "[1, 3)"),
    (r"(-\infty, 0) \cup (1, \infty)", r"(-\infty,0)\cup(1,\infty)"),
    (r"\{1,2,3\}", r"\{3,2,1\}"),
    ("5", r"5\text{ cm}"),  # units are stripped
    ("5", r"5 \mathrm{m}"),
    (r"10\%", "0.1"),
    ("1000", "1,000"),
    ("90^\\circ", "90"),
    ("x=2", "2"),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
]

NOT_EQUIVALENT = [
    ("a^2-4", "(a+2)(a+2)"),
    ("x^2+2x+1", "(x-1)^2"),
    ("0.5", r"\frac{1}{3}"),
    (r"\frac{1}{3}", "0.333"),  # too coarse
    ("3", "-3"),
    (r"\pi", "3.14"),
    ("[1,3)", "[1,3]"),  # closedness matters
    ("(1,3)", "[1,3]"),
    (r"(-\infty, 0) \cup (1, \infty)", r"(-\infty,1)"),
    (r"\{1,2\}", r"\{1,3\}"),
    ("5", r"6\text{ cm}"),
    (r"10\%", "0.2"),
    (r"\frac{\pi}{2}", "90^\\circ"),
]

FORMATS = [r"Thus the answer is $\boxed{{{}}}$.", "We get...\nAnswer: ${}$",
           r"\boxed{{{}}}"]


def _cases(pairs):
  return [({"id": f"p{i}", "prompt": "", "answer": gold},
           FORMATS[i % len(FORMATS)].format(pred))
          for i, (gold, pred) in enumerate(pairs)]


def test_equivalence_table(reward):
  cases = _cases(EQUIVALENT) + _cases(NOT_EQUIVALENT)
  results = score_all(reward, [c[0] for c in cases], [c[1] for c in cases])
  expected = [True] * len(EQUIVALENT) + [False] * len(NOT_EQUIVALENT)
  wrong = [(rec["answer"], resp, res) for (rec, resp), res, want
           in zip(cases, results, expected) if res.correct != want]
  assert not wrong, wrong
  for res, want in zip(results, expected):
    assert res.score == (1.0 if want else 0.0)
    assert res.error is None  # every answer was found and compared


def test_missing_answer_and_bad_record(reward):
  results = score_all(reward, [{"id": "a", "prompt": "", "answer": "1"},
                               {"id": "b", "prompt": ""}],
                      ["I am not sure.", r"\boxed{1}"])
  assert [r.correct for r in results] == [False, False]
  assert results[0].error == "no answer found"
  assert "answer" in results[1].error


def test_numeric_reference_answer(reward):
  res = reward({"id": "n", "prompt": "", "answer": 12}, r"\boxed{12}")
  assert res.correct and res.score == 1.0


# -- pathological answers -----------------------------------------------------

PATHOLOGICAL = [
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{1000000!}",
    r"\boxed{" + "(" * 450 + "1" + ")" * 450 + "}",
    r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    r"\boxed{" + "7" * (1 << 20) + "}",  # a megabyte of digits
    "Answer: " + "1" * (3 << 20),
    "[" * 200_000,
]


def test_pathological_answers_return_incorrect_within_timeout(reward):
  records = [{"id": f"x{i}", "prompt": "", "answer": "5"}
             for i in range(len(PATHOLOGICAL))]
  start = time.monotonic()
  results = reward.batch(records, PATHOLOGICAL)
  elapsed = time.monotonic() - start
  assert [r.correct for r in results] == [False] * len(PATHOLOGICAL)
  assert all(r.error for r in results), results
  # The power towers never finish: they must have been cut by the pool.
  assert results[0].error == "timeout" and results[1].error == "timeout"
  # 2 workers, each timeout costs TIMEOUT_S plus a worker restart (~3 s on
  # 2 busy cores); a hang would blow far past this.
  assert elapsed < 60, elapsed
  # The replaced workers still check normally afterwards.
  ok = reward({"id": "ok", "prompt": "", "answer": "a^2-4"},
              r"\boxed{(a+2)(a-2)}")
  assert ok.correct, ok


def test_single_timeout_is_bounded(reward):
  start = time.monotonic()
  res = reward({"id": "t", "prompt": "", "answer": "1"},
               r"\boxed{2^{2^{2^{2^{2^{2}}}}}}")
  assert (res.correct, res.error) == (False, "timeout")
  # Deadline plus at most one worker restart.
  assert time.monotonic() - start < TIMEOUT_S + 15


# -- threads ------------------------------------------------------------------

def test_math_verify_alone_breaks_in_threads():
  """Why the pool exists: math-verify's signal-based timeout needs the main
  thread."""
  from math_verify import parse
  errors = []

  def work():
    try:
      parse("$1$")
    except ValueError as exc:
      errors.append(exc)

  t = threading.Thread(target=work)
  t.start()
  t.join()
  assert errors and "thread" in str(errors[0])


def test_reward_works_from_worker_threads(reward):
  pairs = [("a^2-4", r"\boxed{(a+2)(a-2)}", True),
           (r"\frac12", "Answer: 0.5", True),
           ("3", r"\boxed{4}", False),
           ("[1,3)", r"\boxed{[1,3)}", True)] * 2
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    futures = [pool.submit(reward, {"id": str(i), "prompt": "", "answer": g}, r)
               for i, (g, r, _) in enumerate(pairs)]
    results = [f.result(timeout=120) for f in futures]
  assert [r.correct for r in results] == [want for _, _, want in pairs]
  assert all(r.error is None for r in results)
