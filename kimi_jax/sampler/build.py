"""The engine and sampler of a model, as every caller builds them.

The sampler section (`SamplerConfig`) holds the engine's shape (slots,
cache, prefill buckets), the repeat detector and the decode steps per call;
a judge with its own cache passes a section of its own.
"""

from __future__ import annotations

import dataclasses

from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine
from kimi_jax.sharding import Sharder


def make_engine(model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                sharder: Sharder | None = None, *,
                record_experts: bool = False) -> Engine:
  """The engine of `model_cfg` at `sampler_cfg`'s slots and cache, on
  `sharder`'s mesh (None: one device); `record_experts` for routing
  replay (rl.routing_replay)."""
  return Engine(model_cfg, dataclasses.replace(
      sampler_cfg.engine, record_experts=record_experts), sharder=sharder)


def make_sampler(model_cfg: ModelConfig, sampler_cfg: SamplerConfig,
                 sharder: Sharder | None = None, *,
                 record_experts: bool = False) -> Sampler:
  """A sampler on a new `make_engine` (its `.engine`), with the section's
  repeat detector and decode steps per call."""
  return Sampler(make_engine(model_cfg, sampler_cfg, sharder,
                             record_experts=record_experts),
                 repeat=sampler_cfg.repeat,
                 steps_per_call=sampler_cfg.steps_per_call)
