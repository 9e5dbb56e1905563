"""The sampler-trainer gap of log-probs, and truncated importance sampling.

The gap metrics against hand computations, through the real learner (which
tokens count: only those sampled in this iteration) and with a real sampler
whose engine computes in bfloat16 (a gap) or float32 (none). The truncated
importance-sampling correction of the mirror-descent loss against the same
loss written out by hand, with the cap binding, and off: the loss as it is
without it.
"""

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job.experiment import parse_config
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import batching, losses, replay_buffer, rollout, trainer
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.learner import Learner
from kimi_jax.sampler import handoff
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.config import SamplerConfig, SamplingSettings
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True,
                  tie_embeddings=True, max_seq_len=48)
K = 3
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13]]
REWARDS_PxK = np.array([[1., 0., 0.], [0., 1., 1.], [1., 0., 1.],
                        [0., 0., 1.]], np.float32)
VERSION = 1  # the iteration trained; version-0 segments are older
TIS_CAP = 1.2
# Per group, per response: segments of (n tokens, policy version).
SEGMENTS = [[[(5, 1)], [(2, 0), (3, 1)], [(4, 1)]],
            [[(3, 0), (2, 1)], [(6, 1)], [(2, 1)]],
            [[(1, 1)], [(4, 0), (4, 1)], [(3, 1)]],
            [[(7, 1)], [(2, 1)], [(3, 0), (1, 1)]]]
RL = RLConfig(iterations=1, prompts_per_iteration=4, samples_per_prompt=K,
              minibatch_prompts=2, epochs=2, learning_rate=1e-3,
              max_response_len=12, token_budget=12, tau=0.5,
              train_len_buckets=(16, 32), train_on_old_segments=True)


def _sharder() -> Sharder:
  return Sharder(make_mesh(MeshConfig(data=1), jax.devices()[:1]))


def _host_params(seed=3):
  return jax.device_get(transformer.init_sharded(CFG, seed, _sharder(),
                                                 std=0.2))


SEQ = 17  # every test sequence (prompt + response) fits, padded to this


@jax.jit
def _padded_logp(params, seqs_NxL):
  """log p of every token after the first of each (end-padded) sequence,
  one sequence per row: causal, so the padding changes nothing before it."""
  n = seqs_NxL.shape[1] - 1
  positions = jnp.broadcast_to(jnp.arange(n), (seqs_NxL.shape[0], n))
  logits, _ = transformer.forward(params, seqs_NxL[:, :-1], positions,
                                  jnp.ones_like(positions), cfg=CFG)
  return transformer.token_logprobs(logits, seqs_NxL[:, 1:])


def _padded(prompt, tokens) -> np.ndarray:
  seq = list(prompt) + list(tokens)
  return np.array(seq + [0] * (SEQ - len(seq)), np.int32)


def _trainer_logp(params, prompt, tokens) -> np.ndarray:
  """The trainer's log-prob of each response token, by a plain forward."""
  lp = _padded_logp(params, jax.device_put(_padded(prompt, tokens)[None]))
  start = len(prompt) - 1
  return np.asarray(lp)[0, start:start + len(tokens)]


def _shifted_groups(params, shift):
  """Groups on SEGMENTS whose sampler log-probs are the trainer's plus
  `shift(version, n)`; returns (groups, {(p, j): (logp, shift, versions)})."""
  rng = np.random.default_rng(0)
  buf = replay_buffer.RolloutBuffer(group_size=K, max_wait_iterations=5)
  truth = {}
  params = jax.device_put(params)
  for p, per_response in enumerate(SEGMENTS):
    gid = buf.new_group(p)
    for j, segs in enumerate(per_response):
      tokens = [int(t) for t in rng.integers(1, CFG.vocab_size,
                                             sum(n for n, _ in segs))]
      logp = _trainer_logp(params, PROMPTS[p], tokens)
      deltas = np.concatenate([shift(v, n) for n, v in segs])
      versions = np.concatenate([[v] * n for n, v in segs])
      start = 0
      for s, (n, v) in enumerate(segs):
        buf.add_segment(gid, j, tokens[start:start + n],
                        [float(x) for x in (logp + deltas)[start:start + n]],
                        version=v, finish_reason="stop"
                        if s == len(segs) - 1 else None)
        start += n
      truth[p, j] = (logp, deltas, versions)
  return buf.complete_groups(), truth


def _minibatches(learner, groups, old=True):
  mbs, members = batching.sorted_minibatches(
      groups, [PROMPTS[g.prompt_index] for g in groups],
      size=learner.rl.minibatch_prompts, version=VERSION,
      train_on_old_segments=old, len_buckets=learner.len_buckets, pad_id=0,
      rows=learner.row_buckets)
  reward = REWARDS_PxK[[g.prompt_index for g in groups]]
  return batching.with_scores(mbs, members, reward_PxK=reward,
                              correct_PxK=reward > 0), members


def _train(rl, host_params, groups, old=True, cfg=CFG):
  learner = Learner(cfg, rl, _sharder(), cache_len=32)
  state = learner.init_state(jax.device_put(host_params,
                                            learner.shardings.params))
  mbs, members = _minibatches(learner, groups, old)
  after, stats = learner.train(state, mbs)
  return jax.device_get(after.params), stats, members


# ---------------------------------------------------------------------------
# The gap metrics


@pytest.mark.host_inputs
def test_gap_sums_against_a_hand_computation():
  trainer_logp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
  sampler_logp = np.array([[-1.1, -1.5, -0.5, -9.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]], bool)  # the last token is not counted
  got = {k: float(v) for k, v in losses.logprob_gap_sums(
      trainer_logp, sampler_logp, mask).items()}
  r = [0.1, -0.5, 0.0]  # trainer - sampler on the counted tokens
  assert got["gap_tokens"] == 3
  assert got["gap_abs_sum"] == pytest.approx(0.6, rel=1e-6)
  assert got["gap_kl_sum"] == pytest.approx(
      sum(math.exp(x) - 1 - x for x in r), rel=1e-5)


def _gap_by_hand(truth, groups):
  """(mean |trainer - sampler|, mean k3, tokens) over the tokens of
  `groups` sampled at VERSION."""
  r = np.concatenate([-truth[g.prompt_index, j][1][
      truth[g.prompt_index, j][2] == VERSION]
                      for g in groups for j in range(K)])
  return np.abs(r).mean(), (np.exp(r) - 1 - r).mean(), r.size


@pytest.mark.slow
@pytest.mark.parametrize("rl_changes,old,first_only", [
    ({}, True, False),  # the first minibatch's gap from its first step
    ({"tis_cap": TIS_CAP}, True, False),  # all from the reference pass
    ({"reference_logprobs": "sampler"}, False, True),  # no reference pass
], ids=["fused", "tis", "sampler_reference"])
def test_learner_gap_counts_the_tokens_sampled_in_this_iteration(
    rl_changes, old, first_only):
  params = _host_params()
  rng = np.random.default_rng(1)
  # Older segments are far off (their sampler was older weights): they
  # must not count.
  shift = lambda v, n: (rng.uniform(-0.3, 0.3, n) if v == VERSION
                        else np.full(n, 5.0))
  groups, truth = _shifted_groups(params, shift)
  rl = dataclasses.replace(RL, train_on_old_segments=old, **rl_changes)
  _, stats, members = _train(rl, params, groups, old)
  counted = [groups[i] for i in (members[0] if first_only
                                 else sum(members, []))]
  gap_abs, gap_kl, n = _gap_by_hand(truth, counted)
  assert stats["logprob_gap_tokens"] == n
  assert stats["logprob_gap_abs"] == pytest.approx(gap_abs, abs=2e-5)
  assert stats["logprob_gap_kl"] == pytest.approx(gap_kl, abs=2e-5)
  assert gap_abs > 0.05  # far from the tolerance
  if rl.tis:
    _check_tis_stats(stats, truth, [[groups[i] for i in idx]
                                    for idx in members])
  else:
    assert "tis_weight_mean" not in stats


def _check_tis_stats(stats, truth, minibatches):
  """The weights the steps applied, by hand: every response token is in
  the loss (train_on_old_segments); each step reports its minibatch's
  token means and the stats average the steps."""
  ratios = [np.concatenate([np.exp(-truth[g.prompt_index, j][1])
                            for g in groups for j in range(K)])
            for groups in minibatches]
  clipped = np.mean([(r > TIS_CAP).mean() for r in ratios])
  assert 0.05 < clipped < 0.5  # the cap binds on some tokens only
  assert stats["tis_clipped_frac"] == pytest.approx(clipped, abs=1e-6)
  assert stats["tis_weight_mean"] == pytest.approx(
      np.mean([np.minimum(r, TIS_CAP).mean() for r in ratios]), rel=1e-5)


def _sampled_groups(model_cfg, host_params, n_prompts=3, matmul_dtype=""):
  """Groups of K responses sampled by a real sampler whose engine runs
  `model_cfg` (its compute dtype; its weight matmuls in `matmul_dtype`,
  `sampler.matmul_dtype`), at VERSION, from `host_params`."""
  sharder = _sharder()
  sampler = make_sampler(model_cfg, SamplerConfig(
      max_slots=16, cache_len=32, matmul_dtype=matmul_dtype), sharder)
  params, _ = handoff.place_params(
      jax.device_put(host_params, sampler.engine.param_shardings),
      sampler.engine.param_shardings)
  buf = replay_buffer.RolloutBuffer(group_size=K, max_wait_iterations=0)
  for p in range(n_prompts):
    buf.new_group(p)
  pending = buf.pending()
  requests = rollout.continue_requests(
      pending, [PROMPTS[t.prompt_index] for t in pending], seed=0,
      iteration=VERSION, settings=SamplingSettings(), stop_tokens=(),
      max_response_lens=[10] * len(pending), token_budget=10)
  results, _ = sampler.generate(params, requests)
  rollout.record_results(buf, results, version=VERSION)
  return buf.complete_groups()


@pytest.mark.slow
def test_bfloat16_sampling_shows_a_gap_that_float32_sampling_does_not():
  """The same weights: a float32 engine agrees with the float32 trainer to
  rounding; a bfloat16 one does not."""
  params = _host_params()
  rl = dataclasses.replace(RL, prompts_per_iteration=3, minibatch_prompts=3,
                           epochs=1)
  got = {}
  for dtype in ("float32", "bfloat16"):
    groups = _sampled_groups(dataclasses.replace(CFG, compute_dtype=dtype),
                             params)
    got[dtype] = _train(rl, params, groups)[1]
    assert got[dtype]["logprob_gap_tokens"] == sum(
        t.length for g in groups for t in g.trajectories) > 0
  f32, bf16 = got["float32"], got["bfloat16"]
  assert f32["logprob_gap_abs"] < 1e-5
  assert 0 <= f32["logprob_gap_kl"] < 1e-9
  # One bfloat16 rounding of a logit is ~4e-3 relative.
  assert bf16["logprob_gap_abs"] > 1e-3
  assert bf16["logprob_gap_kl"] > 1e3 * max(f32["logprob_gap_kl"], 1e-12)


@pytest.mark.slow
def test_bfloat16_sampler_matmuls_gap_to_a_float32_trainer_only():
  """`sampler.matmul_dtype="bfloat16"` under a float32 model: a gap to the
  float32 trainer, none (to float32 rounding) to a trainer whose weight
  matmuls round alike (`model.matmul_dtype`), which also trains."""
  params = _host_params()
  rl = dataclasses.replace(RL, prompts_per_iteration=3, minibatch_prompts=3,
                           epochs=1)
  groups = _sampled_groups(CFG, params, matmul_dtype="bfloat16")
  exact = _train(rl, params, groups)[1]
  alike_cfg = dataclasses.replace(CFG, matmul_dtype="bfloat16")
  after, alike, _ = _train(rl, params, groups, cfg=alike_cfg)
  assert exact["logprob_gap_abs"] > 1e-3
  assert alike["logprob_gap_abs"] < 1e-5
  assert exact["logprob_gap_kl"] > 1e3 * max(alike["logprob_gap_kl"], 1e-12)
  # The bfloat16-matmul trainer's update moves the weights.
  moved = max(float(np.abs(np.asarray(a, np.float32) - b).max())
              for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)))
  assert moved > 1e-5 and np.isfinite(moved)


# ---------------------------------------------------------------------------
# Truncated importance sampling


@pytest.mark.host_inputs
def test_tis_weights_against_a_hand_computation():
  ref = np.array([-1.0, -0.2, -2.0, 0.0], np.float32)
  sampler = np.array([-1.5, -2.2, -1.0, -50.0], np.float32)
  mask = np.array([1, 1, 1, 0], np.float32)
  w = np.asarray(losses.tis_weights(ref, sampler, mask, cap=2.0))
  # exp(0.5) under the cap, exp(2) = 7.39 truncated to 2, exp(-1) under
  # it; the masked slot (whose ratio would overflow) weighs 1.
  np.testing.assert_allclose(w, [math.exp(0.5), 2.0, math.exp(-1.0), 1.0],
                             rtol=1e-6)
  stats = losses.tis_stats(w, mask, cap=2.0)
  assert float(stats["tis_weight_mean"]) == pytest.approx(
      (math.exp(0.5) + 2.0 + math.exp(-1.0)) / 3, rel=1e-6)
  assert float(stats["tis_clipped_frac"]) == pytest.approx(1 / 3)


def _hand_case(seed=0):
  P, T = 2, 6
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (P, K, T)).astype(np.float32)
  mask = (rng.uniform(size=(P, K, T)) < 0.7).astype(np.float32)
  mask[0, 0] = 1.0
  ref_tok = logp + rng.normal(0, 0.05, (P, K, T)).astype(np.float32)
  sampler_tok = ref_tok - rng.uniform(-1.5, 1.5, (P, K, T)).astype(
      np.float32)
  ref_seq = (mask * ref_tok).sum(-1)
  reward = rng.uniform(size=(P, K)).astype(np.float32)
  return logp, mask, ref_tok, sampler_tok, ref_seq, reward


@pytest.mark.host_inputs
@pytest.mark.parametrize("cap", [1.5, 100.0], ids=["binding", "loose"])
def test_tis_loss_and_gradient_against_a_step_by_step_recomputation(cap):
  logp, mask, ref_tok, sampler_tok, ref_seq, reward = _hand_case()
  tau = 0.7
  w = np.where(mask > 0, np.minimum(np.exp(ref_tok - sampler_tok), cap), 1.0)
  on = w[mask > 0]
  if cap < 10:
    assert (on == cap).any() and (on < cap).any()  # the cap binds, not always
  else:
    assert (on < cap).all() and on.max() > 2.0  # never binds, yet matters
  # By hand: eq. 3's surrogate with the policy-gradient term reweighted.
  s = (mask * logp).sum(-1).astype(np.float64)
  s_w = (mask * w * logp).sum(-1)
  adv = reward - reward.mean(-1, keepdims=True)
  P = logp.shape[0]
  want_loss = np.mean(-s_w * adv + 0.5 * tau * (s - ref_seq) ** 2)
  # d loss / d logp[p, j, t] = mask * (-w A_j + tau (s_j - ref_j)) / (P K)
  want_grad = mask * (-w * adv[..., None]
                      + tau * (s - ref_seq)[..., None]) / (P * K)

  def loss_fn(lp):
    weights = losses.tis_weights(ref_tok, sampler_tok, mask, cap=cap)
    return losses.mirror_descent_loss(lp, ref_seq, mask, reward, tau=tau,
                                      tis_weight_PxKxT=weights)[0]

  loss, grad = jax.value_and_grad(loss_fn)(logp)
  assert float(loss) == pytest.approx(want_loss, rel=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5,
                             atol=1e-7)
  # Without the weights the policy-gradient part differs.
  plain = losses.mirror_descent_loss(logp, ref_seq, mask, reward, tau=tau)[0]
  assert abs(float(plain) - want_loss) > 1e-3


@pytest.mark.host_inputs
def test_unit_weights_give_the_loss_without_them_bit_for_bit():
  logp, mask, _, _, ref_seq, reward = _hand_case(1)

  def loss_fn(lp, weights):
    return losses.mirror_descent_loss(lp, ref_seq, mask, reward, tau=0.5,
                                      tis_weight_PxKxT=weights)[0]

  off = jax.value_and_grad(loss_fn)(logp, None)
  ones = jax.value_and_grad(loss_fn)(logp, np.ones_like(logp))
  assert float(off[0]) == float(ones[0])
  assert np.array_equal(np.asarray(off[1]), np.asarray(ones[1]))


def _tis_policy_case(cap):
  """A minibatch whose sampler log-probs are the trainer's at theta_i minus
  up to 2 (ratios up to e^2), its references from the reference pass,
  and parameters theta moved from theta_i."""
  params_i = _host_params()
  rng = np.random.default_rng(2)
  groups, truth = _shifted_groups(params_i,
                                  lambda v, n: rng.uniform(-2.0, 0.5, n))
  rl = dataclasses.replace(RL, tis_cap=cap)
  learner = Learner(CFG, rl, _sharder(), cache_len=32)
  mbs, members = _minibatches(learner, groups)
  mb = jax.device_put(mbs[0])
  ref = jax.jit(functools.partial(trainer.reference, cfg=CFG, sharder=None,
                                  token_level=True))(jax.device_put(params_i),
                                                     mb)
  mb = mb.replace(ref_seq_logp_PxK=ref["seq_logp_PxK"],
                  ref_logp_RxT=ref["logp_RxT"])
  moved = jax.tree.map(
      lambda x: x + 0.02 * np.random.default_rng(x.size).standard_normal(
          x.shape).astype(x.dtype), params_i)
  return rl, mb, [groups[i] for i in members[0]], truth, moved


@pytest.mark.parametrize("cap", [
    1.5, pytest.param(0.0, marks=pytest.mark.slow)], ids=["binding", "off"])
def test_packed_policy_loss_with_tis_against_a_hand_recomputation(cap):
  """trainer.policy_loss on packed rows, its weights from the reference
  pass, against eq. 3 with reweighted tokens written out per response on
  plain forward passes; at theta != theta_i so the penalty counts too."""
  rl, mb, groups, truth, theta = _tis_policy_case(cap)

  # Eq. 3 with reweighted tokens, one response per row: tokens, the loss
  # slots of each row, the weights, advantages and references.
  seqs, mask, w, adv, ref = [], [], [], [], []
  for g in groups:
    r = REWARDS_PxK[g.prompt_index]
    for j, traj in enumerate(g.trajectories):
      prompt = PROMPTS[g.prompt_index]
      seqs.append(_padded(prompt, traj.tokens))
      ref_lp, delta, _ = truth[g.prompt_index, j]
      slots = np.zeros(SEQ - 1, np.float32)
      slots[len(prompt) - 1:len(prompt) - 1 + traj.length] = 1.0
      # sampler = trainer at theta_i + delta: the ratio is exp(-delta).
      weight = np.zeros(SEQ - 1, np.float32)
      weight[slots > 0] = np.minimum(np.exp(-delta), cap) if cap else 1.0
      mask.append(slots)
      w.append(weight)
      adv.append(r[j] - r.mean())
      ref.append(ref_lp.sum())
  seqs, mask, w = np.stack(seqs), np.stack(mask), np.stack(w)
  adv, ref = np.array(adv, np.float32), np.array(ref, np.float32)

  def hand_loss(params, seqs, mask, w, adv, ref):
    lp = _padded_logp(params, seqs)
    s, s_w = jnp.sum(mask * lp, -1), jnp.sum(w * lp, -1)
    return jnp.mean(-s_w * adv + 0.5 * rl.tau * (s - ref) ** 2)

  got_loss, got_grad = jax.jit(jax.value_and_grad(
      lambda p, mb: trainer.policy_loss(p, mb, cfg=CFG, rl=rl,
                                        sharder=None)[0]))(
          jax.device_put(theta), mb)
  want_loss, want_grad = jax.jit(jax.value_and_grad(hand_loss))(
      *jax.device_put((theta, seqs, mask, w, adv, ref)))
  assert float(got_loss) == pytest.approx(float(want_loss), rel=2e-4)
  for got, want in zip(jax.tree.leaves(got_grad),
                       jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3,
                               atol=2e-5)
  if cap:
    ratios = np.concatenate([np.exp(-truth[g.prompt_index, j][1])
                             for g in groups for j in range(K)])
    assert (ratios > cap).any() and (ratios < cap).any()


# ---------------------------------------------------------------------------
# The config key


@pytest.mark.parametrize("changes,needle", [
    ({"tis_cap": -1.0}, "must be >= 0"),
    ({"tis_cap": float("nan")}, "must be >= 0"),
    ({"tis_cap": "2"}, "must be a number"),
    ({"tis_cap": 2.0, "loss": "rest"}, "mirror-descent"),
    ({"tis_cap": 2.0, "reference_logprobs": "sampler",
      "train_on_old_segments": False}, "reference_logprobs='recompute'"),
])
def test_bad_tis_cap_is_rejected_naming_the_key(changes, needle):
  with pytest.raises(ValueError, match=r"config\.rl\.tis_cap: .*" + needle):
    dataclasses.replace(RL, **changes)


def test_tis_cap_is_off_by_default_and_set_from_the_command_line():
  assert not RL.tis and RL.tis_cap is None
  assert not dataclasses.replace(RL, tis_cap=0.0).tis
  tiny = os.path.join(ROOT, "experiments", "tiny.py:micro")
  assert not parse_config(load_config(tiny)).rl.tis
  cfg = parse_config(load_config(tiny, ["--config.rl.tis_cap=2"]))
  assert cfg.rl.tis and cfg.rl.tis_cap == 2.0
  with pytest.raises(ConfigError, match=r"config\.rl\.tis_cap"):
    parse_config(load_config(tiny, ["--config.rl.tis_cap=-0.5"]))
