"""benchmarks/sampler_profile.py: op_name classes, the figures of a
hand-made trace, and a real traced run of a tiny model read back."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler_profile  # noqa: E402
from sampler_workloads import NEW_TOKENS  # noqa: E402

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(
    os, "sched_getaffinity") else []


@pytest.mark.parametrize("op_name, cls", [
    ("jit(_generate_fn)/while/body/btd,df->btf/dot_general",
     "weight matmuls"),
    ("jit(_generate_fn)/shard_map/while/body/btd,vd->btv/dot_general",
     "weight matmuls"),
    ("jit(_generate_fn)/while/body/dot_general", "attention products"),
    ("jit(_generate_fn)/while/body/scatter", "cache writes"),
    ("jit(_generate_fn)/while/body/reduce_max", "reductions"),
    ("jit(_generate_fn)/while/body/jit(log_softmax)/reduce_sum",
     "reductions"),
    ("jit(_generate_fn)/while/body/reduce", "reductions"),
    ("jit(_generate_fn)/slice", "view copies"),
    ("jit(_generate_fn)/scatter", "view copies"),
    ("jit(_generate_fn)/while/body/concatenate", "other"),
    ("jit(_generate_fn)/while/body/slice", "other"),
])
def test_classes_of_op_names(op_name, cls):
  assert sampler_profile.classify(op_name) == cls


HLO = """
ENTRY %main {
  %wrapped_slice = f32[4,2,16,64]{3,2,1,0} fusion(%p), kind=kLoop, metadata={op_name="jit(_generate_fn)/slice" stack_frame_id=3}
  ROOT %ynn_fusion.3 = f32[4,512]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(_generate_fn)/while/body/btd,vd->btv/dot_general" stack_frame_id=143}
}
"""


def test_op_names_and_a_name_that_differs_between_programs():
  names = sampler_profile.op_names(HLO)
  assert names == {
      "wrapped_slice": "jit(_generate_fn)/slice",
      "ynn_fusion.3": "jit(_generate_fn)/while/body/btd,vd->btv/dot_general"}
  other = {"ynn_fusion.3": "jit(_generate_fn)/while/body/dot_general"}
  classes = sampler_profile.op_classes([names, other])
  assert classes == {"wrapped_slice": "view copies", "ynn_fusion.3": "other"}


def test_the_figures_of_a_hand_made_trace():
  classes = {"dot.1": "weight matmuls", "dot.2": "attention products"}
  events = [
      dict(tid=1, ts=0.0, dur=100.0, op="dot.1"),
      dict(tid=2, ts=50.0, dur=100.0, op="dot.2"),   # 50 us beside dot.1
      dict(tid=1, ts=300.0, dur=20.0, op="copy.7"),  # unmapped: other
      dict(tid=1, ts=0.0, dur=500.0, op="while.3"),  # left out
  ]
  out = sampler_profile.profile_figures(events, classes, steps=2)
  per = out["thread_ms_per_step"]
  assert per["weight matmuls"] == pytest.approx(0.05)  # 100 us / 2 steps
  assert per["attention products"] == pytest.approx(0.05)
  assert per["other"] == pytest.approx(0.01)
  assert per["cache writes"] == 0.0
  assert out["thread_ms_per_step_total"] == pytest.approx(0.11)
  assert out["busy_ms_per_step"] == pytest.approx(0.085)  # 150 + 20 us
  assert out["parallelism"] == pytest.approx(220 / 170)
  assert out["threads"] == 2


@pytest.mark.skipif(not ALLOWED, reason="needs os.sched_getaffinity")
def test_a_traced_tiny_run_is_read_back_whole():
  report = sampler_profile.profile_one({ALLOWED[0]}, 4, 16, "fallback-tiny")
  assert report["cpus"] == ALLOWED[:1]
  assert report["decode_steps"] == NEW_TOKENS - 1
  per = report["thread_ms_per_step"]
  assert set(per) == set(sampler_profile.CLASSES)
  assert per["weight matmuls"] > 0 and per["attention products"] > 0
  assert per["cache writes"] > 0
  assert sum(per.values()) == pytest.approx(
      report["thread_ms_per_step_total"])
  # Busy time is a union of the same spans summed in another order: at
  # most the total, up to float rounding.
  assert report["busy_ms_per_step"] <= (
      report["thread_ms_per_step_total"] * (1 + 1e-12))
  assert report["programs"] >= 1
