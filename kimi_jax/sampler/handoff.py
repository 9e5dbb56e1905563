"""Moving the trainer's new params into the sampler, every RL iteration.

Three paths, cheapest first:
  shared:     trainer and sampler shard the params alike, so the sampler uses
              the very same arrays (no copy, no transfer).
  resharded:  same process, different shardings: `jax.device_put` to the
              sampler's shardings.
  checkpoint: separate processes or meshes: the trainer writes an Orbax
              checkpoint and the sampler restores it straight into its own
              shardings (each device reads only its shards).
Each path is timed (wall seconds until the arrays are ready).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

Params = Any


@dataclasses.dataclass(frozen=True)
class Handoff:
  """How params reached the sampler and how long it took."""

  kind: str  # "shared" | "resharded" | "checkpoint"
  seconds: float


def shardings_agree(params: Params, shardings: Params) -> bool:
  """Whether every leaf already lies as `shardings` say."""
  leaves = jax.tree_util.tree_leaves(params)
  targets = jax.tree_util.tree_leaves(shardings)
  if len(leaves) != len(targets):
    raise ValueError(f"params have {len(leaves)} leaves but the sampler "
                     f"expects {len(targets)}")
  return all(
      isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
      for x, s in zip(leaves, targets))


def place_params(params: Params, shardings: Params
                 ) -> tuple[Params, Handoff]:
  """The same arrays when shardings agree, else a resharded copy."""
  start = time.perf_counter()
  if shardings_agree(params, shardings):
    return params, Handoff("shared", time.perf_counter() - start)
  placed = jax.block_until_ready(jax.device_put(params, shardings))
  return placed, Handoff("resharded", time.perf_counter() - start)


def save_params(directory: str, params: Params) -> float:
  """Writes params as an Orbax checkpoint at `directory`; returns seconds."""
  start = time.perf_counter()
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(directory), params, force=True)
    ckptr.wait_until_finished()
  return time.perf_counter() - start


def restore_params(directory: str, abstract: Params, shardings: Params
                   ) -> tuple[Params, Handoff]:
  """Restores params from `directory` directly into `shardings`.

  `abstract` gives every leaf's shape and dtype (e.g. from jax.eval_shape);
  a checkpoint whose shapes differ raises.
  """
  start = time.perf_counter()
  target = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.abspath(directory), target)
  params = jax.block_until_ready(params)
  return params, Handoff("checkpoint", time.perf_counter() - start)
