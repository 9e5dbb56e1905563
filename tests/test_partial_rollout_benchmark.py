"""benchmarks/partial_rollout.py: the long-tail workload's lengths, its
defaults, and a tiny run end to end whose JSON adds up."""

import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark():
  name = "benchmarks_partial_rollout"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", "partial_rollout.py"))
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up while being defined.
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def test_long_tail_lengths_are_a_log_normal_cut_at_the_maximum():
  pr = load_benchmark()
  cfg = pr.LongTailConfig(vocab_size=512, group_size=8, median_len=16,
                          sigma=1.5, max_len=240)
  x = np.array([n for i in range(4096)
                for n in pr.long_tail_lengths_K(cfg, i)])
  assert x.min() >= 1 and x.max() == 240
  assert 15 <= np.median(x) <= 17
  # P(log-normal > 240) = P(z > ln(240 / 16) / 1.5), about 3.6%.
  at_cap = 0.5 * math.erfc(math.log(240 / 16) / 1.5 / math.sqrt(2))
  assert abs(np.mean(x == 240) - at_cap) < 0.006
  assert pr.long_tail_lengths_K(cfg, 7) == pr.long_tail_lengths_K(cfg, 7)


def test_each_workload_fills_in_its_own_defaults():
  pr = load_benchmark()
  default = pr.parse_args([])
  assert (default.model, default.slots, default.group_size,
          default.median_len, default.prompt_len, default.iterations,
          default.step_costs) == ("tiny", 64, 4, 16, 8, 20, False)
  tail = pr.parse_args(["--workload", "long_tail", "--slots", "32"])
  assert (tail.model, tail.slots, tail.group_size, tail.max_len,
          tail.sigma, tail.step_costs) == ("qwen_shaped", 32, 8, 240, 1.5,
                                           True)


@pytest.mark.slow
def test_a_tiny_long_tail_run_reports_figures_that_add_up(tmp_path):
  pr = load_benchmark()
  out = tmp_path / "long_tail.json"
  pr.main(["--workload", "long_tail", "--model", "tiny", "--slots", "8",
           "--group-size", "4", "--median-len", "4", "--max-len", "28",
           "--prompt-len", "4", "--iterations", "2", "--no-pack",
           "--minibatch-prompts", "2", "--json", str(out)])
  r = json.loads(out.read_text())
  assert r["workload"] == "long_tail"
  assert r["settings"]["budget"] == (4 + 28) // 4
  assert r["recompiles_during_timed_run"] == 0
  steps = r["decode_step_ms"]
  assert set(steps["by_engine_slots"]) == set(steps["by_busy_slots"]) == {
      "8"}
  assert steps["by_engine_slots"]["8"] > 0
  modes = [m for m in pr.MODES if m in r]
  assert modes == ["full", "partial", "partial_no_queue", "partial_keep_kv"]
  K = r["settings"]["group_size"]
  for name in modes:
    row, its = r[name], r[name]["per_iteration"]
    assert row["iterations"] == len(its) == 2
    for key in ("trained_tokens", "groups_trained", "decode_steps",
                "generate_calls", "prefill_tokens",
                "continued_prefill_tokens", "requests",
                "continued_requests"):
      assert row[key] == sum(it[key] for it in its), (name, key)
    assert row["wall_s"] == pytest.approx(sum(it["iteration_s"]
                                              for it in its))
    assert row["trained_tokens_per_s"] == pytest.approx(
        row["trained_tokens"] / row["wall_s"])
    assert row["groups_trained"] * K <= row["trained_tokens"] <= (
        row["groups_trained"] * K * 28)
    assert row["continued_prefill_tokens"] <= row["prefill_tokens"]
    assert 0 < row["slot_utilisation"] <= 1
    assert row["budget_exhausted"] == 0
    b = row["breakdown"]
    assert b["decode_steps"] == pytest.approx(row["decode_steps"] / 2)
    assert b["decode_s"] == pytest.approx(
        sum(it["engine_decode_s"] for it in its) / 2)
    # The engine's calls happen inside the rollout phase.
    assert 0 < b["decode_s"] and 0 < b["prefill_s"]
    assert b["decode_s"] + b["prefill_s"] + b["insert_s"] <= b["rollout_s"]
    assert b["continued_prefill_s"] <= b["prefill_s"]
  # Full rollouts run every response to its end in one iteration; partial
  # ones continue some, prefilling prompt and earlier segments again.
  assert r["full"]["continued_requests"] == 0
  assert r["full"]["continued_prefill_tokens"] == 0
  assert r["partial"]["continued_requests"] > 0
  assert r["partial"]["continued_prefill_tokens"] >= (
      r["partial"]["continued_requests"] * (4 + 1))
  # Keeping the cut responses' caches, they continue with no prefill: the
  # same windows (the same cuts), so the same requests continue, in place.
  keep = r["partial_keep_kv"]
  assert keep["resumed_in_slot"] > 0
  assert keep["continued_requests"] == keep["continued_prefill_tokens"] == 0
  assert sum(it["resumed_in_slot"] for it in keep["per_iteration"]) == (
      keep["resumed_in_slot"])
  assert r["partial"]["resumed_in_slot"] == 0
  # The gap is measured on the trained tokens of every mode.
  for name in modes:
    assert r[name]["logprob_gap_tokens"] > 0
    assert 0 <= r[name]["logprob_gap_abs"] < 10
  assert keep["vs_full"]["groups_per_s"] == pytest.approx(
      keep["groups_per_s"] / r["full"]["groups_per_s"])
  assert r["partial"]["vs_full"]["rollout_phase"] == pytest.approx(
      r["partial_vs_full_rollout_phase_speedup"])
  assert r["partial_keep_kv_vs_full_speedup"] == pytest.approx(
      keep["trained_tokens_per_s"] / r["full"]["trained_tokens_per_s"])
  assert r["partial_vs_full_speedup"] == pytest.approx(
      r["partial"]["trained_tokens_per_s"]
      / r["full"]["trained_tokens_per_s"])
  assert r["partial_vs_full_groups_per_s_speedup"] == pytest.approx(
      r["partial"]["groups_per_s"] / r["full"]["groups_per_s"])
