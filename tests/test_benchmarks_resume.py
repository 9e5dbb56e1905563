"""A benchmark evaluation killed midway resumes from its journal: the
chunks of problems it had sampled and scored are taken from there, not
sampled again, and the result equals an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def complete_lines(path) -> int:
  """Journal entries written whole (a kill may leave a torn last line)."""
  if not os.path.exists(path):
    return 0
  n = 0
  with open(path) as f:
    for line in f:
      try:
        json.loads(line)
        n += line.endswith("\n")
      except ValueError:
        pass
  return n


@pytest.mark.slow  # three evaluations of a tiny checkpoint
def test_a_killed_evaluation_resumes_from_its_journal(tmp_path):
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  n_problems = 150
  math500 = tmp_path / "math500.jsonl"
  math500.write_text("".join(json.dumps(dict(
      problem=f"What is {a} + {b}?", solution="", answer=str(a + b),
      subject="Prealgebra", level=1, unique_id=f"test/{i}.json")) + "\n"
      for i, (a, b) in enumerate((i % 5, 2) for i in range(n_problems))))
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def command(out, *extra):
    return [sys.executable, "launch/evaluate.py", f"--hf={hf_dir}",
            f"--benchmark=math500={math500}", "--samples=2",
            "--max_response_len=16", "--chunk_problems=1", f"--out={out}",
            *extra]

  out = tmp_path / "out"
  journal = out / "journal.jsonl"
  proc = subprocess.Popen(command(out), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.monotonic() + 600
  while complete_lines(journal) < 3 and proc.poll() is None:
    assert time.monotonic() < deadline, "no journal entries in 600 s"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  _, stderr = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
  assert not (out / "benchmarks.json").exists()
  kept = complete_lines(journal)
  assert 3 <= kept < n_problems

  resumed = subprocess.run(command(out), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert (f"math500: {kept} chunk(s) of problems taken from the journal"
          in resumed.stderr), resumed.stderr[-3000:]
  report = json.loads((out / "benchmarks.json").read_text())["math500"]
  assert report["journal_chunks_reused"] == kept
  # Every chunk is in the journal now, once.
  assert complete_lines(journal) == n_problems

  fresh = tmp_path / "fresh"
  whole = subprocess.run(command(fresh, "--journal="), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
  assert whole.returncode == 0, whole.stderr[-3000:]
  assert not (fresh / "journal.jsonl").exists()
  assert ((out / "responses.jsonl").read_text() ==
          (fresh / "responses.jsonl").read_text())
  expected = json.loads((fresh / "benchmarks.json").read_text())["math500"]
  assert expected["journal_chunks_reused"] == 0
  assert report["pass_at_1"] == expected["pass_at_1"]
  assert 0.0 < report["pass_at_1"] < 1.0
