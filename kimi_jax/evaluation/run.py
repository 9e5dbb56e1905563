"""A benchmark run: K samples per problem (through a model, or read from a
responses file), scored, summarised and written out.

  benchmarks.json  {benchmark: {pass_at_1, n_problems, samples,
                   mean_response_tokens, p90_response_tokens, pass_at_k,
                   file, settings}}
  responses.jsonl  one row per scored response: benchmark, id, sample,
                   response, tokens, correct, answer (math: the extracted
                   answer), error
  journal.jsonl    every finished chunk of problems, sampled and scored
                   (kimi_jax/data/journal.py): a rerun of a killed
                   evaluation takes them from here and samples only the
                   rest

Math items are scored by the math reward (math-verify on the last boxed
answer after the thinking block), code items by the code reward in the
sandbox, MathVista items by mathvista.py's rules.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Sequence

from kimi_jax.data import journal as journal_lib
from kimi_jax.evaluation import mathvista, protocol
from kimi_jax.evaluation.benchmarks import BenchmarkError
from kimi_jax.evaluation.sampling import (DEFAULT_SAMPLES, Drawn, Loaded,
                                          Model, Settings, check_model,
                                          sample)
from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.registry import make_reward
from kimi_jax.sandbox import Sandbox

__all__ = ["DEFAULT_SAMPLES", "Drawn", "Model", "Settings", "evaluate",
           "format_table", "read_responses", "run_benchmark", "score",
           "summarize"]

# Responses scored per journal entry when they come from a file.
RESPONSES_PER_CHUNK = 512
JOURNAL = "journal.jsonl"


def _bar(total: int, desc: str, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, disable=not enabled,
              dynamic_ncols=True, file=sys.stderr)



def read_responses(path: str, loaded: Loaded
                   ) -> dict[str, list[Drawn]]:
  """benchmark -> one `Drawn` per item (in the benchmark's order) from a
  JSONL file of {"benchmark", "id", "response"[, "tokens"]} rows; several
  rows of one item are several samples. Every item of every benchmark
  needs at least one row."""
  index = {name: {str(item["id"]): i for i, item in enumerate(items)}
           for name, (_, items) in loaded.items()}
  out = {name: [Drawn() for _ in items]
         for name, (_, items) in loaded.items()}
  try:
    f = open(path, encoding="utf-8")
  except FileNotFoundError:
    raise BenchmarkError(f"{path}: not found") from None
  with f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError as exc:
        raise BenchmarkError(f"{path}:{n}: not JSON ({exc})") from None
      for field in ("benchmark", "id", "response"):
        if not isinstance(row, dict) or field not in row:
          raise BenchmarkError(f"{path}:{n}: no field {field!r}")
      name = row["benchmark"]
      if name not in out:
        raise BenchmarkError(f"{path}:{n}: benchmark {name!r} is not among "
                             f"the --benchmark ones {sorted(out)}")
      i = index[name].get(str(row["id"]))
      if i is None:
        raise BenchmarkError(f"{path}:{n}: {name} has no id "
                             f"{str(row['id'])!r}")
      if not isinstance(row["response"], str):
        raise BenchmarkError(f"{path}:{n}: field 'response' is not text")
      tokens = row.get("tokens")
      out[name][i].texts.append(row["response"])
      out[name][i].tokens.append(None if tokens is None else int(tokens))
  for name, drawn in out.items():
    missing = [str(item["id"]) for item, d in zip(loaded[name][1], drawn)
               if not d.texts]
    if missing:
      raise BenchmarkError(f"{path}: no response for {len(missing)} {name} "
                           f"problems (ids {missing[:5]}...)")
  return out


class Scorers:
  """The math, code and MathVista rewards, built on first use; `close()`
  stops their workers."""

  def __init__(self):
    self._rewards: dict[str, Any] = {}
    self._closers: list[Any] = []

  def get(self, kind: str) -> Any:
    if kind == "mathvista":
      return self._rewards.setdefault(kind, mathvista.MathVistaReward())
    if kind not in self._rewards:
      options: dict[str, Any] = {}
      if kind == "code":
        options["executor"] = Sandbox(max_workers=os.cpu_count() or 1)
        self._closers.append(options["executor"])
      self._rewards[kind] = make_reward(kind, **options)
      if hasattr(self._rewards[kind], "close"):
        self._closers.append(self._rewards[kind])
    return self._rewards[kind]

  def close(self) -> None:
    for thing in self._closers:
      thing.close()


def score(name: str, items: Sequence[Mapping[str, Any]],
          drawn: Sequence[Drawn], scorers: Scorers) -> list[dict[str, Any]]:
  """One row per response, with its verdict (see the module doc)."""
  flat = [(i, j) for i, d in enumerate(drawn) for j in range(len(d.texts))]
  by_kind: dict[str, list[int]] = {}
  for n, (i, _) in enumerate(flat):
    by_kind.setdefault(items[i]["kind"], []).append(n)
  verdicts: dict[int, Any] = {}
  for kind, ns in by_kind.items():
    results = score_all(scorers.get(kind), [items[flat[n][0]] for n in ns],
                        [drawn[flat[n][0]].texts[flat[n][1]] for n in ns])
    verdicts.update(zip(ns, results))
  rows = []
  for n, (i, j) in enumerate(flat):
    result = verdicts[n]
    rows.append(dict(
        benchmark=name, id=items[i]["id"], sample=j,
        response=drawn[i].texts[j], tokens=drawn[i].tokens[j],
        correct=bool(result.correct),
        answer=(result.info or {}).get("answer"), error=result.error))
  return rows


def _journal(journal: journal_lib.Journal | None) -> journal_lib.Journal:
  import jax
  if journal is None or jax.process_count() > 1:
    # Processes that sample together (SPMD) must make the same calls: one
    # that skipped a chunk its peers recompute would hang them.
    return journal_lib.Journal(None)
  return journal


def run_benchmark(name: str, items: Sequence[Mapping[str, Any]], *,
                  scorers: Scorers, model: Model | None = None,
                  given: Sequence[Drawn] | None = None,
                  settings: Settings = Settings(),
                  journal: journal_lib.Journal | None = None,
                  progress: bool = True) -> tuple[list[dict[str, Any]], int]:
  """(scored rows, chunks taken from the journal) of one benchmark: its
  problems in chunks, each sampled by `model` (or taken from `given`) and
  scored, then journaled before the next starts."""
  if (model is None) == (given is None):
    raise ValueError("run_benchmark: pass exactly one of model or given")
  journal = _journal(journal)
  if model is not None:
    chunk, key = settings.chunk, ("sampled", name, settings.sampling())
    keys = [journal_lib.digest(item) for item in items]
  else:
    per_item = max(1, round(sum(len(d.texts) for d in given) /
                            max(len(given), 1)))
    chunk, key = max(1, RESPONSES_PER_CHUNK // per_item), ("given", name)
    keys = [journal_lib.digest(item, d.texts, d.tokens)
            for item, d in zip(items, given)]
  rows: list[dict[str, Any]] = []
  reused = 0
  desc = (f"{name} ({settings.samples} samples)" if model is not None else
          f"{name} scoring")
  with _bar(len(items), desc, progress) as bar:
    for start in range(0, len(items), chunk):
      part = items[start:start + chunk]
      digest = journal.digest(key, start, keys[start:start + chunk])
      if digest in journal:
        reused += 1
        rows.extend(journal.get(digest))
      else:
        drawn = (sample(model, name, part, settings, start)
                 if model is not None else given[start:start + chunk])
        done = score(name, part, drawn, scorers)
        journal.put(digest, done)
        rows.extend(done)
      bar.update(len(part))
  return rows, reused


def summarize(rows: Sequence[Mapping[str, Any]], n_problems: int,
              pass_at: Sequence[int] = ()) -> dict[str, Any]:
  """A benchmark's figures from its scored rows (see protocol.py)."""
  counts: dict[str, list[int]] = {}
  for row in rows:
    c = counts.setdefault(str(row["id"]), [0, 0])
    c[0] += 1
    c[1] += int(row["correct"])
  per_problem = [tuple(c) for c in counts.values()]
  assert len(per_problem) == n_problems, (len(per_problem), n_problems)
  samples = sorted({n for n, _ in per_problem})
  known = [r["tokens"] for r in rows if r["tokens"] is not None]
  mean_tokens, p90_tokens = protocol.token_stats(
      known if len(known) == len(rows) else [])
  fewest = samples[0]
  bad = [k for k in pass_at if not 1 <= k <= fewest]
  if bad:
    raise BenchmarkError(f"pass@{bad}: k must be in [1, {fewest}] (the "
                         f"fewest samples of a problem)")
  return dict(
      pass_at_1=protocol.mean_pass_at_k(per_problem, 1),
      n_problems=n_problems,
      samples=fewest if len(samples) == 1 else samples,
      n_responses=len(rows),
      mean_response_tokens=mean_tokens, p90_response_tokens=p90_tokens,
      pass_at_k={str(k): protocol.mean_pass_at_k(per_problem, k)
                 for k in sorted(set(pass_at))})


def format_table(report: Mapping[str, Mapping[str, Any]]) -> str:
  """The report as a markdown table."""
  ks = sorted({int(k) for r in report.values() for k in r["pass_at_k"]
               if int(k) != 1})
  head = (["benchmark", "problems", "samples", "pass@1"] +
          [f"pass@{k}" for k in ks] + ["mean tokens", "p90 tokens"])
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]

  def num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)

  for name, r in report.items():
    cells = ([name, str(r["n_problems"]), str(r["samples"]),
              num(r["pass_at_1"], ".4f")] +
             [num(r["pass_at_k"].get(str(k)), ".4f") for k in ks] +
             [num(r["mean_response_tokens"], ".1f"),
              num(r["p90_response_tokens"], ".1f")])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def evaluate(loaded: Loaded, *, out: str, model: Model | None = None,
             responses: str = "", settings: Settings = Settings(),
             source: str = "", progress: bool = True,
             journal: str | None = "") -> dict[str, dict[str, Any]]:
  """Draws (model) or reads (responses) every benchmark's responses,
  scores them, writes OUT/benchmarks.json and OUT/responses.jsonl and
  returns the report. journal: finished chunks (default OUT/journal.jsonl;
  None: none); what it holds for the same model, settings and problems is
  not sampled or scored again."""
  if (model is None) == (not responses):
    raise ValueError("evaluate: pass exactly one of model or responses")
  given = read_responses(responses, loaded) if responses else None
  if model is not None:
    check_model(model, loaded)
  os.makedirs(out, exist_ok=True)
  book = journal_lib.Journal(
      (journal or os.path.join(out, JOURNAL)) if journal is not None
      else None, context=source)
  report: dict[str, dict[str, Any]] = {}
  scorers = Scorers()
  try:
    with open(os.path.join(out, "responses.jsonl"), "w") as f:
      for name, (path, items) in loaded.items():
        rows, reused = run_benchmark(
            name, items, scorers=scorers, model=model,
            given=None if given is None else given[name],
            settings=settings, journal=book, progress=progress)
        if reused:
          print(f"{name}: {reused} chunk(s) of problems taken from the "
                f"journal {book.path}", file=sys.stderr)
        for row in rows:
          f.write(json.dumps(row) + "\n")
        entry = summarize(rows, len(items), settings.pass_at)
        entry.update(file=os.path.abspath(path), source=source,
                     journal_chunks_reused=reused)
        if given is None:
          entry.update(temperature=settings.temperature,
                       top_p=settings.top_p,
                       max_response_len=settings.max_response_len,
                       seed=settings.seed)
        report[name] = entry
  finally:
    scorers.close()
  with open(os.path.join(out, "benchmarks.json"), "w") as f:
    json.dump(report, f, indent=2)
  return report
