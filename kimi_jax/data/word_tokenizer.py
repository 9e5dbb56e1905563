"""A whitespace word-level tokenizer for synthetic tasks, saved beside
checkpoints so `launch/sample.py` can find it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

SPECIALS = ("<pad>", "<bos>", "<eos>")
FILENAME = "word_tokenizer.json"


@dataclasses.dataclass(frozen=True)
class WordTokenizer:
  """Ids 0, 1, 2 are pad, bos, eos; then one id per word of `words`."""

  words: tuple[str, ...]
  pad_id: int = dataclasses.field(default=0, init=False)
  bos_id: int = dataclasses.field(default=1, init=False)
  eos_id: int = dataclasses.field(default=2, init=False)

  def __post_init__(self):
    if len(set(self.words)) != len(self.words):
      raise ValueError("WordTokenizer: duplicate words")
    if any(not w or w.split() != [w] or w in SPECIALS for w in self.words):
      raise ValueError("WordTokenizer: words must be non-empty, without "
                       "spaces, and not special tokens")

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.words)

  def encode(self, text: str) -> list[int]:
    index = {w: i + len(SPECIALS) for i, w in enumerate(self.words)}
    out = []
    for word in text.split():
      if word not in index:
        raise ValueError(f"WordTokenizer: unknown word {word!r}")
      out.append(index[word])
    return out

  def decode(self, ids: Sequence[int]) -> str:
    """Words joined by spaces; special and out-of-range ids are dropped."""
    n = len(SPECIALS)
    return " ".join(self.words[i - n] for i in ids
                    if n <= i < self.vocab_size)

  def save(self, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILENAME)
    with open(path + ".tmp", "w") as f:
      json.dump({"type": "words", "words": list(self.words)}, f)
    os.replace(path + ".tmp", path)
    return path

  @classmethod
  def load(cls, directory: str) -> "WordTokenizer":
    path = os.path.join(directory, FILENAME)
    with open(path) as f:
      data = json.load(f)
    if data.get("type") != "words" or not isinstance(data.get("words"), list):
      raise ValueError(f"{path}: not a word tokenizer file")
    return cls(tuple(data["words"]))
