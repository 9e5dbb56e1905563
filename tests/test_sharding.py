"""Mesh construction, sharding rules and sharded parameter creation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import (MeshConfig, Sharder, ShardingError, make_mesh,
                               rules_from_config)

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True)


def test_init_sharded_places_only_a_shard_on_each_device():
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  params = transformer.init_sharded(CFG, 0, sharder)
  L, V, D, H, K, Dh, F = 2, 64, 32, 4, 2, 8, 64
  # Expected per-device shapes under the default rules: embed -> fsdp (2),
  # vocab / heads / kv_heads / mlp -> tensor (2), norms replicated.
  expected = {
      "embed": (V // 2, D // 2),
      "lm_head": (D // 2, V // 2),
      "final_norm": (D,),
      "attn_norm": (L, D),
      "wq": (L, D // 2, H // 2, Dh),
      "wk": (L, D // 2, K // 2, Dh),
      "bk": (L, K // 2, Dh),
      "wo": (L, H // 2, Dh, D // 2),
      "w_gate": (L, D // 2, F // 2),
      "w_down": (L, F // 2, D // 2),
  }
  for name, shard_shape in expected.items():
    x = params["layers"][name] if name in params["layers"] else params[name]
    shards = x.addressable_shards
    assert len(shards) == 8 and {s.device for s in shards} == set(
        jax.devices()), name
    assert all(s.data.shape == shard_shape for s in shards), (
        name, [s.data.shape for s in shards])
    # The shards, put back at their indices, rebuild the whole array.
    whole = np.full(x.shape, np.nan, np.float32)
    for s in shards:
      whole[s.index] = np.asarray(s.data)
    np.testing.assert_array_equal(whole, np.asarray(x), err_msg=name)


def test_param_that_does_not_divide_raises_naming_it():
  # 8 query heads divide over tensor=4, 2 kv heads do not.
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=8,
                    n_kv_heads=2, head_dim=4, mlp_dim=64)
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=1, tensor=4)))
  with pytest.raises(ShardingError, match=r"\['layers'\]\['wk'\].*'kv_heads'"
                     r" of size 2 .*\('tensor',\) of size 4"):
    transformer.init_sharded(cfg, 0, sharder)


def test_vocab_that_does_not_divide_raises_naming_embed():
  cfg = ModelConfig(vocab_size=63, d_model=32, n_layers=1, n_heads=4,
                    n_kv_heads=2, head_dim=8, mlp_dim=64)
  sharder = Sharder(make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)))
  with pytest.raises(ShardingError, match=r"\['embed'\].*'vocab' of size 63"):
    transformer.param_shardings(cfg, sharder)


def test_changed_rules_shard_heads_instead_of_vocab():
  rules = rules_from_config([["batch", ["data", "fsdp"]], ["length", None],
                             ["act_length", None], ["embed", None], ["act_embed", None],
                             ["mlp", "tensor"], ["heads", "tensor"],
                             ["kv_heads", "tensor"], ["head_dim", None],
                             ["vocab", None], ["layers", None],
                             ["norm", None]])
  sharder = Sharder(make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)), rules)
  shardings = transformer.param_shardings(CFG, sharder)
  assert shardings["embed"].shard_shape((64, 32)) == (64, 32)
  assert shardings["layers"]["wq"].shard_shape((2, 32, 4, 8)) == (2, 32, 2, 8)


@pytest.mark.parametrize("mesh_cfg, pattern", [
    (MeshConfig(data=2, fsdp=2, tensor=3), r"'data': 2, 'fsdp': 2, "
     r"'context': 1, 'tensor': 3.* 12 devices but 8"),
    (MeshConfig(data=-1, fsdp=1, tensor=3), r"8 devices do not divide.*"
     r"'tensor': 3"),
    (MeshConfig(data=-1, fsdp=-1, tensor=2), r"at most one axis.*'data', "
     r"'fsdp'"),
])
def test_mesh_that_does_not_match_device_count_raises_naming_axes(
    mesh_cfg, pattern):
  with pytest.raises(ValueError, match=pattern):
    make_mesh(mesh_cfg)


def test_rule_naming_a_missing_mesh_axis_raises():
  mesh = make_mesh(MeshConfig(data=8))
  with pytest.raises(ValueError, match=r"'mlp'.*no axis 'model'"):
    Sharder(mesh, (("mlp", "model"),))


def test_logical_axis_without_rule_raises():
  sharder = Sharder(make_mesh(MeshConfig(data=8)), (("batch", "data"),))
  with pytest.raises(ShardingError, match=r"'embed' has no sharding rule"):
    sharder.param_sharding("params['x']", (8, 4), ("batch", "embed"))
