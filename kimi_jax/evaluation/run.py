"""A benchmark run: K samples per problem (through a sampler policy, or
read from a responses file), scored, summarised and written out.

  benchmarks.json  {benchmark: {pass_at_1, n_problems, samples,
                   mean_response_tokens, p90_response_tokens, pass_at_k,
                   file, settings}}
  responses.jsonl  one row per scored response: benchmark, id, sample,
                   response, tokens, correct, answer (math: the extracted
                   answer), error

Math items are scored by the math reward (math-verify on the last boxed
answer after the thinking block), code items by the code reward in the
sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Mapping, Sequence

from kimi_jax.evaluation import protocol
from kimi_jax.evaluation.benchmarks import BENCHMARKS, BenchmarkError
from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.registry import make_reward
from kimi_jax.rl import rollout
from kimi_jax.sampler.driver import SampleRequest
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sandbox import Sandbox

# Per-problem samples by default: the k1.5 report (section 3.4) gives AIME
# pass@1 "averaged over 8 runs".
DEFAULT_SAMPLES = 8
# Requests handed to the sampler per call (one progress-bar step): enough
# to keep its slots full, few enough that the bar moves.
REQUESTS_PER_CALL = 1024


@dataclasses.dataclass(frozen=True)
class Settings:
  """How responses are drawn (unused when they are read from a file)."""

  samples: int = DEFAULT_SAMPLES
  temperature: float = 1.0
  top_p: float = 1.0
  max_response_len: int = 1024
  seed: int = 0
  pass_at: tuple[int, ...] = ()


@dataclasses.dataclass
class Drawn:
  """The responses of one problem: texts and their token counts (None:
  unknown)."""

  texts: list[str] = dataclasses.field(default_factory=list)
  tokens: list[int | None] = dataclasses.field(default_factory=list)


Loaded = Mapping[str, tuple[str, Sequence[Mapping[str, Any]]]]


def _bar(total: int, desc: str, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, disable=not enabled,
              dynamic_ncols=True, file=sys.stderr)


def sample(policy: Any, name: str, items: Sequence[Mapping[str, Any]],
           settings: Settings, progress: bool = True) -> list[Drawn]:
  """`settings.samples` responses per item from a `SamplerPolicy`. Draw j
  of item i is seeded by (seed, benchmark, i, j) alone, so it does not
  depend on the other benchmarks or on how requests are batched."""
  for item in items:
    problem = policy.prompt_problem(item["prompt"])
    if problem:
      raise BenchmarkError(f"{name} {item['id']}: {problem}")
  k = settings.samples
  tok = policy.tokenizer
  stops = rollout.stop_tokens(tok)
  engine = policy.sampler.engine
  which = list(BENCHMARKS).index(name)
  out = [Drawn() for _ in items]
  per_call = max(1, REQUESTS_PER_CALL // k)
  with _bar(len(items), f"{name} ({k} samples)", progress) as bar:
    for start in range(0, len(items), per_call):
      requests = []
      for i in range(start, min(start + per_call, len(items))):
        ids = tuple(policy.encode_prompt(items[i]["prompt"]))
        room = engine.cache_len - len(ids)
        for j in range(k):
          requests.append(SampleRequest(
              id=(i, j), prompt=ids, stop_tokens=stops,
              max_new_tokens=min(settings.max_response_len, room),
              sampling=SamplingParams(
                  temperature=settings.temperature, top_p=settings.top_p,
                  greedy=settings.temperature == 0,
                  seed=rollout.request_seed(settings.seed, which, i, j))))
      results, _ = policy.sampler.generate(policy.params, requests)
      for request, result in zip(requests, results):
        drawn = out[request.id[0]]
        drawn.texts.append(rollout.response_text(result.tokens, tok))
        drawn.tokens.append(len(result.tokens))
      bar.update(len(requests) // k)
  return out


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
  """The math and code rewards, built on first use; `close()` stops their
  workers."""

  def __init__(self):
    self._rewards: dict[str, Any] = {}

    self._closers: list[Any] = []

  def get(self, kind: str) -> Any:
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
          drawn: Sequence[Drawn], scorers: Scorers,
          progress: bool = True) -> list[dict[str, Any]]:
  """One row per response, with its verdict (see the module doc)."""
  flat = [(i, j) for i, d in enumerate(drawn) for j in range(len(d.texts))]
  rows: list[dict[str, Any]] = []
  step = 512
  with _bar(len(flat), f"{name} scoring", progress) as bar:
    for start in range(0, len(flat), step):
      chunk = flat[start:start + step]
      by_kind: dict[str, list[int]] = {}
      for n, (i, _) in enumerate(chunk):
        by_kind.setdefault(items[i]["kind"], []).append(n)
      verdicts: dict[int, Any] = {}
      for kind, ns in by_kind.items():
        results = score_all(scorers.get(kind),
                            [items[chunk[n][0]] for n in ns],
                            [drawn[chunk[n][0]].texts[chunk[n][1]]
                             for n in ns])
        verdicts.update(zip(ns, results))
      for n, (i, j) in enumerate(chunk):
        result = verdicts[n]
        rows.append(dict(
            benchmark=name, id=items[i]["id"], sample=j,
            response=drawn[i].texts[j], tokens=drawn[i].tokens[j],
            correct=bool(result.correct),
            answer=(result.info or {}).get("answer"), error=result.error))
      bar.update(len(chunk))
  return rows


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


def evaluate(loaded: Loaded, *, out: str, policy: Any = None,
             responses: str = "", settings: Settings = Settings(),
             source: str = "", progress: bool = True
             ) -> dict[str, dict[str, Any]]:
  """Draws (policy) or reads (responses) every benchmark's responses,
  scores them, writes OUT/benchmarks.json and OUT/responses.jsonl and
  returns the report."""
  if (policy is None) == (not responses):
    raise ValueError("evaluate: pass exactly one of policy or responses")
  given = read_responses(responses, loaded) if responses else None
  report: dict[str, dict[str, Any]] = {}
  scorers = Scorers()
  os.makedirs(out, exist_ok=True)
  try:
    with open(os.path.join(out, "responses.jsonl"), "w") as f:
      for name, (path, items) in loaded.items():
        drawn = (given[name] if given is not None else
                 sample(policy, name, items, settings, progress))
        rows = score(name, items, drawn, scorers, progress)
        for row in rows:
          f.write(json.dumps(row) + "\n")
        entry = summarize(rows, len(items), settings.pass_at)
        entry.update(file=os.path.abspath(path), source=source)
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
