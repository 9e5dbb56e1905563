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
import numpy as np
import optax

from kimi_jax.infra import compile_options
from kimi_jax.model import logprobs, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import Sharder
from kimi_jax.token_rows import TokenRows

# A batch is any pytree of arrays the loss reads (TokenRows, Minibatch).
Batch = Any
LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


DECAYS = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamWConfig:
  """The AdamW settings of every training section (`sft`, `rl`, `dpo`,
  `rm_value`, `rm_cot`): each section's config inherits these fields, so
  its keys stay `config.<section>.learning_rate` etc. and it states only
  the defaults it changes; `optimizer()` builds its OptimizerConfig.

  learning_rate: the peak, reached by a linear ramp from 0 over
  `warmup_steps` optimizer steps; grad_clip: the global-norm clip.
  """

  learning_rate: float
  warmup_steps: int = 0
  weight_decay: float = 0.0
  grad_clip: float = 1.0

  def optimizer(self) -> OptimizerConfig:
    """These settings, warm-up then a constant learning rate; a section
    with a decay schedule extends it."""
    return OptimizerConfig(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(AdamWConfig)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig(AdamWConfig):
  """AdamW with global-norm clipping and a warm-up / decay schedule: the
  AdamWConfig settings, Adam's betas, and the schedule below.

  Learning rate by step s (optimizer updates so far):
    stage 1: linear warm-up from 0 to `learning_rate` over `warmup_steps`,
      then `decay` ("constant": stay; "linear" / "cosine": go down to
      `final_learning_rate` over `decay_steps`), then stay at that floor;
    stage 2 (when `stage2_learning_rate` > 0; report 2.5.2's re-warm-up):
      from the end of stage 1, linear warm-up from the stage-1 floor to
      `stage2_learning_rate` over `stage2_warmup_steps`, the same kind of
      decay to `stage2_final_learning_rate` over `stage2_decay_steps`, then
      that floor for good.
  """

  b1: float = 0.9
  b2: float = 0.95
  decay: str = "constant"
  decay_steps: int = 0
  final_learning_rate: float = 0.0
  stage2_learning_rate: float = 0.0
  stage2_warmup_steps: int = 0
  stage2_decay_steps: int = 0
  stage2_final_learning_rate: float = 0.0

  def optimizer(self) -> OptimizerConfig:
    """Itself: the schedule is already complete."""
    return self

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be positive, got "
                       f"{self.learning_rate}")
    if self.grad_clip <= 0:
      raise ValueError(f"grad_clip must be positive, got {self.grad_clip}")
    if self.decay not in DECAYS:
      raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
    for name in ("warmup_steps", "decay_steps", "stage2_warmup_steps",
                 "stage2_decay_steps"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    decaying = self.decay != "constant"
    if decaying and self.decay_steps <= 0:
      raise ValueError(f"decay={self.decay!r} needs decay_steps > 0")
    if decaying and not 0 <= self.final_learning_rate <= self.learning_rate:
      raise ValueError(f"final_learning_rate must be in [0, learning_rate="
                       f"{self.learning_rate}], got "
                       f"{self.final_learning_rate}")
    if self.stage2_learning_rate < 0:
      raise ValueError("stage2_learning_rate must be >= 0 (0: no stage 2)")
    if self.stage2_learning_rate > 0:
      if not decaying or self.stage2_decay_steps <= 0:
        raise ValueError("a second stage (stage2_learning_rate > 0) needs a "
                         "decaying first stage and stage2_decay_steps > 0")
      if not 0 <= self.stage2_final_learning_rate <= \
          self.stage2_learning_rate:
        raise ValueError(f"stage2_final_learning_rate must be in [0, "
                         f"stage2_learning_rate={self.stage2_learning_rate}]"
                         f", got {self.stage2_final_learning_rate}")


def _ramp(step, start: float, end: float, steps: int):
  """start -> end linearly over `steps` (end from then on)."""
  if steps == 0:
    return jnp.asarray(end, jnp.float32)
  frac = jnp.clip(step / steps, 0.0, 1.0)
  return start + (end - start) * frac


def _decayed(step, peak: float, floor: float, steps: int, kind: str):
  frac = jnp.clip(step / steps, 0.0, 1.0)
  if kind == "linear":
    return peak + (floor - peak) * frac
  return floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """The learning rate as a function of the step (see OptimizerConfig)."""

  def stage(step, start, peak, floor, warmup, decay_steps):
    warm = _ramp(step, start, peak, warmup)
    if cfg.decay == "constant":
      return warm
    return jnp.where(step < warmup, warm,
                     _decayed(step - warmup, peak, floor, decay_steps,
                              cfg.decay))

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    lr = stage(step, 0.0, cfg.learning_rate, cfg.final_learning_rate,
               cfg.warmup_steps, cfg.decay_steps)
    if cfg.stage2_learning_rate > 0:
      start2 = cfg.warmup_steps + cfg.decay_steps
      lr2 = stage(step - start2, cfg.final_learning_rate,
                  cfg.stage2_learning_rate, cfg.stage2_final_learning_rate,
                  cfg.stage2_warmup_steps, cfg.stage2_decay_steps)
      lr = jnp.where(step < start2, lr, lr2)
    return lr

  return schedule


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  if cfg.warmup_steps > 0 or cfg.decay != "constant":
    lr = learning_rate_schedule(cfg)
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
  # tree_map_params runs the optimizer's init eagerly on placeholders, which
  # creates its scalar counters on the host; nothing of size moves.
  with jax.transfer_guard_host_to_device("allow"):
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
  step = jax.device_put(np.zeros((), np.int32), shardings.step)
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
                   batch_sharding: Any, *,
                   compiler_options: Mapping[str, str] | None = None,
                   matmul_dtype=jnp.float32
                   ) -> tuple[Callable, TraceCounter]:
  """The step jitted with in/out shardings and the state donated.

  `compiler_options` None: the train-step options of the mesh's backend
  for a model whose weight matmuls take `matmul_dtype` inputs
  (`kimi_jax.infra.compile_options`); {} compiles with XLA's defaults.
  """
  if compiler_options is None:
    platform = shardings.step.mesh.devices.flat[0].platform
    compiler_options = compile_options.train_step_options(platform,
                                                          matmul_dtype)
  counter = TraceCounter(
      lambda state, batch: train_step(state, batch, loss_fn=loss_fn,
                                      optimizer=optimizer,
                                      grad_shardings=shardings.params))
  # Metrics come back replicated so every process can read them.
  step = jax.jit(counter, in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, shardings.step),
                 donate_argnums=(0,),
                 compiler_options=dict(compiler_options) or None)
  return step, counter


def cross_entropy_loss(params, rows: TokenRows, *, cfg: ModelConfig,
                       sharder: Sharder | None = None):
  """Masked next-token cross-entropy: sum(mask * -log p(target)) / sum(mask)
  over packed rows (`TokenRows`); log-probs in chunks of the sequence
  (`kimi_jax.model.logprobs`), never the whole R x T x V logits."""
  logp_RxT, trace = logprobs.traced_rows_logprobs(params, rows, cfg=cfg,
                                                  sharder=sharder)
  mask_RxT = rows.mask_RxT.astype(jnp.float32)
  n_tokens = jnp.maximum(mask_RxT.sum(), 1.0)
  loss = -(logp_RxT * mask_RxT).sum() / n_tokens
  aux, aux_metrics = logprobs.router_aux_loss(trace, cfg)
  if aux_metrics:
    loss = loss + aux
  return loss, {"tokens": mask_RxT.sum(), **aux_metrics}
