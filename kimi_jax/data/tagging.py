"""Domain / discipline tags of prompts and the per-tag balance (report 2.1:
"a tagging system to categorize prompts by domain and discipline, ensuring
balanced representation").

A tagger maps a record to a list of tags. Taggers, by name:

- "record": the record's own `tags` (none when it has none);
- "reasoning_gym": `rg/<dataset>` for reasoning-gym records;
- "keywords": rule-based, the first matching keyword rule of `RULES`
  (ours: math, code, logic, puzzle; "general" otherwise);
- "auto" (default): record tags, else reasoning_gym, else keywords;
- "learned": a model fitted on labelled prompts (`fit_naive_bayes`: a
  multinomial naive Bayes over word unigrams and bigrams, numbers folded to
  one token): record tags, else its most probable tag when the posterior
  is at least `min_confidence`, else none ("untagged"). It learns the
  label set of whatever it is fitted on, e.g. the tagged part of a mixed
  prompt set, to tag the rest.

More rule taggers register in `TAGGERS`. A record's first tag is its
primary tag: per-tag caps count primary tags, so a record is capped once.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

Tagger = Callable[[Mapping[str, Any]], list]

RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("code", re.compile(r"\bdef |\bfunction\b|\bpython\b|\bprogram\b|"
                        r"\bstdin\b|\bcode\b", re.IGNORECASE)),
    ("logic", re.compile(r"\blogic|\bknights?\b|\bknaves?\b|\bsyllogism|"
                         r"\bimplies\b|\bpropositional\b", re.IGNORECASE)),
    ("puzzle", re.compile(r"\bpuzzle\b|\bsudoku\b|\bmaze\b|\bgrid\b",
                          re.IGNORECASE)),
    ("math", re.compile(r"\d\s*[-+*/^=]\s*\d|\bequation\b|\bsolve\b|"
                        r"\bsum\b|\bproduct\b|\bintegral\b|\bprobability\b|"
                        r"\bcount\b|\bhow many\b", re.IGNORECASE)),
)


def record_tags(record: Mapping[str, Any]) -> list:
  return list(record.get("tags") or [])


def reasoning_gym_tags(record: Mapping[str, Any]) -> list:
  spec = record.get("rg")
  if isinstance(spec, Mapping) and isinstance(spec.get("dataset"), str):
    return [f"rg/{spec['dataset']}"]
  return []


def keyword_tags(record: Mapping[str, Any]) -> list:
  text = str(record.get("prompt", ""))
  for tag, pattern in RULES:
    if pattern.search(text):
      return [tag]
  return ["general"]


def auto_tags(record: Mapping[str, Any]) -> list:
  return record_tags(record) or reasoning_gym_tags(record) or \
      keyword_tags(record)


TAGGERS: dict[str, Tagger] = {"record": record_tags,
                              "reasoning_gym": reasoning_gym_tags,
                              "keywords": keyword_tags, "auto": auto_tags}


LEARNED = "learned"
_WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?|[^\sa-z\d]")


def features(text: str) -> list[str]:
  """Lower-cased words, numbers as "<num>" (a tag is about the kind of
  problem, not its numbers), symbols, and the bigrams of all of them."""
  words = ["<num>" if t[0].isdigit() else t
           for t in _WORD.findall(text.lower())]
  return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


@dataclasses.dataclass(frozen=True)
class NaiveBayesTagger:
  """A fitted multinomial naive Bayes (see `fit_naive_bayes`)."""

  tags: tuple[str, ...]
  log_prior: tuple[float, ...]
  # log P(feature | tag) per tag, and the value for an unseen feature.
  log_likelihood: tuple[Mapping[str, float], ...]
  log_unseen: tuple[float, ...]
  min_confidence: float = 0.0

  def posterior(self, text: str) -> list[float]:
    """P(tag | text) for each of `tags`."""
    feats = features(text)
    scores = [prior + sum(table.get(f, unseen) for f in feats)
              for prior, table, unseen in zip(
                  self.log_prior, self.log_likelihood, self.log_unseen)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]

  def __call__(self, record: Mapping[str, Any]) -> list:
    own = record_tags(record)
    if own:
      return own
    post = self.posterior(str(record.get("prompt", "")))
    best = max(range(len(post)), key=post.__getitem__)
    return [self.tags[best]] if post[best] >= self.min_confidence else []


def fit_naive_bayes(texts: Sequence[str], labels: Sequence[str], *,
                    alpha: float = 1.0, min_confidence: float = 0.0
                    ) -> NaiveBayesTagger:
  """Multinomial naive Bayes with add-`alpha` smoothing over the features
  of the training texts (a model, not rules: it learns whatever label set
  it is given)."""
  if len(texts) != len(labels):
    raise ValueError("fit_naive_bayes: one label per text")
  tags = tuple(sorted(set(labels)))
  if len(tags) < 2:
    raise ValueError(f"the learned tagger needs labelled prompts of at "
                     f"least 2 tags, got {list(tags)}")
  counts = {t: collections.Counter() for t in tags}
  docs = collections.Counter(labels)
  for text, label in zip(texts, labels):
    counts[label].update(features(text))
  vocab = set().union(*counts.values())
  tables, unseen = [], []
  for t in tags:
    denom = math.log(sum(counts[t].values()) + alpha * (len(vocab) + 1))
    tables.append({f: math.log(c + alpha) - denom
                   for f, c in counts[t].items()})
    unseen.append(math.log(alpha) - denom)
  prior = tuple(math.log(docs[t] / len(labels)) for t in tags)
  return NaiveBayesTagger(tags, prior, tuple(tables), tuple(unseen),
                          min_confidence)


def check_tagger_name(name: str) -> None:
  known = sorted([*TAGGERS, LEARNED])
  if name not in known:
    raise ValueError(f"unknown tagger {name!r} (known: {known})")


def make_tagger(name: str, labelled: Iterable[Mapping[str, Any]] = (),
                min_confidence: float = 0.0) -> Tagger:
  """The tagger `name`; "learned" is fitted on the primary tags of the
  `labelled` records that have tags."""
  check_tagger_name(name)
  if name != LEARNED:
    return TAGGERS[name]
  pairs = [(str(r.get("prompt", "")), primary(record_tags(r)))
           for r in labelled if record_tags(r)]
  return fit_naive_bayes([p for p, _ in pairs], [t for _, t in pairs],
                         min_confidence=min_confidence)


def primary(tags: Sequence[str]) -> str:
  return tags[0] if tags else "untagged"


def balance(tag_lists: Iterable[Sequence[str]]) -> dict[str, int]:
  """Records per primary tag, most frequent first."""
  counts = collections.Counter(primary(t) for t in tag_lists)
  return dict(counts.most_common())


def over_quota(keys: Sequence[str], quota: Callable[[str], int],
               order: Sequence[int]) -> list[int]:
  """Indices beyond `quota(key)` records of their key (a primary tag, a
  difficulty bucket), visiting records in `order` (a seeded permutation, so
  which ones go is not file order)."""
  seen: collections.Counter = collections.Counter()
  out = []
  for i in order:
    seen[keys[i]] += 1
    if seen[keys[i]] > quota(keys[i]):
      out.append(i)
  return sorted(out)
