"""Labelled responses: what both reward models learn from and are judged on.

`sample_and_label` draws responses from a policy for a prompt set and labels
each with the task's verifier (the exact checker of a synthetic task, or
math-verify). A row of the JSONL files `launch/train_rm.py` writes:

  {"id": "pc-37-5/2", "record_id": "pc-37-5", "question": "37 c5 =",
   "reference": "55", "response": "c4 81 ; ... > 55", "label": true,
   "extracted": "55", "source": "verifier", "hidden": false}

`extracted` is the answer the verifier read (for seed rationales), `source`
says who labelled it. A hand-labelled set (`source: "hand"`) marks its rows
`hidden: true`: they measure the verifier and the reward models and never
enter training (`training_examples` refuses them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Mapping, Sequence

from kimi_jax.data.journal import ModelCalls
from kimi_jax.rewards.base import RewardFn, RewardResult, score_all
from kimi_jax.rl import rollout
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.sampling import SamplingParams

_REQUIRED = {"id": str, "question": str, "reference": str, "response": str,
             "label": bool}


@dataclasses.dataclass(frozen=True)
class LabelledExample:
  id: str
  record_id: str
  question: str
  reference: str
  response: str
  label: bool
  extracted: str | None = None
  source: str = "verifier"
  hidden: bool = False

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def extracted_answer(result: RewardResult) -> str | None:
  """The answer a verifier read from the response, if it reports one."""
  for key in ("extracted", "answer"):
    value = result.info.get(key)
    if value is not None:
      return str(value)
  return None


def from_json(row: Mapping[str, Any], where: str) -> LabelledExample:
  """A row read back; a missing or mistyped field is named with `where`."""
  if not isinstance(row, Mapping):
    raise ValueError(f"{where}: expected a JSON object")
  for key, kind in _REQUIRED.items():
    if key not in row:
      raise ValueError(f"{where}: field {key!r} is missing")
    if not isinstance(row[key], kind):
      raise ValueError(f"{where}: field {key!r} must be "
                       f"{kind.__name__}, got {type(row[key]).__name__}")
  hidden = row.get("hidden", False)
  if not isinstance(hidden, bool):
    raise ValueError(f"{where}: field 'hidden' must be bool")
  fields = {f.name for f in dataclasses.fields(LabelledExample)}
  unknown = sorted(set(row) - fields - {"note"})
  if unknown:
    raise ValueError(f"{where}: unknown fields {unknown}")
  extracted = row.get("extracted")
  return LabelledExample(
      id=row["id"], record_id=str(row.get("record_id", row["id"])),
      question=row["question"], reference=row["reference"],
      response=row["response"], label=row["label"],
      extracted=None if extracted is None else str(extracted),
      source=str(row.get("source", "verifier")), hidden=hidden)


def save_jsonl(examples: Iterable[LabelledExample], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    for ex in examples:
      f.write(json.dumps(ex.to_json()) + "\n")
  os.replace(path + ".tmp", path)


def load_jsonl(path: str) -> list[LabelledExample]:
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
      out.append(from_json(row, where))
  return out


def training_examples(examples: Sequence[LabelledExample]
                      ) -> list[LabelledExample]:
  """`examples` checked fit for training: no hidden (hand-labelled) row."""
  hidden = [ex.id for ex in examples if ex.hidden]
  if hidden:
    raise ValueError(f"{len(hidden)} hidden (evaluation-only) examples in "
                     f"training data, e.g. {hidden[:3]}")
  return list(examples)


def sample_and_label(*, sampler: Sampler, sampler_params: Any,
                     records: Sequence[Mapping[str, Any]],
                     encode_prompt, tokenizer: Any, verifier: RewardFn,
                     samples: int, max_response_len: int,
                     settings: SamplingSettings, seed: int,
                     calls: ModelCalls = ModelCalls()
                     ) -> list[LabelledExample]:
  """`samples` responses per record from the policy, labelled by
  `verifier`. Seeds depend only on (seed, record index, sample), so the
  same call gives the same data, asked in one call or in `calls.chunk`
  records at a time (each finished chunk kept in `calls.journal`)."""
  stop = rollout.stop_tokens(tokenizer)

  def label(chunk: Sequence[Mapping[str, Any]], start: int
            ) -> list[list[dict[str, Any]]]:
    requests = []
    for i, record in enumerate(chunk, start):
      prompt = tuple(encode_prompt(record))
      for j in range(samples):
        requests.append(SampleRequest(
            id=(i, j), prompt=prompt, max_new_tokens=max_response_len,
            stop_tokens=stop,
            sampling=SamplingParams(
                temperature=settings.temperature, top_k=settings.top_k,
                top_p=settings.top_p,
                seed=rollout.request_seed(seed, i, j))))
    results, _ = sampler.generate(sampler_params, requests)
    texts = [rollout.response_text(r.tokens, tokenizer) for r in results]
    recs = [chunk[r.id[0] - start] for r in results]
    scored = score_all(verifier, recs, texts)
    out: list[list[dict[str, Any]]] = [[] for _ in chunk]
    for r, rec, text, s in zip(results, recs, texts, scored):
      out[r.id[0] - start].append(LabelledExample(
          id=f"{rec['id']}/{r.id[1]}", record_id=str(rec["id"]),
          question=str(rec["prompt"]), reference=str(rec["answer"]),
          response=text, label=bool(s.correct),
          extracted=extracted_answer(s)).to_json())
    return out

  key = dict(step="rm_label", samples=samples,
             max_response_len=max_response_len,
             settings=dataclasses.asdict(settings), seed=seed)
  rows = calls.map(records, records, label, key=key, desc="label")
  return [from_json(row, "the labelling journal") for per in rows
          for row in per]
