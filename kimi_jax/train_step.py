"""Train state, optimizer and the jitted, sharded, donated train step.

The step is generic over a loss `loss_fn(params, batch) -> (loss, metrics)`:
supervised cross-entropy lives here, the RL losses in `kimi_jax.rl.losses`.
Non-finite loss or gradient norm leaves the state untouched and reports
`finite=0` so the caller can stop before any bad update lands.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import optax

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import Sharder

Batch = Mapping[str, jax.Array]
LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float
  warmup_steps: int = 0
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  b1: float = 0.9
  b2: float = 0.95

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be positive, got "
                       f"{self.learning_rate}")
    if self.grad_clip <= 0:
      raise ValueError(f"grad_clip must be positive, got {self.grad_clip}")


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  if cfg.warmup_steps > 0:
    lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    lr = cfg.learning_rate
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def opt_state_shardings(optimizer: optax.GradientTransformation,
                        abstract_params: Any, param_shardings: Any,
                        sharder: Sharder) -> Any:
  """Optimizer moments take their parameter's sharding; counters replicate."""
  abstract_state = jax.eval_shape(optimizer.init, abstract_params)
  return optax.tree_map_params(
      optimizer, lambda _, s: s, abstract_state, param_shardings,
      transform_non_params=lambda _: sharder.replicated())


def state_shardings(optimizer, model_cfg: ModelConfig, sharder: Sharder
                    ) -> TrainState:
  params_sh = transformer.param_shardings(model_cfg, sharder)
  return TrainState(
      step=sharder.replicated(), params=params_sh,
      opt_state=opt_state_shardings(optimizer,
                                    transformer.abstract_params(model_cfg),
                                    params_sh, sharder))


def make_reset_optimizer(optimizer, shardings: TrainState):
  """Jitted: fresh optimizer state for the given params (sharded in place)."""

  def reset(params):
    return optimizer.init(params)

  return jax.jit(reset, in_shardings=(shardings.params,),
                 out_shardings=shardings.opt_state)


def create_state(params: Any, optimizer, shardings: TrainState) -> TrainState:
  opt_state = make_reset_optimizer(optimizer, shardings)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return TrainState(step=step, params=params, opt_state=opt_state)


def _tree_norm(tree) -> jax.Array:
  return optax.tree.norm(tree)


def train_step(state: TrainState, batch: Batch, *, loss_fn: LossFn,
               optimizer: optax.GradientTransformation,
               grad_shardings: Any = None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One gradient step; the update is skipped if loss or grads are not finite.

  grad_shardings: pins gradients to their parameters' shardings, so XLA
  cannot leave them gathered (the memory plan counts them sharded).
  """
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params, batch)
  if grad_shardings is not None:
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  grad_norm = _tree_norm(grads)
  updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                       new, old)
  new_state = TrainState(step=state.step + finite.astype(jnp.int32),
                         params=keep(new_params, state.params),
                         opt_state=keep(new_opt, state.opt_state))
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm,
                 update_norm=_tree_norm(updates),
                 param_norm=_tree_norm(new_state.params),
                 finite=finite.astype(jnp.float32))
  return new_state, metrics


class NonFiniteError(RuntimeError):
  """Loss or gradient norm became NaN/inf; the update was not applied."""


class TraceCounter:
  """Counts how often a function is traced, i.e. compiled for new shapes."""

  def __init__(self, fn: Callable):
    self.fn = fn
    self.count = 0

  def __call__(self, *args, **kwargs):
    self.count += 1
    return self.fn(*args, **kwargs)


def jit_train_step(loss_fn: LossFn, optimizer, shardings: TrainState,
                   batch_sharding: Any) -> tuple[Callable, TraceCounter]:
  """The step jitted with in/out shardings and the state donated."""
  counter = TraceCounter(
      lambda state, batch: train_step(state, batch, loss_fn=loss_fn,
                                      optimizer=optimizer,
                                      grad_shardings=shardings.params))
  # Metrics come back replicated so every process can read them.
  step = jax.jit(counter, in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, shardings.step),
                 donate_argnums=(0,))
  return step, counter


def cross_entropy_loss(params, batch: Batch, *, cfg: ModelConfig,
                       sharder: Sharder | None = None):
  """Masked next-token cross-entropy: sum(mask * -log p(target)) / sum(mask).

  batch: tokens_BxT (inputs), targets_BxT, mask_BxT (1 where the target
  counts), positions_BxT, segment_ids_BxT.
  """
  logits, _ = transformer.forward(params, batch["tokens"], batch["positions"],
                                  batch["segment_ids"], cfg=cfg,
                                  sharder=sharder)
  logp_BxT = transformer.token_logprobs(logits, batch["targets"])
  mask_BxT = batch["mask"].astype(jnp.float32)
  n_tokens = jnp.maximum(mask_BxT.sum(), 1.0)
  loss = -(logp_BxT * mask_BxT).sum() / n_tokens
  return loss, {"tokens": mask_BxT.sum()}


def batch_shardings(sharder: Sharder, batch_shapes: Mapping[str, tuple]):
  """Every batch field is sharded on its leading (batch) axis."""
  return {k: sharder.data_sharding(shape, ("batch",) + (None,) *
                                   (len(shape) - 1))
          for k, shape in batch_shapes.items()}
