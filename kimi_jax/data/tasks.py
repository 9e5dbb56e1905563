"""A task bundles a prompt set, its held-out split, a reward and a tokenizer.

`make_task(task_section, seed, tokenizer)` is the one place the RL job learns
what it trains on. Tasks:

- `pointer_chase`: the synthetic tiny task (kimi_jax.data.pointer_chase),
  with its own word tokenizer and exact verifier.
- `jsonl`: problem records from JSONL files (`train_path`, `eval_path`), each
  line an object with `prompt_field` and the reward's fields, scored by a
  reward from `kimi_jax.rewards.registry` (math, code, reasoning_gym, ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping, Sequence

from kimi_jax.data import pointer_chase
from kimi_jax.rewards.base import RewardFn


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  train: Sequence[dict]
  eval: Sequence[dict]
  reward: RewardFn
  tokenizer: Any
  # Turns a record into the prompt token ids fed to the sampler.
  encode_prompt: Callable[[Mapping[str, Any]], list[int]]
  # Supervised warm-start pairs (prompt, solution text), if the task has them.
  warmstart: Callable[[int], list[tuple[str, str]]] | None = None


def read_jsonl_records(path: str, prompt_field: str) -> list[dict]:
  """Reads problem records; a bad line raises naming the file, line, field."""
  records = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})"
                         ) from None
      if not isinstance(rec, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object")
      if not isinstance(rec.get(prompt_field), str):
        raise ValueError(f"{path}:{lineno}: field {prompt_field!r} missing or "
                         f"not a string")
      rec.setdefault("id", f"{path}:{lineno}")
      rec["prompt"] = rec[prompt_field]
      records.append(rec)
  if not records:
    raise ValueError(f"{path}: no records")
  return records


def _pointer_chase_task(section: Mapping[str, Any], seed: int,
                        warmstart_size: int) -> Task:
  from kimi_jax.config import to_dataclass
  cfg = to_dataclass(pointer_chase.PointerChaseConfig, section, "task")
  train, held = pointer_chase.make_problems(cfg, seed)
  tok = pointer_chase.tokenizer()
  return Task(
      name=cfg.name, train=train, eval=held,
      reward=pointer_chase.PointerChaseReward(), tokenizer=tok,
      encode_prompt=lambda r: [tok.bos_id] + tok.encode(r["prompt"]),
      warmstart=lambda s: pointer_chase.warmstart_texts(train, cfg, s,
                                                        warmstart_size))


def _jsonl_task(section: Mapping[str, Any], tokenizer: Any) -> Task:
  from kimi_jax.rewards import registry
  if tokenizer is None:
    raise ValueError("task.name='jsonl' needs a tokenizer: set init_from_hf "
                     "to a local Hugging Face directory")
  for key in ("train_path", "eval_path"):
    if not section.get(key):
      raise ValueError(f"config.task.{key} must be set for task 'jsonl'")
  prompt_field = section.get("prompt_field", "prompt")
  train = read_jsonl_records(section["train_path"], prompt_field)
  held = read_jsonl_records(section["eval_path"], prompt_field)
  reward = registry.make_reward(section.get("reward", "math"))
  return Task(name="jsonl", train=train, eval=held, reward=reward,
              tokenizer=tokenizer,
              encode_prompt=lambda r: tokenizer.encode(r["prompt"]))


def make_task(section: Mapping[str, Any], seed: int, tokenizer: Any = None,
              warmstart_size: int = 4096) -> Task:
  name = section.get("name")
  if name == "pointer_chase":
    return _pointer_chase_task(section, seed, warmstart_size)
  if name == "jsonl":
    return _jsonl_task(section, tokenizer)
  raise ValueError(f"config.task.name: unknown task {name!r} "
                   f"(known: pointer_chase, jsonl)")
