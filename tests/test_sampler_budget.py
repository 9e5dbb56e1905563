"""benchmarks/sampler_budget.py: the budget figures against hand-computed
values, and the clocked run against the sampler's own count and output."""

import os
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler_budget  # noqa: E402
from sampler_measure import prepared  # noqa: E402
from sampler_workloads import FALLBACK_TINY, NEW_TOKENS  # noqa: E402

from kimi_jax.model import transformer  # noqa: E402

LOG = [dict(kind="prefill", seconds=0.1),
       dict(kind="generate", seconds=0.112, view=64, steps=16),
       dict(kind="generate", seconds=0.144, view=128, steps=16),
       dict(kind="generate", seconds=0.001, view=128, steps=0)]


def test_the_budget_of_a_run_by_hand():
  out = sampler_budget.budget(LOG, wall_s=0.4, tunix_s=0.6, target=2.0)
  assert out["prefill_s"] == pytest.approx(0.1)
  assert out["generate_s"] == pytest.approx(0.257)
  assert out["host_s"] == pytest.approx(0.4 - 0.1 - 0.257)
  assert out["decode_steps"] == 32
  assert out["step_ms_cheapest"] == pytest.approx(7.0)  # 0.112 s / 16
  assert out["step_ms_mean"] == pytest.approx(257 / 32)
  # 0.1 + 0.043 + 32 x 0.007
  assert out["best_case_s"] == pytest.approx(0.367)
  assert out["vs_tunix_clocked"] == pytest.approx(1.5)
  assert out["vs_tunix_best_case"] == pytest.approx(0.6 / 0.367)
  # (0.6 / 2 - 0.1 - 0.043) / 32 steps
  assert out["step_ms_for_target"] == pytest.approx(1e3 * 0.157 / 32)
  assert [c["view"] for c in out["calls"]] == [64, 128]  # no empty call
  assert "tunix_s" not in sampler_budget.budget(LOG, wall_s=0.4)


@pytest.mark.host_inputs  # the benchmark's requests are host arrays
def test_a_clocked_run_times_every_call_and_changes_nothing():
  cfg = FALLBACK_TINY
  params = jax.jit(lambda k: transformer.init_params(cfg, k))(
      jax.random.key(0))
  sampler, reqs, _ = prepared(cfg, params, 4, 16)
  plain, _ = sampler.generate(params, reqs)
  engine = sampler.engine
  with sampler_budget.clocked(engine) as log:
    clocked, stats = sampler.generate(params, reqs)
  assert clocked == plain
  kinds = [c["kind"] for c in log]
  assert kinds[0] == "prefill" and kinds.count("prefill") == 1
  calls = [c for c in log if c["kind"] == "generate"]
  # The prefill draws the first token, each decode step one more.
  assert sum(c["steps"] for c in calls) == stats.decode_steps == NEW_TOKENS - 1
  assert [c["view"] for c in calls] == sorted(c["view"] for c in calls)
  assert all(c["view"] in engine.engine_cfg.views for c in calls)
  assert all(c["seconds"] > 0 for c in log)
  # The engine's own methods are back.
  assert not {"prefill_batch", "traced_generate",
              "_view_for_call"} & set(vars(engine))
