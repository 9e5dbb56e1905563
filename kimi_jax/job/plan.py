"""Per-device memory plan of a run, from abstract shapes and shardings alone.

Nothing is allocated: shapes come from `jax.eval_shape`, placements from the
same `Sharder` rules the run uses, over a `jax.sharding.AbstractMesh`, so a
256-chip mesh can be planned on a laptop. Per-device bytes of an array are
prod(sharding.shard_shape(shape)) * itemsize; replicated arrays count fully on
every device.

What is counted, per device:
- params: the policy's parameters (param dtype, parameter shardings);
- opt_state: what `optimizer.init` creates (adamw: two moments shaped like
  the params, plus scalar counters), moments sharded like their parameter;
- grads: one gradient per parameter, same dtype and sharding;
- kv_cache: the sampler's keys and values in compute dtype, slots (or a
  paged pool's pages) over the batch axes and kv heads over `tensor`:
  layers x slots x cache_len entries, or layers x kv_pages x page_size;
- activations: an estimate for one train step over `train_rows` sequences of
  `train_len` tokens (see `activation_estimate`).

The total assumes all of it is live at once (the sampler's decode state stays
allocated while the trainer steps): an upper bound, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, NamedSharding

from kimi_jax import train_step
from kimi_jax.infra import aot
from kimi_jax.infra.config import to_dataclass
from kimi_jax.job.experiment import model_config
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.learner import Learner
from kimi_jax.sampler import repetition
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sampler.build import make_engine
from kimi_jax.sharding import (MESH_AXES, MeshConfig, Sharder, make_mesh,
                               rules_from_config, tree_bytes_per_device)
from kimi_jax.vision.config import VisionConfig

GB = 1e9  # decimal gigabytes, as TPU HBM sizes are quoted


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
  """A mesh of the given sizes (`context` and `expert` default to 1),
  without devices."""
  sizes = {"context": 1, "expert": 1} | dict(sizes)
  missing = [a for a in MESH_AXES if a not in sizes]
  if missing or any(sizes[a] < 1 for a in MESH_AXES):
    raise ValueError(f"mesh sizes must give a positive size to each of "
                     f"{MESH_AXES}, got {dict(sizes)}")
  return AbstractMesh(tuple(int(sizes[a]) for a in MESH_AXES), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
  """Bytes per device of one train step's activations (see the formula in
  `activation_estimate`). `attention` is the part of `layer` spent on the
  T x T score and probability matrices."""

  boundaries: int
  layer: int
  attention: int
  logits: int
  total: int
  # The vision tower's share of `total` (0 for a text model).
  vision: int = 0


def _local_bytes(sharder: Sharder, shape: Sequence[int],
                 logical: Sequence[str | None], dtype: Any) -> int:
  # Activations follow the run's constraints: a batch that does not divide
  # over (data, fsdp) stays whole, exactly as `Sharder.activation_spec` does.
  sharding = NamedSharding(sharder.mesh, sharder.activation_spec(shape,
                                                                 logical))
  return math.prod(sharding.shard_shape(tuple(shape))) * jnp.dtype(
      dtype).itemsize


def activation_estimate(cfg: ModelConfig, sharder: Sharder, rows: int,
                        length: int) -> ActivationEstimate:
  """Activation bytes per device for a train step of `rows` x `length`.

  With B rows of T tokens, every tensor's local size comes from its logical
  axes (batch over data x fsdp, the sequence over context, heads / kv_heads
  / mlp / vocab over tensor):

    x      = B T D                       residual stream at a layer boundary
    layer  = 2 x (B T D)      norm outputs      + B T D  mid-layer residual
           + (B T H Dh) x 2   queries, attention output
           + (B T K Dh) x 2   keys, values
           + (B T F) x 3      gate, up, silu(gate) * up
                              (a mixture-of-experts layer instead: the
                              router's B T E f32 logits and probabilities,
                              and its B T k token copies, (B T k D) x 3 in,
                              out and back at their tokens, plus
                              (B T k Fe) x 3, each expert's gate, up and
                              product)
           + attention scores:
               model.attention "dot":  B H T T x (4 + c)  (f32 scores, probs)
               otherwise:              3 x B H b b x 4    (one block pair's
                                       scores, probs and dS, b = the block)
    logits = 3 x B C V x 4    one chunk's logits, log-softmax and cotangent
                              (C = model.logprob_chunk positions, f32)

  in compute dtype (c bytes) unless marked.

    remat:    L x + 2 layer + logits   (the scan saves only layer inputs; the
                                        layer being recomputed holds its
                                        intermediates and their cotangents)
    no remat: L (x + layer) + layer + logits
  """
  c = cfg.compute_jnp_dtype
  B, T, D = rows, length, cfg.d_model
  H, K, Dh, F, V = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                    cfg.vocab_size)
  x = _local_bytes(sharder, (B, T, D), ("batch", "act_length", "act_embed"), c)
  q = _local_bytes(sharder, (B, T, H, Dh),
                   ("batch", "act_length", "heads", "head_dim"), c)
  kv = _local_bytes(sharder, (B, T, K, Dh),
                    ("batch", "act_length", "kv_heads", "head_dim"), c)
  mlp = 3 * _local_bytes(sharder, (B, T, F), ("batch", "act_length", "mlp"),
                        c)
  if cfg.n_experts:
    E, k, Fe = cfg.n_experts, cfg.n_experts_per_token, cfg.expert_mlp_dim
    moe = (2 * _local_bytes(sharder, (B, T, E), ("batch", "act_length", None),
                            jnp.float32) +
           3 * _local_bytes(sharder, (B, T, k, D),
                            ("batch", "act_length", None, "act_embed"), c) +
           3 * _local_bytes(sharder, (B, T, k, Fe),
                            ("batch", "act_length", None, "expert_mlp"), c))
    mlp = moe if not cfg.dense_layers else max(mlp, moe)
  if cfg.attention == "dot":
    scores_shape = (B, K, H // K, T, T)
    scores_logical = ("batch", "kv_heads", None, "length", "length")
    attention = (_local_bytes(sharder, scores_shape, scores_logical,
                              jnp.float32) +
                 _local_bytes(sharder, scores_shape, scores_logical, c))
  else:
    b = min(cfg.attention_block, T)
    attention = 3 * _local_bytes(sharder, (B, K, H // K, b, b),
                                 ("batch", "kv_heads", None, None, None),
                                 jnp.float32)
  layer = 3 * x + 2 * q + 2 * kv + mlp + attention
  chunk = min(cfg.logprob_chunk, T)
  logits = 3 * _local_bytes(sharder, (B, chunk, V), ("batch", None, "vocab"),
                            jnp.float32)
  L = cfg.n_layers
  if cfg.remat:
    total = L * x + 2 * layer + logits
  else:
    total = L * (x + layer) + layer + logits
  vision = (0 if cfg.vision is None else
            vision_activation_estimate(cfg.vision, sharder, rows))
  return ActivationEstimate(boundaries=L * x, layer=layer, attention=attention,
                            logits=logits, total=total + vision,
                            vision=vision)


def vision_activation_estimate(v: VisionConfig, sharder: Sharder,
                               rows: int) -> int:
  """Activation bytes per device of the vision tower in a train step over
  `rows` rows, each with `v.max_images` image slots (empty slots are
  encoded too: shapes are fixed). With N = rows x max_images images of P
  patches, width D, MLP width F, h heads (compute dtype c unless marked):

    x     = N P D                     residual stream at a layer boundary
    layer = 6 x (N P D)               two norm outputs, q, k, v, attention out
          + 2 x (N P F)               fc1 and gelu(fc1)
          + 2 x N h P P x 4           scores and probabilities (f32, dense:
                                      P is small, e.g. 64 to 1024)
    tower: remat L x + 2 layer, else L (x + layer) + layer; plus the
    projector's input and hidden (N Q M, M = D pool^2, Q = P / pool^2).
  """
  c = v.compute_jnp_dtype
  N, P, D, F, h = (rows * v.max_images, v.n_patches, v.d_model, v.mlp_dim,
                   v.n_heads)
  x = _local_bytes(sharder, (N, P, D), ("batch", None, "act_embed"), c)
  mlp = _local_bytes(sharder, (N, P, F), ("batch", None, "mlp"), c)
  scores = 2 * _local_bytes(sharder, (N, h, P, P),
                            ("batch", "heads", None, None), jnp.float32)
  layer = 6 * x + 2 * mlp + scores
  L = v.n_layers
  tower = L * x + 2 * layer if v.remat else L * (x + layer) + layer
  Q, M = v.tokens_per_image, v.merged_dim
  projector = 2 * _local_bytes(sharder, (N, Q, max(M, v.projector_hidden)),
                               ("batch", None, "mlp"), c)
  return tower + projector


@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """What the plan depends on; `launch/plan.py` reads it from a config.

  train_rows: sequences in one train step (rl.minibatch_prompts x
    rl.samples_per_prompt: one row per response). train_len: their padded
    length (the largest of rl.train_len_buckets). page_size, kv_pages:
    the sampler's KV layout (sampler.page_size, sampler.kv_pages; 0: rows).
  """

  model: ModelConfig
  mesh: Mapping[str, int]
  rules: tuple[tuple[str, Any], ...]
  max_slots: int
  cache_len: int
  train_rows: int
  train_len: int
  page_size: int = 0
  kv_pages: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of each part of the run."""

  mesh: Mapping[str, int]
  params: int
  opt_state: int
  grads: int
  kv_cache: int
  activations: ActivationEstimate

  @property
  def total(self) -> int:
    return (self.params + self.opt_state + self.grads + self.kv_cache +
            self.activations.total)

  def exceeds(self, device_bytes: float) -> bool:
    return self.total > device_bytes

  def to_json(self) -> dict[str, Any]:
    return dict(mesh=dict(self.mesh), params=self.params,
                opt_state=self.opt_state, grads=self.grads,
                kv_cache=self.kv_cache,
                activations=dataclasses.asdict(self.activations),
                total=self.total)


def make_plan(inputs: PlanInputs, optimizer: optax.GradientTransformation
              ) -> MemoryPlan:
  """The memory plan; a parameter or the cache that cannot be sharded as
  the rules say raises `ShardingError` naming it."""
  cfg = inputs.model
  sharder = Sharder(abstract_mesh(inputs.mesh), inputs.rules)
  params = transformer.abstract_params(cfg)
  params_sh = transformer.param_shardings(cfg, sharder)
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_sh = train_step.opt_state_shardings(optimizer, params, params_sh,
                                          sharder)
  param_bytes = tree_bytes_per_device(params, params_sh)
  return MemoryPlan(
      mesh=dict(inputs.mesh),
      params=param_bytes,
      opt_state=tree_bytes_per_device(opt_state, opt_sh),
      grads=param_bytes,
      kv_cache=kv_cache_bytes(inputs, sharder),
      activations=activation_estimate(cfg, sharder, inputs.train_rows,
                                      inputs.train_len))


def kv_cache_bytes(inputs: PlanInputs, sharder: Sharder) -> int:
  """Per-device bytes of the sampler's keys and values: rows of cache_len
  per slot, or (page_size > 0) a pool of kv_pages pages, sliding layers'
  rings per slot either way."""
  cfg = inputs.model
  slots, length = inputs.max_slots, inputs.cache_len

  def cache_bytes(batch: int, entries: int, what: str):
    cache = jax.eval_shape(lambda: transformer.init_cache(cfg, batch,
                                                          entries))
    shardings = transformer.cache_shardings(cfg, sharder, batch, entries,
                                            what)
    sizes = {name: tree_bytes_per_device(getattr(cache, name),
                                         getattr(shardings, name))
             for name in ("k", "v", "local_k", "local_v")
             if getattr(cache, name) is not None}
    return sizes.get("k", 0) + sizes.get("v", 0), sizes.get(
        "local_k", 0) + sizes.get("local_v", 0)

  what = f"sampler KV cache (sampler.max_slots={slots})"
  full, rings = cache_bytes(slots, length, what)
  if inputs.page_size:
    pages = inputs.kv_pages or slots * -(-length // inputs.page_size)
    full, _ = cache_bytes(pages, inputs.page_size,
                          f"sampler KV pool (sampler.kv_pages={pages})")
  return full + rings


def format_table(plan: MemoryPlan, device_gb: float | None = None) -> str:
  """A text table in GB per device, with a WARNING line when over budget."""
  a = plan.activations
  rows = [("params", plan.params), ("optimizer state", plan.opt_state),
          ("gradients", plan.grads), ("sampler KV cache", plan.kv_cache),
          ("activations (estimate)", a.total),
          ("  layer boundaries", a.boundaries),
          ("  one layer's working set", a.layer),
          ("    of which attention scores", a.attention),
          ("  logits", a.logits)] + (
              [("  vision tower", a.vision)] if a.vision else []) + [
          ("total", plan.total)]
  mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.items())
  lines = [f"per-device memory plan, mesh {mesh} "
           f"({math.prod(plan.mesh.values())} devices)",
           f"{'part':<30}{'GB/device':>12}"]
  lines += [f"{name:<30}{b / GB:>12.3f}" for name, b in rows]
  if device_gb is not None:
    lines.append(f"{'device memory':<30}{device_gb:>12.3f}")
    if plan.exceeds(device_gb * GB):
      lines.append(f"WARNING: total {plan.total / GB:.2f} GB exceeds the "
                   f"{device_gb:g} GB per device")
  return "\n".join(lines)


def parse_mesh(text: str) -> dict[str, int]:
  """"data=4,fsdp=16,tensor=4" -> sizes; -1 (one axis) means "the rest"."""
  sizes = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    name, sep, value = part.partition("=")
    if not sep or name not in MESH_AXES:
      raise ValueError(f"--mesh: expected axis=size with axis in {MESH_AXES},"
                       f" got {part!r}")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(f"--mesh: size of {name!r} must be an integer, got "
                       f"{value!r}") from None
  return sizes


def plan_for_config(config: Any, mesh: Mapping[str, int],
                    num_devices: int | None = None) -> MemoryPlan:
  """The plan of a loaded experiment config (an ml_collections ConfigDict).

  `mesh` gives axis sizes (missing axes take the config's mesh section); one
  of them may be -1 when `num_devices` is given. The optimizer is the RL
  stage's, built as the run builds it.
  """
  sizes = dict(config.mesh) | dict(mesh)
  mesh_cfg = to_dataclass(MeshConfig, sizes, "mesh")
  if -1 in sizes.values():
    if num_devices is None:
      raise ValueError(f"mesh {sizes} has a -1 axis: give the device count "
                       f"(--num_devices, the chips of the slice)")
    sizes = mesh_cfg.resolve(num_devices)
  elif num_devices is not None:
    sizes = mesh_cfg.resolve(num_devices)  # checks the product
  rl = to_dataclass(RLConfig, config.rl, "rl")
  optimizer = train_step.make_optimizer(rl.optimizer())
  inputs = PlanInputs(
      model=to_dataclass(ModelConfig, config.model, "model"),
      mesh=sizes,
      rules=rules_from_config(config.sharding.rules),
      max_slots=int(config.sampler.max_slots),
      cache_len=int(config.sampler.cache_len),
      page_size=int(config.sampler.get("page_size", 0)),
      kv_pages=int(config.sampler.get("kv_pages", 0)),
      train_rows=int(rl.minibatch_prompts * rl.samples_per_prompt),
      train_len=int(max(rl.train_len_buckets or (config.model.max_seq_len,))))
  return make_plan(inputs, optimizer)


# ---- the TPU compiler's figures (ahead-of-time, kimi_jax/infra/aot.py) -----


def main_job_functions(config: Any, sharder: Sharder
                       ) -> dict[str, tuple[Any, tuple]]:
  """Every jitted function of the main job at the config's full shapes:
  name -> (jitted fn, abstract args with shardings).

  - rl_train_step_T<len>: the RL train step (policy loss, optimizer, donated
    state) on a minibatch of the experiment's own rows for each length
    bucket, and reference_logprobs_T<len> at the largest (the learner's);
  - sampler_prefill (largest prefill and batch bucket) and sampler_generate
    (`sampler.steps_per_call` decode steps over every slot of a full cache)
    (the engine's).
  The learner and the engine are built exactly as the job builds them.
  """
  # Only the sections that shape the programs: a slice is checked before
  # the data paths (task, sft) are chosen.
  model = model_config(config)
  rl = to_dataclass(RLConfig, config.rl, "rl")
  sampler = to_dataclass(SamplerConfig, config.sampler, "sampler")
  learner = Learner(model, rl, sharder, cache_len=sampler.cache_len)
  engine = make_engine(model, sampler, sharder,
                       record_experts=rl.routing_replay)
  return {**learner.aot_functions(),
          **engine.aot_functions(sampler.steps_per_call,
                                 repetition.device_rule(sampler.repeat))}


def aot_report(config: Any, topology: str) -> dict[str, Any]:
  """Compiles `main_job_functions` for a TPU topology (the experiment's own
  mesh over its chips) and returns the per-function memory as JSON:
  {topology, devices, mesh, seq_len, hbm_bytes, functions: {name:
  {argument_bytes, output_bytes, alias_bytes, temp_bytes, total_bytes,
  fits}}, fits}. A function the compiler rejects for exceeding HBM is
  listed with fits=False, the total the compiler reported and the error."""
  devices = aot.topology_devices(topology)
  hbm = aot.hbm_bytes(devices)
  mesh_cfg = to_dataclass(MeshConfig, config.mesh, "mesh")
  sizes = mesh_cfg.resolve(len(devices))
  sharder = Sharder(make_mesh(mesh_cfg, devices),
                    rules_from_config(config.sharding.rules))
  functions = {}
  for name, (fn, args) in main_job_functions(config, sharder).items():
    t0 = time.perf_counter()
    try:
      functions[name] = aot.compile_memory(fn, args).to_json(hbm)
    except aot.CompileOutOfMemory as exc:  # reported, not hidden
      functions[name] = aot.out_of_memory_json(exc)
    print(f"compiled {name} in {time.perf_counter() - t0:.0f} s: "
          f"{functions[name]['total_bytes'] / GB:.2f} GB per chip",
          file=sys.stderr, flush=True)
  return dict(topology=topology, devices=len(devices), mesh=sizes,
              seq_len=int(config.model.max_seq_len), hbm_bytes=hbm,
              functions=functions, kv_cache=kv_cache_report(config, sharder),
              fits=all(f["fits"] for f in functions.values()))


MEAN_LIVE = (2048, 8192, 16384)


def kv_cache_report(config: Any, sharder: Sharder) -> dict[str, Any]:
  """The sampler's KV cache per chip and how many sequences it holds at
  mean live lengths MEAN_LIVE (`Engine.kv_capacity`)."""
  sampler = to_dataclass(SamplerConfig, config.sampler, "sampler")
  engine = make_engine(model_config(config), sampler, sharder)
  return engine.kv_capacity(MEAN_LIVE)
