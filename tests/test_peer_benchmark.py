"""benchmarks/sampler_tunix.py's timing of Tunix's sampler, without Tunix:
a call that draws fewer tokens than the workload asks fails, a compile
inside a timed call fails, and the row reports the median call."""

import os
import sys
import types

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler_tunix  # noqa: E402
import timing  # noqa: E402
from sampler_workloads import NEW_TOKENS  # noqa: E402


def drawing(batch: int, per_request: int):
  return lambda: types.SimpleNamespace(
      tokens=[list(range(per_request))] * batch)


def test_a_short_draw_fails():
  assert sampler_tunix.timed(drawing(3, NEW_TOKENS), 3) >= 0
  with pytest.raises(AssertionError, match="drew 381 tokens, expected 384"):
    sampler_tunix.timed(drawing(3, NEW_TOKENS - 1), 3)


def test_a_compile_inside_a_timed_call_fails():
  def compiles():
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    return drawing(1, NEW_TOKENS)()
  with pytest.raises(timing.CompiledInTimedSection, match="tunix b1"):
    sampler_tunix.timed(compiles, 1)


def test_the_row_reports_the_median_call():
  row = sampler_tunix.row(2, [1.0, 4.0, 2.0], 3e-6)
  assert row["seconds"] == 2.0
  assert row["tokens_per_s"] == 2 * NEW_TOKENS / 2.0
  assert row["runs_s"] == [1.0, 4.0, 2.0] and row["logit_gap"] == 3e-6
