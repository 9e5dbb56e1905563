"""One job per workdir (kimi_jax/infra/workdir_lock.py): a second job stops at
once with the holder named, a killed holder frees the workdir, and a stage
nested in another on the same workdir goes on."""

import os
import signal
import subprocess
import sys

import pytest

from kimi_jax.infra import workdir_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLDER = """
import sys, time
from kimi_jax.infra import workdir_lock
with workdir_lock.held(sys.argv[1]):
  print("held", flush=True)
  time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
  """Another process holding tmp_path/w's lock; yields (workdir, process)."""
  workdir = str(tmp_path / "w")
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, workdir],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert proc.stdout.readline().strip() == "held"
    yield workdir, proc
  finally:
    proc.kill()
    proc.wait()


def test_a_second_job_is_refused_and_a_killed_holder_frees_it(holder):
  workdir, proc = holder
  with pytest.raises(workdir_lock.WorkdirBusyError,
                     match=rf"in use by another kimi_jax job \(pid "
                           rf"{proc.pid} on "):
    with workdir_lock.held(workdir):
      pytest.fail("entered a workdir another process holds")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  entered = []
  with workdir_lock.held(workdir):
    entered.append(True)
  assert entered == [True]


@pytest.mark.slow  # waits on another process
def test_wait_enters_once_the_holder_has_finished(tmp_path):
  workdir = tmp_path / "w"
  finisher = HOLDER.replace("time.sleep(600)", "time.sleep(1.0); open("
                            "sys.argv[1] + '/finished', 'w').close()")
  proc = subprocess.Popen([sys.executable, "-c", finisher, str(workdir)],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert proc.stdout.readline().strip() == "held"
    with workdir_lock.held(str(workdir), wait=True):
      assert (workdir / "finished").exists()
  finally:
    proc.kill()
    proc.wait()


def test_nested_stages_on_one_workdir_and_sibling_workdirs(tmp_path):
  order = []
  with workdir_lock.held(str(tmp_path / "w")):
    with workdir_lock.held(str(tmp_path / "w" / ".")):  # same directory
      order.append("nested")
    with workdir_lock.held(str(tmp_path / "w" / "rl")):
      order.append("sub")
    order.append("outer")
  assert order == ["nested", "sub", "outer"]
  # Released on the way out: another process may take it now.
  done = subprocess.run([sys.executable, "-c", HOLDER.replace(
      "time.sleep(600)", "pass"), str(tmp_path / "w")],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == "held", done.stderr


def test_exclusive_passes_arguments_through(tmp_path):
  @workdir_lock.exclusive
  def job(config, workdir, *, extra):
    assert os.path.exists(os.path.join(workdir, workdir_lock.LOCK_NAME))
    return config, extra

  assert job("c", str(tmp_path / "w"), extra=3) == ("c", 3)


def test_a_filesystem_without_locks_runs_unguarded(tmp_path, monkeypatch,
                                                  capsys):
  import errno
  import fcntl

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_locks)
  entered = []
  with workdir_lock.held(str(tmp_path / "w")):
    entered.append(True)
  assert entered == [True]
  assert "cannot lock" in capsys.readouterr().out


def test_object_store_workdirs_are_not_locked(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with workdir_lock.held("gs://bucket/run"):
    pass
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_launcher_stops_with_one_line_naming_the_holder(holder):
  workdir, proc = holder
  done = subprocess.run(
      [sys.executable, "launch/tpu_run.py", "--config",
       "experiments/tiny.py:micro", "--workdir", workdir],
      capture_output=True, text=True, cwd=ROOT, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode != 0
  last = done.stderr.strip().splitlines()[-1]
  # distributed.fail names the process that stopped.
  assert last.startswith(f"process 0: workdir error: {workdir} is in use by "
                         f"another kimi_jax job (pid {proc.pid} on "), (
                             done.stderr)
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))
