"""Image+text prompt data: decoding and SigLIP normalisation, the JSONL
source's bad rows (named by file, line and field; rejected, or skipped and
counted), and the generated visual problems: answers recomputed from the
pixels, text images read back glyph by glyph and scored by the text
version's verifier, determinism, and the round trip through write_jsonl."""

from __future__ import annotations

import base64
import io
import json
import re

import grain
import numpy as np
import pytest
from PIL import Image

from kimi_jax.data import image_records as ir
from kimi_jax.data import images as im
from kimi_jax.data import pointer_chase as pc
from kimi_jax.data import visual_tasks as vt
from kimi_jax.data.records import DataError, RowError
from kimi_jax.rewards.reasoning_gym import ReasoningGymReward


def _png(img: np.ndarray, mode: str | None = None, fmt: str = "PNG") -> bytes:
  out = io.BytesIO()
  arr = img[..., 0] if img.shape[-1] == 1 else img
  Image.fromarray(arr, mode).save(out, fmt)
  return out.getvalue()


def _b64(data: bytes) -> str:
  return base64.b64encode(data).decode()


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)


def _jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return str(path)


# ---------------------------------------------------------------------------
# images.py


def test_to_pixels_normalises_and_pads_never_resizes():
  img = np.array([[[0, 255, 51]], [[255, 0, 102]]], np.uint8)  # 2 x 1 x 3
  out = im.to_pixels(img, 4, 3)
  assert out.shape == (4, 4, 3) and out.dtype == np.float32
  np.testing.assert_allclose(out[:2, 0], [[-1, 1, -0.6], [1, -1, -0.2]],
                             atol=1e-6)
  # Bottom and right padded with PAD_VALUE; the image is at the top-left.
  assert (out[2:] == im.PAD_VALUE).all() and (out[:, 1:] == im.PAD_VALUE
                                              ).all()
  with pytest.raises(RowError, match=r"5x2 \(W x H\), larger than 4x4") as e:
    im.to_pixels(np.zeros((2, 5, 3), np.uint8), 4, 3, where="images[2]")
  assert e.value.field == "images[2]"
  with pytest.raises(RowError, match="grayscale .* expected 3"):
    im.to_pixels(np.zeros((2, 2, 1), np.uint8), 4, 3)
  with pytest.raises(RowError, match="RGBA"):
    im.to_pixels(np.zeros((2, 2, 4), np.uint8), 4, 3)
  with pytest.raises(RowError, match="uint8"):
    im.to_pixels(np.zeros((2, 2, 3), np.float32), 4, 3)
  gray = im.to_pixels(np.full((3, 3, 1), 255, np.uint8), 4, 1)
  assert gray.shape == (4, 4, 1) and (gray[:3, :3] == 1).all()


def test_load_image_paths_inline_bytes_and_modes(tmp_path):
  rgb = _rgb(5, 7)
  (tmp_path / "a.png").write_bytes(_png(rgb))
  by_path = im.load_image("a.png", "images[0]", base_dir=str(tmp_path))
  by_bytes = im.load_image({"bytes": _b64(_png(rgb))}, "images[0]")
  uri = im.load_image({"bytes": "data:image/png;base64," + _b64(_png(rgb))},
                      "x")
  assert by_path.shape == (5, 7, 3) and by_path.dtype == np.uint8
  assert (by_path == rgb).all() and (by_bytes == rgb).all() and (
      uri == rgb).all()
  # Grayscale stays one channel; an opaque alpha channel is dropped.
  gray = np.arange(12, dtype=np.uint8).reshape(3, 4, 1)
  assert (im.load_image({"bytes": _b64(_png(gray))}, "x") == gray).all()
  rgba = np.concatenate([rgb, np.full((5, 7, 1), 255, np.uint8)], -1)
  assert (im.load_image({"bytes": _b64(_png(rgba, "RGBA"))}, "x") == rgb
          ).all()
  # JPEG decodes (lossy, so only the shape is checked).
  assert im.load_image({"bytes": _b64(_png(rgb, fmt="JPEG"))},
                       "x").shape == (5, 7, 3)
  # max_size rejects from the header.
  with pytest.raises(RowError, match="larger than 6x6"):
    im.load_image("a.png", "images[0]", base_dir=str(tmp_path), max_size=6)


# ---------------------------------------------------------------------------
# image_records.py: the JSONL source


def test_source_loads_images_and_answers(tmp_path, monkeypatch):
  rgb, gray = _rgb(8, 6, 1), _rgb(4, 4, 2)
  (tmp_path / "img").mkdir()
  (tmp_path / "img" / "a.png").write_bytes(_png(rgb))
  rows = [
      {"prompt": "<image> and <image>: which is brighter?", "answer": 1,
       "images": ["img/a.png", {"bytes": _b64(_png(gray))}], "task": "t"},
      {"prompt": "text only", "answer": "x"},
  ]
  path = _jsonl(tmp_path / "set.jsonl", rows)
  monkeypatch.chdir("/")  # relative image paths: against the file's dir
  src = ir.load_image_source(path, ir.ImageFields(image_size=8))
  assert len(src) == 2 and src.report.skipped == 0
  r0, r1 = src[0], src[1]
  assert (r0["answer"], r0["task"], r0["id"]) == ("1", "t", "set.jsonl:1")
  assert r0["pixels"].shape == (2, 8, 8, 3)
  assert r0["pixels"].dtype == np.float32
  np.testing.assert_array_equal(r0["pixels"][0], im.to_pixels(rgb, 8, 3))
  np.testing.assert_array_equal(r0["pixels"][1], im.to_pixels(gray, 8, 3))
  assert r1["pixels"].shape == (0, 8, 8, 3)
  assert len(ir.split_prompt(r0["prompt"])) == 3
  ds = grain.MapDataset.source(src).map(lambda r: r["pixels"].shape[0])
  assert [ds[0], ds[1]] == [2, 0]


GOOD = {"prompt": "<image> how many?", "answer": 3,
        "images": [{"bytes": _b64(_png(_rgb(4, 4)))}]}


def _one_image(data: bytes) -> dict:
  return dict(GOOD, images=[{"bytes": _b64(data)}])


BAD_ROWS = [
    ("too large", _one_image(_png(_rgb(9, 4))), "images[0]",
     r"4x9 \(W x H\), larger than 8x8"),
    ("grayscale", _one_image(_png(np.zeros((4, 4, 1), np.uint8))),
     "images[0]", r"grayscale \(1 channel\(s\)\), expected 3"),
    ("translucent", _one_image(_png(np.zeros((4, 4, 4), np.uint8), "RGBA")),
     "images[0]", "16 translucent pixel"),
    ("markers", dict(GOOD, prompt="<image> <image> how many?"), "images",
     "2 '<image>' marker\\(s\\) but there are 1 image"),
    ("max images", dict(GOOD, prompt="<image>" * 3,
                        images=GOOD["images"] * 3), "images",
     "3 images, more than max_images=2"),
    ("missing file", dict(GOOD, prompt="<image><image>",
                          images=GOOD["images"] + ["nope.png"]), "images[1]",
     "image file not found: .*nope.png"),
    ("bad base64", dict(GOOD, images=[{"bytes": "not base64!"}]), "images[0]",
     "bad base64"),
    ("not an image", _one_image(b"hello"), "images[0]", "not an image"),
    ("gif", _one_image(_png(_rgb(4, 4), fmt="GIF")), "images[0]",
     "format GIF is not one of"),
    ("not a list", dict(GOOD, images="a.png"), "images", "expected a list"),
    ("source type", dict(GOOD, images=[3]), "images[0]", "expected a file"),
]


@pytest.mark.parametrize("name, row, field, reason", BAD_ROWS,
                         ids=[b[0] for b in BAD_ROWS])
def test_bad_rows_named_by_file_line_field(tmp_path, name, row, field,
                                           reason):
  path = _jsonl(tmp_path / "bad.jsonl", [GOOD, row, GOOD])
  fields = ir.ImageFields(image_size=8, max_images=2)
  with pytest.raises(DataError) as exc:
    ir.load_image_source(path, fields)
  where = re.escape(f"{path}:2: field {field!r}: ")
  assert re.search(where + ".*" + reason, str(exc.value)), str(exc.value)
  src = ir.load_image_source(path, fields, on_bad_row="skip")
  assert src.report.as_metrics() == {"rows": 3, "kept": 2, "skipped": 1}
  (bad,) = src.report.examples
  assert (bad.line, bad.field) == (2, field)
  assert [src.line(i) for i in range(len(src))] == [1, 3]
  assert src[1]["pixels"].shape == (1, 8, 8, 3)


def test_channel_mode_is_configurable(tmp_path):
  gray = np.arange(16, dtype=np.uint8).reshape(4, 4, 1)
  path = _jsonl(tmp_path / "g.jsonl", [_one_image(_png(gray))])
  src = ir.load_image_source(path, ir.ImageFields(image_size=4, channels=1))
  np.testing.assert_array_equal(src[0]["pixels"][0],
                                im.to_pixels(gray, 4, 1))
  with pytest.raises(DataError, match="expected 3 channel"):
    ir.load_image_source(path, ir.ImageFields(image_size=4))


# ---------------------------------------------------------------------------
# Generated problems: answers recomputed from the pixels


def _components(mask_HxW: np.ndarray) -> list[np.ndarray]:
  """4-connected components of a boolean mask, as (row, col) arrays."""
  seen = np.zeros_like(mask_HxW)
  out = []
  for start in zip(*np.nonzero(mask_HxW)):
    if seen[start]:
      continue
    stack, pixels = [start], []
    seen[start] = True
    while stack:
      y, x = stack.pop()
      pixels.append((y, x))
      for p in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
        if 0 <= p[0] < mask_HxW.shape[0] and 0 <= p[1] < mask_HxW.shape[
            1] and mask_HxW[p] and not seen[p]:
          seen[p] = True
          stack.append(p)
    out.append(np.array(pixels))
  return out


def _shape_of(pixels: np.ndarray) -> str:
  """A filled square fills its bounding box, a disc about pi/4 of it, a
  triangle about half."""
  h, w = np.ptp(pixels, axis=0) + 1
  fill = len(pixels) / (h * w)
  return "square" if fill == 1 else "circle" if fill > 0.68 else "triangle"


@pytest.mark.parametrize("size", [64, 32])
def test_count_answers_match_the_pixels(size):
  cfg = vt.VisualTaskConfig(tasks="count", image_size=size)
  records = vt.make_visual_records(cfg, 40, seed=3)
  assert {r["difficulty"] for r in records} == {1.0, 2.0, 3.0}
  for r in records:
    (img,) = r["images"]
    assert img.shape == (size, size, 3) and img.dtype == np.uint8
    # Only the palette: no anti-aliased in-between colours.
    colours = {tuple(c) for c in img.reshape(-1, 3)}
    assert colours <= {vt.WHITE, *vt.COLOURS.values()}
    colour, shape = re.match(r"How many (\w+) (\w+)s are", r["question"]
                             ).groups()
    found = _components((img == vt.COLOURS[colour]).all(-1))
    if shape != "shape":
      found = [c for c in found if _shape_of(c) == shape]
    assert str(len(found)) == r["answer"], (r["id"], r["question"])
    # Every object drawn is one component of the right colour and shape.
    objects = r["metadata"]["objects"]
    every = [(name, _shape_of(c)) for name, rgb in vt.COLOURS.items()
             for c in _components((img == rgb).all(-1))]
    assert sorted(every) == sorted((o["colour"], o["shape"])
                                   for o in objects)


@pytest.mark.parametrize("size", [64, 32])
def test_bar_answers_match_the_pixels(size):
  cfg = vt.VisualTaskConfig(tasks="bars", image_size=size)
  records = vt.make_visual_records(cfg, 30, seed=5)
  assert {r["difficulty"] for r in records} == {1.0, 2.0, 3.0}
  for r in records:
    (img,) = r["images"]
    baseline = int(np.nonzero((img[:, 0] == vt.BLACK).all(-1))[0][0])
    grid_rows = np.nonzero((img[:, 0] == vt.GRID).all(-1))[0]
    unit = set(np.diff(np.r_[grid_rows, baseline]).tolist())
    assert len(unit) == 1, unit
    (unit,) = unit
    bar = (img == vt.BAR).all(-1)
    cols = np.nonzero(bar.any(0))[0]
    runs = np.split(cols, np.nonzero(np.diff(cols) > 1)[0] + 1)
    heights = [int(bar[:, run[0]].sum()) for run in runs]
    assert all(h % unit == 0 for h in heights)
    values = [h // unit for h in heights]
    assert values == r["metadata"]["values"]
    q = r["question"]
    if "tallest" in q:
      expect = int(np.argmax(values)) + 1
    elif "value of bar" in q:
      expect = values[int(re.search(r"bar (\d+)\?", q)[1]) - 1]
    else:
      i, j = map(int, re.search(r"bar (\d+) than bar (\d+)", q).groups())
      expect = values[i - 1] - values[j - 1]
      assert expect > 0
    assert str(expect) == r["answer"], (r["id"], q)


def _read_text(img: np.ndarray) -> str:
  """The text of a render_text image, read glyph cell by glyph cell at the
  scale where every cell is a font glyph and no ink is left over."""
  ink = (img < 128).all(-1)
  assert ((img == 0).all(-1) | (img == 255).all(-1)).all()
  size = img.shape[0]
  for scale in range(size // vt.GLYPH_H, 0, -1):
    step_x, step_y = (vt.GLYPH_W + 1) * scale, (vt.GLYPH_H + 1) * scale
    left = ink.copy()
    lines, ok = [], True
    for top in range(vt.MARGIN, size - vt.GLYPH_H * scale + 1, step_y):
      line = ""
      for x in range(vt.MARGIN, size - vt.GLYPH_W * scale + 1, step_x):
        cell = ink[top:top + vt.GLYPH_H * scale, x:x + vt.GLYPH_W * scale]
        match = [ch for ch, g in vt.FONT.items()
                 if (np.kron(g, np.ones((scale, scale), bool)) == cell).all()]
        if not match:
          ok = False
          break
        line += match[0]
        left[top:top + vt.GLYPH_H * scale, x:x + vt.GLYPH_W * scale] = False
      if not ok:
        break
      lines.append(line.strip())
    if ok and not left.any():
      return " ".join(line for line in lines if line)
  raise AssertionError("no scale reads the image")


def test_font_glyphs_are_distinct():
  glyphs = [g.tobytes() for g in vt.FONT.values()]
  assert len(set(glyphs)) == len(glyphs)


@pytest.mark.parametrize("size", [64, 32])
def test_chain_sum_images_read_back_and_score_like_text(tmp_path, size):
  records = vt.chain_sum_image_records(12, seed=1, image_size=size)
  path = str(tmp_path / "cs.jsonl")
  vt.write_jsonl(records, path, str(tmp_path / "img"))
  src = ir.load_image_source(path, ir.ImageFields(image_size=size))
  reward = ReasoningGymReward()
  for r, loaded in zip(records, src):
    text = _read_text(r["images"][0])
    assert text == r["image_text"]
    expression, tail = text.split(" = ")
    assert tail == "?" and str(eval(expression)) == r["answer"]
    assert r["question"] not in r["prompt"] and vt.INSTRUCTION in r["prompt"]
    right = reward(loaded, f"<answer>{r['answer']}</answer>")
    wrong = reward(loaded, f"<answer>{int(r['answer']) + 1}</answer>")
    assert (right.correct, wrong.correct) == (True, False)


def test_pointer_chase_images_read_back_and_score_like_text():
  train, _ = pc.make_problems(pc.PointerChaseConfig(), seed=0)
  records = vt.pointer_chase_image_records(train[:20], image_size=32)
  reward = pc.PointerChaseReward()
  for text_record, r in zip(train, records):
    assert _read_text(r["images"][0]) == text_record["prompt"] + " ?"
    assert reward(r, f"c0 {r['answer']} ; > {r['answer']}").correct
    assert reward(r, "> 00").correct == (r["answer"] == "00")


def test_exact_answer_reward():
  reward = vt.ExactAnswerReward()
  record = {"answer": "3"}
  assert reward(record, "so <answer> 3 </answer>").correct
  assert not reward(record, "<answer>4</answer>").correct
  assert not reward(record, "<answer>three</answer>").correct
  assert not reward(record, "3").correct


def test_generation_is_deterministic_per_seed():
  cfg = vt.VisualTaskConfig(image_size=32)
  a = vt.make_visual_records(cfg, 6, seed=7)
  b = vt.make_visual_records(cfg, 6, seed=7)
  c = vt.make_visual_records(cfg, 6, seed=8)
  for x, y in zip(a, b):
    assert x["question"] == y["question"] and x["answer"] == y["answer"]
    assert im.encode_png(x["images"][0]) == im.encode_png(y["images"][0])
  assert any((x["images"][0] != z["images"][0]).any() for x, z in zip(a, c))
  # Record i does not depend on how many are drawn.
  one = vt.visual_record(cfg, 7, 4)
  assert (one["images"][0] == a[4]["images"][0]).all()
  assert vt.make_visual_records(cfg, 2, seed=7, start=4)[0]["id"] == one["id"]
  x, y = (vt.chain_sum_image_records(3, seed=2, image_size=64)
          for _ in range(2))
  assert all((p["images"][0] == q["images"][0]).all() for p, q in zip(x, y))


def test_round_trip_files_and_inline_bytes_agree(tmp_path):
  records = (vt.make_visual_records(vt.VisualTaskConfig(), 6, seed=0) +
             vt.chain_sum_image_records(3, seed=0))
  files = str(tmp_path / "data" / "train.jsonl")
  inline = str(tmp_path / "inline.jsonl")
  (tmp_path / "data").mkdir()
  vt.write_jsonl(records, files, str(tmp_path / "data" / "img"))
  vt.write_jsonl(records, inline)
  with open(files) as f:
    first = json.loads(f.readline())
  assert first["images"] == ["img/train-000000-0.png"]
  by_file, by_bytes = ir.load_image_source(files), ir.load_image_source(inline)
  assert len(by_file) == len(by_bytes) == len(records)
  for r, a, b in zip(records, by_file, by_bytes):
    want = np.stack([im.to_pixels(x, 64, 3) for x in r["images"]])
    np.testing.assert_array_equal(a["pixels"], want)
    np.testing.assert_array_equal(b["pixels"], want)
    for key in ("prompt", "answer", "task", "family", "difficulty"):
      assert a.get(key) == b.get(key) == r.get(key), key
    assert isinstance(b["images"][0], dict) and isinstance(a["images"][0],
                                                           str)


def test_text_too_long_for_the_image_is_an_error():
  with pytest.raises(ValueError, match="does not fit"):
    vt.render_text("1234567 + 1234567", 32)
  with pytest.raises(ValueError, match="no glyph"):
    vt.render_text("1 * 2", 64)
  with pytest.raises(ValueError, match="image_size must be >= 32"):
    vt.VisualTaskConfig(image_size=16)
