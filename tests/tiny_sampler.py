"""A real Sampler over experiments/tiny.py:micro with seeded random
weights, for tests that need a model to answer (not a stand-in)."""

from __future__ import annotations

import os
from typing import Any

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_micro_sampler(params_seed: int) -> tuple[Any, Any, Any]:
  """(parsed config, Sampler, params placed for it)."""
  from kimi_jax.infra.config import load_config
  from kimi_jax.job.experiment import parse_config
  from kimi_jax.model import transformer
  from kimi_jax.sampler.build import make_sampler
  from kimi_jax.sharding import Sharder, make_mesh
  cfg = parse_config(load_config(os.path.join(ROOT, "experiments",
                                              "tiny.py:micro")),
                     jax.device_count())
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  sampler = make_sampler(cfg.model, cfg.sampler, sharder)
  return cfg, sampler, transformer.init_sharded(cfg.model, params_seed,
                                                sharder)


class CountingSampler:
  """The real `sampler`, recording each generate call's request count in
  `calls` (to see which chunks a journaled run asks for)."""

  def __init__(self, sampler: Any):
    self.sampler = sampler
    self.engine = sampler.engine
    self.calls: list[int] = []

  def generate(self, params: Any, requests: Any):
    self.calls.append(len(requests))
    return self.sampler.generate(params, requests)
