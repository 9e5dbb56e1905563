"""Training the chain-of-thought reward model: SFT on rejection-sampled
rationales that end in the verifier's label.

  1. seed (when `seed_examples` > 0): SFT the base model on a few seed
     rationales (`cot_model.seed_rationale`), so it writes the format at
     all. A model that already follows the instruction (a prompted instruct
     model) skips this: seed_examples = 0;
  2. rejection sampling: the seeded model judges every training example
     `rejection_samples` times at `rejection_temperature`; a rationale is
     kept when its verdict parses and equals the label (the first such one
     per example);
  3. SFT the base model afresh on the kept rationales.

SFT here is next-token cross-entropy on the rationale and its end token
(`train_step.cross_entropy_loss`), examples packed into rows
(`data.sft_data.PackedBatches`), on the project's jitted train step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.data.journal import digest
from kimi_jax.data.sft_data import PackedBatches, pair_example
from kimi_jax.infra.console import log
from kimi_jax.infra.files import write_json
from kimi_jax.model.config import ModelConfig
from kimi_jax.reward_models import cot_model
from kimi_jax.reward_models.labelled import LabelledExample
from kimi_jax.sharding import Sharder, batch_shardings
from kimi_jax.step_loop import Progress, final_loss, peek, run_steps
from kimi_jax.token_rows import TokenRows


@dataclasses.dataclass(frozen=True, kw_only=True)
class CotTrainConfig(ts.AdamWConfig):
  """`config.rm_cot`. Seed stage: `seed_examples` (0: none, balanced
  between labels) for `seed_steps`; rejection sampling: `rejection_samples`
  draws per example at `rejection_temperature`; final SFT: `steps` on
  batches of `batch_rows` packed rows of `row_len`; judging writes at most
  `max_new_tokens` on `max_slots` sampler slots. Each SFT saves a
  checkpoint every `checkpoint_every` steps, which a rerun continues from
  (`kimi_jax.step_loop`). The optimizer's settings are AdamWConfig's."""

  seed_examples: int = 128
  seed_steps: int = 100
  rejection_samples: int = 4
  rejection_temperature: float = 1.0
  steps: int = 300
  batch_rows: int = 16
  row_len: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  max_new_tokens: int = 16
  max_slots: int = 64
  checkpoint_every: int = 100

  def __post_init__(self):
    if self.checkpoint_every < 1:
      raise ValueError("config.rm_cot.checkpoint_every must be >= 1")
    if self.seed_examples < 0 or self.seed_steps < 0:
      raise ValueError("config.rm_cot.seed_examples / seed_steps must be "
                       ">= 0")
    if self.seed_examples and not self.seed_steps:
      raise ValueError("config.rm_cot.seed_steps must be > 0 when "
                       "seed_examples > 0")
    if self.rejection_samples < 1 or self.rejection_temperature <= 0:
      raise ValueError("config.rm_cot: rejection_samples >= 1 and "
                       "rejection_temperature > 0 are required")
    if self.steps < 1 or self.max_new_tokens < 2 or self.max_slots < 1:
      raise ValueError("config.rm_cot: steps >= 1, max_new_tokens >= 2 and "
                       "max_slots >= 1 are required")


def sft(params: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        *, model_cfg: ModelConfig, cfg: CotTrainConfig, steps: int,
        sharder: Sharder, pad_id: int, seed: int, what: str,
        progress: Progress | None = None
        ) -> tuple[Any, list[dict[str, float]]]:
  """`steps` SFT steps on (prompt ids, target ids) pairs, packed; returns
  new params (the input params are not donated) and the metrics of the
  steps this call ran. With `progress`, a rerun continues from the last
  checkpoint (`kimi_jax.step_loop`)."""
  optimizer = ts.make_optimizer(cfg.optimizer())
  shardings = ts.state_shardings(optimizer, model_cfg, sharder)
  params = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p),
                   out_shardings=shardings.params)(params)
  state = ts.create_state(params, optimizer, shardings)
  as_rows = lambda d: TokenRows(**{f"{k}_RxT": v for k, v in d.items()})
  batches = PackedBatches(list(pairs), lambda p: pair_example(*p),
                          n_rows=cfg.batch_rows, row_len=cfg.row_len,
                          pad_id=pad_id, seed=seed)
  first = as_rows(peek(batches))
  loss = functools.partial(ts.cross_entropy_loss, cfg=model_cfg,
                           sharder=sharder)
  step_fn, _ = ts.jit_train_step(loss, optimizer, shardings,
                                 batch_shardings(sharder, first),
                                 matmul_dtype=model_cfg.matmul_jnp_dtype)
  history, t0 = [], time.perf_counter()

  def read(step: int, metrics: Any, _) -> None:
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not m["finite"]:
      raise ts.NonFiniteError(f"{what} step {step}: not finite ({m})")
    history.append(dict(m, step=step + 1))
    if (step + 1) % 50 == 0 or step + 1 == steps:
      log(f"{what} step {step + 1}/{steps}: loss {m['loss']:.4f} "
          f"({len(history) / (time.perf_counter() - t0):.1f} steps/s)")

  state = run_steps(step_fn, state, batches, steps, sharder=sharder,
                    shardings=shardings, read=read, progress=progress,
                    what=what, convert=as_rows)
  return state.params, history


def rationale_pair(judge: cot_model.CotJudge, ex: LabelledExample,
                   rationale: str) -> tuple[list[int], list[int]]:
  """(input ids, rationale ids + end token) of one SFT example."""
  x = judge.encode(cot_model.JudgeItem(ex.question, ex.reference,
                                       ex.response, ex.id))
  tok = judge.tokenizer
  return list(x.ids), list(tok.encode(" " + rationale)) + [tok.eos_id]


def seed_subset(examples: Sequence[LabelledExample], n: int, seed: int
                ) -> list[LabelledExample]:
  """Up to `n` examples, half of each label where possible, seeded."""
  rng = np.random.default_rng([seed, 5])
  pos = [e for e in examples if e.label]
  neg = [e for e in examples if not e.label]
  rng.shuffle(pos)
  rng.shuffle(neg)
  k = min(len(pos), n // 2)
  return pos[:k] + neg[:n - k]


def rejection_sample(judge: cot_model.CotJudge,
                     examples: Sequence[LabelledExample], *, samples: int,
                     temperature: float, seed: int
                     ) -> tuple[list[tuple[LabelledExample, str]],
                                dict[str, float]]:
  """The first rationale per example whose verdict parses and matches the
  label; and the acceptance statistics."""
  items = [cot_model.JudgeItem(e.question, e.reference, e.response, e.id)
           for e in examples]
  judged, _ = judge.judge(items, temperature=temperature, samples=samples,
                          seed=seed)
  kept, drawn, statuses = [], 0, {"ok": 0, "malformed": 0, "missing": 0}
  for ex, js in zip(examples, judged):
    for j in js:
      drawn += 1
      statuses[j.verdict.status] += 1
    match = [j for j in js if j.verdict.status == "ok"
             and j.verdict.correct == ex.label]
    if match:
      kept.append((ex, match[0].text))
  pos = sum(e.label for e in examples)
  kept_pos = sum(e.label for e, _ in kept)
  stats = {
      "examples": len(examples), "draws": drawn,
      "kept": len(kept), "coverage": len(kept) / max(len(examples), 1),
      "coverage_correct": kept_pos / max(pos, 1),
      "coverage_incorrect": (len(kept) - kept_pos) /
                            max(len(examples) - pos, 1),
      **{f"draws_{k}": v for k, v in statuses.items()}}
  return kept, stats


def _stage(progress: Progress | None, name: str) -> Progress | None:
  if progress is None:
    return None
  return Progress(os.path.join(progress.directory, name),
                  digest(progress.key, name), progress.every)


def _read_kept(path: str, key: str, examples: Sequence[LabelledExample]
               ) -> tuple[list[tuple[LabelledExample, str]], dict,
                          dict | None] | None:
  """Rejection sampling's result saved by an earlier run of these inputs."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  if saved.get("key") != key:
    return None
  by_id = {e.id: e for e in examples}
  return ([(by_id[i], text) for i, text in saved["kept"]], saved["stats"],
          saved["seed"])


def train(base_params: Any, examples: Sequence[LabelledExample], *,
          judge_for, model_cfg: ModelConfig, cfg: CotTrainConfig,
          sharder: Sharder, pad_id: int, seed: int,
          progress: Progress | None = None
          ) -> tuple[Any, dict[str, Any]]:
  """The three stages (module doc). `judge_for(params)` gives a CotJudge
  on params (the job's sampler and template). Returns the final params and
  a report of each stage. With `progress`, each SFT keeps checkpoints in
  its own directory under `progress.directory` and rejection sampling's
  result is saved there, so a rerun with the same key continues where a
  kill stopped it."""
  report: dict[str, Any] = {}
  kept_file = (os.path.join(progress.directory, "rejection.json")
               if progress is not None else "")
  saved = (_read_kept(kept_file, progress.key, examples)
           if progress is not None else None)
  if saved is not None:
    # The seed SFT only serves rejection sampling, which is done.
    kept, stats, seed_report = saved
    if seed_report is not None:
      report["seed"] = seed_report
    judge = judge_for(base_params)
    log(f"CoT RM rejection sampling: read back from {kept_file}")
  else:
    proposer = base_params
    if cfg.seed_examples:
      seeds = seed_subset(examples, cfg.seed_examples, seed)
      judge = judge_for(base_params)
      pairs = [rationale_pair(judge, e, cot_model.seed_rationale(
          e.extracted, e.reference, e.label)) for e in seeds]
      proposer, hist = sft(base_params, pairs, model_cfg=model_cfg, cfg=cfg,
                           steps=cfg.seed_steps, sharder=sharder,
                           pad_id=pad_id, seed=seed, what="CoT RM seed SFT",
                           progress=_stage(progress, "seed_sft"))
      report["seed"] = {"examples": len(seeds),
                        "final_loss": final_loss(hist)}
    judge = judge_for(proposer)
    t0 = time.perf_counter()
    kept, stats = rejection_sample(judge, examples,
                                   samples=cfg.rejection_samples,
                                   temperature=cfg.rejection_temperature,
                                   seed=seed + 1)
    stats["seconds"] = time.perf_counter() - t0
    if progress is not None and jax.process_index() == 0:
      write_json(kept_file, {"key": progress.key, "stats": stats,
                             "seed": report.get("seed"),
                             "kept": [[e.id, text] for e, text in kept]})
  report["rejection_sampling"] = stats
  log(f"CoT RM rejection sampling: kept {stats['kept']} of "
      f"{stats['examples']} examples (coverage {stats['coverage']:.3f}; "
      f"correct {stats['coverage_correct']:.3f}, incorrect "
      f"{stats['coverage_incorrect']:.3f})")
  if not kept:
    raise ValueError("rejection sampling kept no rationale: the proposer "
                     "never wrote a verdict matching the label")
  pairs = [rationale_pair(judge, e, text) for e, text in kept]
  params, hist = sft(base_params, pairs, model_cfg=model_cfg, cfg=cfg,
                     steps=cfg.steps, sharder=sharder, pad_id=pad_id,
                     seed=seed + 2, what="CoT RM SFT",
                     progress=_stage(progress, "sft"))
  report["sft"] = {"examples": len(pairs), "final_loss": final_loss(hist)}
  return params, report

