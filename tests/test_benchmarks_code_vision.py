"""LiveCodeBench, MBPP and MathVista (kimi_jax/evaluation): readers of
their published formats, written here in small files, and --responses
scoring of hand-written right and wrong responses (code in the real
sandbox) with the exact pass@1 each should get."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from kimi_jax.evaluation import benchmarks, code_benchmarks, mathvista
from kimi_jax.evaluation.benchmarks import BenchmarkError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def packed(cases) -> str:
  """Private cases as the published LiveCodeBench files hold them."""
  return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))
                          ).decode()


STDIN_CASES = [dict(input="5 7\n", output="12\n", testtype="stdin"),
               dict(input="-4 10\n", output="6\n", testtype="stdin")]
FUNCTIONAL_PRIVATE = [
    dict(input="[]\n5", output="[]", testtype="functional"),
    dict(input="[-1, 4]\n1", output="[0, 5]", testtype="functional")]
STARTER = ("class Solution:\n"
           "    def addAll(self, nums: List[int], k: int) -> List[int]:\n"
           "        ")
LIVECODEBENCH = [
    dict(question_title="Sum", question_id="abc001_a", platform="atcoder",
         contest_id="abc001", contest_date="2024-08-01T00:00:00",
         difficulty="easy", starter_code="",
         question_content="Read two integers A and B and print A+B.",
         public_test_cases=json.dumps(
             [dict(input="1 2\n", output="3\n", testtype="stdin")]),
         private_test_cases=packed(STDIN_CASES), metadata="{}"),
    dict(question_title="Add to all", question_id="3001",
         platform="leetcode", contest_id="weekly-1",
         contest_date="2024-08-02T00:00:00", difficulty="easy",
         starter_code=STARTER,
         question_content="Add k to every element of nums.",
         public_test_cases=json.dumps(
             [dict(input="[1, 2, 3]\n10", output="[11, 12, 13]",
                   testtype="functional")]),
         # Plain JSON private cases are read too.
         private_test_cases=json.dumps(FUNCTIONAL_PRIVATE),
         metadata=json.dumps({"func_name": "addAll"})),
]

MBPP = [
    # The original format (mbpp.jsonl).
    dict(task_id=1, text="Write a function that returns the square of x.",
         code="def square(x):\n    return x * x",
         test_list=["assert square(3) == 9", "assert square(-2) == 4",
                    "assert square(0) == 0"],
         test_setup_code="", challenge_test_list=[]),
    # The sanitized format: `prompt` and `test_imports`.
    dict(source_file="x.py", task_id=2,
         prompt="Write a function to find the hypotenuse of a right "
         "triangle with legs a and b.",
         code="import math\ndef hyp(a, b):\n    return math.sqrt(a*a + b*b)",
         test_imports=["import math"],
         test_list=["assert math.isclose(hyp(3, 4), 5.0)",
                    "assert math.isclose(hyp(5, 12), 13.0)"]),
]


def mathvista_rows():
  return [
      dict(pid="1", question="What is the angle at B?", image="images/1.png",
           choices=["30°", "45°", "60°"], answer="45°",
           question_type="multi_choice", answer_type="text", precision=None,
           unit=None, metadata={"source": "x"}),
      dict(pid="2", question="How many bars?", image="images/2.png",
           choices=None, answer="12", question_type="free_form",
           answer_type="integer", precision=None),
      dict(pid="3", question="What is the ratio?", image="images/3.png",
           choices=None, answer="2.5", question_type="free_form",
           answer_type="float", precision=1.0),
      dict(pid="4", question="Which two values?", image="images/4.png",
           choices=None, answer="[1, 2]", question_type="free_form",
           answer_type="list", precision=None),
  ]


@pytest.fixture
def files(tmp_path):
  (tmp_path / "images").mkdir()
  for n in range(1, 5):
    Image.fromarray(np.full((20 + n, 30, 3), 40 * n, np.uint8)).save(
        tmp_path / "images" / f"{n}.png")
  return dict(
      livecodebench=write_jsonl(tmp_path / "lcb.jsonl", LIVECODEBENCH),
      mbpp=write_jsonl(tmp_path / "mbpp.jsonl", MBPP),
      mathvista=write_jsonl(tmp_path / "mathvista.jsonl", mathvista_rows()))


def test_livecodebench_reader_decodes_private_cases(files):
  _, _, items = benchmarks.load(f"livecodebench={files['livecodebench']}")
  stdin, functional = items
  assert stdin["id"] == "abc001_a" and stdin["kind"] == "code"
  assert (stdin["n_public"], stdin["n_private"]) == (1, 2)
  assert stdin["tests"] == [dict(input="1 2\n", output="3\n"),
                            dict(input="5 7\n", output="12\n"),
                            dict(input="-4 10\n", output="6\n")]
  assert "standard input" in stdin["prompt"]
  assert stdin["prompt"].startswith("Read two integers")
  assert functional["entry_point"] == code_benchmarks.ENTRY
  assert "Solution().addAll(*args)" in functional["code_prefix"]
  assert "from typing import *" in functional["code_prefix"]
  assert STARTER.rstrip() in functional["prompt"]
  # The check holds all three cases, arguments parsed from JSON lines.
  ns: dict = {}
  exec(functional["test"], ns)  # noqa: S102 - our own generated code
  assert ns["CASES"] == [[[[1, 2, 3], 10], [11, 12, 13]], [[[], 5], []],
                         [[[-1, 4], 1], [0, 5]]]


def test_livecodebench_refuses_a_pickle_that_names_a_callable(tmp_path):
  evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()
  row = dict(LIVECODEBENCH[0], private_test_cases=evil)
  path = write_jsonl(tmp_path / "evil.jsonl", [row])
  with pytest.raises(BenchmarkError, match=r"evil\.jsonl: row 0: field "
                     r"'private_test_cases': neither JSON nor .*refusing"):
    code_benchmarks.read_livecodebench(path)


def test_code_readers_name_bad_fields(tmp_path):
  cases = [
      (dict(LIVECODEBENCH[1], metadata="{}"), "livecodebench",
       r"row 0: field 'metadata': functional tests need a func_name"),
      ({k: v for k, v in LIVECODEBENCH[0].items()
        if k != "question_content"}, "livecodebench",
       r"row 0: no field 'question_content'"),
      (dict(LIVECODEBENCH[1], private_test_cases=json.dumps(
          [dict(input="[1", output="[]", testtype="functional")])),
       "livecodebench", r"field 'private_test_cases': functional case 0: "
       r"input lines and output must be JSON"),
      (dict(LIVECODEBENCH[0], private_test_cases=json.dumps(
          [dict(input="1", output="1", testtype="functional")])),
       "livecodebench", "mixes stdin and functional"),
      ({k: v for k, v in MBPP[0].items() if k != "text"}, "mbpp",
       r"row 0: no field 'text'"),
      (dict(MBPP[0], test_list=["assert True"]), "mbpp",
       r"field 'test_list': calls no function that field 'code' defines"),
  ]
  for n, (row, name, message) in enumerate(cases):
    path = write_jsonl(tmp_path / f"bad{n}.jsonl", [row])
    with pytest.raises(BenchmarkError, match=message):
      benchmarks.load(f"{name}={path}")
  with pytest.raises(BenchmarkError, match="'livecodebench' needs its file"):
    benchmarks.load("livecodebench")


def test_mbpp_reader_both_formats(files):
  _, _, items = benchmarks.load(f"mbpp={files['mbpp']}")
  original, sanitized = items
  assert original["id"] == "1" and original["entry_point"] == "square"
  assert original["code_prefix"] == ""
  assert "assert square(-2) == 4" in original["prompt"]
  assert original["prompt"].startswith("Write a function that returns")
  assert sanitized["entry_point"] == "hyp"
  assert sanitized["code_prefix"] == "import math\n"
  assert code_benchmarks.mbpp_entry_point(
      "def helper(x):\n  return x\ndef f(y):\n  return helper(y)",
      ["assert set(f(1)) == {1}"]) == "f"


def test_mathvista_reader_and_rules(files, tmp_path):
  _, path, items = benchmarks.load(f"mathvista={files['mathvista']}")
  assert benchmarks.BENCHMARKS["mathvista"].vision
  first = items[0]
  assert first["kind"] == "mathvista"
  assert first["image"] == str(tmp_path / "images" / "1.png")
  assert first["prompt"].startswith("<image>\nWhat is the angle at B?\n")
  assert "(B) 45°" in first["prompt"]
  assert items[2]["precision"] == 1
  by_id = {i["id"]: i for i in items}
  cases = [("1", "B", True), ("1", "(B)", True), ("1", "b.", True),
           ("1", "45°", True), ("1", "(B) 45°", True), ("1", "A", False),
           ("1", "D", False), ("2", "12", True), ("2", "12 bars", True),
           ("2", "1,200", False), ("2", "12.5", False), ("2", "12.0", True),
           ("3", "2.54", True), ("3", "2.44", False), ("3", "2.5", True),
           ("4", "[1, 2]", True), ("4", "[1,2]", True), ("4", "[2, 1]", False),
           ("4", "1, 2", True), ("1", "\\text{B}", True)]
  for pid, answer, right in cases:
    assert mathvista.is_correct(by_id[pid], answer) == right, (pid, answer)
  # Pixels: a larger image is scaled down to the tower's size, aspect kept.
  big = dict(first, image=str(tmp_path / "big.png"))
  Image.fromarray(np.full((40, 80, 3), 255, np.uint8)).save(big["image"])
  px = mathvista.pixels(big, 16, 3)
  assert px.shape == (1, 16, 16, 3)
  assert np.allclose(px[0, :8], 1.0) and not np.allclose(px[0, 8:], 1.0)


def test_mathvista_reader_names_bad_fields(tmp_path):
  (tmp_path / "images").mkdir()
  Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(
      tmp_path / "images" / "1.png")
  good = mathvista_rows()[0]
  cases = [
      ({k: v for k, v in good.items() if k != "answer_type"},
       r"row 0: no field 'answer_type'"),
      (dict(good, image="images/none.png"), r"field 'image': no file"),
      (dict(good, answer="90°"), r"field 'answer': '90°' is not among"),
      (dict(good, question_type="yes_no"), r"field 'question_type'"),
      (dict(mathvista_rows()[2], image="images/1.png", precision=None),
       r"field 'precision': a float answer needs"),
  ]
  for n, (row, message) in enumerate(cases):
    path = write_jsonl(tmp_path / f"bad{n}.jsonl", [row])
    with pytest.raises(BenchmarkError, match=message):
      benchmarks.load(f"mathvista={path}")


def evaluate(*args, timeout=300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "launch/evaluate.py", *args],
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env=env)


def fenced(code: str) -> str:
  return f"Here is my solution.\n```python\n{code}\n```\nDone."


# (benchmark, id, response, right?): pass@1 per benchmark is checked
# against the rights below and against a hand-computed value.
RESPONSES = [
    # LiveCodeBench stdin: a real solution; one that prints the public
    # case's answer (right on the visible test, wrong on a hidden one).
    ("livecodebench", "abc001_a",
     fenced("a, b = map(int, input().split())\nprint(a + b)"), True),
    ("livecodebench", "abc001_a", fenced("print(3)"), False),
    # Functional: a tuple result counts as the list; a bare reply (no
    # fence) using the header's List; a hard-coded public answer.
    ("livecodebench", "3001", fenced(
        "class Solution:\n    def addAll(self, nums, k):\n"
        "        return tuple(x + k for x in nums)"), True),
    ("livecodebench", "3001",
     "class Solution:\n    def addAll(self, nums: List[int], k: int) -> "
     "List[int]:\n        return [x + k for x in nums]\n", True),
    ("livecodebench", "3001", fenced(
        "class Solution:\n    def addAll(self, nums, k):\n"
        "        return [11, 12, 13]"), False),
    # MBPP original: right, wrong on one assert, right with chatter.
    ("mbpp", 1, fenced("def square(x):\n    return x * x"), True),
    ("mbpp", 1, fenced("def square(x):\n    return x + x"), False),
    ("mbpp", 1, fenced("def square(x):\n    print('hi')\n    return x ** 2"),
     True),
    # MBPP sanitized: math comes from test_imports; a misnamed function.
    ("mbpp", "2", fenced("def hyp(a, b):\n    return math.hypot(a, b)"),
     True),
    ("mbpp", "2", fenced("def hyp(a, b):\n    return a + b"), False),
    ("mbpp", "2", fenced("def hypotenuse(a, b):\n    return (a*a+b*b)**.5"),
     False),
    # MathVista.
    ("mathvista", "1", "\\boxed{B}", True),
    ("mathvista", "1", "The answer is \\boxed{(B)}.", True),
    ("mathvista", "1", "\\boxed{45°}", True),
    ("mathvista", "1", "\\boxed{A}", False),
    ("mathvista", "1", "<think>\\boxed{B}</think> so \\boxed{C}", False),
    ("mathvista", "2", "\\boxed{12}", True),
    ("mathvista", "2", "\\boxed{12 \\text{ bars}}", True),
    ("mathvista", "2", "\\boxed{12.5}", False),
    ("mathvista", "3", "\\boxed{2.54}", True),
    ("mathvista", "3", "\\boxed{2.44}", False),
    ("mathvista", "4", "Answer: [1, 2]", True),
    ("mathvista", "4", "\\boxed{[2, 1]}", False),
]


@pytest.mark.slow  # the launcher and the sandbox
def test_responses_scored_with_exact_pass_at_1(files, tmp_path):
  lines = [dict(benchmark=b, id=i, response=r) for b, i, r, _ in RESPONSES]
  responses = write_jsonl(tmp_path / "responses.jsonl", lines)
  out = tmp_path / "out"
  proc = evaluate(*[f"--benchmark={n}={f}" for n, f in files.items()],
                  f"--responses={responses}", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())
  # Per problem: LCB 1/2 and 2/3; MBPP 2/3 and 1/3; MathVista 3/5, 2/3,
  # 1/2, 1/2.
  assert report["livecodebench"]["pass_at_1"] == pytest.approx(
      (1 / 2 + 2 / 3) / 2)
  assert report["mbpp"]["pass_at_1"] == pytest.approx((2 / 3 + 1 / 3) / 2)
  assert report["mathvista"]["pass_at_1"] == pytest.approx(
      (3 / 5 + 2 / 3 + 1 / 2 + 1 / 2) / 4)
  scored = [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]
  assert [r["correct"] for r in scored] == [right for *_, right in RESPONSES]
  hidden = scored[1]  # print(3): the public case passes, case 1 fails
  assert hidden["error"] is None and not hidden["correct"]
  assert "| mathvista | 4 |" in proc.stdout


@pytest.mark.slow  # loads a checkpoint
def test_a_text_model_cannot_run_mathvista(files, tmp_path):
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  proc = evaluate(f"--hf={hf_dir}", f"--benchmark=mathvista="
                  f"{files['mathvista']}", f"--out={tmp_path / 'out'}")
  assert proc.returncode != 0
  assert ("mathvista: its problems are images and need a vision model "
          "(model.vision)") in proc.stderr, proc.stderr[-2000:]
  assert "is a text model" in proc.stderr
