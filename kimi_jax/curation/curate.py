"""RL prompt-set curation (report 2.1): raw problems in, a diverse,
difficulty-labelled, verifiable prompt set out, and nothing lost silently.

`curate(path, cfg, policy=, reward=)` reads a JSONL prompt set and runs
these steps, in this order, each switchable (`CurateConfig`) and counted in
the report:

1. read: every row validated as the RL task would (`records.PromptFields`);
   a bad row stops the run naming file, line and field
   (`on_bad_row="error"`) or is rejected with its reason ("reject").
2. format: multiple-choice, true/false and proof problems are dropped
   (`question_format.detect`, rule-based).
3. dedup: exact and near-duplicate prompts are dropped (`dedup`: normalised
   hash, character 5-gram Jaccard >= 0.8), and so are prompts that repeat a
   held-out evaluation problem (`held_out`).
4. tags: each record gets domain tags (`tagging`: its own, or a tagger's:
   rules, or a model fitted on labelled prompts, `tagger="learned"`); the
   report holds the per-tag balance before and after curation.
5. easy_to_hack: the model answers with no chain of thought `hack_guesses`
   times (8, the report's N); a prompt answered correctly by any guess is
   dropped.
6. pass_rate: the model samples `pass_samples` answers (10, the report's) at
   `pass_temperature`; the verified pass rate is stored in `pass_rate` and
   a difficulty bucket in the task's difficulty field (`difficulty`: 0 the
   easiest bucket; higher is harder, as the curriculum of
   `rl/prompt_sampling.py` reads it; `difficulty_bucket` names it). A
   prompt solved more often than `max_pass_rate` is dropped as trivial.
7. tag_cap: at most `max_per_tag` records per primary tag (seeded choice).
8. difficulty_balance: the difficulty buckets cut to the shares in
   `bucket_shares` (report 2.1, "balanced difficulty"): the largest set
   whose bucket counts are in those proportions (seeded choice of which
   rows go; a bucket with no rows is left out of the proportion).

After the steps, the report's `answer_shift` compares each tag's answers in
the input and in the kept rows, and warns when curation all but removed an
answer the input is full of (`answer_shift.py`: the easy-to-hack step does
that to small answer sets, and RL on the rest then learns the answer is
rare).

The curated file holds the kept rows as read, plus the fields the steps
add; the rejected file holds every dropped row with `step`, `reason`,
`detail` and its `line`; kept + rejected = rows read, which the report
states (`accounted`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.curation import question_format
from kimi_jax.curation import answer_shift as shift_lib
from kimi_jax.curation import dedup as dedup_lib
from kimi_jax.curation.policy import Policy, sample_verified
from kimi_jax.data import tagging
from kimi_jax.data import records as records_lib
from kimi_jax.data.journal import CHUNK_PROMPTS, Journal, ModelCalls
from kimi_jax.data.records import DataError, PromptFields, RowError
from kimi_jax.rewards.base import RewardFn

STEPS = ("read", "format", "dedup", "tags", "easy_to_hack", "pass_rate",
         "tag_cap", "difficulty_balance")
_MODEL_STEPS = ("easy_to_hack", "pass_rate")
_ON_BAD_ROW = ("error", "reject")
NO_COT_TEMPLATE = ("{question}\n\nGive only the final answer between "
                   "<answer> and </answer> tags, with no reasoning.")


@dataclasses.dataclass(frozen=True)
class CurateConfig:
  """The `curate` config section (see the module doc for the steps)."""

  # Schema: field names as in the task section (kimi_jax/data/tasks.py).
  kind: str = "open"  # "math" | "code" | "open" (records.PromptFields)
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  difficulty_field: str = "difficulty"
  tags_field: str = "tags"
  tests_field: str = "tests"
  # The problem text that formats, duplicates and guesses look at: this
  # field when a row has it (reasoning-gym's bare `question`), else the
  # prompt.
  question_field: str = "question"
  on_bad_row: str = "error"
  format_filter: bool = True
  dedup: bool = True
  dedup_exact: bool = True
  dedup_near: bool = True
  dedup_ngram: int = 5  # characters
  dedup_threshold: float = 0.8
  dedup_same_numbers: bool = True
  # Shingles in more than this fraction of the prompts are template
  # (kimi_jax/curation/dedup.py); 1.0: off.
  dedup_ignore_common: float = 0.1
  # "pairwise" (exact), "minhash" (LSH candidates, for large sets) or
  # "auto": pairwise up to 2000 prompts (kimi_jax/curation/dedup.py).
  dedup_search: str = "auto"
  tags: bool = True
  tagger: str = "auto"
  # The "learned" tagger (tagging.fit_naive_bayes; ours) is fitted on this
  # JSONL of labelled prompts (prompt_field and tags_field), or, when empty,
  # on the input rows that have tags, and tags the rest; below this
  # posterior a row stays untagged.
  tagger_train: str = ""
  tagger_min_confidence: float = 0.5
  max_per_tag: int = 0  # 0: no cap
  easy_to_hack: bool = True
  hack_guesses: int = 8  # report 2.1: N = 8
  hack_template: str = NO_COT_TEMPLATE
  # Opens the response, so the model answers at once (see data/policy.py).
  hack_response_prefix: str = "<answer>"
  hack_max_tokens: int = 16
  hack_temperature: float = 1.0
  pass_rate: bool = True
  pass_samples: int = 10  # report 2.1: ten answers per prompt
  # How the model is asked when its pass rate is measured: the prompt as RL
  # poses it, or with a cue for a model whose plain-prompt answers are not
  # the chain-of-thought mode RL trains (ours; must contain {prompt}).
  pass_template: str = "{prompt}"
  pass_temperature: float = 1.0  # "relatively high" (ours: 1.0)
  pass_max_tokens: int = 256
  # Pass-rate edges between difficulty buckets, hardest last: a pass rate
  # >= edges[0] is bucket 0, [edges[1], edges[0]) bucket 1, ... (ours).
  difficulty_edges: tuple[float, ...] = (0.7, 0.3)
  bucket_names: tuple[str, ...] = ("easy", "medium", "hard")
  max_pass_rate: float = 1.0  # drop prompts solved more often (trivial)
  min_pass_rate: float = 0.0  # drop prompts solved less often (0: keep all)
  # Shares of the difficulty buckets in the kept set, in bucket_names order
  # (e.g. (1, 1, 1): as many easy as medium as hard; a 0 drops a bucket);
  # empty: no balancing (ours; report 2.1 asks for "a well-distributed
  # range of easy, moderate, and difficult questions").
  bucket_shares: tuple[float, ...] = ()
  # A bucket with fewer rows is kept whole and does not limit the others
  # (ours: buckets of 0 / 1 / 970 prompts, measured, would keep 2).
  bucket_min_rows: int = 10
  # Prompts per model call in the model steps; each finished chunk is kept
  # in the journal, so a killed run resumes there (ours).
  chunk_prompts: int = CHUNK_PROMPTS
  # The answer-shift check (answer_shift.py; ours): an answer at least
  # min_share of a tag's input rows but under keep_ratio times that share of
  # its kept rows is reported, for tags of at least min_rows input rows.
  answer_shift: bool = True
  answer_shift_min_share: float = 0.25
  answer_shift_keep_ratio: float = 0.25
  answer_shift_min_rows: int = 20
  seed: int = 0

  def __post_init__(self):
    if self.on_bad_row not in _ON_BAD_ROW:
      raise ValueError(f"curate.on_bad_row must be one of {_ON_BAD_ROW}, "
                       f"got {self.on_bad_row!r}")
    for key in ("hack_guesses", "pass_samples", "hack_max_tokens",
                "pass_max_tokens"):
      if getattr(self, key) < 1:
        raise ValueError(f"curate.{key} must be >= 1")
    if self.chunk_prompts < 1:
      raise ValueError("curate.chunk_prompts must be >= 1")
    if self.max_per_tag < 0:
      raise ValueError("curate.max_per_tag must be >= 0 (0: no cap)")
    edges = list(self.difficulty_edges)
    if edges != sorted(edges, reverse=True) or not all(
        0 <= e <= 1 for e in edges):
      raise ValueError(f"curate.difficulty_edges must be decreasing pass "
                       f"rates in [0, 1], got {self.difficulty_edges}")
    if len(self.bucket_names) != len(edges) + 1:
      raise ValueError(f"curate.bucket_names needs {len(edges) + 1} names "
                       f"(one more than difficulty_edges)")
    shares = tuple(self.bucket_shares)
    if shares and (len(shares) != len(self.bucket_names)
                   or min(shares) < 0 or sum(shares) <= 0):
      raise ValueError(
          f"curate.bucket_shares needs {len(self.bucket_names)} shares >= 0 "
          f"(one per bucket of {tuple(self.bucket_names)}, not all 0), got "
          f"{self.bucket_shares}")
    if self.bucket_min_rows < 1:
      raise ValueError("curate.bucket_min_rows must be >= 1")
    if shares and not self.pass_rate:
      raise ValueError("curate.bucket_shares balances the buckets the "
                       "pass_rate step measures: turn curate.pass_rate on")
    if not 0 <= self.min_pass_rate <= self.max_pass_rate <= 1:
      raise ValueError("curate: need 0 <= min_pass_rate <= max_pass_rate "
                       "<= 1")
    if "{prompt}" not in self.pass_template:
      raise ValueError("curate.pass_template must contain {prompt}")
    if "{question}" not in self.hack_template:
      raise ValueError("curate.hack_template must contain {question}")
    tagging.check_tagger_name(self.tagger)
    if not 0 <= self.tagger_min_confidence <= 1:
      raise ValueError("curate.tagger_min_confidence must be in [0, 1]")
    if self.tagger_train and self.tagger != tagging.LEARNED:
      raise ValueError(f"curate.tagger_train fits the {tagging.LEARNED!r} "
                       f"tagger; curate.tagger is {self.tagger!r}")
    self.fields()
    self.dedup_config()
    self.shift_rule()

  def fields(self) -> PromptFields:
    return PromptFields(kind=self.kind, prompt=self.prompt_field,
                        answer=self.answer_field,
                        difficulty=self.difficulty_field,
                        tags=self.tags_field, tests=self.tests_field)

  def dedup_config(self) -> dedup_lib.DedupConfig:
    return dedup_lib.DedupConfig(
        exact=self.dedup_exact, near=self.dedup_near, ngram=self.dedup_ngram,
        threshold=self.dedup_threshold, same_numbers=self.dedup_same_numbers,
        ignore_common=self.dedup_ignore_common, search=self.dedup_search)

  def shift_rule(self) -> shift_lib.ShiftRule:
    try:
      return shift_lib.ShiftRule(self.answer_shift_min_share,
                                 self.answer_shift_keep_ratio,
                                 self.answer_shift_min_rows)
    except ValueError as exc:
      raise ValueError(f"curate.answer_shift_{exc}") from None

  @property
  def needs_model(self) -> bool:
    return self.easy_to_hack or self.pass_rate


@dataclasses.dataclass
class Row:
  """One row of the input: its line, the row as read (None if it is not a
  JSON object: then `text`), and its canonical record."""

  line: int
  raw: dict | None
  record: dict | None = None
  text: str = ""
  added: dict = dataclasses.field(default_factory=dict)

  def output(self) -> dict:
    return dict(self.raw, **self.added)


@dataclasses.dataclass(frozen=True)
class Dropped:
  row: Row
  step: str
  reason: str
  detail: str = ""

  def to_json(self, path: str) -> dict:
    out = {"file": path, "line": self.row.line, "step": self.step,
           "reason": self.reason, "detail": self.detail}
    if self.row.raw is not None:
      out["row"] = self.row.raw
    else:
      out["row_text"] = self.row.text
    if self.row.added:
      # What the steps before the drop measured (tags, pass rate), apart
      # from the row as read, which stays re-usable as input.
      out["added"] = dict(self.row.added)
    return out


@dataclasses.dataclass
class StepReport:
  name: str
  enabled: bool
  rows_in: int = 0
  kept: int = 0
  dropped: dict = dataclasses.field(default_factory=dict)
  info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CurateResult:
  kept: list[Row]
  dropped: list[Dropped]
  steps: list[StepReport]
  rows_read: int
  path: str
  answer_shift: dict = dataclasses.field(default_factory=dict)

  def report(self) -> dict:
    reasons = collections.Counter(d.reason for d in self.dropped)
    return {
        "input": self.path, "rows": self.rows_read, "kept": len(self.kept),
        "dropped": len(self.dropped),
        "dropped_by_reason": dict(sorted(reasons.items())),
        "accounted": len(self.kept) + len(self.dropped) == self.rows_read,
        "steps": [dataclasses.asdict(s) for s in self.steps],
        "answer_shift": self.answer_shift}


# ---------------------------------------------------------------------------
# Reading


def read_rows(path: str, cfg: CurateConfig
              ) -> tuple[list[Row], list[Dropped]]:
  """Every non-blank line of `path` as a Row; bad ones rejected (or, with
  on_bad_row="error", a DataError naming file, line and field)."""
  if not os.path.isfile(path):
    raise DataError(f"{path}: file not found")
  fields = cfg.fields()
  rows, bad = [], []
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      row = Row(line_no, None, text=raw.decode("utf-8", "replace").rstrip())
      try:
        try:
          parsed = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
          raise RowError(None, f"not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
          raise RowError(None, f"expected a JSON object, got "
                         f"{type(parsed).__name__}")
        row.raw = parsed
        row.record = fields.validate(parsed)
        row.record.setdefault("id", f"{os.path.basename(path)}:{line_no}")
      except RowError as exc:
        where = f"{path}:{line_no}" + (f": field {exc.field!r}"
                                       if exc.field else "")
        if cfg.on_bad_row == "error":
          raise DataError(f"{where}: {exc.reason} (set curate.on_bad_row="
                          f"'reject' to move bad rows to the rejected file)"
                          ) from None
        bad.append(Dropped(row, "read", "bad_row",
                           f"{exc.field}: {exc.reason}" if exc.field
                           else exc.reason))
        continue
      rows.append(row)
  if not rows and not bad:
    raise DataError(f"{path}: empty file (no rows)")
  return rows, bad


def question_text(record: Mapping[str, Any], cfg: CurateConfig) -> str:
  value = record.get(cfg.question_field)
  return value if isinstance(value, str) and value.strip() else \
      record["prompt"]


# ---------------------------------------------------------------------------
# Steps: each takes the rows still in and returns (kept, dropped)


def format_step(rows: Sequence[Row], cfg: CurateConfig):
  kept, dropped = [], []
  for row in rows:
    kind = question_format.detect(question_text(row.record, cfg),
                                  row.record.get("answer"))
    if kind is None:
      kept.append(row)
    else:
      dropped.append(Dropped(row, "format", kind,
                             "rule-based detector (question_format.py)"))
  return kept, dropped


def dedup_step(rows: Sequence[Row], cfg: CurateConfig,
               held_out: Sequence[Mapping[str, Any]] = ()):
  texts = [question_text(r.record, cfg) for r in rows]
  reference = [question_text(r, cfg) for r in held_out]
  dups = dedup_lib.find_duplicates(texts, cfg.dedup_config(), reference)

  def where(d: dedup_lib.Duplicate) -> str:
    if d.kind.startswith("held_out_"):
      return f"held-out record {held_out[d.of].get('id', d.of)!r}"
    return f"line {rows[d.of].line}"

  gone = {d.index: d for d in dups}
  kept = [r for i, r in enumerate(rows) if i not in gone]
  dropped = [Dropped(rows[d.index], "dedup", d.kind,
                     f"of {where(d)} (similarity {d.similarity:.2f})")
             for d in dups]
  return kept, dropped


def read_labelled(path: str, cfg: CurateConfig) -> list[dict]:
  """The learned tagger's training prompts: {"prompt", "tags"} per row of
  `path` (fields prompt_field and tags_field); bad rows are an error
  naming file, line and field."""

  def validate(row: Mapping[str, Any]) -> dict:
    tags = records_lib.tags_field(row, cfg.tags_field)
    if not tags:
      raise RowError(cfg.tags_field, "missing or empty (a labelled prompt "
                     "needs a tag)")
    return {"prompt": records_lib.text_field(row, cfg.prompt_field),
            "tags": tags}

  return list(records_lib.JsonlSource(path, validate))


def build_tagger(rows: Sequence[Row], cfg: CurateConfig
                 ) -> tuple[tagging.Tagger, dict]:
  """`cfg.tagger`, fitted when it is the learned one (on `tagger_train`,
  else on the tagged rows of the input), and what it was fitted on."""
  if cfg.tagger != tagging.LEARNED:
    return tagging.make_tagger(cfg.tagger), {}
  if cfg.tagger_train:
    labelled, source = read_labelled(cfg.tagger_train, cfg), cfg.tagger_train
  else:
    labelled, source = [r.record for r in rows], "the input's tagged rows"
  try:
    tagger = tagging.make_tagger(cfg.tagger, labelled,
                                 cfg.tagger_min_confidence)
  except ValueError as exc:
    raise DataError(f"curate.tagger={tagging.LEARNED!r}: {exc} in "
                    f"{source}") from None
  fitted = sum(bool(tagging.record_tags(r)) for r in labelled)
  return tagger, {"fitted_on": source, "fitted_rows": fitted,
                  "tags": list(tagger.tags),
                  "min_confidence": cfg.tagger_min_confidence}


def tags_step(rows: Sequence[Row], cfg: CurateConfig,
              tagger: tagging.Tagger, fitted: dict) -> dict:
  had_tags = sum(bool(tagging.record_tags(r.record)) for r in rows)
  for row in rows:
    tags = [str(t) for t in tagger(row.record)]
    row.record["tags"] = tags
    row.added[cfg.tags_field] = tags
  info = {"tagger": cfg.tagger,
          "balance": tagging.balance(r.record["tags"] for r in rows)}
  if fitted:
    info["learned"] = dict(fitted, rows_with_own_tags=had_tags,
                           left_untagged=sum(not r.record["tags"]
                                             for r in rows))
  return info


def _fits(rows: Sequence[Row], policy: Policy, prompts: Sequence[str],
          step: str):
  kept, kept_prompts, dropped = [], [], []
  for row, prompt in zip(rows, prompts):
    problem = policy.prompt_problem(prompt)
    if problem is None:
      kept.append(row)
      kept_prompts.append(prompt)
    else:
      dropped.append(Dropped(row, step, "prompt_unusable", problem))
  return kept, kept_prompts, dropped


def correct_counts(policy: Policy, reward: RewardFn,
                   records: Sequence[Mapping[str, Any]],
                   prompts: Sequence[str], n: int, *, temperature: float,
                   max_new_tokens: int, seed: int, response_prefix: str = "",
                   calls: ModelCalls = ModelCalls(), step: str = ""
                   ) -> list[int]:
  """Verified-correct responses out of n, per prompt."""

  def count(chunk: Sequence[tuple[Mapping[str, Any], str]], start: int
            ) -> list[int]:
    answers = sample_verified(
        policy, reward, chunk, n, temperature=temperature,
        max_new_tokens=max_new_tokens, seed=seed,
        response_prefix=response_prefix, first_index=start)
    return [sum(correct) for _, correct in answers]

  items = list(zip(records, prompts))
  settings = dict(step=step, n=n, temperature=temperature,
                  max_new_tokens=max_new_tokens, seed=seed,
                  response_prefix=response_prefix)
  return calls.map(items, items, count, key=settings, desc=step)


def easy_to_hack_step(rows: Sequence[Row], cfg: CurateConfig,
                      policy: Policy, reward: RewardFn, calls: ModelCalls):
  prompts = [cfg.hack_template.format(question=question_text(r.record, cfg))
             for r in rows]
  rows, prompts, dropped = _fits(rows, policy, prompts, "easy_to_hack")
  counts = correct_counts(
      policy, reward, [r.record for r in rows], prompts, cfg.hack_guesses,
      temperature=cfg.hack_temperature, max_new_tokens=cfg.hack_max_tokens,
      seed=cfg.seed, response_prefix=cfg.hack_response_prefix, calls=calls,
      step="easy_to_hack")
  kept = []
  for row, c in zip(rows, counts):
    if c > 0:
      dropped.append(Dropped(row, "easy_to_hack", "easy_to_hack",
                             f"{c} of {cfg.hack_guesses} no-CoT guesses "
                             f"correct"))
    else:
      kept.append(row)
  return kept, dropped


def difficulty_bucket(pass_rate: float, edges: Sequence[float]) -> int:
  """0 for pass rates >= edges[0], 1 below it down to edges[1], ..."""
  for bucket, edge in enumerate(edges):
    if pass_rate >= edge:
      return bucket
  return len(edges)


def pass_rate_step(rows: Sequence[Row], cfg: CurateConfig, policy: Policy,
                   reward: RewardFn, calls: ModelCalls):
  prompts = [cfg.pass_template.format(prompt=r.record["prompt"])
             for r in rows]
  rows, prompts, dropped = _fits(rows, policy, prompts, "pass_rate")
  counts = correct_counts(
      policy, reward, [r.record for r in rows], prompts, cfg.pass_samples,
      temperature=cfg.pass_temperature, max_new_tokens=cfg.pass_max_tokens,
      seed=cfg.seed + 1, calls=calls, step="pass_rate")
  kept, rates = [], []
  for row, c in zip(rows, counts):
    rate = c / cfg.pass_samples
    rates.append(rate)
    bucket = difficulty_bucket(rate, cfg.difficulty_edges)
    if "difficulty" in row.record:
      row.added["source_difficulty"] = row.record["difficulty"]
    row.added.update({"pass_rate": rate, cfg.difficulty_field: float(bucket),
                      "difficulty_bucket": cfg.bucket_names[bucket]})
    if rate > cfg.max_pass_rate:
      dropped.append(Dropped(row, "pass_rate", "trivial",
                             f"pass rate {rate:.2f} > {cfg.max_pass_rate}"))
    elif rate < cfg.min_pass_rate:
      dropped.append(Dropped(row, "pass_rate", "unsolved",
                             f"pass rate {rate:.2f} < {cfg.min_pass_rate}"))
    else:
      kept.append(row)
  hist = collections.Counter(round(r, 6) for r in rates)
  buckets = collections.Counter(r.added["difficulty_bucket"] for r in kept)
  info = {"mean_pass_rate": float(np.mean(rates)) if rates else None,
          "pass_rate_histogram": {f"{k:g}": v for k, v in sorted(hist.items())},
          "kept_by_bucket": {n: buckets.get(n, 0) for n in cfg.bucket_names}}
  return kept, dropped, info


def tag_cap_step(rows: Sequence[Row], cfg: CurateConfig):
  tag_lists = [r.record.get("tags") or [] for r in rows]
  order = np.random.default_rng(cfg.seed).permutation(len(rows))
  gone = set(tagging.over_quota([tagging.primary(t) for t in tag_lists],
                                lambda _: cfg.max_per_tag, order))
  kept = [r for i, r in enumerate(rows) if i not in gone]
  dropped = [Dropped(rows[i], "tag_cap", "tag_cap",
                     f"more than {cfg.max_per_tag} records tagged "
                     f"{tagging.primary(tag_lists[i])!r}")
             for i in sorted(gone)]
  return kept, dropped


def bucket_quota(counts: Sequence[int], shares: Sequence[float],
                 min_rows: int = 1) -> list[int]:
  """The most rows per bucket, at most `counts`, in proportion to `shares`.

  A bucket with fewer than `min_rows` rows is kept whole and left out of
  the proportion (else one near-empty bucket would empty the set); a share
  of 0 keeps none of its bucket.
  """
  min_rows = max(min_rows, 1)
  scale = min((c / s for c, s in zip(counts, shares)
               if c >= min_rows and s > 0), default=0.0)
  out = []
  for c, s in zip(counts, shares):
    if s <= 0:
      out.append(0)
    elif c < min_rows:
      out.append(c)  # kept whole (0 when empty)
    else:
      # The epsilon keeps e.g. 3 * (10 / 3) from flooring to 9.
      out.append(min(c, int(scale * s + 1e-9)))
  return out


def difficulty_balance_step(rows: Sequence[Row], cfg: CurateConfig):
  names = list(cfg.bucket_names)
  buckets = [r.added["difficulty_bucket"] for r in rows]
  counts = [buckets.count(n) for n in names]
  quota = dict(zip(names, bucket_quota(counts, cfg.bucket_shares,
                                       cfg.bucket_min_rows)))
  order = np.random.default_rng(cfg.seed + 2).permutation(len(rows))
  gone = set(tagging.over_quota(buckets, quota.__getitem__, order))
  kept = [r for i, r in enumerate(rows) if i not in gone]
  shares = ":".join(f"{s:g}" for s in cfg.bucket_shares)
  dropped = [Dropped(rows[i], "difficulty_balance", "difficulty_balance",
                     f"{buckets[i]!r} bucket over its quota of "
                     f"{quota[buckets[i]]} (shares {shares})")
             for i in sorted(gone)]
  info = {"by_bucket_before": dict(zip(names, counts)), "quota": quota,
          "empty_buckets": [n for n, c in zip(names, counts) if not c],
          "kept_whole": [n for n, c in zip(names, counts)
                         if 0 < c < cfg.bucket_min_rows]}
  return kept, dropped, info


# ---------------------------------------------------------------------------
# The pipeline


def curate(path: str, cfg: CurateConfig, *, policy: Policy | None = None,
           reward: RewardFn | None = None,
           held_out: Sequence[Mapping[str, Any]] = (),
           journal: Journal | None = None,
           progress: bool = False) -> CurateResult:
  """Runs every enabled step on the JSONL prompt set at `path`; `held_out`:
  evaluation records whose problems the dedup step keeps out; `journal`:
  where the model steps keep finished chunks (a rerun after a kill asks
  the model only for the rest)."""
  if cfg.needs_model and (policy is None or reward is None):
    raise ValueError("curate: the easy_to_hack and pass_rate steps need a "
                     "policy and a reward (or switch them off)")
  rows, dropped = read_rows(path, cfg)
  rows_in = list(rows)
  steps = [StepReport("read", True, len(rows) + len(dropped), len(rows),
                      dict(collections.Counter(d.reason for d in dropped)))]

  def run(name: str, enabled: bool, fn, *args) -> None:
    nonlocal rows
    report = StepReport(name, enabled, len(rows), len(rows))
    if enabled and rows:
      out = fn(rows, cfg, *args)
      if isinstance(out, dict):  # annotates, drops nothing
        report.info = out
      else:
        rows, gone = out[0], out[1]
        if len(out) > 2:
          report.info = out[2]
        dropped.extend(gone)
        report.kept = len(rows)
        report.dropped = dict(collections.Counter(d.reason for d in gone))
    steps.append(report)

  run("format", cfg.format_filter, format_step)
  run("dedup", cfg.dedup, dedup_step, held_out)
  tagger, fitted = (build_tagger(rows, cfg) if cfg.tags
                    else (tagging.make_tagger("record"), {}))
  run("tags", cfg.tags, tags_step, tagger, fitted)
  calls = ModelCalls(cfg.chunk_prompts, journal, progress)
  run("easy_to_hack", cfg.easy_to_hack, easy_to_hack_step, policy, reward,
      calls)
  run("pass_rate", cfg.pass_rate, pass_rate_step, policy, reward, calls)
  run("tag_cap", cfg.tags and cfg.max_per_tag > 0, tag_cap_step)
  run("difficulty_balance", cfg.pass_rate and bool(cfg.bucket_shares),
      difficulty_balance_step)
  if cfg.tags:
    steps[-1].info["balance_after"] = tagging.balance(
        r.record.get("tags") or [] for r in rows)
  shift = (_answer_shift(rows_in, rows, cfg, tagger) if cfg.answer_shift
           else {})
  return CurateResult(rows, dropped, steps, steps[0].rows_in, path, shift)


def _answer_shift(rows_in: Sequence[Row], kept: Sequence[Row],
                  cfg: CurateConfig, tagger: tagging.Tagger) -> dict:
  """`answer_shift.answer_shift` over the valid input rows and the kept
  ones, by primary tag (the tagger's, so rows dropped before the tags step
  count under the tag they would have had; "all" with tags off)."""

  def pairs(rows: Sequence[Row]) -> list[tuple[str, Any]]:
    return [(tagging.primary([str(t) for t in tagger(r.record)])
             if cfg.tags else "all", r.record.get("answer")) for r in rows]

  return shift_lib.answer_shift(pairs(rows_in), pairs(kept),
                                cfg.shift_rule())


def write_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")


def shift_warnings(report: Mapping[str, Any]) -> list[str]:
  """A curation report's answer-shift warnings (none when the check was off,
  or in a report written before it existed)."""
  return (report.get("answer_shift") or {}).get("warnings", [])


def write_outputs(result: CurateResult, out: str, rejected: str,
                  report_path: str, extra: Mapping[str, Any] = ()) -> dict:
  """The curated rows, the rejected rows and the report (returned)."""
  write_jsonl(out, [r.output() for r in result.kept])
  write_jsonl(rejected, [d.to_json(result.path) for d in result.dropped])
  report = dict(result.report(), output=out, rejected=rejected, **dict(extra))
  with open(report_path, "w") as f:
    json.dump(report, f, indent=2)
  return report
