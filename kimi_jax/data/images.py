"""Decoding and normalising the images of image+text prompt records.

An image source in a record is a path (PNG or JPEG; a relative path is
resolved against the JSONL file's directory) or inline bytes, `{"bytes":
"<base64>"}` (a `data:image/...;base64,` prefix is allowed). `load_image`
decodes it to uint8 H x W x C, C = 1 (grayscale) or 3 (RGB); `to_pixels`
turns that into the vision encoder's input: float32 S x S x C in [-1, 1],
SigLIP's normalisation (x / 255 - 0.5) / 0.5.

Choices, each to keep what the model sees exactly what the file shows:

- Never resized. An image smaller than S is placed at the top-left corner
  and padded with `PAD_VALUE` (0.0: mid grey, neither the white paper nor
  the black ink of a rendered problem, so the image's edge stays visible);
  upscaling would blur small text and change digit shapes. An image larger
  than S is an error (downscaling makes small text illegible): resize it
  offline, where someone looks at the result.
- Alpha: an RGBA (or LA, or palette with transparency) image whose pixels
  are all opaque loses its alpha channel, which changes nothing. One with a
  translucent pixel is an error: the colour under a transparent pixel is
  often arbitrary (black), so dropping alpha can make ink vanish or appear;
  flatten it onto the intended background before writing the file.
- Channels are never converted: grayscale where RGB is expected (or the
  reverse) is an error, so a data set with a mix is noticed, not silently
  tripled or averaged.

Every error is a `RowError` naming the record field (e.g. `images[1]`), so
the JSONL source reports file, line and field.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from kimi_jax.data.records import RowError

IMAGE_FORMATS = ("PNG", "JPEG")
# Padding of an image smaller than S, in normalised units (0.0: mid grey).
PAD_VALUE = 0.0
_DATA_URI = "data:"


def decode_base64(text: Any, where: str) -> bytes:
  """The bytes of a base64 string (optionally a `data:...;base64,` URI)."""
  if not isinstance(text, str) or not text.strip():
    raise RowError(where, "expected a non-empty base64 string")
  if text.startswith(_DATA_URI):
    head, sep, text = text.partition(",")
    if not sep or not head.endswith(";base64"):
      raise RowError(where, "data URI is not ';base64,' encoded")
  try:
    return base64.b64decode("".join(text.split()), validate=True)
  except (binascii.Error, ValueError) as exc:
    raise RowError(where, f"bad base64 ({exc})") from None


def encode_png(img_HxWxC: np.ndarray) -> bytes:
  """PNG bytes of a uint8 image with 1 or 3 channels (lossless)."""
  img = _check_uint8(img_HxWxC, "image")
  mode = {1: "L", 3: "RGB"}.get(img.shape[-1])
  if mode is None:
    raise ValueError(f"can only encode 1 or 3 channels, got {img.shape}")
  out = io.BytesIO()
  Image.fromarray(img[..., 0] if mode == "L" else img, mode).save(out, "PNG")
  return out.getvalue()


def encode_base64(img_HxWxC: np.ndarray) -> str:
  """The base64 text of `encode_png`: a record's inline `{"bytes": ...}`."""
  return base64.b64encode(encode_png(img_HxWxC)).decode("ascii")


def _open(source: Any, where: str, base_dir: str) -> Image.Image:
  """The PIL image of a path or `{"bytes": base64}` source (not decoded)."""
  if isinstance(source, dict) and set(source) == {"bytes"}:
    return _open_bytes(decode_base64(source["bytes"], where), where)
  if isinstance(source, dict) and set(source) == {"path"}:
    source = source["path"]
  if not isinstance(source, str) or not source.strip():
    raise RowError(where, f"expected a file path or {{'bytes': <base64>}}, "
                   f"got {source!r}"[:200])
  path = os.path.join(base_dir, source)
  if not os.path.isfile(path):
    raise RowError(where, f"image file not found: {path}")
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as exc:
    raise RowError(where, f"cannot read {path}: {exc}") from None
  return _open_bytes(data, where)


def _open_bytes(data: bytes, where: str) -> Image.Image:
  try:
    img = Image.open(io.BytesIO(data))
  except (UnidentifiedImageError, OSError) as exc:
    raise RowError(where, f"not an image PIL can read ({exc})") from None
  if img.format not in IMAGE_FORMATS:
    raise RowError(where, f"image format {img.format} is not one of "
                   f"{IMAGE_FORMATS}")
  return img


def _opaque_alpha_dropped(img: np.ndarray, where: str) -> np.ndarray:
  """Colour channels of an image with alpha last, if it is all opaque."""
  alpha = img[..., -1]
  if (alpha != 255).any():
    raise RowError(where, f"image has {int((alpha != 255).sum())} "
                   f"translucent pixel(s); flatten its alpha channel onto "
                   f"a background before use")
  return img[..., :-1]


def load_image(source: Any, where: str, *, base_dir: str = ".",
               max_size: int | None = None) -> np.ndarray:
  """uint8 H x W x C (C = 1 or 3) of a path or `{"bytes": base64}` source.

  `where` is the record field named in errors; `base_dir` resolves relative
  paths; `max_size`, if given, rejects an image with a side over it from its
  header, before decoding it (a huge file must not fill memory). JPEG EXIF
  rotation is applied. Opaque alpha is dropped, translucency is an error.
  """
  img = _open(source, where, base_dir)
  width, height = img.size
  if max_size is not None and max(width, height) > max_size:
    raise RowError(where, f"image is {width}x{height} (W x H), larger than "
                   f"{max_size}x{max_size}; images are padded, never "
                   f"downscaled: resize it offline")
  try:
    img = ImageOps.exif_transpose(img)
    img.load()
  except (OSError, SyntaxError, ValueError) as exc:
    raise RowError(where, f"cannot decode the image ({exc})") from None
  mode = img.mode
  if mode == "1":
    img, mode = img.convert("L"), "L"
  elif mode in ("P", "PA"):
    alpha = mode == "PA" or "transparency" in img.info
    mode = "RGBA" if alpha else "RGB"
    img = img.convert(mode)
  if mode not in ("L", "LA", "RGB", "RGBA"):
    raise RowError(where, f"unsupported image mode {img.mode!r} (need "
                   f"grayscale or RGB, 8 bits)")
  out = np.asarray(img, np.uint8)
  out = out[..., None] if out.ndim == 2 else out
  if mode in ("LA", "RGBA"):
    out = _opaque_alpha_dropped(out, where)
  return np.ascontiguousarray(out)


def _check_uint8(img: Any, where: str) -> np.ndarray:
  if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or \
      img.ndim != 3:
    raise RowError(where, f"expected a uint8 H x W x C array, got "
                   f"{getattr(img, 'dtype', type(img).__name__)} "
                   f"{getattr(img, 'shape', '')}")
  return img


def to_pixels(img_HxWxC: np.ndarray, image_size: int, channels: int, *,
              where: str = "image") -> np.ndarray:
  """float32 image_size x image_size x channels in [-1, 1] (SigLIP).

  Pads a smaller image at the bottom and right with PAD_VALUE; rejects a
  larger one, and one whose channel count is not `channels` (a 4th channel
  is alpha: `load_image` drops it when opaque).
  """
  img = _check_uint8(img_HxWxC, where)
  height, width, c = img.shape
  if c != channels:
    kind = {1: "grayscale", 3: "RGB", 4: "RGBA (alpha)"}.get(c, f"{c}-channel")
    raise RowError(where, f"image is {kind} ({c} channel(s)), expected "
                   f"{channels} channel(s)")
  if height > image_size or width > image_size:
    raise RowError(where, f"image is {width}x{height} (W x H), larger than "
                   f"{image_size}x{image_size}; images are padded, never "
                   f"downscaled: resize it offline")
  out_SxSxC = np.full((image_size, image_size, channels), PAD_VALUE,
                      np.float32)
  out_SxSxC[:height, :width] = (img.astype(np.float32) / 255.0 - 0.5) / 0.5
  return out_SxSxC
