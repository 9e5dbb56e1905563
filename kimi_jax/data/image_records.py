"""Image+text prompt sets from JSONL: records.JsonlSource with images.

A row is a prompt record (records.PromptFields: `prompt`, `answer`, optional
`difficulty`, `tags`, other fields kept) plus `images`, a list of image
sources (images.py: a path relative to the JSONL file's directory, or
`{"bytes": "<base64>"}`):

  {"prompt": "<image>\\nHow many red shapes? ...", "answer": "3",
   "images": ["img/train-000000-0.png"], "task": "count"}

Each `<image>` marker in the prompt is where one image goes, in order: the
number of markers must equal len(images), and be at most `max_images`
(a missing `images` field means none, a text-only row). Every image is
decoded and checked (format, size, channels) when the file is loaded, so a
bad one is a BadRow naming file, line and field (`images[1]`), rejected or
skipped and counted as records.py's `on_bad_row` says. A loaded record adds
`pixels`: float32 N x S x S x C (images.to_pixels), N = len(images).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping

import numpy as np

from kimi_jax.data import images as im
from kimi_jax.data.records import (JsonlSource, PromptFields, Record,
                                   RowError)

IMAGE_MARKER = "<image>"


@dataclasses.dataclass(frozen=True)
class ImageFields:
  """An image+text prompt set: the text fields (`text`, a PromptFields), the
  images field, the marker, and what the vision encoder takes: at most
  `max_images` images of at most image_size x image_size, `channels` each."""

  text: PromptFields = PromptFields()
  images: str = "images"
  marker: str = IMAGE_MARKER
  max_images: int = 4
  image_size: int = 64
  channels: int = 3

  def __post_init__(self):
    if not self.marker:
      raise ValueError("image marker must be a non-empty string")
    if self.max_images < 1 or self.image_size < 1:
      raise ValueError(f"max_images and image_size must be >= 1, got "
                       f"{self.max_images}, {self.image_size}")
    if self.channels not in (1, 3):
      raise ValueError(f"channels must be 1 or 3, got {self.channels}")

  def sources(self, row: Mapping[str, Any]) -> list[Any]:
    """The row's image sources, checked against its prompt's markers."""
    value = row.get(self.images)
    value = [] if value is None else value
    if not isinstance(value, list):
      raise RowError(self.images, f"expected a list of image sources, got "
                     f"{type(value).__name__}")
    if len(value) > self.max_images:
      raise RowError(self.images, f"{len(value)} images, more than "
                     f"max_images={self.max_images}")
    markers = str(row.get(self.text.prompt, "")).count(self.marker)
    if markers != len(value):
      raise RowError(self.images, f"the prompt has {markers} "
                     f"{self.marker!r} marker(s) but there are {len(value)} "
                     f"image(s)")
    return value

  def pixels(self, sources: list[Any], base_dir: str) -> np.ndarray:
    """float32 N x S x S x C of the sources; RowError names `images[i]`."""
    out_NxSxSxC = np.zeros((len(sources), self.image_size, self.image_size,
                            self.channels), np.float32)
    for i, source in enumerate(sources):
      where = f"{self.images}[{i}]"
      img = im.load_image(source, where, base_dir=base_dir,
                          max_size=self.image_size)
      out_NxSxSxC[i] = im.to_pixels(img, self.image_size, self.channels,
                                    where=where)
    return out_NxSxSxC

  def validate(self, row: Mapping[str, Any], base_dir: str = ".") -> Record:
    """The canonical record of one row, with `pixels`; raises RowError."""
    record = self.text.validate(row)
    sources = self.sources(row)
    record[self.images] = sources
    record["pixels"] = self.pixels(sources, base_dir)
    return record


def load_image_source(path: str, fields: ImageFields = ImageFields(), *,
                      on_bad_row: str = "error",
                      admit: Callable[[Record], None] | None = None
                      ) -> JsonlSource:
  """An image+text prompt set as a Grain data source (records.JsonlSource:
  `len`, `__getitem__`, `report`); relative image paths are resolved against
  the directory of `path`."""
  base_dir = os.path.dirname(os.path.abspath(path))
  return JsonlSource(path, functools.partial(fields.validate,
                                             base_dir=base_dir),
                     on_bad_row=on_bad_row, admit=admit)


def split_prompt(prompt: str, marker: str = IMAGE_MARKER) -> list[str]:
  """The prompt's text around its markers: N + 1 pieces for N images, so
  text piece i comes before image i."""
  return prompt.split(marker)
