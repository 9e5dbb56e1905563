"""Model-input rows for training, shared by SFT and RL: a typed pytree.

A row holds one or several packed sequences. The model reads `tokens` and
is trained to predict `targets` (the next token) where `mask` is 1.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import numpy as np

from kimi_jax.vision.config import VisionConfig
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
  # An MoE model's routing replay (kimi_jax/model/moe.py): the experts each
  # input token went to in the sampler, per MoE layer (integer ids, int8 or
  # int16 as recorded; Lm x K per token). None: the trainer routes on its
  # own.
  experts_RxTxLxK: np.ndarray | None = None

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens_RxT.shape)


class ImageSlots(NamedTuple):
  """A vision model's rows carry `slots` images each, of shape `like`
  (H, W, C)."""

  slots: int
  like: tuple[int, int, int]

  def empty(self, R: int) -> RowImages:
    """Host image slots of R rows, all empty."""
    return RowImages(np.zeros((R, self.slots) + tuple(self.like), np.float32),
                     np.zeros((R, self.slots), bool))


def image_slots(vision: VisionConfig | None) -> ImageSlots | None:
  """The rows' image slots of a model with `model.vision` (None: text)."""
  if vision is None:
    return None
  return ImageSlots(vision.max_images, (vision.image_size, vision.image_size,
                                        vision.channels))


def put_images(images: RowImages, row: int, start: int,
               pixels_NxHxWxC: np.ndarray) -> int:
  """Writes N images into `row`'s slots from `start` (host arrays); returns
  the next free slot. Rows take their images in the order their
  placeholder runs come, which is the order they are put here."""
  end = start + len(pixels_NxHxWxC)
  images.pixels_BxIxHxWxC[row, start:end] = pixels_NxHxWxC
  images.mask_BxI[row, start:end] = True
  return end


def empty_rows(R: int, T: int, pad_id: int,
               images: ImageSlots | None = None) -> TokenRows:
  """All-padding host rows, to be filled in, with empty image slots when
  `images` says the rows carry some."""
  return TokenRows(
      tokens_RxT=np.full((R, T), pad_id, np.int32),
      targets_RxT=np.full((R, T), pad_id, np.int32),
      positions_RxT=np.zeros((R, T), np.int32),
      segment_ids_RxT=np.zeros((R, T), np.int32),
      mask_RxT=np.zeros((R, T), np.float32),
      images=None if images is None else images.empty(R))
