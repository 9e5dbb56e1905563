"""Exact and near-duplicate prompts (report 2.1: a diverse prompt set).

Two prompts are exact duplicates when their normalised texts are equal:
Unicode NFKC, lower case, every run of non-alphanumeric characters one
space (so spacing, punctuation and case do not count). The key is the
SHA-1 of that text.

Two prompts are near duplicates when the Jaccard similarity of their
character n-gram sets (n = 5 by default, over the normalised text) is at
least the threshold, 0.8 by default: resemblance of shingle sets (Broder,
"On the resemblance and containment of documents", 1997) at the 0.8
threshold of e.g. Lee et al., "Deduplicating Training Data Makes Language
Models Better" (2022). Character shingles rather than word shingles because
prompts are short: one changed word in a 20-word problem leaves a word
3-gram Jaccard of 0.75, a character 5-gram Jaccard near 0.9. Ours, since
the report gives no threshold.

Numbers guard (ours): templated problems share most of their words and
differ only in their numbers ("What is 3 + 5?" / "What is 4 + 7?"); they are
different problems. With `same_numbers=True` two prompts are near
duplicates only if they also carry the same sequence of numbers. Prompts are
compared within blocks of equal number sequences, so the pairwise check
costs O(block size^2), not O(n^2), for numeric data.

Template guard (ours): generated problems share a long template ("Spell
this word backward (example: sun -> nus): cat"), whose shingles alone can
push two different problems past the threshold. Shingles found in more than
`ignore_common` of all the texts compared (and in at least
`MIN_COMMON_TEXTS` of them) are template, and are left out of both sets
before the Jaccard; a text left with no shingle of its own keeps its full
set. 1.0 switches the guard off.

The first occurrence of a group (in input order) is kept; each later one
names the row it duplicates. Texts that repeat a `reference` set (the
held-out evaluation problems) are dropped too, so training never sees an
evaluation problem.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import unicodedata
from typing import Sequence

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
# A shingle is template only if this many texts share it, so small sets
# (where any two texts are a large fraction) keep their near duplicates.
MIN_COMMON_TEXTS = 20


@dataclasses.dataclass(frozen=True)
class DedupConfig:
  exact: bool = True
  near: bool = True
  ngram: int = 5
  threshold: float = 0.8
  same_numbers: bool = True
  ignore_common: float = 0.1

  def __post_init__(self):
    if self.ngram < 1:
      raise ValueError(f"dedup ngram must be >= 1, got {self.ngram}")
    if not 0.0 < self.threshold <= 1.0:
      raise ValueError(f"dedup threshold must be in (0, 1], got "
                       f"{self.threshold}")
    if not 0.0 < self.ignore_common <= 1.0:
      raise ValueError(f"dedup ignore_common must be in (0, 1], got "
                       f"{self.ignore_common}")


def normalise(text: str) -> str:
  """Case-, spacing- and punctuation-free text (see the module doc)."""
  text = unicodedata.normalize("NFKC", text).lower()
  return _NON_WORD.sub(" ", text).strip()


def text_hash(text: str) -> str:
  return hashlib.sha1(normalise(text).encode()).hexdigest()


def shingles(text: str, n: int) -> frozenset[str]:
  """Character n-grams of the normalised text (the whole text if shorter)."""
  text = normalise(text)
  if len(text) <= n:
    return frozenset([text])
  return frozenset(text[i:i + n] for i in range(len(text) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
  if not a and not b:
    return 1.0
  return len(a & b) / len(a | b)


def numbers(text: str) -> tuple[str, ...]:
  return tuple(_NUMBER.findall(unicodedata.normalize("NFKC", text)))


def template_shingles(grams: Sequence[frozenset], fraction: float
                      ) -> frozenset[str]:
  """Shingles in more than `fraction` of the sets (and in at least
  MIN_COMMON_TEXTS of them); none when fraction is 1."""
  if fraction >= 1.0:
    return frozenset()
  counts = collections.Counter(g for gs in grams for g in gs)
  return frozenset(g for g, n in counts.items()
                   if n > fraction * len(grams) and n >= MIN_COMMON_TEXTS)


def distinctive(grams: frozenset, template: frozenset) -> frozenset:
  """A text's own shingles: without the template's, unless none is left."""
  own = grams - template
  return own if own else grams


@dataclasses.dataclass(frozen=True)
class Duplicate:
  index: int        # the dropped text
  of: int           # the earlier text it duplicates
  kind: str         # "exact_duplicate" | "near_duplicate"
  similarity: float


def find_duplicates(texts: Sequence[str], cfg: DedupConfig = DedupConfig(),
                    reference: Sequence[str] = ()) -> list[Duplicate]:
  """Every text that repeats an earlier kept one, in input order.

  reference: texts that must not reappear (a held-out set): a text that
  duplicates one of them is reported with kind "held_out_" + kind and `of`
  its index in `reference`.
  """
  out: list[Duplicate] = []
  first_of_hash: dict[str, int] = {}
  # Kept texts by block (number sequence or one block): (index, shingles);
  # indices below len(reference) are the reference texts.
  blocks: dict[tuple, list[tuple[int, frozenset]]] = {}
  n_ref = len(reference)
  every = list(reference) + list(texts)
  all_grams = ([shingles(t, cfg.ngram) for t in every] if cfg.near else [])
  template = template_shingles(all_grams, cfg.ignore_common)
  for i, text in enumerate(every):
    key = text_hash(text)
    found = None
    if cfg.exact and key in first_of_hash:
      found = (first_of_hash[key], "exact_duplicate", 1.0)
    elif cfg.near:
      grams = distinctive(all_grams[i], template)
      block = blocks.setdefault(numbers(text) if cfg.same_numbers else (),
                                [])
      best = max(((jaccard(grams, g), j) for j, g in block), default=None)
      if best is not None and best[0] >= cfg.threshold:
        found = (best[1], "near_duplicate", best[0])
      else:
        block.append((i, grams))
    if found is None:
      first_of_hash.setdefault(key, i)
    elif i >= n_ref:  # a reference text repeating another is not reported
      of, kind, similarity = found
      if of < n_ref:
        out.append(Duplicate(i - n_ref, of, "held_out_" + kind, similarity))
      else:
        out.append(Duplicate(i - n_ref, of - n_ref, kind, similarity))
  return out
