"""benchmarks/sampler_measure.py's `logprob_gap`, the peer benchmark's
sampler-to-model gap: a float32 sampler's own log-probs read no gap, the
same log-probs shifted by a known amount read that amount (so the drawn
tokens and the model's log-probs line up), and a bfloat16-matmul sampler
reads a gap of bfloat16's size. And `--part matmul`'s figures against
their own definitions."""

import dataclasses
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler  # noqa: E402
from sampler_measure import logprob_gap, prepared  # noqa: E402
from sampler_workloads import FALLBACK_TINY  # noqa: E402

from kimi_jax.model import transformer  # noqa: E402

import jax  # noqa: E402


@pytest.fixture(scope="module")
def params():
  return jax.jit(lambda: transformer.init_params(
      FALLBACK_TINY, jax.random.key(0), std=0.2))()


def test_a_samplers_gap_by_construction(params):
  sampler, reqs, _ = prepared(FALLBACK_TINY, params, 4, 8)
  reqs = [dataclasses.replace(r, max_new_tokens=12) for r in reqs]
  results, _ = sampler.generate(params, reqs)
  own = logprob_gap(FALLBACK_TINY, params, reqs, results)
  assert own["tokens"] == 4 * 12
  assert own["logprob_gap_abs"] < 1e-5
  shift = 0.1  # the sampler's log-probs 0.1 below the model's: r = +0.1
  shifted = [dataclasses.replace(r, logprobs=tuple(x - shift
                                                   for x in r.logprobs))
             for r in results]
  got = logprob_gap(FALLBACK_TINY, params, reqs, shifted)
  assert got["logprob_gap_abs"] == pytest.approx(shift, abs=1e-5)
  assert got["logprob_gap_kl"] == pytest.approx(
      math.expm1(shift) - shift, rel=1e-3)


def test_bfloat16_matmuls_read_a_gap_of_their_rounding(params):
  low, reqs, _ = prepared(FALLBACK_TINY, params, 4, 8,
                          matmul_dtype="bfloat16")
  reqs = [dataclasses.replace(r, max_new_tokens=12) for r in reqs]
  results, _ = low.generate(params, reqs)
  gap = logprob_gap(FALLBACK_TINY, params, reqs, results)
  assert 1e-4 < gap["logprob_gap_abs"] < 5e-2


def test_the_matmul_part_reports_each_product_in_both_dtypes():
  shapes = ((8, 32, 16), (8, 16, 32))
  report = sampler.matmul_part(shapes, steps=4)
  assert [r["shape"] for r in report["rows"]] == ["8x32x16", "8x16x32"]
  for (m, k, n), row in zip(shapes, report["rows"]):
    for dtype in ("float32", "bfloat16"):
      ms = row[f"ms_{dtype}"]
      assert ms > 0 and report[f"product_ms_{row['shape']}_{dtype}"] == ms
      assert row[f"gflop_s_{dtype}"] == pytest.approx(2 * m * k * n / ms
                                                      / 1e6)
    assert row["bf16_speedup"] == pytest.approx(row["ms_float32"] /
                                                row["ms_bfloat16"])
