"""Long2short over seeds (kimi_jax/long2short/seeds.py): means and sample
std per method, paired differences to each seed's long model with their
standard error, against hand-computed values."""

from __future__ import annotations

import json
import math
import os

import ml_collections
import pytest

from kimi_jax.long2short import seeds


def _result(long_p1, long_tok, rs_p1, rs_tok, val=True):
  def rec(p1, tok):
    r = {"pass_at_1": p1, "mean_tokens": tok, "greedy_accuracy": p1}
    if val:
      r["val"] = {"pass_at_1": p1 - 0.1, "mean_tokens": tok + 1.0}
    return r
  return {"methods": {"long": rec(long_p1, long_tok),
                      "shortest_rs": rec(rs_p1, rs_tok)},
          "shortest_solution_tokens": 3.0}


def test_aggregate_by_hand():
  # long: pass@1 0.5, 0.7, 0.9 (mean 0.7, sd 0.2); tokens 20, 24, 28.
  # shortest_rs: 0.4, 0.7, 0.7 -> differences -0.1, 0, -0.2: mean -0.1,
  # sd 0.1, s.e. 0.1 / sqrt(3); tokens 10, 12, 20 -> -10, -12, -8: mean
  # -10, sd 2, s.e. 2 / sqrt(3).
  agg = seeds.aggregate({0: _result(0.5, 20.0, 0.4, 10.0),
                         1: _result(0.7, 24.0, 0.7, 12.0),
                         2: _result(0.9, 28.0, 0.7, 20.0)})
  assert agg["seeds"] == [0, 1, 2]
  long = agg["methods"]["long"]["eval"]
  assert long["pass_at_1"]["mean"] == pytest.approx(0.7)
  assert long["pass_at_1"]["std"] == pytest.approx(0.2)
  assert "vs_long" not in long
  vs = agg["methods"]["shortest_rs"]["eval"]["vs_long"]
  assert vs["pass_at_1"]["mean"] == pytest.approx(-0.1)
  assert vs["pass_at_1"]["sem"] == pytest.approx(0.1 / math.sqrt(3))
  assert vs["mean_tokens"]["values"] == pytest.approx([-10.0, -12.0, -8.0])
  assert vs["mean_tokens"]["sem"] == pytest.approx(2 / math.sqrt(3))
  # Validation: every figure 0.1 lower / 1 token longer; same differences.
  val = agg["methods"]["shortest_rs"]["val"]
  assert val["pass_at_1"]["mean"] == pytest.approx(0.6 - 0.1)
  assert val["vs_long"]["pass_at_1"]["mean"] == pytest.approx(-0.1)
  rows = seeds.markdown(agg).splitlines()
  assert rows[2] == "| long | 0.700 ± 0.200 | 24.0 ± 4.0 |  |  |"
  assert rows[3] == ("| shortest_rs | 0.600 ± 0.173 | 14.0 ± 5.3 | "
                     "-0.100 ± 0.058 | -10.0 ± 1.2 |")
  assert seeds.mean_methods(agg)["shortest_rs"] == pytest.approx(
      {"pass_at_1": 0.6, "mean_tokens": 14.0})


def test_aggregate_rejects_mismatched_methods_and_skips_missing_splits():
  a, b = _result(0.5, 20.0, 0.4, 10.0), _result(0.7, 24.0, 0.7, 12.0)
  del b["methods"]["shortest_rs"]
  with pytest.raises(ValueError, match="seed 1"):
    seeds.aggregate({0: a, 1: b})
  # One seed without validation: only the held-out split is aggregated.
  c = _result(0.7, 24.0, 0.7, 12.0, val=False)
  assert list(seeds.aggregate({0: a, 1: c})["methods"]["long"]) == ["eval"]
  with pytest.raises(ValueError):
    seeds.aggregate({})


def test_run_gives_each_seed_its_own_workdir_and_writes_the_aggregate(
    tmp_path):
  calls = []
  figures = {3: (0.5, 20.0, 0.4, 10.0), 4: (0.7, 24.0, 0.7, 12.0)}

  def one_run(config, workdir):
    calls.append((config.seed, workdir))
    return _result(*figures[config.seed])

  config = ml_collections.ConfigDict({"seed": 3, "rl": {"iterations": 1}})
  agg = seeds.run(config, str(tmp_path), 2, run_fn=one_run)
  assert calls == [(3, str(tmp_path / "seed3")), (4, str(tmp_path / "seed4"))]
  assert config.seed == 3  # the caller's config is left as it was
  with open(tmp_path / seeds.RESULT_FILE) as f:
    assert json.load(f) == json.loads(json.dumps(agg))
  assert agg["seeds"] == [3, 4]
  with open(tmp_path / seeds.FIGURE_FILE, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # A seed whose comparison is written is read back, not run again.
  os.makedirs(tmp_path / "seed3", exist_ok=True)
  with open(tmp_path / "seed3" / "long2short.json", "w") as f:
    json.dump(_result(0.9, 10.0, 0.8, 5.0), f)
  calls.clear()
  again = seeds.run(config, str(tmp_path), 2, run_fn=one_run)
  assert calls == [(4, str(tmp_path / "seed4"))]
  assert again["methods"]["long"]["eval"]["pass_at_1"]["values"] == [0.9,
                                                                      0.7]
