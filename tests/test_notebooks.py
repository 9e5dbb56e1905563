"""The notebooks in notebooks/ run top to bottom (micro configs, injected
after each notebook's `parameters` cell, as papermill does), so a notebook
that breaks fails CI."""

from __future__ import annotations

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
# What CI changes: seconds-scale configs.
CI_PARAMETERS = 'VARIANT = "micro"\n'
CELL_TIMEOUT_S = 600


def test_the_notebooks_are_there():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"tiny_rl_run.ipynb", "sampler_and_rewards.ipynb"} <= names


def _with_ci_parameters(nb):
  import nbformat
  cells = nb.cells
  tagged = [i for i, c in enumerate(cells)
            if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(tagged) == 1, "a notebook needs exactly one 'parameters' cell"
  injected = nbformat.v4.new_code_cell(CI_PARAMETERS)
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells = cells[:tagged[0] + 1] + [injected] + cells[tagged[0] + 1:]
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS,
                         ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
  import nbformat
  from nbclient import NotebookClient
  nb = _with_ci_parameters(nbformat.read(path, as_version=4))
  # The kernel inherits the environment: the repository on the path (its
  # install cell then has nothing to do), one CPU device.
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep +
                     os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": os.path.dirname(
                              path)}})
  client.execute()  # raises CellExecutionError naming the failing cell
  out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                for o in c.get("outputs", []))
  assert "kimi_jax already importable" in out
  if "tiny_rl_run" in path:
    assert "final:" in out and "->" in out
    images = [o for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if "image/png" in o.get(
                  "data", {})]
    assert len(images) == 2  # the curves of the run, then of both runs
  else:
    assert "score 1.0" in out and "score 0.0" in out
    assert "right reference" in out and "wrong reference" in out
    assert "timeout" in out
