"""A character-level tokenizer for synthetic tasks, saved beside checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
FILENAME = "char_tokenizer.json"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Ids 0, 1, 2 are pad, bos, eos; then one id per character."""

  chars: str

  def __post_init__(self):
    if len(set(self.chars)) != len(self.chars):
      raise ValueError(f"CharTokenizer: duplicate characters in {self.chars!r}")

  pad_id: int = dataclasses.field(default=0, init=False)
  bos_id: int = dataclasses.field(default=1, init=False)
  eos_id: int = dataclasses.field(default=2, init=False)

  @property
  def vocab_size(self) -> int:
    return 3 + len(self.chars)

  def encode(self, text: str) -> list[int]:
    index = {c: i + 3 for i, c in enumerate(self.chars)}
    try:
      return [index[c] for c in text]
    except KeyError as exc:
      raise ValueError(f"CharTokenizer: character {exc.args[0]!r} is not in "
                       f"the vocabulary {self.chars!r}") from None

  def decode(self, ids: Sequence[int]) -> str:
    """Drops special tokens; stops at nothing (callers cut at eos)."""
    return "".join(self.chars[i - 3] for i in ids if 3 <= i < self.vocab_size)

  def save(self, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILENAME)
    with open(path + ".tmp", "w") as f:
      json.dump({"type": "char", "chars": self.chars}, f)
    os.replace(path + ".tmp", path)
    return path

  @classmethod
  def load(cls, directory: str) -> "CharTokenizer":
    path = os.path.join(directory, FILENAME)
    with open(path) as f:
      data = json.load(f)
    if data.get("type") != "char" or not isinstance(data.get("chars"), str):
      raise ValueError(f"{path}: not a character tokenizer file")
    return cls(data["chars"])
