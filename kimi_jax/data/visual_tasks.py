"""Generated image+text problems with exact answers (Kimi k1.5's vision data
in miniature), drawn at a small size (default 64 px; 32 px works too).

Two of the report's three vision-data categories:

- synthetic visual reasoning, `make_visual_records`: "count" (how many
  shapes of a colour, or of a colour and a shape, on a grid of cells) and
  "bars" (a bar chart on unit grid lines: which bar is tallest, the value of
  a bar, the difference of two bars), each at difficulty levels 1..3.
  Answers are integers, scored by `ExactAnswerReward` (the last `<answer>`
  span, compared as an integer).
- text rendering, `chain_sum_image_records` / `pointer_chase_image_records`:
  a text problem drawn as an image in a built-in 3x5 pixel font, and a
  generic prompt ("Solve the problem in the image."). The record keeps the
  text version's fields (`answer`, reasoning-gym's `rg` + `question`, the
  pointer chase's `x`, `n`), so the text version's verifier scores it.

Everything is a pure function of (seed, index) and the image size: record i
draws from `np.random.default_rng([seed, i])`, and PIL draws without
anti-aliasing, so every pixel is one of the palette's colours. A generated
record holds its images as uint8 H x W x 3 arrays; `write_jsonl` writes them
as PNG files (or inline base64) in image_records.py's format.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw

from kimi_jax.data import images as im
from kimi_jax.data.image_records import IMAGE_MARKER
from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.reasoning_gym import (DEFAULT_PROMPT_SUFFIX,
                                            extract_answer, make_records)

VISUAL_TASKS = ("count", "bars")
LEVELS = (1, 2, 3)
INSTRUCTION = "Solve the problem in the image."
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
GRID = (200, 200, 200)
BAR = (40, 80, 220)
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60),
           "blue": (40, 80, 220), "yellow": (230, 190, 20)}
SHAPES = ("square", "circle", "triangle")
# Smallest image: 3x3 cells of >= 10 px keep a circle rounder than a square
# and a triangle thinner than a circle.
MIN_IMAGE_SIZE = 32

# ---------------------------------------------------------------------------
# A 3x5 pixel font: digits and the symbols of the rendered problems.

_FONT_ROWS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", "..#", "..#", "..#"),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    "+": ("...", ".#.", "###", ".#.", "..."),
    "-": ("...", "...", "###", "...", "..."),
    "=": ("...", "###", "...", "###", "..."),
    "?": ("###", "..#", ".##", "...", ".#."),
    "c": ("...", "...", "###", "#..", "###"),
    " ": ("...", "...", "...", "...", "..."),
}
FONT = {ch: np.array([[c == "#" for c in row] for row in rows])
        for ch, rows in _FONT_ROWS.items()}
GLYPH_H, GLYPH_W = 5, 3
# Text starts this many pixels from the top-left corner; glyphs are one
# (scaled) pixel apart, lines too.
MARGIN = 2


def _units(text: str) -> list[str]:
  """The words of `text`, an operator kept with the word after it, so a
  line break never separates "-" from its number."""
  units: list[str] = []
  for word in text.split():
    if units and len(units[-1]) == 1 and units[-1] in "+-=":
      units[-1] += " " + word
    else:
      units.append(word)
  return units


def _wrap(text: str, per_line: int) -> list[str] | None:
  """Greedy wrap of `_units` to lines of <= per_line characters; None if a
  unit is longer than a line."""
  lines: list[str] = []
  for word in _units(text):
    if len(word) > per_line:
      return None
    if lines and len(lines[-1]) + 1 + len(word) <= per_line:
      lines[-1] += " " + word
    else:
      lines.append(word)
  return lines


def layout(text: str, image_size: int) -> tuple[int, list[str]]:
  """(scale, lines): the largest integer glyph scale at which `text`,
  word-wrapped, fits in the image; ValueError if none does."""
  unknown = sorted(set(text) - set(FONT))
  if unknown:
    raise ValueError(f"no glyph for {unknown} in {text!r}")
  room = image_size - 2 * MARGIN
  for scale in range(max(1, room // GLYPH_H), 0, -1):
    per_line = (room + scale) // ((GLYPH_W + 1) * scale)
    lines = _wrap(text, per_line) if per_line else None
    if lines and len(lines) * (GLYPH_H + 1) * scale - scale <= room:
      return scale, lines
  raise ValueError(f"{text!r} does not fit a {image_size} px image in the "
                   f"3x5 font")


def render_text(text: str, image_size: int = 64) -> np.ndarray:
  """uint8 image_size x image_size x 3: black text on white, top-left,
  at the largest scale that fits (`layout`)."""
  scale, lines = layout(text, image_size)
  ink_SxS = np.zeros((image_size, image_size), bool)
  for row, line in enumerate(lines):
    top = MARGIN + row * (GLYPH_H + 1) * scale
    for col, ch in enumerate(line):
      left = MARGIN + col * (GLYPH_W + 1) * scale
      glyph = np.kron(FONT[ch], np.ones((scale, scale), bool))
      ink_SxS[top:top + GLYPH_H * scale, left:left + GLYPH_W * scale] = glyph
  out = np.full((image_size, image_size, 3), 255, np.uint8)
  out[ink_SxS] = 0
  return out


# ---------------------------------------------------------------------------
# Synthetic visual reasoning


def _check_size(image_size: int) -> None:
  if image_size < MIN_IMAGE_SIZE:
    raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE}, got "
                     f"{image_size}")


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, ...],
                colour: tuple[int, int, int]) -> None:
  x0, y0, x1, y1 = box
  if shape == "square":
    draw.rectangle(box, fill=colour)
  elif shape == "circle":
    draw.ellipse(box, fill=colour)
  else:
    draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=colour)


# Per level: colours used, shapes used, most objects (as a share of cells),
# and whether the question names the shape too.
_COUNT_LEVELS = {1: (2, 1, 0.5, False), 2: (3, 2, 0.75, False),
                 3: (4, 3, 1.0, True)}


def count_problem(rng: np.random.Generator, level: int, image_size: int
                  ) -> dict[str, Any]:
  """Shapes in the cells of a grid (one per cell, never touching); the
  question asks how many have a colour (level 3: a colour and a shape)."""
  n_colours, n_shapes, share, by_shape = _COUNT_LEVELS[level]
  grid = 3 if image_size < 48 else 4
  cell = image_size // grid
  cells = grid * grid
  n = int(rng.integers(1, max(2, round(share * cells)) + 1))
  colours = list(COLOURS)[:n_colours]
  shapes = SHAPES[:n_shapes]
  img = Image.new("RGB", (image_size, image_size), WHITE)
  draw = ImageDraw.Draw(img)
  objects = []
  for slot in sorted(rng.choice(cells, size=n, replace=False).tolist()):
    colour = colours[int(rng.integers(n_colours))]
    shape = shapes[int(rng.integers(n_shapes))]
    x0, y0 = (slot % grid) * cell + 1, (slot // grid) * cell + 1
    _draw_shape(draw, shape, (x0, y0, x0 + cell - 3, y0 + cell - 3),
                COLOURS[colour])
    objects.append({"cell": slot, "colour": colour, "shape": shape})
  colour = colours[int(rng.integers(n_colours))]
  shape = shapes[int(rng.integers(n_shapes))] if by_shape else None
  answer = sum(o["colour"] == colour and shape in (None, o["shape"])
               for o in objects)
  what = f"{colour} {shape}s" if shape else f"{colour} shapes"
  return {"question": f"How many {what} are in the image?",
          "answer": str(answer), "image": np.asarray(img, np.uint8),
          "metadata": {"objects": objects, "colour": colour, "shape": shape}}


# Per level: bars, and most value (one grid line per unit).
_BAR_LEVELS = {1: (3, 6), 2: (4, 8), 3: (5, 8)}


def bar_geometry(image_size: int, n_bars: int, max_value: int
                 ) -> tuple[int, int, int]:
  """(baseline row, pixels per unit, pixels per bar slot) of a chart."""
  baseline = image_size - 3
  return baseline, (baseline - 2) // max_value, (image_size - 4) // n_bars


def bars_problem(rng: np.random.Generator, level: int, image_size: int
                 ) -> dict[str, Any]:
  """A bar chart on unit grid lines, bars numbered 1..n from the left.
  Level 1: which bar is tallest; 2: the value of a bar; 3: how much taller
  one bar is than another."""
  n_bars, max_value = _BAR_LEVELS[level]
  # Distinct values: "the tallest" is unique, differences are positive.
  values = (rng.permutation(max_value)[:n_bars] + 1).tolist()
  baseline, unit, slot = bar_geometry(image_size, n_bars, max_value)
  img = Image.new("RGB", (image_size, image_size), WHITE)
  draw = ImageDraw.Draw(img)
  for k in range(1, max_value + 1):
    draw.line([(0, baseline - k * unit), (image_size - 1, baseline - k * unit)],
              fill=GRID)
  draw.line([(0, baseline), (image_size - 1, baseline)], fill=BLACK)
  width = max(2, slot * 2 // 3)
  for i, v in enumerate(values):
    left = 2 + i * slot + (slot - width) // 2
    draw.rectangle((left, baseline - v * unit, left + width - 1,
                    baseline - 1), fill=BAR)
  if level == 1:
    answer = int(np.argmax(values)) + 1
    question = (f"The bars are numbered 1 to {n_bars} from left to right. "
                f"Which bar is the tallest?")
  else:
    pick = rng.choice(n_bars, size=2, replace=False).tolist()
    i, j = sorted(pick, key=lambda b: -values[b])
    if level == 2:
      answer = values[i]
      question = (f"The bars are numbered 1 to {n_bars} from left to right; "
                  f"grid lines are 1 apart. What is the value of bar "
                  f"{i + 1}?")
    else:
      answer = values[i] - values[j]
      question = (f"The bars are numbered 1 to {n_bars} from left to right; "
                  f"grid lines are 1 apart. How much taller is bar {i + 1} "
                  f"than bar {j + 1}?")
  return {"question": question, "answer": str(answer),
          "image": np.asarray(img, np.uint8),
          "metadata": {"values": values}}


_PROBLEMS = {"count": count_problem, "bars": bars_problem}


@dataclasses.dataclass(frozen=True)
class VisualTaskConfig:
  """Synthetic visual problems: tasks (comma-separated, of VISUAL_TASKS),
  the levels drawn from (uniformly), and the image size."""

  tasks: str = "count,bars"
  min_level: int = 1
  max_level: int = 3
  image_size: int = 64
  prompt_suffix: str = DEFAULT_PROMPT_SUFFIX

  def __post_init__(self):
    unknown = sorted(set(self.names()) - set(VISUAL_TASKS))
    if not self.names() or unknown:
      raise ValueError(f"visual tasks must be some of {VISUAL_TASKS}, got "
                       f"{self.tasks!r}")
    if not LEVELS[0] <= self.min_level <= self.max_level <= LEVELS[-1]:
      raise ValueError(f"need {LEVELS[0]} <= min_level <= max_level <= "
                       f"{LEVELS[-1]}, got {self.min_level}, "
                       f"{self.max_level}")
    _check_size(self.image_size)

  def names(self) -> list[str]:
    return [n.strip() for n in self.tasks.split(",") if n.strip()]


def visual_record(cfg: VisualTaskConfig, seed: int, index: int
                  ) -> dict[str, Any]:
  """Problem `index` of the set at `seed`: a pure function of both."""
  rng = np.random.default_rng([seed, index])
  names = cfg.names()
  task = names[index % len(names)]
  level = int(rng.integers(cfg.min_level, cfg.max_level + 1))
  p = _PROBLEMS[task](rng, level, cfg.image_size)
  return {"id": f"visual/{task}/{seed}/{index}",
          "prompt": f"{IMAGE_MARKER}\n{p['question']}{cfg.prompt_suffix}",
          "question": p["question"], "answer": p["answer"],
          "images": [p["image"]], "task": task, "family": "visual",
          "difficulty": float(level), "metadata": p["metadata"]}


def make_visual_records(cfg: VisualTaskConfig, size: int, seed: int = 0,
                        start: int = 0) -> list[dict[str, Any]]:
  """Problems [start, start + size) at `seed` (held-out sets: a later
  start, as gym_problems does)."""
  return [visual_record(cfg, seed, i) for i in range(start, start + size)]


@dataclasses.dataclass(frozen=True)
class ExactAnswerReward:
  """1 if the last `<answer>` span equals the record's integer answer."""

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    text = extract_answer(response)
    try:
      correct = text is not None and int(text) == int(record["answer"])
    except ValueError:
      correct = False
    return RewardResult(float(correct), correct, info={"answer": text})


# ---------------------------------------------------------------------------
# Text problems rendered as images


def as_image_record(record: Mapping[str, Any], text: str, image_size: int,
                    instruction: str = INSTRUCTION, suffix: str = ""
                    ) -> dict[str, Any]:
  """`record` with `text` drawn as its image and a generic prompt; its
  other fields (answer, verifier spec) are kept for the text's verifier."""
  out = dict(record)
  out.update(prompt=f"{IMAGE_MARKER}\n{instruction}{suffix}",
             images=[render_text(text, image_size)], image_text=text,
             family="text_image")
  return out


CHAIN_SUM_OPTIONS = {"min_terms": 2, "max_terms": 4, "min_digits": 1,
                     "max_digits": 2}


def chain_sum_image_records(size: int, seed: int = 0, image_size: int = 64,
                            prompt_suffix: str = DEFAULT_PROMPT_SUFFIX,
                            **options: Any) -> list[dict[str, Any]]:
  """reasoning-gym chain_sum problems ("12 + 7 - 3 = ?") as images, scored
  by ReasoningGymReward like the text ones. Options: chain_sum's config
  (default CHAIN_SUM_OPTIONS, which fit 32 px); a problem too long for the
  image raises ValueError."""
  _check_size(image_size)
  options = {**CHAIN_SUM_OPTIONS, **options}
  out = []
  for r in make_records("chain_sum", size=size, seed=seed,
                        prompt_suffix=prompt_suffix, **options):
    text = f"{r['metadata']['expression']} = ?"
    out.append(dict(as_image_record(r, text, image_size,
                                    suffix=prompt_suffix), task="chain_sum"))
  return out


def pointer_chase_image_records(records: Sequence[Mapping[str, Any]],
                                image_size: int = 64,
                                instruction: str = INSTRUCTION
                                ) -> list[dict[str, Any]]:
  """pointer_chase.make_problems records ("37 c5 =") as images, scored by
  PointerChaseReward like the text ones (it reads only `answer`)."""
  _check_size(image_size)
  return [dict(as_image_record(r, f"{r['prompt']} ?", image_size,
                               instruction), task="pointer_chase")
          for r in records]


# ---------------------------------------------------------------------------
# Writing


def _jsonable(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_jsonl(records: Sequence[Mapping[str, Any]], path: str,
                image_dir: str | None = None) -> None:
  """Writes generated records as image_records.py's JSONL: each image as a
  PNG in `image_dir` (named `<jsonl stem>-<row>-<image>.png`, stored
  relative to the JSONL's directory), or inline base64 if image_dir is
  None."""
  stem = os.path.splitext(os.path.basename(path))[0]
  base_dir = os.path.dirname(os.path.abspath(path))
  if image_dir is not None:
    os.makedirs(image_dir, exist_ok=True)
  with open(path, "w") as f:
    for i, record in enumerate(records):
      sources = []
      for j, img in enumerate(record.get("images", [])):
        if image_dir is None:
          sources.append({"bytes": im.encode_base64(img)})
          continue
        file = os.path.join(image_dir, f"{stem}-{i:06d}-{j}.png")
        with open(file, "wb") as out:
          out.write(im.encode_png(img))
        sources.append(os.path.relpath(os.path.abspath(file), base_dir))
      row = dict(record, images=sources)
      f.write(json.dumps(row, default=_jsonable) + "\n")
