"""Launchers print their own output only: no Orbax or JAX INFO lines unless
--verbosity asks for them, and no libtpu start-up errors on a machine
without a TPU (JAX_PLATFORMS unset, as a user runs them)."""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from kimi_jax.infra import quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
# Launchers that never load JAX: nothing for them to quiet.
JAX_FREE = {"sandbox_run.py", "sandbox_server.py", "testgen.py"}
# An absl/glog line: "I1126 16:24:38.748 12345 checkpoint_manager.py:701] ..."
LIBRARY_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\]")
TPU_NOISE = ("libtpu", "TPU_WORKER", "TPU_ACCELERATOR_TYPE", "InitGoogle")

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="without libtpu JAX never starts a TPU client")


@needs_libtpu
def test_a_bare_host_pins_the_cpu(tmp_path):
  assert quiet.platforms_to_pin({}, str(tmp_path)) == "cpu"
  # Importing JAX and libtpu sets these on any host: no sign of a TPU.
  environ = {"TPU_SKIP_MDS_QUERY": "1",
             "TPU_LIBRARY_PATH": "/site-packages/libtpu/libtpu.so"}
  assert quiet.platforms_to_pin(environ, str(tmp_path)) == "cpu"


@needs_libtpu
@pytest.mark.parametrize("device", ["dev/accel0", "dev/vfio/0",
                                    "dev/nvidiactl", "dev/kfd"])
def test_a_tpu_or_gpu_keeps_jaxs_choice(tmp_path, device):
  (tmp_path / device).parent.mkdir(parents=True, exist_ok=True)
  (tmp_path / device).write_text("")
  assert quiet.platforms_to_pin({}, str(tmp_path)) is None


@pytest.mark.parametrize("environ", [
    {"JAX_PLATFORMS": ""}, {"JAX_PLATFORMS": "tpu"},
    {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"},
    {"TPU_ACCELERATOR_TYPE": "v5p-8"}, {"JAX_FORCE_TPU_INIT": "1"}])
def test_the_users_settings_keep_jaxs_choice(tmp_path, environ):
  assert quiet.platforms_to_pin(environ, str(tmp_path)) is None


def _main(path: str) -> ast.FunctionDef:
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  return next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "main")


def _calls_quiet_start(stmt: ast.stmt) -> bool:
  return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
          and ast.unparse(stmt.value.func) == "quiet.start")


@pytest.mark.parametrize("name", sorted(
    os.path.basename(p) for p in glob.glob(os.path.join(LAUNCH, "*.py"))))
def test_every_jax_launcher_starts_quiet(name):
  """quiet.start() comes before the launcher's first import of a kimi_jax
  module that may start JAX; the JAX-free ones really never load it."""
  path = os.path.join(LAUNCH, name)
  if name in JAX_FREE:
    code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='x'); "
            "assert 'jax' not in sys.modules, 'loads jax'")
    subprocess.run([sys.executable, "-c", code, path], check=True,
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    return
  for stmt in _main(path).body:
    if _calls_quiet_start(stmt):
      return
    loads_kimi_jax = any(
        isinstance(n, (ast.Import, ast.ImportFrom)) and "kimi_jax" in (
            ast.unparse(n).replace("kimi_jax.infra import quiet", ""))
        for n in ast.walk(stmt))
    assert not loads_kimi_jax, f"{name}: imports kimi_jax before quiet.start"
  raise AssertionError(f"{name}: main never calls quiet.start()")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A run's workdir with the micro config and a checkpoint of its seeded
  init: what launch/sample.py and launch/export_hf.py read."""
  from kimi_jax.infra.checkpoint import Checkpointer
  from kimi_jax.infra.config import load_config
  from kimi_jax.job.experiment import parse_config
  from kimi_jax.model import transformer
  from kimi_jax.sharding import Sharder, make_mesh
  path = tmp_path_factory.mktemp("run")
  config = load_config(os.path.join(ROOT, "experiments", "tiny.py:micro"))
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  cfg = parse_config(config)
  params = transformer.init_sharded(
      cfg.model, cfg.seed, Sharder(make_mesh(cfg.mesh), cfg.rules))
  checkpointer = Checkpointer(str(path / "checkpoints"))
  checkpointer.save(1, params=params, host={"stage": "rl"})
  checkpointer.close()
  return str(path)


def _launch(*args: str) -> subprocess.CompletedProcess:
  """A launcher as a user runs it: JAX_PLATFORMS unset."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["PYTHONPATH"] = ROOT
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def _noise(stderr: str) -> list[str]:
  return [l for l in stderr.splitlines()
          if LIBRARY_LOG.match(l) or any(t in l for t in TPU_NOISE)]


@pytest.mark.slow
def test_sample_prints_only_its_completions(workdir):
  out = _launch("launch/sample.py", "--workdir", workdir, "--prompt",
                "37 c5 =", "--num_samples", "2", "--max_new_tokens", "4")
  assert out.returncode == 0, out.stderr
  assert _noise(out.stderr) == [], out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 2, out.stdout
  assert all(l.startswith("[prompt 0 sample ") for l in lines), out.stdout


@pytest.mark.slow
def test_verbosity_brings_the_library_logs_back(workdir, tmp_path):
  quiet_run = _launch("launch/export_hf.py", "--workdir", workdir,
                      "--out", str(tmp_path / "a"))
  assert quiet_run.returncode == 0, quiet_run.stderr
  assert _noise(quiet_run.stderr) == [], quiet_run.stderr
  assert quiet_run.stdout.startswith("exported step 1 of ")
  verbose = _launch("launch/export_hf.py", "--workdir", workdir,
                    "--out", str(tmp_path / "b"), "--verbosity", "0")
  assert verbose.returncode == 0, verbose.stderr
  assert "checkpoint_manager.py" in verbose.stderr, verbose.stderr
