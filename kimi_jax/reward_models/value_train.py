"""Training and running the classic (value-head) reward model on the mesh.

Training is the project's train step (`kimi_jax.train_step.jit_train_step`:
jitted with in/out shardings, donated state, the NaN guard) with the value
loss over packed `ValueBatch`es placed by `sharding.place_batch`; one batch
shape, so one compilation. `ValueScorer` is the jitted forward that scores
inputs in fixed-shape packed batches (evaluation, and the RL reward).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.infra.console import log
from kimi_jax.model.config import ModelConfig
from kimi_jax.reward_models import value_model
from kimi_jax.reward_models.value_data import (Scored, Unit, ValueBatches,
                                               pack_units)
from kimi_jax.sharding import Sharder, batch_shardings, place_batch
from kimi_jax.step_loop import Progress, peek, run_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueTrainConfig(ts.AdamWConfig):
  """`config.rm_value`: loss "bce" or "bradley_terry"; batches of
  `batch_rows` packed rows of `row_len` tokens; AdamW with warm-up; a
  checkpoint every `checkpoint_every` steps, which a rerun continues from
  (`kimi_jax.step_loop`)."""

  loss: str = "bce"
  steps: int = 300
  batch_rows: int = 16
  row_len: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  checkpoint_every: int = 100

  def __post_init__(self):
    if self.checkpoint_every < 1:
      raise ValueError("config.rm_value.checkpoint_every must be >= 1")
    if self.loss not in value_model.LOSSES:
      raise ValueError(f"config.rm_value.loss must be one of "
                       f"{value_model.LOSSES}, got {self.loss!r}")
    if self.steps < 1 or self.batch_rows < 1 or self.row_len < 2:
      raise ValueError("config.rm_value: steps, batch_rows >= 1 and "
                       "row_len >= 2 are required")


def state_shardings(optimizer, cfg: ModelConfig, sharder: Sharder
                    ) -> ts.TrainState:
  params_sh = value_model.param_shardings(cfg, sharder)
  return ts.TrainState(
      step=sharder.replicated(), params=params_sh,
      opt_state=ts.opt_state_shardings(
          optimizer, value_model.abstract_params(cfg), params_sh, sharder))


def train(params: dict[str, Any], units: Sequence[Unit], *,
          model_cfg: ModelConfig, cfg: ValueTrainConfig, sharder: Sharder,
          pad_id: int, seed: int, log_every: int = 50,
          progress: Progress | None = None
          ) -> tuple[dict[str, Any], list[dict[str, float]]]:
  """`cfg.steps` steps over `units`; returns new params (`params` stay
  valid) and per-step metrics (loss, accuracy or pair accuracy, grad norm,
  epoch) of the steps this call ran. With `progress`, a rerun continues
  from the last checkpoint (`kimi_jax.step_loop`)."""
  optimizer = ts.make_optimizer(cfg.optimizer())
  shardings = state_shardings(optimizer, model_cfg, sharder)
  # The step donates its state: train a copy, the caller keeps `params`.
  params = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p),
                   out_shardings=shardings.params)(params)
  state = ts.create_state(params, optimizer, shardings)
  batches = ValueBatches(units, n_rows=cfg.batch_rows, row_len=cfg.row_len,
                         pad_id=pad_id, seed=seed)
  first = peek(batches)
  loss = functools.partial(value_model.loss_fn(cfg.loss), cfg=model_cfg,
                           sharder=sharder)
  step_fn, counter = ts.jit_train_step(
      loss, optimizer, shardings, batch_shardings(sharder, first),
      matmul_dtype=model_cfg.matmul_jnp_dtype)
  history: list[dict[str, float]] = []
  t0 = time.perf_counter()

  def read(step: int, metrics: Any, epoch: float) -> None:
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not m["finite"]:
      raise ts.NonFiniteError(f"value RM step {step}: loss {m['loss']} / "
                              f"grad norm {m['grad_norm']} not finite")
    m.update(step=step + 1, epoch=epoch)
    history.append(m)
    if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
      acc = m.get("accuracy", m.get("pair_accuracy"))
      log(f"value RM step {step + 1}/{cfg.steps}: loss {m['loss']:.4f} "
          f"train acc {acc:.3f} epoch {epoch:.2f} "
          f"({len(history) / (time.perf_counter() - t0):.1f} steps/s)")

  state = run_steps(step_fn, state, batches, cfg.steps, sharder=sharder,
                    shardings=shardings, read=read, progress=progress,
                    what="value RM")
  if counter.count > 1:
    raise AssertionError(f"value RM train step compiled {counter.count}x")
  return state.params, history


class ValueScorer:
  """Logits of many inputs: packed into fixed-shape batches, scored by one
  jitted forward (compiled once), read back at each input's last token."""

  def __init__(self, params: dict[str, Any], *, model_cfg: ModelConfig,
               sharder: Sharder, n_rows: int, row_len: int, pad_id: int):
    self.params, self.sharder = params, sharder
    self.n_rows, self.row_len, self.pad_id = n_rows, row_len, pad_id
    probe, _, _ = pack_units([], n_rows, row_len, pad_id)
    self._batch_sh = batch_shardings(sharder, probe.rows)
    self.counter = ts.TraceCounter(functools.partial(
        value_model.score_logits, cfg=model_cfg, sharder=sharder))
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    sh = self._batch_sh
    self._fn = jax.jit(
        self.counter,
        in_shardings=(params_sh, sh.tokens_RxT, sh.positions_RxT,
                      sh.segment_ids_RxT),
        out_shardings=sharder.replicated())

  def logits(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
    """One logit per input, in order (offset not applied)."""
    units = [(Scored(tuple(ids), False),) for ids in inputs]
    out = np.zeros(len(units), np.float32)
    done = 0
    while done < len(units):
      batch, where, placed = pack_units(units[done:], self.n_rows,
                                        self.row_len, self.pad_id)
      if placed == 0:
        raise ValueError(f"input {done} has {len(inputs[done])} tokens, "
                         f"more than a row of {self.row_len}")
      rows = place_batch(self.sharder, batch.rows)
      s_RxT = np.asarray(jax.device_get(self._fn(
          self.params, rows.tokens_RxT, rows.positions_RxT,
          rows.segment_ids_RxT)))
      for k, (r, t) in enumerate(where):
        out[done + k] = s_RxT[r, t]
      done += placed
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))
