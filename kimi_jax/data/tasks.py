"""A task bundles a prompt set, its held-out split, a reward and a tokenizer.

`make_task(task_cfg, seed, tokenizer)` is the one place the RL job learns
what it trains on. Tasks, by `config.task.name`:

- `pointer_chase`: the synthetic tiny task (kimi_jax.data.pointer_chase),
  with its own word tokenizer and exact verifier.
- `jsonl`: prompt sets from JSONL files (`train_path`, `eval_path`, optional
  `val_path`) loaded as
  Grain data sources (kimi_jax.data.records: field names, bad-row policy),
  scored by a reward from `kimi_jax.rewards.registry` (math, code,
  reasoning_gym, ...), prompted through the checkpoint's chat template
  unless `chat_template=False` (base models), with an optional
  `system_prompt`.

Benchmarks build a `kimi_jax.data.synthetic` task directly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence, Union

from kimi_jax.data import image_records, images, pointer_chase, visual_tasks
from kimi_jax.data import records as records_lib
from kimi_jax.infra.config import ConfigError, to_dataclass
from kimi_jax.model.tokenizer import (THINKING, chat_messages,
                                      load_hf_tokenizer, prompt_ids,
                                      thinking_vars)
from kimi_jax.rewards import registry
from kimi_jax.rewards.base import RewardFn


@dataclasses.dataclass(frozen=True)
class JsonlTaskConfig:
  """`config.task` for name='jsonl'; *_field name the JSONL fields."""

  name: str = "jsonl"
  train_path: str = ""
  eval_path: str = ""
  # Optional validation prompts (ours): RL's periodic evaluations read them
  # instead of the held-out set, so settings can be tuned without looking
  # at it; the warm-start and final evaluations run on both.
  val_path: str = ""
  reward: str = "math"
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  difficulty_field: str = "difficulty"
  tags_field: str = "tags"
  tests_field: str = "tests"
  # A vision model's rows: image sources (paths or inline base64), one per
  # `<image>` marker in the prompt (docs/vision.md).
  images_field: str = "images"
  # A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config
  # .json) for a model trained from scratch; empty with init_from_hf, whose
  # checkpoint brings its own.
  tokenizer: str = ""
  # Instruct models: prompts go through the checkpoint's chat template.
  chat_template: bool = True
  system_prompt: str = ""
  # Reasoning models (Qwen3): "template" (the chat template's default), "on"
  # or "off" (enable_thinking); the same for SFT rows and for sampling.
  thinking: str = "template"
  # A bad row: "error" stops before training, naming file, line and field;
  # "skip" drops it and counts it in the load report.
  on_bad_row: str = "error"

  def __post_init__(self):
    for key in ("train_path", "eval_path"):
      if not getattr(self, key):
        raise ValueError(f"config.task.{key} must be set for task 'jsonl'")
    if self.thinking not in THINKING:
      raise ValueError(f"config.task.thinking must be one of "
                       f"{sorted(THINKING)}, got {self.thinking!r}")
    if self.on_bad_row not in records_lib.ON_BAD_ROW:
      raise ValueError(f"config.task.on_bad_row must be one of "
                       f"{records_lib.ON_BAD_ROW}, got "
                       f"{self.on_bad_row!r}")


TaskConfig = Union[pointer_chase.PointerChaseConfig, JsonlTaskConfig]
_TASK_CONFIGS = {"pointer_chase": pointer_chase.PointerChaseConfig,
                 "jsonl": JsonlTaskConfig}
# Tasks that bring their own warm-start (SFT) pairs.
_TASKS_WITH_WARMSTART = ("pointer_chase",)


def tokenizer_dir(init_from_hf: str, task: TaskConfig) -> str:
  """The Hugging Face directory whose tokenizer the run uses ("" for a
  task with its own): the checkpoint's, else `task.tokenizer`."""
  return init_from_hf or getattr(task, "tokenizer", "")


def hf_tokenizer(init_from_hf: str, task: TaskConfig) -> Any:
  """The Hugging Face tokenizer the run uses (see `tokenizer_dir`); None
  for a task with a tokenizer of its own."""
  path = tokenizer_dir(init_from_hf, task)
  if not path:
    return None
  return load_hf_tokenizer(path)


def prompt_images(record: Mapping[str, Any]) -> Any:
  """A record's prompt images as the model takes them (n x H x W x C
  float32 pixels, `kimi_jax.data.images.to_pixels`), or None for a text
  record."""
  return record.get("pixels")


def task_config(section: Mapping[str, Any]) -> TaskConfig:
  """The typed `config.task` section of the task it names."""
  name = section.get("name")
  if name not in _TASK_CONFIGS:
    raise ConfigError(f"config.task.name: unknown task {name!r} "
                      f"(known: {sorted(_TASK_CONFIGS)})")
  return to_dataclass(_TASK_CONFIGS[name], section, "task")


def has_warmstart(cfg: TaskConfig) -> bool:
  return cfg.name in _TASKS_WITH_WARMSTART


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
  # Per-response length cap (record, sample index) -> tokens, below
  # rl.max_response_len: a synthetic task forces lengths with it.
  response_cap: Callable[[Mapping[str, Any], int], int] | None = None
  # What loading each data file did (rows kept / skipped), by role
  # ("task_train", "task_eval", "task_val"), for the metrics log.
  reports: Mapping[str, records_lib.LoadReport] = dataclasses.field(
      default_factory=dict)
  # Validation records (`task.val_path`); empty when the task has none.
  val: Sequence[dict] = ()


def _with_image(record: dict, cfg: pointer_chase.PointerChaseConfig,
                seed: int) -> dict:
  """A pointer-chase record, shown as an image when the task says so: its
  pixels, and "image" / "text" as its first tag (pass@1 by task)."""
  if not cfg.image_fraction:
    return record
  if not pointer_chase.shown_as_image(record["x"], record["n"], seed,
                                      cfg.image_fraction):
    return dict(record, tags=["text"])
  drawn = visual_tasks.render_text(pointer_chase.image_text(record),
                                   cfg.image_size)
  pixels = images.to_pixels(drawn, cfg.image_size, 3, where=record["id"])
  return dict(record, tags=["image"], pixels=pixels[None])


def _pointer_chase_task(cfg: pointer_chase.PointerChaseConfig, seed: int,
                        warmstart_size: int) -> Task:
  train, held = pointer_chase.make_problems(cfg, seed)
  train, val = pointer_chase.split_validation(train, cfg, seed)
  train = [_with_image(r, cfg, seed) for r in train]
  held = [_with_image(r, cfg, seed) for r in held]
  val = [_with_image(r, cfg, seed) for r in val]
  tok = pointer_chase.tokenizer(cfg.cot_style, images=cfg.image_fraction > 0)

  def encode_prompt(r: Mapping[str, Any]) -> list[int]:
    if prompt_images(r) is None:
      return [tok.bos_id] + tok.encode(r["prompt"])
    # The picture shows "x cN"; the response reads it out, then solves.
    return [tok.bos_id] + tok.encode(pointer_chase.IMAGE_WORD) * \
        cfg.image_tokens

  return Task(
      name=cfg.name, train=train, eval=held, val=val,
      reward=pointer_chase.PointerChaseReward(), tokenizer=tok,
      encode_prompt=encode_prompt,
      warmstart=lambda s: pointer_chase.warmstart_texts(
          train, cfg, s, warmstart_size) + pointer_chase.reading_drills(
              train, cfg.reading_repeats))


# Which fields a row must have, by reward; other rewards read their own.
_KIND_OF_REWARD = {"math": "math", "code": "code"}


def verifier_name(reward: str) -> str:
  """The rule-based reward of a jsonl task: `task.reward` itself, or
  math-verify under a reward model (report 2.3.5 trains them for math; the
  job swaps the model in for RL, held-out evaluation keeps math-verify)."""
  return "math" if registry.needs_model(reward) else reward


def prompt_fields(cfg: JsonlTaskConfig) -> records_lib.PromptFields:
  """The prompt-set schema of a jsonl task (field names, kind)."""
  return records_lib.PromptFields(
      kind=_KIND_OF_REWARD.get(verifier_name(cfg.reward), "open"),
      prompt=cfg.prompt_field,
      answer=cfg.answer_field, difficulty=cfg.difficulty_field,
      tags=cfg.tags_field, tests=cfg.tests_field)


def image_prompt_ids(tokenizer: Any, prompt: str, vision: Any, *,
                     chat_template: bool, system_prompt: str = "",
                     thinking: str = "template", marker: str = "<image>"
                     ) -> list[int]:
  """`prompt_ids` of a prompt whose `marker`s stand for images: the prompt
  (through the chat template, if any) is cut at each marker, the pieces
  tokenized on their own and joined by runs of `vision.tokens_per_image`
  placeholders (`vision.image_token_id`), as a vision-language processor
  inserts its image tokens. A prompt without markers gives `prompt_ids`."""
  if marker not in prompt:
    return prompt_ids(tokenizer, prompt, chat_template=chat_template,
                      system_prompt=system_prompt, thinking=thinking)
  if chat_template:
    text = tokenizer.render_chat(chat_messages(prompt, system_prompt),
                                 add_generation_prompt=True,
                                 **thinking_vars(thinking))
    first = tokenizer.encode
  else:
    text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    first = tokenizer.encode_with_special_tokens  # BOS, if any, once
  pieces = text.split(marker)
  run = [vision.image_token_id] * vision.tokens_per_image
  out = first(pieces[0])
  for piece in pieces[1:]:
    out += run + tokenizer.encode(piece)
  return out


def _jsonl_task(cfg: JsonlTaskConfig, tokenizer: Any,
                max_prompt_tokens: int | None, vision: Any = None) -> Task:
  if tokenizer is None:
    raise ValueError("task.name='jsonl' needs a tokenizer: set init_from_hf "
                     "to a local Hugging Face directory, or task.tokenizer "
                     "to a tokenizer directory")
  fields = prompt_fields(cfg)
  if vision is None:
    encode = lambda r: prompt_ids(tokenizer, r["prompt"],
                                  chat_template=cfg.chat_template,
                                  system_prompt=cfg.system_prompt,
                                  thinking=cfg.thinking)
  else:
    encode = lambda r: image_prompt_ids(
        tokenizer, r["prompt"], vision, chat_template=cfg.chat_template,
        system_prompt=cfg.system_prompt, thinking=cfg.thinking)
  admit = None
  if max_prompt_tokens is not None:
    def admit(record):
      n = len(encode(record))
      if n > max_prompt_tokens:
        raise records_lib.RowError(
            cfg.prompt_field, f"{n} tokens as prompted, more than the "
            f"{max_prompt_tokens} that leave room for a response "
            f"(sampler.cache_len - rl.max_response_len)")
  if vision is None:
    load = lambda path: records_lib.load_prompt_source(
        path, fields, on_bad_row=cfg.on_bad_row, admit=admit)
  else:
    # Rows may carry images (`task.images_field`, `<image>` markers in the
    # prompt), checked against the tower at load time; records get pixels.
    image_fields = image_records.ImageFields(
        text=fields, images=cfg.images_field, max_images=vision.max_images,
        image_size=vision.image_size, channels=vision.channels)
    load = lambda path: image_records.load_image_source(
        path, image_fields, on_bad_row=cfg.on_bad_row, admit=admit)
  train, held = load(cfg.train_path), load(cfg.eval_path)
  reports = {"task_train": train.report, "task_eval": held.report}
  val = ()
  if cfg.val_path:
    val = load(cfg.val_path)
    reports["task_val"] = val.report
  return Task(name="jsonl", train=train, eval=held,
              reward=registry.make_reward(verifier_name(cfg.reward)),
              tokenizer=tokenizer, encode_prompt=encode, reports=reports,
              val=val)


def check_data_config(task: TaskConfig, sft_steps: int,
                      sft_train_path: str, sft_stage2_path: str = ""
                      ) -> None:
  """Fails before any weights load when the data the config asks for is not
  there: the task's JSONL paths, and SFT data when `sft.steps` > 0.

  Raises ValueError naming the config key.
  """
  if isinstance(task, JsonlTaskConfig):
    for key in ("train_path", "eval_path", "val_path"):
      path = getattr(task, key)
      if key == "val_path" and not path:
        continue
      if not os.path.isfile(path):
        raise ValueError(f"config.task.{key}: file not found: {path}")
  if sft_steps > 0 and sft_stage2_path:
    if not isinstance(task, JsonlTaskConfig):
      raise ValueError(
          f"config.sft.stage2_train_path: SFT records are tokenized with the "
          f"Hugging Face tokenizer and chat template of task 'jsonl', not "
          f"task {task.name!r}")
    if not os.path.isfile(sft_stage2_path):
      raise ValueError(f"config.sft.stage2_train_path: file not found: "
                       f"{sft_stage2_path}")
  if sft_steps > 0:
    if sft_train_path:
      if not isinstance(task, JsonlTaskConfig):
        raise ValueError(
            f"config.sft.train_path: SFT records are tokenized with the "
            f"Hugging Face tokenizer and chat template of task 'jsonl'; task "
            f"{task.name!r} brings its own warm-start data (leave "
            f"config.sft.train_path empty)")
      if not os.path.isfile(sft_train_path):
        raise ValueError(f"config.sft.train_path: file not found: "
                         f"{sft_train_path}")
    elif not has_warmstart(task):
      raise ValueError(
          f"config.sft.steps={sft_steps} asks for a warm start but "
          f"config.sft.train_path is empty and task {task.name!r} has no "
          f"warm-start data of its own; set config.sft.train_path or "
          f"config.sft.steps=0")


def make_task(cfg: TaskConfig, seed: int, tokenizer: Any = None,
              warmstart_size: int = 4096,
              max_prompt_tokens: int | None = None,
              vision: Any = None) -> Task:
  """The task `cfg` names. max_prompt_tokens: a jsonl prompt longer than
  this once tokenized (chat template included) is a bad row, rejected or
  skipped by `task.on_bad_row` at load time rather than failing in the
  sampler. vision: the policy's `model.vision`; with it a jsonl set's rows
  may carry images (docs/vision.md)."""
  if isinstance(cfg, pointer_chase.PointerChaseConfig):
    return _pointer_chase_task(cfg, seed, warmstart_size)
  return _jsonl_task(cfg, tokenizer, max_prompt_tokens, vision)
