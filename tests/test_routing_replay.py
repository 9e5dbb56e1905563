"""Routing replay end to end (rl.routing_replay, docs/rl.md): the sampler
records every model input's experts (prefill and decode, across preemption
and partial rollouts), the replay buffer keeps them (checkpoints included),
minibatches carry them, and the trainer's log-probs of the sampled tokens
are then the sampler's. The model-level version is in tests/test_moe.py."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job.experiment import parse_config
from kimi_jax.model import logprobs, moe, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import batching, replay_buffer, rollout, trainer
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.learner import Learner
from kimi_jax.rl.loop_state import LoopState
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from kimi_jax.token_rows import TokenRows
from test_moe import _near_tie_params

pytestmark = pytest.mark.host_inputs

VOCAB = 64


def _moe(**changes) -> ModelConfig:
  base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
              n_kv_heads=2, head_dim=8, mlp_dim=48, qk_norm=True,
              n_experts=4, n_experts_per_token=1, expert_mlp_dim=16,
              norm_topk_prob=True, max_seq_len=64)
  return ModelConfig(**{**base, **changes})


def _trainer_experts(params, cfg, seq) -> np.ndarray:
  """The experts the trainer's own forward routes each token of `seq` to
  (T x Lm x K)."""
  seq = jnp.asarray(seq, jnp.int32)[None]
  T = seq.shape[1]
  _, _, trace = transformer.traced_hidden_states(
      params, seq, jnp.arange(T)[None], jnp.ones_like(seq), cfg=cfg)
  return np.asarray(moe.experts_BxTxLxK(trace))[0]


@pytest.mark.parametrize("paged", [False, True])
def test_sampler_records_the_experts_of_every_model_input(paged):
  """Each result's experts are those of prompt + prefix + tokens[:-1], as
  the model routes them (random weights: no near ties), in the narrow id
  dtype; a paged pool too small for every slot preempts and resumes
  requests on the way, and their records still cover every input."""
  cfg = _moe(n_experts=8, n_experts_per_token=2, dense_layers=(0,),
             n_layers=3)
  params = transformer.init_params(cfg, jax.random.key(0), std=0.3)
  e = EngineConfig(max_slots=4, cache_len=48, prefill_buckets=(16, 48),
                   record_experts=True,
                   **(dict(page_size=4, kv_pages=12, min_view=4) if paged
                      else {}))
  sampler = Sampler(Engine(cfg, e), steps_per_call=3)
  rng = np.random.RandomState(1)
  requests = [SampleRequest(
      id=i, prompt=tuple(rng.randint(1, VOCAB, 3 + i)),
      prefix=tuple(rng.randint(1, VOCAB, i % 3)), max_new_tokens=30,
      budget=None if i % 2 or paged else 9,
      sampling=SamplingParams_(seed=i)) for i in range(6)]
  results, stats = sampler.generate(params, requests)
  if paged:
    assert stats.preemptions > 0
  for req, res in zip(requests, results):
    seq = req.prompt + req.prefix + res.tokens
    assert res.experts.dtype == np.int8
    assert res.experts.shape == (len(seq) - 1, 2, 2)  # MoE layers 1, 2
    want = _trainer_experts(params, cfg, seq[:-1])
    np.testing.assert_array_equal(np.sort(res.experts, -1),
                                  np.sort(want, -1))


def SamplingParams_(seed):
  from kimi_jax.sampler.sampling import SamplingParams
  return SamplingParams(temperature=1.0, seed=seed)


def test_a_dense_engine_records_nothing_and_replay_needs_experts():
  dense = _moe(n_experts=0, n_experts_per_token=0, expert_mlp_dim=0,
               norm_topk_prob=False)
  params = transformer.init_params(dense, jax.random.key(0))
  sampler = Sampler(Engine(dense, EngineConfig(max_slots=2, cache_len=32)))
  [res], _ = sampler.generate(params, [SampleRequest(
      id=0, prompt=(1, 2, 3), max_new_tokens=4)])
  assert res.experts is None
  with pytest.raises(ValueError, match=r"rl\.routing_replay.*dense"):
    Engine(dense, EngineConfig(max_slots=2, cache_len=32,
                               record_experts=True))


def test_routing_replay_on_a_dense_model_names_the_key():
  config = load_config("experiments/tiny.py")
  config.rl.routing_replay = True
  with pytest.raises(ConfigError, match=r"config\.rl\.routing_replay"):
    parse_config(config)


# ---- the buffer and checkpoints ---------------------------------------------


def _experts(n, seed=0):
  return np.random.RandomState(seed).randint(0, 100, (n, 3, 2)).astype(
      np.int8)


def test_each_segment_replaces_the_record_and_checkpoints_keep_it(tmp_path):
  """A continued segment's record (its re-prefill plus its decode steps)
  replaces the last; the loop state saved in a real Orbax checkpoint and
  restored gives back the same ids and dtype; dense trajectories write no
  experts key."""
  buf = replay_buffer.RolloutBuffer(group_size=2, max_wait_iterations=2)
  gid = buf.new_group(0)
  prompt_len = 4
  buf.add_segment(gid, 0, [5, 6, 7], [-1.0] * 3, version=0,
                  finish_reason=None, experts=_experts(prompt_len + 2))
  t = buf.add_segment(gid, 0, [8, 9], [-1.0] * 2, version=1,
                      finish_reason="stop", experts=_experts(prompt_len + 4,
                                                             seed=1))
  np.testing.assert_array_equal(t.experts, _experts(prompt_len + 4, 1))
  buf.add_segment(gid, 1, [5], [-0.5], version=1, finish_reason=None)
  with pytest.raises(ValueError, match=r"experts of shape \(2, 3, 2\)"):
    buf.add_segment(gid, 1, [1, 2, 3, 4], [0.0] * 4, version=2,
                    finish_reason=None, experts=_experts(2))
  state = LoopState.initial(group_size=2, max_wait_iterations=2,
                            records=[{"id": "a", "prompt": "p"}],
                            prompt_sampling=PromptSamplingConfig())
  state = dataclasses.replace(state, buffer=buf)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(3, params={"w": np.zeros((2,), np.float32)},
            host={"stage": "rl", "loop": state.to_json()})
  host = ckpt_lib.Checkpointer(str(tmp_path / "ckpt")).restore_host(3)
  back = LoopState.from_json(host["loop"], group_size=2,
                             max_wait_iterations=2,
                             records=[{"id": "a", "prompt": "p"}],
                             prompt_sampling=PromptSamplingConfig())
  [t0, t1] = back.buffer._groups[gid]
  assert t0.experts.dtype == np.int8
  np.testing.assert_array_equal(t0.experts, _experts(prompt_len + 4, 1))
  assert t1.experts is None
  assert "experts" not in host["loop"]["buffer"]["groups"][0][1]
  assert back.buffer.state_dict() == json.loads(json.dumps(
      buf.state_dict()))


# ---- rollout -> buffer -> minibatch -> trainer ------------------------------


def _rollout_minibatch(sampler_params, cfg, *, replay: bool):
  """Two iterations of partial rollouts of 2 prompts x 2 responses through
  the real sampler and replay buffer (the buffer's state through JSON in
  between, as a resumed run reads it), packed into one minibatch of the
  second iteration."""
  sampler = Sampler(Engine(cfg, EngineConfig(
      max_slots=4, cache_len=48, prefill_buckets=(16, 48),
      record_experts=replay)), steps_per_call=4)
  buf = replay_buffer.RolloutBuffer(group_size=2, max_wait_iterations=3)
  rng = np.random.RandomState(0)
  prompts = {i: list(rng.randint(1, VOCAB, 5 + i)) for i in range(2)}
  for i in prompts:
    buf.new_group(i)
  for it in range(2):
    pending = buf.pending()
    requests = rollout.continue_requests(
        pending, [prompts[t.prompt_index] for t in pending], seed=7,
        iteration=it, settings=SamplingSettings(temperature=1.0),
        stop_tokens=(), max_response_lens=[12] * len(pending),
        token_budget=6)
    results, _ = sampler.generate(sampler_params, requests)
    rollout.record_results(buf, results, version=it)
    state = json.loads(json.dumps(buf.state_dict()))
    buf = replay_buffer.RolloutBuffer(group_size=2, max_wait_iterations=3)
    buf.load_state_dict(state)
  groups = buf.complete_groups()
  assert len(groups) == 2 and all(len(t.segments) == 2 for g in groups
                                  for t in g.trajectories)
  return batching.packed_minibatch(
      groups, [prompts[g.prompt_index] for g in groups], version=1,
      train_on_old_segments=True, len_buckets=(32,), rows=(4,), pad_id=0,
      pad_prompts_to=2)


def test_replay_gives_the_trainer_the_samplers_logprobs_of_rollouts():
  """The sampler's and the trainer's router weights differ by rounding
  (+-1e-4 between two tied experts). Through the real rollout (partial
  rollouts over two iterations), replay buffer, minibatch and trainer:
  with routing replay the trainer's log-prob of every sampled token, both
  segments', is the sampler's, and the learner's reference pass measures
  no sampler-trainer gap; routing again (replay off) sends tokens to the
  other expert, and the log-probs and the gap move."""
  cfg = _moe()
  sampler_params, trainer_params = _near_tie_params(cfg, 1e-4)
  logp = jax.jit(lambda p, rows: trainer.token_logp_RxT(p, rows, cfg=cfg,
                                                        sharder=None))
  learner = Learner(cfg, RLConfig(
      iterations=1, prompts_per_iteration=2, samples_per_prompt=2,
      minibatch_prompts=2, routing_replay=True), Sharder(make_mesh(
          MeshConfig(), jax.devices()[:1])), cache_len=48)

  gaps = {}
  for replay in (True, False):
    mb = _rollout_minibatch(sampler_params, cfg, replay=replay)
    rows = mb.rows
    resp = (rows.mask_RxT > 0)
    assert resp.sum() == 4 * 12
    if replay:
      assert rows.experts_RxTxLxK.dtype == np.int8
      assert rows.experts_RxTxLxK.shape == rows.shape + (2, 1)
      # The recorded experts are where the trainer, routing on its own,
      # disagrees: that is what replay corrects.
      _, trace = jax.jit(lambda p, r: logprobs.traced_rows_logprobs(
          p, r, cfg=cfg))(trainer_params, rows.replace(experts_RxTxLxK=None))
      own = np.asarray(moe.experts_BxTxLxK(trace))
      real = rows.segment_ids_RxT > 0
      assert (own[real] != rows.experts_RxTxLxK[real]).any()
    else:
      assert rows.experts_RxTxLxK is None
    got = np.asarray(logp(trainer_params, rows))
    gaps[replay] = np.abs(got - mb.sampler_logp_RxT)[resp]
    placed, measured = learner.reference(trainer_params, [
        jax.tree.map(jnp.asarray, mb)])
    m = jax.device_get(measured[0])
    assert m["gap_tokens"] == 4 * 6  # the second segment's tokens
    gaps[replay, "learner"] = m["gap_abs_sum"] / m["gap_tokens"]
  assert gaps[True].max() < 2e-5, gaps[True].max()
  assert gaps[True, "learner"] < 2e-5
  assert gaps[False].max() > 1e-2, gaps[False].max()
  assert gaps[False, "learner"] > 1e-3
