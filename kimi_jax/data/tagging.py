"""Domain / discipline tags of prompts and the per-tag balance (report 2.1:
"a tagging system to categorize prompts by domain and discipline, ensuring
balanced representation").

A tagger maps a record to a list of tags. Taggers, by name:

- "record": the record's own `tags` (none when it has none);
- "reasoning_gym": `rg/<dataset>` for reasoning-gym records;
- "keywords": rule-based, the first matching keyword rule of `RULES`
  (ours: math, code, logic, puzzle; "general" otherwise);
- "auto" (default): record tags, else reasoning_gym, else keywords.

More taggers (a model) register in `TAGGERS`. A record's first tag is its
primary tag: per-tag caps count primary tags, so a record is capped once.
"""

from __future__ import annotations

import collections
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


def make_tagger(name: str) -> Tagger:
  if name not in TAGGERS:
    raise ValueError(f"unknown tagger {name!r} (known: {sorted(TAGGERS)})")
  return TAGGERS[name]


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
