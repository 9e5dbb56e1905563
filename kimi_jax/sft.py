"""Supervised warm start (report 2.2, 2.5.2): the `sft` config section, its
learning-rate schedule and its data.

Examples (a JSONL set's prompt + response or chat records, or the task's
own warm-start pairs) are packed several to a row with segment ids, loss on
response tokens only (kimi_jax/data/sft_data.py). Rows come from a shuffled,
repeated Grain source; the stream position after each step is the data
state the job saves in its checkpoints, so a resumed stage continues with
exactly the batches it would have seen. Every process builds the global
batch and places its own rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from kimi_jax.data import records, sft_data
from kimi_jax.data.records import LoadReport
from kimi_jax.data.sft_data import PackedBatches
from kimi_jax.data.tasks import JsonlTaskConfig, Task, TaskConfig
from kimi_jax.token_rows import TokenRows, image_slots
from kimi_jax.train_step import AdamWConfig, OptimizerConfig
from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.merge import RowImages


# Validation figures an SFT stage can stop on (kimi_jax.rl.evaluation).
STOP_METRICS = ("pass_at_1", "greedy_accuracy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(AdamWConfig):
  """The `sft` config section.

  Data (kimi_jax.data.records / sft_data): `train_path` is a JSONL file of
  prompt + response or chat messages rows (field names configurable);
  empty means the task's own warm-start data. `truncate`: cut examples
  longer than `seq_len` instead of failing. Learning rate: warm-up, then
  `decay` to `final_learning_rate`; when `stage2_steps` > 0 the last
  `stage2_steps` steps re-warm to `stage2_learning_rate` and decay to
  `stage2_final_learning_rate` (report 2.5.2's two stages).
  `stage2_train_path`: the data of those last `stage2_steps` steps, e.g.
  the long-CoT warm-up set of launch/warmup_data.py (report 2.2), so one
  run is a vanilla SFT stage then a long-CoT stage, each with its data
  position in the checkpoints; "" keeps `train_path` for both.
  `stop_at_val` (ours; 0: off): every `check_every` steps the stage
  samples the task's validation set and ends at the first check whose
  `stop_metric` ("pass_at_1", sampled, or "greedy_accuracy") reaches this
  value, so runs (seeds) whose models learn at different speeds all leave
  the stage equally competent. The learning rate keeps the schedule of
  `steps`: a stopped stage ends mid-schedule.
  """

  steps: int
  batch_size: int
  seq_len: int
  decay: str = "constant"
  final_learning_rate: float = 0.0
  stage2_steps: int = 0
  stage2_warmup_steps: int = 0
  stage2_learning_rate: float = 0.0
  stage2_final_learning_rate: float = 0.0
  train_path: str = ""
  stage2_train_path: str = ""
  on_bad_row: str = "error"
  prompt_field: str = "prompt"
  response_field: str = "response"
  messages_field: str = "messages"
  truncate: bool = False
  stop_at_val: float = 0.0
  stop_metric: str = "pass_at_1"
  check_every: int = 0

  def __post_init__(self):
    if self.steps < 0:
      raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
    if self.batch_size <= 0 or self.seq_len <= 1:
      raise ValueError("sft.batch_size must be > 0 and sft.seq_len > 1")
    if self.on_bad_row not in ("error", "skip"):
      raise ValueError(f"sft.on_bad_row must be 'error' or 'skip', got "
                       f"{self.on_bad_row!r}")
    if self.steps and self.stage2_steps + self.warmup_steps >= self.steps \
        and self.decay != "constant":
      raise ValueError(
          f"sft.warmup_steps ({self.warmup_steps}) + sft.stage2_steps "
          f"({self.stage2_steps}) leave no decay steps of sft.steps "
          f"({self.steps})")
    if self.stage2_train_path and not 0 < self.stage2_steps <= self.steps:
      raise ValueError(
          f"sft.stage2_train_path needs 0 < sft.stage2_steps <= sft.steps "
          f"(the steps that train on it), got stage2_steps="
          f"{self.stage2_steps}, steps={self.steps}")
    if not 0 <= self.stop_at_val <= 1:
      raise ValueError(f"sft.stop_at_val must be in [0, 1] (0: off), "
                       f"got {self.stop_at_val}")
    if self.stop_metric not in STOP_METRICS:
      raise ValueError(f"sft.stop_metric must be one of {STOP_METRICS}, "
                       f"got {self.stop_metric!r}")
    if self.stop_at_val and self.check_every < 1:
      raise ValueError(f"sft.stop_at_val={self.stop_at_val} needs "
                       f"sft.check_every >= 1, got {self.check_every}")
    if self.steps:
      try:
        self.optimizer()
      except ValueError as exc:
        raise ValueError(f"sft: {exc}") from None

  def optimizer(self) -> OptimizerConfig:
    """The SFT optimizer: stage 1 decays over the steps that stage 2 (the
    last `stage2_steps`) and the warm-up leave."""
    two = self.stage2_steps > 0
    return dataclasses.replace(
        super().optimizer(), decay=self.decay,
        decay_steps=(self.steps - self.stage2_steps - self.warmup_steps
                     if self.decay != "constant" else 0),
        final_learning_rate=self.final_learning_rate,
        stage2_learning_rate=self.stage2_learning_rate if two else 0.0,
        stage2_warmup_steps=self.stage2_warmup_steps if two else 0,
        stage2_decay_steps=(self.stage2_steps - self.stage2_warmup_steps
                            if two else 0),
        stage2_final_learning_rate=self.stage2_final_learning_rate)


@dataclasses.dataclass(frozen=True)
class SFTData:
  """The SFT stage's rows: packed batches and, for a JSONL set, what loading
  it did (rows kept / skipped); `stage2`: the batches of the last
  `sft.stage2_steps` steps when `sft.stage2_train_path` is set."""

  batches: PackedBatches
  report: LoadReport | None = None
  stage2: PackedBatches | None = None
  stage2_report: LoadReport | None = None

  def batches_at(self, step: int, cfg: SFTConfig) -> PackedBatches:
    """The stream SFT step `step` (0-based) draws from."""
    if self.stage2 is not None and step >= cfg.steps - cfg.stage2_steps:
      return self.stage2
    return self.batches


def warmstart_pairs(texts: Sequence[tuple], tokenizer,
                    encode_prompt: Callable[[dict], list[int]]
                    ) -> list[tuple[list[int], list[int], Any]]:
  """A task's (prompt, solution[, pixels[, eos]]) warm-start examples as
  (prompt ids, solution ids + eos, pixels or None); an image prompt's
  pixels go to `encode_prompt` too, which writes its placeholders.
  eos=False (default True) leaves the end-of-sequence out: the example
  teaches its solution's tokens and nothing about what follows them."""
  out = []
  for p, s, *extra in texts:
    pixels = extra[0] if extra else None
    eos = [tokenizer.eos_id] if len(extra) < 2 or extra[1] else []
    record = {"prompt": p, **({"pixels": pixels} if pixels is not None
                              else {})}
    out.append((encode_prompt(record), tokenizer.encode(s) + eos, pixels))
  return out


def sft_source(cfg: SFTConfig, path: str | None = None
               ) -> records.JsonlSource:
  """The JSONL SFT set `path` (default `sft.train_path`), every row checked
  (bad rows rejected or skipped and counted, `sft.on_bad_row`)."""
  return records.load_sft_source(
      cfg.train_path if path is None else path, records.SFTFields(
          prompt=cfg.prompt_field, response=cfg.response_field,
          messages=cfg.messages_field), on_bad_row=cfg.on_bad_row)


def make_sft_data(cfg: SFTConfig, task: Task, task_cfg: TaskConfig,
                  seed: int, *, source: records.JsonlSource | None = None,
                  stage2_source: records.JsonlSource | None = None,
                  vision: VisionConfig | None = None) -> SFTData:
  """Packed batches of `sft.batch_size` rows of `sft.seq_len` positions.

  With `sft.train_path`: its records (prompt + response, or chat messages;
  `source` when already loaded) tokenized with the task's Hugging Face
  tokenizer, through the chat template and system prompt the task prompts
  with (`task.chat_template`, `task.system_prompt`), loss on the response /
  assistant tokens. Without: the task's own warm-start pairs, loss on the
  solution and eos. With `sft.stage2_train_path` (`stage2_source` when
  already loaded), its records the same way, for the second stage.
  """
  hf_example = None
  if cfg.train_path or cfg.stage2_train_path:
    if not isinstance(task_cfg, JsonlTaskConfig):
      raise ValueError("config.sft.train_path / stage2_train_path need task "
                       "'jsonl' (its Hugging Face tokenizer and chat "
                       "template)")
    hf_example = sft_data.hf_example_fn(
        task.tokenizer, sft_data.SFTTokenizeConfig(
            chat_template=task_cfg.chat_template,
            system_prompt=task_cfg.system_prompt,
            thinking=task_cfg.thinking))
  pack = lambda src, fn: PackedBatches(
      src, fn, n_rows=cfg.batch_size, row_len=cfg.seq_len,
      pad_id=task.tokenizer.pad_id, seed=seed, truncate=cfg.truncate,
      images=image_slots(vision))
  stage2 = stage2_report = None
  if cfg.stage2_train_path:
    stage2_source = (stage2_source if stage2_source is not None else
                     sft_source(cfg, cfg.stage2_train_path))
    stage2, stage2_report = pack(stage2_source, hf_example), \
        stage2_source.report
  if cfg.train_path:
    source = source if source is not None else sft_source(cfg)
    to_example = hf_example
    report = source.report
  else:
    if task.warmstart is None:
      raise ValueError(f"config.sft.train_path is empty and task "
                       f"{task.name!r} has no warm-start data of its own")
    source = warmstart_pairs(task.warmstart(seed), task.tokenizer,
                             task.encode_prompt)
    to_example, report = _pair_example, None
  return SFTData(pack(source, to_example), report, stage2, stage2_report)


def _pair_example(pair: tuple[list[int], list[int], Any]
                  ) -> sft_data.SFTExample:
  return sft_data.pair_example(pair[0], pair[1], pixels=pair[2])


def token_rows(rows: dict[str, np.ndarray]) -> TokenRows:
  """`PackedBatches` rows as the model's `TokenRows` (with their image
  slots, for a vision model's rows)."""
  images = (RowImages(rows["pixels"], rows["image_mask"])
            if "pixels" in rows else None)
  return TokenRows(**{f"{k}_RxT": rows[k] for k in sft_data.ROW_KEYS},
                   images=images)
