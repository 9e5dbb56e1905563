"""Every relative link in README.md and docs/ names a file that exists and,
with a #fragment, a heading of that file (GitHub's anchor rule)."""

import collections
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _markdown_files() -> list[str]:
  docs = os.path.join(ROOT, "docs")
  return ["README.md"] + sorted(
      os.path.join("docs", name) for name in os.listdir(docs)
      if name.endswith(".md"))


def _prose_lines(path: str) -> list[str]:
  """The file's lines outside fenced code blocks."""
  out, fenced = [], False
  with open(os.path.join(ROOT, path)) as f:
    for line in f:
      if FENCE.match(line.strip()):
        fenced = not fenced
      elif not fenced:
        out.append(line.rstrip("\n"))
  return out


def slug(heading: str) -> str:
  """GitHub's anchor: lower case, punctuation but '-' and '_' dropped,
  each space a hyphen."""
  text = heading.strip().lower().replace("`", "")
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
  """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
  seen: collections.Counter = collections.Counter()
  out = set()
  for line in _prose_lines(path):
    match = re.match(r"^#{1,6}\s+(.*)$", line)
    if not match:
      continue
    base = slug(match.group(1))
    out.add(base if not seen[base] else f"{base}-{seen[base]}")
    seen[base] += 1
  return out


def test_slug_by_hand():
  assert slug("One job from raw problems: `experiments/gym_tiny.py`") == (
      "one-job-from-raw-problems-experimentsgym_tinypy")
  assert slug("`curation`: curated vs raw RL prompts (2.1)") == (
      "curation-curated-vs-raw-rl-prompts-21")
  assert slug("Figures: `:spelling` and `:three_tasks`") == (
      "figures-spelling-and-three_tasks")
  assert "curation-curated-vs-raw-rl-prompts-21" in anchors(
      os.path.join("docs", "ablations.md"))


@pytest.mark.parametrize("path", _markdown_files())
def test_relative_links_resolve(path):
  broken = []
  for line in _prose_lines(path):
    for target in LINK.findall(line):
      if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
        continue
      file_part, _, fragment = target.partition("#")
      linked = (os.path.normpath(os.path.join(os.path.dirname(path),
                                              file_part))
                if file_part else path)
      if not os.path.exists(os.path.join(ROOT, linked)):
        broken.append(f"{target}: no file {linked}")
      elif fragment and linked.endswith(".md") and (
          fragment not in anchors(linked)):
        broken.append(f"{target}: no heading #{fragment} in {linked}")
  assert not broken, f"{path}: " + "; ".join(broken)
