"""Mixture-of-experts layers (kimi_jax/model/moe.py): the sparse block and
the load-balancing loss against `transformers`' Qwen3-MoE, the config.json
mapping, expert parallelism (sharded = unsharded on 8 fake devices) and
routing replay. Whole-model parity (forward, prefill, decode, export) is in
tests/test_hf_families.py (qwen3_moe, qwen3_moe_mixed)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

import hf_dirs
from kimi_jax.model import decode, hf, logprobs, moe, transformer
from kimi_jax.model.config import ModelConfig, count_params
from kimi_jax.sharding import MeshConfig, Sharder, ShardingError, make_mesh
from kimi_jax.token_rows import TokenRows
from kimi_jax.train_step import cross_entropy_loss

pytestmark = pytest.mark.host_inputs


def _tiny(**changes) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              head_dim=8, mlp_dim=48, qk_norm=True, n_experts=8,
              n_experts_per_token=2, expert_mlp_dim=16, norm_topk_prob=True)
  return ModelConfig(**{**base, **changes})


# --------------------------------------------------------------------------
# The sparse block and the auxiliary loss against transformers


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_block_matches_transformers(norm_topk_prob):
  """Router (softmax, top-k, renormalised or not) and the grouped-matmul
  experts against Qwen3MoeSparseMoeBlock on random tokens."""
  from transformers.models.qwen3_moe import modeling_qwen3_moe as ref
  config = transformers.Qwen3MoeConfig(
      hidden_size=32, num_experts=8, num_experts_per_tok=3,
      moe_intermediate_size=16, norm_topk_prob=norm_topk_prob)
  torch.manual_seed(0)
  block = ref.Qwen3MoeSparseMoeBlock(config)
  with torch.no_grad():
    for p in block.parameters():
      p.normal_(0.0, 0.3)
  x = torch.randn(3, 7, 32)
  with torch.no_grad():
    want = block(x).numpy()
    _, _, want_idx = block.gate(x.reshape(-1, 32))
  cfg = _tiny(n_experts=8, n_experts_per_token=3,
              norm_topk_prob=norm_topk_prob)
  gate_up = block.experts.gate_up_proj.detach().numpy()  # E x 2F x D
  lp = {"router": block.gate.weight.detach().numpy().T,
        "expert_gate": gate_up[:, :16].transpose(0, 2, 1),
        "expert_up": gate_up[:, 16:].transpose(0, 2, 1),
        "expert_down": block.experts.down_proj.detach().numpy().transpose(
            0, 2, 1)}
  out, trace = moe.moe_mlp(jnp.asarray(x.numpy()), lp, cfg, None)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      np.sort(np.asarray(trace.experts_BxTxK).reshape(-1, 3), axis=1),
      np.sort(want_idx.numpy(), axis=1))
  assert float(trace.counts_E.sum()) == 3 * 21


@functools.lru_cache(maxsize=None)
def _hf_moe(root: str):
  model = hf_dirs.tiny_hf_model("qwen3_moe")
  model.save_pretrained(f"{root}/qwen3_moe")
  cfg, params = hf.load_hf_checkpoint(f"{root}/qwen3_moe")
  return model, cfg, params


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
  return _hf_moe(str(tmp_path_factory.mktemp("moe")))


def test_load_balancing_loss_matches_transformers(hf_moe):
  """Rows of 9 and 6 real tokens (right-padded): transformers'
  load_balancing_loss_func under the attention mask against ours over the
  segment ids, and the train step's loss adds coef x that value."""
  model, cfg, params = hf_moe
  lengths = np.array([9, 6])
  tokens = np.random.RandomState(1).randint(0, 96, (2, 9))
  mask = (np.arange(9)[None] < lengths[:, None]).astype(np.int32)
  tokens = tokens * mask
  with torch.no_grad():
    out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                output_router_logits=True)
  want = float(out.aux_loss)
  rows = TokenRows(tokens_RxT=tokens, targets_RxT=np.roll(tokens, -1, 1),
                   positions_RxT=np.broadcast_to(np.arange(9), (2, 9)),
                   segment_ids_RxT=mask, mask_RxT=mask.astype(np.float32))
  _, trace = logprobs.traced_rows_logprobs(params, rows, cfg=cfg)
  assert trace.experts_BxTxK.shape == (cfg.n_layers, 2, 9, 2)
  np.testing.assert_allclose(moe.load_balancing_loss(trace, cfg), want,
                             rtol=1e-5)
  # Unmasked, padding counts too (transformers without a mask).
  with torch.no_grad():
    unmasked = model(torch.tensor(tokens), output_router_logits=True)
  rows_all = rows.replace(segment_ids_RxT=np.ones_like(mask))
  _, trace_all = logprobs.traced_rows_logprobs(params, rows_all, cfg=cfg)
  np.testing.assert_allclose(moe.load_balancing_loss(trace_all, cfg),
                             float(unmasked.aux_loss), rtol=1e-5)
  # The train step's loss: cross-entropy + coef * aux.
  plain, metrics = cross_entropy_loss(params, rows, cfg=cfg)
  assert "router_aux_loss" not in metrics  # coefficient 0: off
  with_aux, metrics = cross_entropy_loss(
      params, rows, cfg=dataclasses.replace(cfg, router_aux_loss_coef=0.01))
  np.testing.assert_allclose(with_aux, plain + 0.01 * want, rtol=1e-5)
  np.testing.assert_allclose(metrics["router_aux_loss"], want, rtol=1e-5)


# --------------------------------------------------------------------------
# config.json


def _moe_config(**changes) -> dict:
  out = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
             vocab_size=96, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             rope_theta=1e6)
  out.update(changes)
  return out


def test_moe_config_reads_dense_layers_as_transformers_builds_them():
  cfg = hf.config_from_hf(_moe_config(decoder_sparse_step=2,
                                      mlp_only_layers=[3]))
  built = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
      **{k: v for k, v in _moe_config(decoder_sparse_step=2,
                                      mlp_only_layers=[3]).items()
         if k not in ("architectures", "model_type")}))
  sparse = tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
                 for layer in built.model.layers)
  assert cfg.sparse_kinds == sparse == (False, True, False, False)
  assert cfg.dense_layers == (0, 2, 3) and cfg.moe_layers == (1,)
  assert (cfg.n_experts, cfg.n_experts_per_token, cfg.expert_mlp_dim,
          cfg.norm_topk_prob, cfg.qk_norm) == (8, 2, 16, True, True)
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
  assert count_params(cfg) == sum(p.numel() for p in built.parameters())
  # transformers 5's spelling of the expert count.
  moved = _moe_config()
  moved["num_local_experts"] = moved.pop("num_experts")
  assert hf.config_from_hf(moved).n_experts == 8


@pytest.mark.parametrize("changes, pattern", [
    (dict(mlp_only_layers=[7]), r"my/config\.json: mlp_only_layers \[7\]"),
    (dict(moe_intermediate_size=None),
     r"missing required key 'moe_intermediate_size'"),
    (dict(num_experts_per_tok=9), r"n_experts_per_token must be in \[1, "),
    (dict(use_sliding_window=True), r"use_sliding_window=true"),
])
def test_unsupported_moe_configs_raise(changes, pattern):
  with pytest.raises(hf.HFCheckpointError, match=pattern):
    hf.config_from_hf(_moe_config(**changes), source="my/config.json")


def test_dense_configs_do_not_export_as_moe_and_back():
  with pytest.raises(hf.HFCheckpointError, match=r"cannot express.*"
                     r"n_experts=8"):
    hf.config_to_hf(_tiny(), "Qwen3ForCausalLM")
  with pytest.raises(ValueError, match="dense_layers is set but"):
    _tiny(n_experts=0, dense_layers=(1,))


# --------------------------------------------------------------------------
# Expert parallelism: an `expert` mesh axis


def _rows(B=4, T=12, seed=0) -> TokenRows:
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, 64, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[1, 9:] = 0
  return TokenRows(tokens_RxT=tokens, targets_RxT=np.roll(tokens, -1, 1),
                   positions_RxT=np.broadcast_to(np.arange(T), (B, T)).copy(),
                   segment_ids_RxT=seg, mask_RxT=seg.astype(np.float32))


@pytest.mark.parametrize("dense_layers", [(), (1,)])
def test_expert_parallel_matches_unsharded(dense_layers):
  """Loss (with the auxiliary term) and its gradient of a two-layer MoE on
  a (data 1, fsdp 2, tensor 2, expert 2) mesh equal the single-device
  values; the expert weights E x D x F split over `expert`."""
  cfg = _tiny(dense_layers=dense_layers, router_aux_loss_coef=0.1,
              scan_layers=True)
  params = transformer.init_params(cfg, jax.random.key(0), std=0.2)
  rows = _rows()
  loss_fn = lambda p, r, s: cross_entropy_loss(p, r, cfg=cfg, sharder=s)[0]
  want, want_grad = jax.value_and_grad(loss_fn)(params, rows, None)
  sharder = Sharder(make_mesh(MeshConfig(data=1, fsdp=2, tensor=2,
                                         expert=2)))
  shardings = transformer.param_shardings(cfg, sharder)
  assert shardings["layers"]["expert_gate"].spec == P(
      None, "expert", ("fsdp", "context"), "tensor")
  assert shardings["layers"]["expert_down"].spec == P(
      None, "expert", "tensor", ("fsdp", "context"))
  placed = jax.device_put(params, shardings)
  got, got_grad = jax.jit(jax.value_and_grad(
      lambda p, r: loss_fn(p, r, sharder)))(placed, rows)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for path, g in jax.tree_util.tree_flatten_with_path(got_grad)[0]:
    w = want_grad
    for k in path:
      w = w[k.key]
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  # The unused slices of a mixed model get no gradient.
  if dense_layers:
    assert not np.any(np.asarray(want_grad["layers"]["expert_up"][1]))
    assert not np.any(np.asarray(want_grad["layers"]["w_up"][0]))


def test_expert_axis_must_divide_the_experts():
  sharder = Sharder(make_mesh(MeshConfig(data=1, fsdp=1, expert=8)))
  with pytest.raises(ShardingError, match=r"\['expert_\w+'\]: dimension "
                     r"'experts' of size 6 does not divide"):
    transformer.param_shardings(_tiny(n_experts=6), sharder)


# --------------------------------------------------------------------------
# Routing replay


def _near_tie_params(cfg: ModelConfig, eps: float):
  """Random params whose router columns 0 and 1 are equal in every layer
  but for +-eps along one direction: (sampler's params, trainer's params),
  which pick different experts wherever those two lead."""
  params = transformer.init_params(cfg, jax.random.key(3), std=0.3)
  router = params["layers"]["router"]  # L x D x E
  router = router.at[:, :, 1].set(router[:, :, 0])
  # Both experts lead the other experts' logits by a margin.
  router = router.at[:, :, 0].multiply(4.0).at[:, :, 1].multiply(4.0)
  u = jnp.ones((cfg.d_model,), jnp.float32) / cfg.d_model
  nudge = lambda sign: router.at[:, :, 1].add(sign * eps * u)
  sampler = dict(params, layers=dict(params["layers"], router=nudge(1.0)))
  trainer = dict(params, layers=dict(params["layers"], router=nudge(-1.0)))
  return sampler, trainer


@functools.partial(jax.jit, static_argnames="cfg")
def _sample(params, prompt_1xP, cfg):
  """The sampler's path: prefill of the prompt, then greedy decode steps,
  recording every input token's experts and every sampled token's
  log-prob."""
  P = prompt_1xP.shape[1]
  n_new = 6
  cache = transformer.init_cache(cfg, 1, P + n_new)
  pos = jnp.arange(P)[None]
  x, cache, trace = transformer.traced_hidden_states(
      params, prompt_1xP, pos, jnp.ones_like(prompt_1xP), cfg=cfg,
      cache=cache, prefill=True)
  logits = transformer.unembed(params, x[:, -1:], cfg=cfg)[:, 0]
  experts = [moe.experts_BxTxLxK(trace)]
  dparams, dcache = decode.to_decode_params(params), decode.to_decode_cache(
      cache)
  tokens, logps = [], []
  length = jnp.full((1,), P, jnp.int32)
  for _ in range(n_new):
    logp = jax.nn.log_softmax(logits, -1)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    tokens.append(token)
    logps.append(logp[0, token[0]])
    logits, dcache, exp_BxLxK = decode.traced_decode_step(
        dparams, token, length, dcache, cfg=cfg)
    logits = logits[:, 0]
    experts.append(exp_BxLxK[:, None])
    length = length + 1
  return (jnp.stack(tokens, 1), jnp.stack(logps),
          jnp.concatenate(experts, axis=1))


def test_routing_replay_gives_the_trainer_the_samplers_logprobs():
  """The sampler's and the trainer's router weights differ by rounding
  (+-1e-4 between two experts that tie): recomputing the routing sends
  some tokens to the other expert and the trainer's log-probs of the
  sampled tokens move away from the sampler's; replaying the sampler's
  choices (top-1, renormalised: gate 1) gives its log-probs back."""
  cfg = _tiny(n_experts=4, n_experts_per_token=1, norm_topk_prob=True)
  sampler, trainer = _near_tie_params(cfg, 1e-4)
  prompt = jnp.asarray(np.random.RandomState(0).randint(0, 64, (1, 5)),
                       jnp.int32)
  tokens, sampler_logp, experts_1xTxLxK = _sample(sampler, prompt, cfg)
  seq = jnp.concatenate([prompt, tokens], axis=1)[0]
  n = seq.shape[0] - 1  # model inputs: every token but the last sampled
  assert experts_1xTxLxK.shape == (1, n + 1, cfg.n_layers, 1)
  rows = TokenRows(tokens_RxT=seq[None, :-1], targets_RxT=seq[None, 1:],
                   positions_RxT=jnp.arange(n)[None],
                   segment_ids_RxT=jnp.ones((1, n), jnp.int32),
                   mask_RxT=jnp.ones((1, n), jnp.float32))
  response = slice(prompt.shape[1] - 1, n)

  def trainer_logp(replay):
    r = rows.replace(experts_RxTxLxK=experts_1xTxLxK[:, :n] if replay
                     else None)
    logp, trace = logprobs.traced_rows_logprobs(trainer, r, cfg=cfg)
    return np.asarray(logp[0, response]), moe.experts_BxTxLxK(trace)

  recomputed_logp, recomputed = trainer_logp(replay=False)
  # The near tie: the trainer routes some tokens elsewhere.
  changed = np.asarray(recomputed != experts_1xTxLxK[:, :n])
  assert changed.any() and set(np.asarray(
      experts_1xTxLxK[:, :n])[changed]) <= {0, 1}
  gap = np.abs(recomputed_logp - np.asarray(sampler_logp))
  assert gap.max() > 1e-2, gap
  replayed_logp, replayed = trainer_logp(replay=True)
  np.testing.assert_array_equal(replayed, experts_1xTxLxK[:, :n])
  np.testing.assert_allclose(replayed_logp, sampler_logp, rtol=0, atol=2e-5)
  # Replay keeps the router in the gradient (the gates' probabilities).
  grad = jax.grad(lambda p: logprobs.rows_logprobs(
      p, rows.replace(experts_RxTxLxK=experts_1xTxLxK[:, :n]),
      cfg=dataclasses.replace(cfg, n_experts_per_token=1,
                              norm_topk_prob=False)).sum())(trainer)
  assert np.abs(np.asarray(grad["layers"]["router"])).max() > 0
