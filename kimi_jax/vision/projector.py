"""The projector: vision patch embeddings -> language model embeddings.

Each `pool` x `pool` neighbourhood of the patch grid is merged into one
token by concatenating its patches' features (pixel shuffle: D ->
D * pool**2, four times fewer tokens for pool 2), then a two-layer MLP
(Linear -> GELU -> Linear) maps it to the language model's width. The
neighbourhood's patches are concatenated in row-major order (top-left,
top-right, bottom-left, bottom-right for pool 2), the layout of Qwen2-VL's
patch merger. The GELU is the exact (erf) one, as `torch.nn.GELU()`.

Shapes in names: N images, P patches (g * g), D tower width, M = D * pool**2,
Q = tokens per image ((g / pool)**2), E projector hidden width, Dl the
language model's width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kimi_jax.model.projection import project
from kimi_jax.sharding import Sharder, constrain, init_shardings
from kimi_jax.sharding import init_sharded as sharding_init_sharded
from kimi_jax.vision import tower
from kimi_jax.vision.config import VisionConfig

Params = dict[str, Any]


def param_logical_axes(cfg: VisionConfig) -> Params:
  """Logical axis names of every parameter, same tree as the params."""
  del cfg
  return {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed"),
          "b2": ("norm",)}


def param_shapes(cfg: VisionConfig) -> Params:
  """Shape of every parameter, same tree as the params."""
  M, E, Dl = cfg.merged_dim, cfg.projector_hidden, cfg.lm_d_model
  return {"w1": (M, E), "b1": (E,), "w2": (E, Dl), "b2": (Dl,)}


def init_params(cfg: VisionConfig, rng: jax.Array, std: float = 0.02
                ) -> Params:
  """Random init: normal(std) matrices, zero biases."""
  shapes = param_shapes(cfg)
  k1, k2 = jax.random.split(rng)
  dt = cfg.param_jnp_dtype
  normal = lambda k, s: (std * jax.random.normal(k, s, jnp.float32)).astype(
      dt)
  return {"w1": normal(k1, shapes["w1"]), "b1": jnp.zeros(shapes["b1"], dt),
          "w2": normal(k2, shapes["w2"]), "b2": jnp.zeros(shapes["b2"], dt)}


def param_shardings(cfg: VisionConfig, sharder: Sharder) -> Params:
  """NamedShardings of every parameter; raises naming any that can't divide."""
  return init_shardings(lambda key: init_params(cfg, key),
                        param_logical_axes(cfg), sharder)


def init_sharded(cfg: VisionConfig, seed: int, sharder: Sharder,
                 std: float = 0.02) -> Params:
  """Creates params directly in their shardings: no device holds them all."""
  return sharding_init_sharded(lambda key: init_params(cfg, key, std),
                               param_logical_axes(cfg), sharder, seed)


def pixel_shuffle(patches_NxPxD: jax.Array, pool: int) -> jax.Array:
  """Concatenates each pool x pool neighbourhood of the (square) patch grid:
  N x (g / pool)**2 x D * pool**2, the merged tokens row-major over the
  coarser grid."""
  N, P, D = patches_NxPxD.shape
  g = int(round(P ** 0.5))
  if g * g != P or g % pool:
    raise ValueError(f"vision: {P} patches are not a square grid divisible "
                     f"by vision.pool={pool}")
  c = g // pool
  # (n, coarse row, row offset, coarse column, column offset, d)
  x = patches_NxPxD.reshape(N, c, pool, c, pool, D)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(N, c * c, pool * pool * D)


def project_patches(params: Params, patches_NxPxD: jax.Array,
                    cfg: VisionConfig, *, sharder: Sharder | None = None
                    ) -> jax.Array:
  """Pixel shuffle, then the MLP: N x Q x Dl (compute dtype)."""
  dt = cfg.compute_jnp_dtype
  x_NxQxM = pixel_shuffle(patches_NxPxD.astype(dt), cfg.pool)
  h = project("nqm,me->nqe", x_NxQxM, params["w1"].astype(dt))
  h = jax.nn.gelu(h + params["b1"].astype(dt)[None, None], approximate=False)
  h = constrain(sharder, h, ("batch", None, "mlp"))
  out = project("nqe,el->nql", h, params["w2"].astype(dt))
  out = out + params["b2"].astype(dt)[None, None]
  return constrain(sharder, out, ("batch", None, "act_embed"))


def embed_images(vision_params: Params, projector_params: Params,
                 pixels_NxHxWxC: jax.Array, cfg: VisionConfig, *,
                 sharder: Sharder | None = None) -> jax.Array:
  """Language model input embeddings of N images: N x tokens_per_image x
  lm_d_model (compute dtype)."""
  patches = tower.encode(vision_params, pixels_NxHxWxC, cfg, sharder=sharder)
  return project_patches(projector_params, patches, cfg, sharder=sharder)
