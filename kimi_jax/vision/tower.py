"""The vision tower: a functional SigLIP ViT (as HF `SiglipVisionModel`).

Computes what Hugging Face's `SiglipVisionModel` returns as
`last_hidden_state`: a stride-`patch_size` conv patch embedding (here a
reshape and one matmul) plus learned position embeddings, `n_layers`
pre-norm encoder layers (LayerNorm with bias; bidirectional multi-head
attention with q/k/v/out biases; MLP fc1 -> gelu (tanh approximation) ->
fc2), and a final LayerNorm. SigLIP's attention-pooling head is not part of
it: a vision language model reads the patch embeddings.

Parameters are a plain pytree of arrays; layers are stacked along a leading
`layers` axis and run with `lax.scan`. Nothing here calls `jit` except
`init_sharded`.

Shapes in names: N images, P patches (g * g), p patch size, C channels,
D width, H heads, Dh head dim, F MLP width, L layers, X = p * p * C.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model.projection import project
from kimi_jax.sharding import Sharder, constrain, init_shardings
from kimi_jax.sharding import init_sharded as sharding_init_sharded
from kimi_jax.vision.config import VisionConfig

Params = dict[str, Any]

# Names of the bias / norm leaves: zeros and ones at init.
_ZERO_INIT = ("bq", "bk", "bv", "bo", "b_fc1", "b_fc2", "attn_norm_bias",
              "mlp_norm_bias", "final_norm_bias", "patch_bias")
_ONE_INIT = ("attn_norm", "mlp_norm", "final_norm")


def param_logical_axes(cfg: VisionConfig) -> Params:
  """Logical axis names of every parameter, same tree as the params.

  The language model's names where they fit. D-wide biases take `norm`
  (replicated, like the norm scales); the patch pixels and the position
  index are `None`: small axes, never split.
  """
  del cfg
  layers = {
      "attn_norm": ("layers", "norm"),
      "attn_norm_bias": ("layers", "norm"),
      "wq": ("layers", "embed", "heads", "head_dim"),
      "wk": ("layers", "embed", "heads", "head_dim"),
      "wv": ("layers", "embed", "heads", "head_dim"),
      "bq": ("layers", "heads", "head_dim"),
      "bk": ("layers", "heads", "head_dim"),
      "bv": ("layers", "heads", "head_dim"),
      "wo": ("layers", "heads", "head_dim", "embed"),
      "bo": ("layers", "norm"),
      "mlp_norm": ("layers", "norm"),
      "mlp_norm_bias": ("layers", "norm"),
      "w_fc1": ("layers", "embed", "mlp"),
      "b_fc1": ("layers", "mlp"),
      "w_fc2": ("layers", "mlp", "embed"),
      "b_fc2": ("layers", "norm"),
  }
  return {
      "patch_embed": (None, None, None, "embed"),
      "patch_bias": ("norm",),
      "pos_embed": (None, "embed"),
      "layers": layers,
      "final_norm": ("norm",),
      "final_norm_bias": ("norm",),
  }


def param_shapes(cfg: VisionConfig) -> Params:
  """Shape of every parameter, same tree as the params."""
  L, D, H, Dh, F = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim,
                    cfg.mlp_dim)
  layers = {
      "attn_norm": (L, D), "attn_norm_bias": (L, D),
      "wq": (L, D, H, Dh), "wk": (L, D, H, Dh), "wv": (L, D, H, Dh),
      "bq": (L, H, Dh), "bk": (L, H, Dh), "bv": (L, H, Dh),
      "wo": (L, H, Dh, D), "bo": (L, D),
      "mlp_norm": (L, D), "mlp_norm_bias": (L, D),
      "w_fc1": (L, D, F), "b_fc1": (L, F), "w_fc2": (L, F, D),
      "b_fc2": (L, D),
  }
  p = cfg.patch_size
  return {
      # The conv kernel as (row, column, channel, out): a patch flattened
      # in that order times the kernel reshaped to (X, D) is the conv.
      "patch_embed": (p, p, cfg.channels, D),
      "patch_bias": (D,),
      "pos_embed": (cfg.n_patches, D),
      "layers": layers,
      "final_norm": (D,),
      "final_norm_bias": (D,),
  }


def _leaf_name(path) -> str:
  return str(path[-1].key)


def init_params(cfg: VisionConfig, rng: jax.Array, std: float = 0.02
                ) -> Params:
  """Random init: normal(std) matrices (position embeddings
  normal(1/sqrt(D)), as SigLIP), unit norm scales, zero biases."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(rng, len(flat))
  dt = cfg.param_jnp_dtype
  leaves = []
  for (path, shape), key in zip(flat, keys):
    name = _leaf_name(path)
    if name in _ONE_INIT:
      leaf = jnp.ones(shape, dt)
    elif name in _ZERO_INIT:
      leaf = jnp.zeros(shape, dt)
    else:
      scale = cfg.d_model ** -0.5 if name == "pos_embed" else std
      leaf = (scale * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    leaves.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def param_shardings(cfg: VisionConfig, sharder: Sharder) -> Params:
  """NamedShardings of every parameter; raises naming any that can't divide."""
  return init_shardings(lambda key: init_params(cfg, key),
                        param_logical_axes(cfg), sharder)


def init_sharded(cfg: VisionConfig, seed: int, sharder: Sharder,
                 std: float = 0.02) -> Params:
  """Creates params directly in their shardings: no device holds them all."""
  return sharding_init_sharded(lambda key: init_params(cfg, key, std),
                               param_logical_axes(cfg), sharder, seed)


def layer_norm(x_NxPxD: jax.Array, scale_D: jax.Array, bias_D: jax.Array,
               eps: float) -> jax.Array:
  """LayerNorm with bias, statistics in float32 (as torch's LayerNorm)."""
  x32 = x_NxPxD.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
  lead = (1,) * (x_NxPxD.ndim - 1)
  out = (normed * scale_D.astype(jnp.float32).reshape(lead + scale_D.shape) +
         bias_D.astype(jnp.float32).reshape(lead + bias_D.shape))
  return out.astype(x_NxPxD.dtype)


def patchify(pixels_NxHxWxC: jax.Array, patch_size: int) -> jax.Array:
  """Non-overlapping patches, row-major over the grid, each flattened in
  (row, column, channel) order: N x P x X."""
  N, Hpx, Wpx, C = pixels_NxHxWxC.shape
  p = patch_size
  gh, gw = Hpx // p, Wpx // p
  x = pixels_NxHxWxC.reshape(N, gh, p, gw, p, C).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(N, gh * gw, p * p * C)


def embed_patches(params: Params, pixels_NxHxWxC: jax.Array,
                  cfg: VisionConfig) -> jax.Array:
  """The conv patch embedding plus position embeddings: N x P x D."""
  dt = cfg.compute_jnp_dtype
  patches_NxPxX = patchify(pixels_NxHxWxC.astype(dt), cfg.patch_size)
  kernel_XxD = params["patch_embed"].reshape(-1, cfg.d_model).astype(dt)
  x = project("npx,xd->npd", patches_NxPxX, kernel_XxD)
  x = x + params["patch_bias"].astype(dt)[None, None, :]
  return x + params["pos_embed"].astype(dt)[None, :, :]


def attention(q_NxPxHxDh: jax.Array, k_NxPxHxDh: jax.Array,
              v_NxPxHxDh: jax.Array) -> jax.Array:
  """Bidirectional softmax(q k^T / sqrt(Dh)) v, softmax in float32."""
  Dh = q_NxPxHxDh.shape[-1]
  scores = jnp.einsum("nqhd,nkhd->nhqk", q_NxPxHxDh, k_NxPxHxDh,
                      preferred_element_type=jnp.float32) * Dh ** -0.5
  probs = jax.nn.softmax(scores, axis=-1).astype(v_NxPxHxDh.dtype)
  return jnp.einsum("nhqk,nkhd->nqhd", probs, v_NxPxHxDh)


def _layer(x_NxPxD: jax.Array, lp: Params, cfg: VisionConfig,
           sharder: Sharder | None) -> jax.Array:
  """One pre-norm encoder layer."""
  dt = cfg.compute_jnp_dtype
  act = ("batch", None, "act_embed")
  heads = ("batch", None, "heads", "head_dim")
  h = layer_norm(x_NxPxD, lp["attn_norm"], lp["attn_norm_bias"],
                 cfg.norm_eps)
  qkv = []
  for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")):
    y = project("npd,dhk->nphk", h, lp[w].astype(dt))
    qkv.append(constrain(sharder, y + lp[b].astype(dt)[None, None], heads))
  attn = constrain(sharder, attention(*qkv), heads)
  x_NxPxD = x_NxPxD + project("nphk,hkd->npd", attn, lp["wo"].astype(dt))
  x_NxPxD = x_NxPxD + lp["bo"].astype(dt)[None, None]
  x_NxPxD = constrain(sharder, x_NxPxD, act)
  h = layer_norm(x_NxPxD, lp["mlp_norm"], lp["mlp_norm_bias"], cfg.norm_eps)
  h = project("npd,df->npf", h, lp["w_fc1"].astype(dt))
  h = h + lp["b_fc1"].astype(dt)[None, None]
  # SigLIP's "gelu_pytorch_tanh".
  h = constrain(sharder, jax.nn.gelu(h, approximate=True),
                ("batch", None, "mlp"))
  x_NxPxD = x_NxPxD + project("npf,fd->npd", h, lp["w_fc2"].astype(dt))
  x_NxPxD = x_NxPxD + lp["b_fc2"].astype(dt)[None, None]
  return constrain(sharder, x_NxPxD, act)


def check_pixels(pixels_NxHxWxC: Any, cfg: VisionConfig) -> None:
  """Raises ValueError unless pixels are N x image_size x image_size x C."""
  shape = tuple(np.shape(pixels_NxHxWxC))
  want = (cfg.image_size, cfg.image_size, cfg.channels)
  if len(shape) != 4 or shape[1:] != want:
    raise ValueError(f"vision: pixels must be N x {want[0]} x {want[1]} x "
                     f"{want[2]} (channels last), got {shape}")


def encode(params: Params, pixels_NxHxWxC: jax.Array, cfg: VisionConfig, *,
           sharder: Sharder | None = None) -> jax.Array:
  """Patch embeddings N x P x D (compute dtype) of N images.

  pixels_NxHxWxC: channels last, already normalised as the checkpoint
  expects (SigLIP: (x - 0.5) / 0.5). Patch k is grid row k // g, column
  k % g, as HF's `last_hidden_state`.
  """
  check_pixels(pixels_NxHxWxC, cfg)
  x = embed_patches(params, pixels_NxHxWxC, cfg)
  x = constrain(sharder, x, ("batch", None, "act_embed"))

  def body(x_NxPxD, lp):
    return _layer(x_NxPxD, lp, cfg, sharder), None

  if cfg.remat:
    body = jax.checkpoint(body, prevent_cse=False)
  x, _ = jax.lax.scan(body, x, params["layers"])
  return layer_norm(x, params["final_norm"], params["final_norm_bias"],
                    cfg.norm_eps)
