"""Image embeddings into token rows: the placeholder merge.

A row carries its images as runs of `image_token_id` placeholder tokens,
`tokens_per_image` (P) per image, in the order of the row's image slots.
After the token embedding lookup, `merge_image_embeddings` puts image j's P
embeddings at the placeholders numbered j * P .. j * P + P - 1 of the row
(counting placeholders from the left), position by position. The host-side
`check_placeholders` guarantees that numbering is the same as "the j-th run
is image j": every run holds whole images.

Shapes in names: B rows, T tokens, I image slots per row, P embeddings per
image, D the language model's width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.vision.config import VisionConfig


class RowImages(NamedTuple):
  """The images of B token rows, in I fixed slots per row (padded, so
  shapes stay bucketed): slot j of row b is the row's j-th image, in the
  order of its placeholder runs; mask_BxI is False on empty slots."""

  pixels_BxIxHxWxC: Any
  mask_BxI: Any


def merge_image_embeddings(text_embeds_BxTxD: jax.Array,
                           tokens_BxT: jax.Array,
                           image_embeds_BxIxPxD: jax.Array,
                           image_mask_BxI: jax.Array,
                           image_token_id: int) -> jax.Array:
  """Text embeddings with the placeholders replaced by image embeddings.

  Placeholder k of row b (k-th from the left) takes embedding k % P of the
  row's image k // P, if that slot exists and its mask is True; every other
  position (text, placeholders beyond the row's images, placeholders of
  masked-out slots) keeps its text embedding. Static shapes, no host sync:
  jittable, and the gradient reaches an image embedding only through the
  position it was placed at.
  """
  B, T, D = text_embeds_BxTxD.shape
  _, I, P, _ = image_embeds_BxIxPxD.shape
  is_image_BxT = tokens_BxT == image_token_id
  # The k-th placeholder of a row has k = (placeholders up to it) - 1.
  k_BxT = jnp.cumsum(is_image_BxT.astype(jnp.int32), axis=1) - 1
  image_BxT = jnp.clip(k_BxT // P, 0, I - 1)
  patch_BxT = jnp.clip(k_BxT, 0) % P
  rows_Bx1 = jnp.arange(B)[:, None]
  slot_used_BxT = image_mask_BxI.astype(bool)[rows_Bx1, image_BxT]
  use_BxT = is_image_BxT & (k_BxT // P < I) & slot_used_BxT
  gathered_BxTxD = image_embeds_BxIxPxD[rows_Bx1, image_BxT, patch_BxT]
  return jnp.where(use_BxT[:, :, None],
                   gathered_BxTxD.astype(text_embeds_BxTxD.dtype),
                   text_embeds_BxTxD)


def placeholder_runs(tokens_T: Any, image_token_id: int
                     ) -> list[tuple[int, int]]:
  """(start, length) of every run of consecutive placeholder tokens."""
  is_image = np.asarray(tokens_T).reshape(-1) == image_token_id
  edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
  starts = np.flatnonzero(edges == 1)
  stops = np.flatnonzero(edges == -1)
  return [(int(a), int(b - a)) for a, b in zip(starts, stops)]


def check_placeholders(tokens_T: Any, n_images: int, cfg: VisionConfig,
                       where: str) -> None:
  """Raises ValueError naming `where` (e.g. "train.jsonl line 3") unless the
  row's placeholders hold exactly its `n_images` images: at most
  `vision.max_images`, every run of placeholders a whole number of images
  (P = vision.tokens_per_image each; images back to back form one run of
  a multiple of P), and n_images * P placeholders in all."""
  tokens = np.asarray(tokens_T)
  if tokens.ndim != 1:
    raise ValueError(f"{where}: expected one row of tokens, got shape "
                     f"{tokens.shape}")
  P, token = cfg.tokens_per_image, cfg.image_token_id
  if n_images < 0:
    raise ValueError(f"{where}: negative number of images ({n_images})")
  if n_images > cfg.max_images:
    raise ValueError(f"{where}: {n_images} images, more than "
                     f"vision.max_images={cfg.max_images}")
  runs = placeholder_runs(tokens, token)
  for start, length in runs:
    if length % P:
      raise ValueError(
          f"{where}: the run of image placeholder tokens (id {token}) at "
          f"token {start} has {length}, not a multiple of "
          f"vision.tokens_per_image={P}: a broken or partial image")
  count = sum(length for _, length in runs)
  if count != n_images * P:
    raise ValueError(
        f"{where}: {count} image placeholder tokens (id {token}) for "
        f"{n_images} image(s); expected {n_images} x "
        f"vision.tokens_per_image={P} = {n_images * P}")
