"""benchmarks/sampler_cores.py: the figures against hand-computed values,
and a tiny run whose two children are pinned as asked and draw the same
tokens."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler_cores  # noqa: E402
from child import Child  # noqa: E402
from sampler_workloads import NEW_TOKENS  # noqa: E402

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(
    os, "sched_getaffinity") else []
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2,
                              reason="needs two CPUs this process may use")


def test_the_figures_by_hand():
  runs = {"kimi_jax": {"one": [2.0, 1.0, 3.0], "all": [1.0, 1.0, 0.5]},
          "tunix": {"one": [4.0, 4.0, 4.0], "all": [2.0, 5.0, 3.0]}}
  out = sampler_cores.cores_figures(runs, batch=4, n_cpus=2)
  tokens = 4 * NEW_TOKENS
  assert out["kimi_jax_tok_s_one"] == pytest.approx(tokens / 2.0)  # median
  assert out["kimi_jax_tok_s_all"] == pytest.approx(tokens / 1.0)
  assert out["kimi_jax_cores_gain"] == pytest.approx(2.0)
  assert out["tunix_cores_gain"] == pytest.approx(4.0 / 3.0)
  assert out["vs_tunix_one"] == pytest.approx(2.0)
  assert out["vs_tunix_all"] == pytest.approx(3.0)
  alone = sampler_cores.cores_figures({"kimi_jax": runs["kimi_jax"]}, 4, 2)
  assert "vs_tunix_one" not in alone


@two_cpus
def test_a_tiny_run_pins_each_child_and_both_draw_the_same_tokens():
  report = sampler_cores.cores_part(batch=4, steps=16, repeats=2,
                                    model="fallback-tiny", with_tunix=False)
  assert report["cpus_of"] == {"one": ALLOWED[:1], "all": ALLOWED}
  runs = report["runs_s"]["kimi_jax"]
  assert len(runs["one"]) == len(runs["all"]) == 2
  assert report["same_results"]
  assert report["kimi_jax_cores_gain"] == pytest.approx(
      report["kimi_jax_tok_s_all"] / report["kimi_jax_tok_s_one"])
  assert "tunix" not in report["runs_s"]


@two_cpus
def test_a_child_that_fails_to_start_is_reported():
  child = Child({ALLOWED[0]},
                "sampler_cores.serve(4, 16, 'no-such-model', False)")
  with pytest.raises(RuntimeError, match="ended .exit code 1"):
    child.read()
  child.close()
