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

Candidate search (ours): comparing every text with every kept one of its
block costs O(n^2) Jaccards, hours for 10^5 number-free prompts in one
block. `search="minhash"` finds candidates by locality-sensitive hashing
instead (Broder 1997; the banding of Leskovec, Rajaraman and Ullman,
"Mining of Massive Datasets", ch. 3): each text's shingle set gets a
MinHash signature of `bands x rows` values; two texts become candidates
when all `rows` values of some band agree, which for Jaccard s happens with
probability 1 - (1 - s^rows)^bands; candidates are then checked with the
exact Jaccard, so a near duplicate is never reported wrongly, and one is
missed only when it never becomes a candidate. With the defaults (25 bands
of 5) that probability is 0.99995 at s = 0.8 and above 0.9999999 at 0.9
(`candidate_probability`). `search="auto"` (the default) runs the exact
pairwise search up to `pairwise_max` texts and MinHash above.

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
import zlib
from typing import Sequence

import numpy as np

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
# A shingle is template only if this many texts share it, so small sets
# (where any two texts are a large fraction) keep their near duplicates.
MIN_COMMON_TEXTS = 20
SEARCHES = ("pairwise", "minhash", "auto")


@dataclasses.dataclass(frozen=True)
class DedupConfig:
  exact: bool = True
  near: bool = True
  ngram: int = 5
  threshold: float = 0.8
  same_numbers: bool = True
  ignore_common: float = 0.1
  search: str = "auto"  # "pairwise" | "minhash" | "auto" (module doc)
  pairwise_max: int = 2000  # "auto": texts compared above which MinHash runs
  minhash_bands: int = 25
  minhash_rows: int = 5

  def __post_init__(self):
    if self.search not in SEARCHES:
      raise ValueError(f"dedup search must be one of {SEARCHES}, got "
                       f"{self.search!r}")
    if self.minhash_bands < 1 or self.minhash_rows < 1:
      raise ValueError("dedup minhash_bands and minhash_rows must be >= 1")
    if self.pairwise_max < 0:
      raise ValueError("dedup pairwise_max must be >= 0")
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
  n_ref = len(reference)
  every = list(reference) + list(texts)
  all_grams = ([shingles(t, cfg.ngram) for t in every] if cfg.near else [])
  template = template_shingles(all_grams, cfg.ignore_common)
  minhash = cfg.search == "minhash" or (cfg.search == "auto" and
                                        len(every) > cfg.pairwise_max)
  kept = (_MinHashIndex(cfg.minhash_bands, cfg.minhash_rows) if minhash
          else _PairwiseIndex())
  for i, text in enumerate(every):
    key = text_hash(text)
    found = None
    if cfg.exact and key in first_of_hash:
      found = (first_of_hash[key], "exact_duplicate", 1.0)
    elif cfg.near:
      grams = distinctive(all_grams[i], template)
      keys = kept.keys(numbers(text) if cfg.same_numbers else (), grams)
      # Ties go to the later kept text, as max over (similarity, index).
      best = max(((jaccard(grams, g), j) for j, g in kept.candidates(keys)),
                 default=None)
      if best is not None and best[0] >= cfg.threshold:
        found = (best[1], "near_duplicate", best[0])
      else:
        kept.add(keys, i, grams)
    if found is None:
      first_of_hash.setdefault(key, i)
    elif i >= n_ref:  # a reference text repeating another is not reported
      of, kind, similarity = found
      if of < n_ref:
        out.append(Duplicate(i - n_ref, of, "held_out_" + kind, similarity))
      else:
        out.append(Duplicate(i - n_ref, of - n_ref, kind, similarity))
  return out


class _PairwiseIndex:
  """Kept texts by block (number sequence, or one block): every one is a
  candidate of every later text of its block. A text's keys: its block."""

  def __init__(self):
    self._blocks: dict[tuple, list[tuple[int, frozenset]]] = {}

  def keys(self, block: tuple, grams: frozenset) -> tuple:
    del grams
    return block

  def candidates(self, block: tuple):
    return self._blocks.get(block, ())

  def add(self, block: tuple, index: int, grams: frozenset) -> None:
    self._blocks.setdefault(block, []).append((index, grams))


# Multiply-shift hashing of 32-bit keys (Dietzfelbinger et al. 1997): the
# high 32 bits of a x + b mod 2^64, one (a, b) per signature row. Fixed
# seed, so the same input gives the same duplicates in every run.
_MAX_ROWS = 4096
_RNG = np.random.default_rng(20251124)
_A = _RNG.integers(1, 2**63, _MAX_ROWS, dtype=np.uint64) | np.uint64(1)
_B = _RNG.integers(0, 2**63, _MAX_ROWS, dtype=np.uint64)


def shingle_keys(grams: frozenset) -> np.ndarray:
  """32-bit keys of a shingle set (CRC-32: stable across processes)."""
  return np.fromiter((zlib.crc32(g.encode()) for g in grams), np.uint64,
                     len(grams))


def minhash_signature(grams: frozenset, n: int) -> np.ndarray:
  """n MinHash values (uint32) of a shingle set: per row, the least hash of
  its shingles under that row's hash function."""
  if not 1 <= n <= _MAX_ROWS:
    raise ValueError(f"a MinHash signature has 1 to {_MAX_ROWS} values")
  keys = shingle_keys(grams)
  with np.errstate(over="ignore"):  # mod 2^64 is the point
    hashed_SxN = (keys[:, None] * _A[None, :n] + _B[None, :n]) >> np.uint64(32)
  return hashed_SxN.min(axis=0).astype(np.uint32)


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
  """P(two sets of this Jaccard share a band): 1 - (1 - s^rows)^bands."""
  return 1.0 - (1.0 - similarity ** rows) ** bands


class _MinHashIndex:
  """Kept texts in LSH buckets: (block, band, that band's values) -> texts.
  Candidates of a text: the kept texts sharing one of its buckets."""

  def __init__(self, bands: int, rows: int):
    self.bands, self.rows = bands, rows
    self._buckets: dict[tuple, list[int]] = {}
    self._grams: dict[int, frozenset] = {}

  def keys(self, block: tuple, grams: frozenset) -> list[tuple]:
    """A text's buckets, one per band."""
    sig_BxR = minhash_signature(grams, self.bands * self.rows).reshape(
        self.bands, self.rows)
    return [(block, b, sig_BxR[b].tobytes()) for b in range(self.bands)]

  def candidates(self, keys: list[tuple]):
    seen = {j for key in keys for j in self._buckets.get(key, ())}
    return [(j, self._grams[j]) for j in sorted(seen)]

  def add(self, keys: list[tuple], index: int, grams: frozenset) -> None:
    self._grams[index] = grams
    for key in keys:
      self._buckets.setdefault(key, []).append(index)
