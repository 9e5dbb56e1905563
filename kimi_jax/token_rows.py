"""Model-input rows for training, shared by SFT and RL: a typed pytree.

A row holds one or several packed sequences. The model reads `tokens` and
is trained to predict `targets` (the next token) where `mask` is 1.
"""

from __future__ import annotations

import flax.struct
import numpy as np

from kimi_jax.vision.merge import RowImages


@flax.struct.dataclass
class TokenRows:
  """R rows of T tokens.

  tokens_RxT: model inputs. targets_RxT: the token after each input.
  positions_RxT: position within its own sequence (restarts at 0 for each
    packed sequence). segment_ids_RxT: 1, 2, ... per packed sequence, 0 on
    padding; attention never crosses segments. mask_RxT: 1.0 where the
    target enters the loss.
  """

  tokens_RxT: np.ndarray
  targets_RxT: np.ndarray
  positions_RxT: np.ndarray
  segment_ids_RxT: np.ndarray
  mask_RxT: np.ndarray
  # A vision model's rows: each row's images in `vision.max_images` slots
  # (kimi_jax/vision/merge.py). None for text rows.
  images: RowImages | None = None

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens_RxT.shape)


def empty_rows(R: int, T: int, pad_id: int,
               image_like: tuple[int, int, int] | None = None,
               image_slots: int = 0) -> TokenRows:
  """All-padding host rows, to be filled in; with `image_like` (one image's
  H, W, C) each row has `image_slots` empty image slots."""
  images = None if image_like is None else RowImages(
      np.zeros((R, image_slots) + tuple(image_like), np.float32),
      np.zeros((R, image_slots), bool))
  return TokenRows(
      tokens_RxT=np.full((R, T), pad_id, np.int32),
      targets_RxT=np.full((R, T), pad_id, np.int32),
      positions_RxT=np.zeros((R, T), np.int32),
      segment_ids_RxT=np.zeros((R, T), np.int32),
      mask_RxT=np.zeros((R, T), np.float32), images=images)
