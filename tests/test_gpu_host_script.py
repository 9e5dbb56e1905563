"""benchmarks/gpu_host.sh: every benchmark of both lanes runs once with
its JSON under OUTDIR, each lane logs to its own file, and a benchmark that
would start past the deadline is skipped, not started."""

import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_host.sh")

# Stands in for python: records its arguments and writes the --json file;
# the environment check (-c) prints what jax would.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then echo "jax fake"; exit 0; fi
echo "$(basename "$1") ${JAX_PLATFORMS:-gpu} $*" >> "$CALLS"
while [ $# -gt 0 ]; do
  if [ "$1" = "--json" ]; then echo '{}' > "$2"; fi
  shift
done
"""


def _run(tmp_path, seconds):
  fake = tmp_path / "python"
  fake.write_text(FAKE_PYTHON)
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  out = tmp_path / "out"
  env = dict(os.environ, PYTHON=str(fake), CALLS=str(tmp_path / "calls"))
  env.pop("JAX_PLATFORMS", None)
  subprocess.run(["bash", SCRIPT, str(out), "box", str(seconds)], env=env,
                 check=True, capture_output=True, text=True)
  calls = ((tmp_path / "calls").read_text().splitlines()
           if (tmp_path / "calls").exists() else [])
  return out, calls


def test_both_lanes_run_every_benchmark_with_its_json(tmp_path):
  out, calls = _run(tmp_path, 100)
  ran = sorted(c.split()[0] + " " + c.split()[1] for c in calls)
  assert ran == ["partial_rollout.py gpu", "rl_iteration.py cpu",
                 "rl_iteration.py cpu", "sampler.py cpu", "sampler.py gpu"]
  cores = len(os.sched_getaffinity(0))  # what nproc counts
  half = cores - cores // 2
  want = {"partial_rollout_long_tail_box.json", "sampler_length_box.json",
          f"rl_iteration_box_cpu{half}.json",
          f"sampler_peer_box_cpu{half}.json",
          f"rl_iteration_layer_loop_box_cpu{half}.json",
          "gpu_lane_box.log", "cpu_lane_box.log"}
  assert set(os.listdir(out)) == want
  assert any("--part length" in c for c in calls)
  assert any("--baseline layer_loop" in c for c in calls)
  log = (out / "gpu_lane_box.log").read_text()
  assert "jax fake" in log and "[sampler_length_box] rc 0" in log


def test_past_the_deadline_nothing_starts(tmp_path):
  out, calls = _run(tmp_path, 0)
  assert calls == []
  assert "skipped" in (out / "cpu_lane_box.log").read_text()
  assert not [f for f in os.listdir(out) if f.endswith(".json")]
