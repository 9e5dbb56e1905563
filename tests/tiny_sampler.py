"""A real Sampler over experiments/tiny.py:micro with seeded random
weights, for tests that need a model to answer (not a stand-in)."""

from __future__ import annotations

import os
from typing import Any

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_micro_sampler(params_seed: int) -> tuple[Any, Any, Any]:
  """(parsed config, Sampler, params placed for it)."""
  from kimi_jax.config import load_config
  from kimi_jax.experiment import parse_config
  from kimi_jax.model import transformer
  from kimi_jax.sampler.driver import Sampler
  from kimi_jax.sampler.engine import Engine
  from kimi_jax.sharding import Sharder, make_mesh
  cfg = parse_config(load_config(os.path.join(ROOT, "experiments",
                                              "tiny.py:micro")),
                     jax.device_count())
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  engine = Engine(cfg.model, cfg.sampler.engine, sharder=sharder)
  sampler = Sampler(engine, repeat=cfg.sampler.repeat,
                    steps_per_call=cfg.sampler.steps_per_call)
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
