"""MathVista: image + question items, their pixels and their scoring.

A row (JSONL, MathVista's fields): pid, question, image (a path relative to
the file's folder), answer, question_type ("multi_choice" | "free_form"),
answer_type ("text" | "integer" | "float" | "list"), choices (multi_choice),
precision (float answers: decimal places), other fields kept out.

Scoring is by rule, not by a judge model: the response's final answer (the
last \\boxed{} after the thinking block, else an "Answer:" line, as for
math) is
  multi_choice  a choice's letter, (letter) or text -> that choice; right
                when it is the answer
  integer       a number equal to the answer's integer
  float         a number equal to the answer after rounding both to
                `precision` decimals
  list          a list (Python/JSON literal) equal to the answer's
  text          the answer's text, compared exactly after stripping
A number may carry a unit or thousands separators (`12 cm`, `1,200`): the
one number in it counts.
"""

from __future__ import annotations

import ast
import os
import re
import string
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.data import images as im
from kimi_jax.data.image_records import IMAGE_MARKER
from kimi_jax.evaluation.rows import bad, field, read_rows
from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.math_extract import after_thinking, extract_answer

QUESTION_TYPES = ("multi_choice", "free_form")
ANSWER_TYPES = ("text", "integer", "float", "list")
LETTERS = string.ascii_uppercase
FINAL = ("Please reason step by step, and put your final answer within "
         "\\boxed{}.")
# A side longer than this is not read at all (the benchmark's largest
# images are a few thousand pixels).
MAX_IMAGE_SIDE = 8192


def _how_to_answer(item: Mapping[str, Any]) -> str:
  if item["question_type"] == "multi_choice":
    return "Answer with the letter of the correct choice."
  return {"integer": "Answer with an integer.",
          "float": (f"Answer with a number with {item['precision']} "
                    f"decimal place(s)."),
          "list": "Answer with a Python list.",
          "text": "Answer with a word or phrase."}[item["answer_type"]]


def prompt(item: Mapping[str, Any]) -> str:
  """The image marker, the question, the lettered choices and how to
  answer."""
  lines = [IMAGE_MARKER, str(item["question"]).strip()]
  if item["choices"]:
    lines.append("Choices:")
    lines += [f"({LETTERS[k]}) {c}" for k, c in enumerate(item["choices"])]
  lines.append(f"{_how_to_answer(item)} {FINAL}")
  return "\n".join(lines)


def read_mathvista(path: str) -> list[dict[str, Any]]:
  base = os.path.dirname(os.path.abspath(path))
  items = []
  for i, row in read_rows(path):
    f = {k: field(path, i, row, k) for k in (
        "pid", "question", "image", "answer", "question_type",
        "answer_type")}
    if f["question_type"] not in QUESTION_TYPES:
      raise bad(path, i, "question_type", f"{f['question_type']!r} is not "
                f"one of {QUESTION_TYPES}")
    if f["answer_type"] not in ANSWER_TYPES:
      raise bad(path, i, "answer_type", f"{f['answer_type']!r} is not one "
                f"of {ANSWER_TYPES}")
    choices = row.get("choices") or []
    if f["question_type"] == "multi_choice":
      if (not isinstance(choices, list) or not 2 <= len(choices) <=
          len(LETTERS)):
        raise bad(path, i, "choices", "a multi_choice question needs a list "
                  "of choices")
      if str(f["answer"]) not in [str(c) for c in choices]:
        raise bad(path, i, "answer", f"{f['answer']!r} is not among the "
                  "choices")
    precision = row.get("precision")
    if f["answer_type"] == "float":
      try:
        precision = int(precision)
      except (TypeError, ValueError):
        raise bad(path, i, "precision", f"a float answer needs the number "
                  f"of decimal places, got {precision!r}") from None
    image = os.path.join(base, str(f["image"]))
    if not os.path.isfile(image):
      raise bad(path, i, "image", f"no file {image}")
    item = dict(id=str(f["pid"]), kind="mathvista", image=image,
                question=str(f["question"]), answer=str(f["answer"]),
                question_type=f["question_type"],
                answer_type=f["answer_type"],
                choices=[str(c) for c in choices], precision=precision)
    item["prompt"] = prompt(item)
    items.append(item)
  return items


def pixels(item: Mapping[str, Any], image_size: int, channels: int
           ) -> np.ndarray:
  """float32 1 x S x S x C of the item's image for a tower taking S x S:
  scaled down (aspect kept) when a side is over S, then padded as every
  image (kimi_jax/data/images.py)."""
  from PIL import Image  # lazy: only vision runs read images

  where = f"mathvista {item['id']}: image"
  img = im.load_image(item["image"], where, max_size=MAX_IMAGE_SIDE)
  if channels == 1 and img.shape[-1] == 3:
    img = np.asarray(Image.fromarray(img).convert("L"))[..., None]
  elif channels == 3 and img.shape[-1] == 1:
    img = np.repeat(img, 3, axis=-1)
  height, width = img.shape[:2]
  if max(height, width) > image_size:
    scale = image_size / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    pil = Image.fromarray(img[..., 0] if channels == 1 else img)
    img = np.asarray(pil.resize(size, Image.BICUBIC), np.uint8)
    img = img[..., None] if img.ndim == 2 else img
  return im.to_pixels(img, image_size, channels, where=where)[None]


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def as_number(text: str) -> float | None:
  """The one number in `text` (separators, $, % and units around it
  allowed), or None."""
  clean = text.replace(",", "").replace("\\%", "").replace("$", "")
  found = NUMBER.findall(clean)
  return float(found[0]) if len(found) == 1 else None


def chosen(text: str, choices: Sequence[str]) -> str | None:
  """The choice a multi_choice answer names: its letter (`B`, `(B)`,
  `B.`) or its text; None when it names none."""
  clean = text.strip().strip("().: ").strip()
  if len(clean) == 1 and clean.upper() in LETTERS[:len(choices)]:
    return choices[LETTERS.index(clean.upper())]
  m = re.fullmatch(r"\(?([A-Z])\)?[.:]?\s+(.*)", text.strip())
  if m and m.group(1) in LETTERS[:len(choices)]:
    return choices[LETTERS.index(m.group(1))]
  for c in choices:
    if clean.lower() == c.strip().lower():
      return c
  return None


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text.strip())
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return None


TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def is_correct(item: Mapping[str, Any], answer: str) -> bool:
  """Whether an extracted final answer is the item's (module doc)."""
  answer = TEXT_COMMAND.sub(r"\1", answer).strip()
  if item["question_type"] == "multi_choice":
    return chosen(answer, item["choices"]) == item["answer"]
  kind = item["answer_type"]
  if kind == "integer":
    value = as_number(answer)
    return value is not None and value == int(float(item["answer"]))
  if kind == "float":
    value, p = as_number(answer), int(item["precision"])
    return value is not None and round(value, p) == round(
        float(item["answer"]), p)
  if kind == "list":
    got, want = _literal(answer), _literal(item["answer"])
    return isinstance(got, (list, tuple)) and want is not None and (
        list(got) == list(want))
  return answer.strip() == item["answer"].strip()


class MathVistaReward:
  """The reward of a MathVista item (a `RewardFn`)."""

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    answer = extract_answer(after_thinking(response))
    if answer is None:
      return RewardResult(0.0, False, info={"answer": None})
    right = is_correct(record, answer)
    return RewardResult(float(right), right, info={"answer": answer})
