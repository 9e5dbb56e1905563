"""A small Hugging Face tokenizer for models trained from scratch on text
tasks: the task's template words are one token each, everything else is
spelled one character at a time.

A laptop-sized policy cannot afford a 150k-token vocabulary, and a learned
BPE would merge digits and letters unpredictably, which hides exactly what
arithmetic, spelling and counting problems are about. Here a word (a run of
ASCII letters, with the space before it) is one token when it is frequent
across the prompt set (`min_fraction` of the problems of some group, so
template words like " arithmetic" qualify and a problem's own word does
not); digits, other characters and rare words are single characters.
Decoding concatenates the pieces, so text round-trips exactly.

The result is written as an ordinary Hugging Face tokenizer directory
(`tokenizer.json`, `tokenizer_config.json`), so every JSONL path of the job
(`task.tokenizer`, docs/real_path.md) uses it as it would a checkpoint's.
"""

from __future__ import annotations

import collections
import json
import os
import re
import string
from typing import Iterable, Mapping, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# Every printable ASCII character and the newline is always in the vocab.
CHARACTERS = tuple(dict.fromkeys(string.printable.replace("\r", "")
                                 .replace("\x0b", "").replace("\x0c", "")))
_WORD = re.compile(r" ?[A-Za-z]+")
# Markup every response of the gym tasks carries, one token each.
DEFAULT_PIECES = ("<answer>", "</answer>")


def frequent_words(groups: Mapping[str, Sequence[str]], min_fraction: float
                   ) -> list[str]:
  """Words (with their leading space, if any) that occur in at least
  `min_fraction` of the texts of some group, sorted."""
  if not 0 < min_fraction <= 1:
    raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")
  words: set[str] = set()
  for texts in groups.values():
    if not texts:
      continue
    seen = collections.Counter()
    for text in texts:
      seen.update(set(_WORD.findall(text)))
    need = min_fraction * len(texts)
    words.update(w for w, n in seen.items() if n >= need and len(w) > 1)
  return sorted(words)


def _pattern(words: Sequence[str], pieces: Sequence[str]) -> str:
  """One piece per fixed piece, per known word (not followed by another
  letter), else one character per piece."""
  alternatives = []
  if pieces:
    alternatives.append("|".join(re.escape(p) for p in
                                 sorted(pieces, key=len, reverse=True)))
  if words:
    alternatives.append("(?:" + "|".join(
        re.escape(w) for w in sorted(words, key=len, reverse=True)) +
                        ")(?![A-Za-z])")
  return "|".join(alternatives + [r"[\s\S]"])


def build(words: Iterable[str], pieces: Sequence[str] = DEFAULT_PIECES
          ) -> tokenizers.Tokenizer:
  """The tokenizer: specials, every character, `pieces` (fixed strings
  such as answer tags), then `words`."""
  words = [w for w in dict.fromkeys(words) if w not in CHARACTERS]
  for w in words:
    if not _WORD.fullmatch(w):
      raise ValueError(f"word {w!r}: must be ASCII letters after an "
                       f"optional space")
  pieces = [p for p in dict.fromkeys(pieces) if p not in CHARACTERS]
  vocab = {t: i for i, t in enumerate(
      (*SPECIALS, *CHARACTERS, *pieces, *words))}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(
      tokenizers.Regex(_pattern(words, pieces)), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIALS))
  # A document starts with BOS (what prompt encoding adds for base models).
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
  return tok


def save(tok: tokenizers.Tokenizer, directory: str) -> str:
  """Writes a Hugging Face tokenizer directory (no chat template: prompts
  are plain text, `task.chat_template=False`)."""
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "unk_token": UNK, "model_max_length": 4096}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return directory


def build_for(groups: Mapping[str, Sequence[str]], directory: str,
              min_fraction: float = 0.1) -> tokenizers.Tokenizer:
  """Builds from a prompt set (texts grouped, e.g. per dataset) and saves."""
  tok = build(frequent_words(groups, min_fraction))
  save(tok, directory)
  return tok
