"""The memory plan (abstract mesh) against arrays really allocated on the 8
fake CPU devices with the run's own init, optimizer and sampler code."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from kimi_jax import train_step as ts
from kimi_jax.infra.config import load_config, to_dataclass
from kimi_jax.job import plan
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sharding import (MeshConfig, Sharder, ShardingError,
                               batch_shardings, make_mesh, rules_from_config)
from kimi_jax.token_rows import empty_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "tiny.py")
QWEN_7B_TINY = os.path.join(ROOT, "experiments", "qwen2_5_7b.py") + ":tiny"


def _bytes_per_device(tree) -> dict[jax.Device, int]:
  """Bytes each device really holds of a pytree of jax.Arrays."""
  held = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] += shard.data.nbytes
  return held


def _only_value(held: dict[jax.Device, int]) -> int:
  assert len(held) == 8, f"expected all 8 devices to hold a part: {held}"
  assert len(set(held.values())) == 1, f"uneven per-device bytes: {held}"
  return next(iter(held.values()))


@pytest.mark.parametrize("config_path,sizes", [
    (TINY, dict(data=2, fsdp=2, tensor=2)),
    (QWEN_7B_TINY, dict(data=1, fsdp=4, tensor=2)),
])
def test_plan_matches_allocated_arrays(config_path, sizes):
  config = load_config(config_path)
  memory = plan.plan_for_config(config, sizes)

  cfg = to_dataclass(ModelConfig, config.model, "model")
  sharder = Sharder(make_mesh(MeshConfig(**sizes)),
                    rules_from_config(config.sharding.rules))
  optimizer = ts.make_optimizer(ts.OptimizerConfig(
      learning_rate=config.rl.learning_rate, grad_clip=config.rl.grad_clip))
  params = transformer.init_sharded(cfg, 0, sharder)
  state = ts.create_state(params, optimizer,
                          ts.state_shardings(optimizer, cfg, sharder))
  engine = Engine(cfg, EngineConfig(max_slots=config.sampler.max_slots,
                                    cache_len=config.sampler.cache_len),
                  sharder=sharder)
  cache = engine.init_decode_state().cache

  assert memory.params == _only_value(_bytes_per_device(params))
  assert memory.opt_state == _only_value(_bytes_per_device(state.opt_state))
  # Gradients are planned like the params they belong to (see the report's
  # note on constraining them in the train step).
  assert memory.grads == memory.params
  assert memory.kv_cache == _only_value(_bytes_per_device(cache))
  assert memory.mesh == {"context": 1, "expert": 1} | sizes


def test_paged_cache_plan_matches_the_allocated_pool():
  sizes = dict(data=2, fsdp=2, tensor=2)
  config = load_config(TINY, ["sampler.page_size=16", "sampler.kv_pages=64"])
  memory = plan.plan_for_config(config, sizes)
  cfg = to_dataclass(ModelConfig, config.model, "model")
  sharder = Sharder(make_mesh(MeshConfig(**sizes)),
                    rules_from_config(config.sharding.rules))
  engine = Engine(cfg, EngineConfig(
      max_slots=config.sampler.max_slots, cache_len=config.sampler.cache_len,
      page_size=16, kv_pages=64), sharder=sharder)
  cache = engine.init_decode_state().cache
  assert cache.kt[0].shape[0] == 64  # the pool, not slots x cache_len
  assert memory.kv_cache == _only_value(_bytes_per_device(cache))


def test_unshardable_parameter_names_it():
  config = load_config(TINY)  # 2 kv heads cannot split over tensor=4
  with pytest.raises(ShardingError, match=r"\['layers'\]\['bk'\].*kv_heads"):
    plan.plan_for_config(config, dict(data=2, fsdp=1, tensor=4))


def test_unshardable_cache_names_it():
  config = load_config(TINY, ["sampler.max_slots=6"])  # 6 slots over 4
  with pytest.raises(ShardingError, match="sampler KV cache"):
    plan.plan_for_config(config, dict(data=2, fsdp=2, tensor=2))


def test_plans_a_pod_on_a_laptop():
  # 256 abstract devices; nothing is allocated. Matrices split 64 ways
  # (fsdp x tensor), biases 4 ways (tensor), norms replicated; bf16.
  config = load_config(os.path.join(ROOT, "experiments", "qwen2_5_7b.py"))
  memory = plan.plan_for_config(config, dict(data=4, fsdp=16, tensor=4))
  L, D, H, K, Dh, F, V = 28, 3584, 28, 4, 128, 18944, 152064
  matrices = L * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F) + 2 * V * D
  biases = L * (H * Dh + 2 * K * Dh)
  norms = 2 * L * D + D
  assert memory.params == 2 * (matrices // 64 + biases // 4 + norms)
  # adamw: two moments in the param dtype, plus replicated int32 counters.
  assert 0 <= memory.opt_state - 2 * memory.params <= 16
  # 28 layers x 256 slots x 32768 x 4 kv heads x 128 x bf16, k and v,
  # split 64 ways over (data, fsdp) and 4 ways over tensor.
  assert memory.kv_cache == pytest.approx(
      2 * 28 * 256 * 32768 * 4 * 128 * 2 / 256, rel=1e-3)


def test_activation_formula_by_hand():
  cfg = ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=16, mlp_dim=256, attention="dot")
  sharder = Sharder(plan.abstract_mesh(dict(data=2, fsdp=2, tensor=2)))
  # D=64, H=4, K=2, Dh=16, F=256, V=32, L=2, float32, no remat.
  # 8 rows / (data*fsdp=4) = 2 local rows; heads, mlp, vocab halve.
  est = plan.activation_estimate(cfg, sharder, rows=8, length=16)
  x = 2 * 16 * 64 * 4
  q, kv, mlp = 2 * 16 * 2 * 16 * 4, 2 * 16 * 1 * 16 * 4, 2 * 16 * 128 * 4
  attention = 2 * 1 * 2 * 16 * 16 * (4 + 4)
  layer = 3 * x + 2 * q + 2 * kv + 3 * mlp + attention
  logits = 3 * 2 * 16 * 16 * 4
  assert (est.attention, est.layer, est.logits) == (attention, layer, logits)
  assert est.total == 2 * (x + layer) + layer + logits
  # With remat only the layer inputs are kept per layer.
  remat = plan.activation_estimate(
      ModelConfig(**{**vars(cfg), "remat": True}), sharder, rows=8, length=16)
  assert remat.total == 2 * x + 2 * layer + logits
  # 3 rows cannot split over 4 batch shards: every device holds all 3.
  odd = plan.activation_estimate(cfg, sharder, rows=3, length=16)
  assert odd.boundaries == 2 * 3 * 16 * 64 * 4
  # Blockwise / splash: one 8 x 8 block pair's scores, probs and dS (f32).
  blocks = plan.activation_estimate(
      ModelConfig(**{**vars(cfg), "attention": "blockwise",
                     "attention_block": 8}), sharder, rows=8, length=16)
  assert blocks.attention == 3 * 2 * 1 * 2 * 8 * 8 * 4


def _launch(*args: str) -> str:
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "plan.py"), *args],
      capture_output=True, text=True, check=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return out.stdout


@pytest.mark.slow
def test_launch_warns_and_writes_json(tmp_path):
  out = tmp_path / "plan.json"
  text = _launch("--config", TINY, "--mesh", "data=-1,fsdp=2,tensor=2",
                 "--num_devices", "8", "--device_memory_gb", "0.001",
                 "--json", str(out), "--config.sampler.max_slots=64")
  assert "WARNING: total" in text and "exceeds the 0.001 GB" in text
  written = json.loads(out.read_text())
  expected = plan.plan_for_config(load_config(TINY, ["sampler.max_slots=64"]),
                                  dict(data=2, fsdp=2, tensor=2))
  assert written["total"] == expected.total
  assert written["mesh"] == dict(data=2, fsdp=2, context=1, tensor=2,
                                 expert=1)
  # The report names the experiment and its overrides as a user writes them.
  assert written["config"] == TINY
  assert written["overrides"] == ["sampler.max_slots=64"]
  text = _launch("--config", TINY, "--mesh", "data=2,fsdp=2,tensor=2",
                 "--device_memory_gb", "16")
  assert "WARNING" not in text


@pytest.mark.parametrize("attention", ["dot", "blockwise"])
def test_activation_estimate_tracks_the_compiler(attention):
  # XLA's own temp-buffer size for the compiled, sharded gradient of the
  # training loss (params and grads are arguments/outputs, not temps), with
  # remat as the long-CoT configs run. At T=512 the T x T attention term
  # dominates with dense attention, as it does at 32k; blockwise attention
  # and chunked log-probs (128 positions) replace it with block terms. The
  # layers in a scan, as the Qwen configs run them (unrolled, XLA:CPU keeps
  # several times more temps alive; the plan is for the scanned models).
  config = load_config(QWEN_7B_TINY)
  cfg = dataclasses.replace(to_dataclass(ModelConfig, config.model, "model"),
                            n_layers=8, max_seq_len=512, remat=True,
                            scan_layers=True,
                            attention=attention, attention_block=128,
                            logprob_chunk=128)
  sizes = dict(data=2, fsdp=2, tensor=2)
  sharder = Sharder(make_mesh(MeshConfig(**sizes)))
  rows, length = 8, 512
  batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((rows, length), x.dtype),
      empty_rows(1, 1, 0))
  params_sh = transformer.param_shardings(cfg, sharder)
  grad_fn = jax.jit(
      jax.grad(lambda p, b: ts.cross_entropy_loss(p, b, cfg=cfg,
                                                  sharder=sharder)[0]),
      in_shardings=(params_sh, batch_shardings(sharder, batch)),
      out_shardings=params_sh)
  compiled = grad_fn.lower(transformer.abstract_params(cfg), batch).compile()
  xla_bytes = compiled.memory_analysis().temp_size_in_bytes
  estimate = plan.activation_estimate(
      cfg, Sharder(plan.abstract_mesh(sizes)), rows, length).total
  # A quick estimate for planning: never below what the compiler needs (an
  # optimistic plan would OOM on the chip), and not so far above it that the
  # plan wastes a chip. (XLA releases fused blocks' buffers earlier in some
  # versions than others; the bounds hold across the versions we test.)
  print(f"estimate {estimate} xla {xla_bytes} ratio {estimate / xla_bytes:.2f}")
  assert 0.95 * xla_bytes <= estimate <= 1.6 * xla_bytes


@pytest.mark.slow  # a launcher subprocess
def test_launch_names_the_missing_device_count():
  # tiny.py's data axis is -1: the analytic plan needs the slice's size.
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "plan.py"), "--config",
       TINY], capture_output=True, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1
  assert "--num_devices" in out.stderr and "Traceback" not in out.stderr


def test_the_plan_counts_the_vision_tower():
  # A hand count of the tower's activations on a 2-way batch split: 4 rows
  # x 2 image slots = 8 images, 4 per device, of 16 patches (16 px, 4 px
  # patches), width 8, MLP 16, 2 heads; float32.
  vision = dict(image_size=16, patch_size=4, d_model=8, n_layers=3,
                n_heads=2, mlp_dim=16, image_token_id=1, pool=2,
                max_images=2)
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64,
                    vision=vision)
  sharder = Sharder(plan.abstract_mesh(dict(data=2, fsdp=1, tensor=1)))
  n, p = 4, 16
  x = n * p * 8 * 4
  layer = 6 * x + 2 * n * p * 16 * 4 + 2 * n * 2 * p * p * 4
  projector = 2 * n * 4 * 32 * 4  # Q = 4 tokens of width 8 x 2 x 2
  assert plan.vision_activation_estimate(cfg.vision, sharder, rows=4) == (
      3 * (x + layer) + layer + projector)
  text = dataclasses.replace(cfg, vision=None)
  with_tower = plan.activation_estimate(cfg, sharder, rows=4, length=16)
  without = plan.activation_estimate(text, sharder, rows=4, length=16)
  assert with_tower.total - without.total == with_tower.vision > 0
  # And the plan's parameters include the tower's.
  assert transformer.param_shapes(cfg).keys() >= {"vision", "projector"}
