"""Multi-host behaviour without a TPU: 2 processes x 2 CPU devices (gloo
collectives over 127.0.0.1) against 1 process x 4 devices, same seed."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "tiny.py") + ":micro"
# Values that depend on wall-clock time, not on the computation.
_TIMING = ("_s", "per_s")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cmd(workdir, iterations, extra=()):
  return [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"),
          "--config", CONFIG, "--workdir", str(workdir),
          f"--config.rl.iterations={iterations}", *extra]


def _env():
  # No inherited 8-device flag: each process sets its own device count.
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def run_processes(workdir, iterations, n_processes, devices_each,
                  timeout=500):
  """Runs the main job as n processes; kills all of them on any failure."""
  if n_processes == 1:
    cmds = [_cmd(workdir, iterations, ["--cpu_devices", str(devices_each)])]
  else:
    port = _free_port()
    cmds = [_cmd(workdir, iterations, [
        "--cpu_devices", str(devices_each),
        "--coordinator_address", f"127.0.0.1:{port}",
        "--num_processes", str(n_processes), "--process_id", str(i)])
            for i in range(n_processes)]
  procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True) for c in cmds]
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def _comparable(row):
  return {k: v for k, v in row.items() if isinstance(v, (int, float)) and
          not any(k.endswith(t) for t in _TIMING)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("mp")
  two, one = base / "two", base / "one"
  run_processes(two, 2, n_processes=2, devices_each=2)
  run_processes(one, 2, n_processes=1, devices_each=4)
  return two, one


@pytest.mark.slow
def test_two_processes_match_one_process(runs):
  two, one = runs
  rows_two, rows_one = _rows(two), _rows(one)
  assert [(r["stage"], r["step"]) for r in rows_two] == [
      (r["stage"], r["step"]) for r in rows_one]
  assert any(r["stage"] == "rl" and "loss" in r for r in rows_two)
  for a, b in zip(rows_two, rows_one):
    a, b = _comparable(a), _comparable(b)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5,
                                 err_msg=f"{k} at {a.get('step')}")
  # Only process 0 writes files.
  assert os.path.exists(two / "summary.json")


@pytest.mark.slow
def test_checkpoints_restore_across_process_counts(runs, tmp_path):
  two, one = runs
  # A 2-process checkpoint resumed by 1 process, and vice versa, each going
  # one iteration further.
  for src, n, dev in ((two, 1, 4), (one, 2, 2)):
    dst = tmp_path / f"from_{src.name}"
    shutil.copytree(src, dst)
    out = run_processes(dst, 3, n_processes=n, devices_each=dev)
    assert "resuming" in out[0]
    steps = [r["step"] for r in _rows(dst) if r["stage"] == "rl"]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_error_in_one_process_stops_all_with_its_message(tmp_path):
  port = _free_port()
  common = ["--cpu_devices", "2", "--coordinator_address",
            f"127.0.0.1:{port}", "--num_processes", "2",
            "--heartbeat_timeout_seconds", "10"]
  cmds = [_cmd(tmp_path, 2, common + ["--process_id", "0"]),
          # Only process 1 is told to import weights from a missing dir.
          _cmd(tmp_path, 2, common + ["--process_id", "1",
                                      "--config.init_from_hf=/nonexistent"])]
  procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True) for c in cmds]
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  assert all(p.returncode != 0 for p in procs), outs[0][-2000:]
  assert "process 1:" in outs[1] and "/nonexistent" in outs[1], outs[1][-2000:]


@pytest.mark.parametrize("environ,expected", [
    ({}, False),
    # An offline AOT compile (kimi_jax.infra.aot) and one-host slices name
    # one host.
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, False),
    ({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}, True),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"}, True),
])
def test_on_tpu_pod_only_for_several_hosts(environ, expected):
  from kimi_jax.infra.distributed import on_tpu_pod
  assert on_tpu_pod(environ) is expected
