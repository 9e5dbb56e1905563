"""Mirror-descent and ReST losses against explicit per-response gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model.config import ModelConfig
from kimi_jax.model.transformer import forward, init_params, token_logprobs
from kimi_jax.rl.losses import baseline, mirror_descent_loss, rest_loss

# Numerics of pure functions on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

CFG = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                  n_kv_heads=1, head_dim=8, mlp_dim=32)
P, K, PROMPT, T = 2, 3, 3, 8          # T = total sequence length
# Response lengths per (prompt, sample); the rest of each row is padding.
RESP_LEN = np.array([[5, 2, 4], [1, 5, 3]])
REWARD = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], np.float32)


def _tokens():
  rng = np.random.default_rng(0)
  return rng.integers(0, CFG.vocab_size, size=(P, K, T)).astype(np.int32)


def _token_logp_PxKxT(params, tokens_PxKxT):
  """log p of token t+1 given tokens <= t, aligned to slot t (last slot 0)."""
  toks = tokens_PxKxT.reshape(P * K, T)
  pos = jnp.broadcast_to(jnp.arange(T), toks.shape)
  logits, _ = forward(params, toks, pos, jnp.ones_like(toks), cfg=CFG)
  lp = token_logprobs(logits[:, :-1], toks[:, 1:])
  lp = jnp.pad(lp, ((0, 0), (0, 1)))
  return lp.reshape(P, K, T)


def _mask_PxKxT():
  """Slot t predicts token t+1; response tokens are PROMPT .. PROMPT+len-1."""
  t = np.arange(T)
  lo = PROMPT - 1
  return ((t >= lo) & (t < lo + RESP_LEN[..., None])).astype(np.float32)


def _seq_logp_row(params, tokens_T, n_resp):
  """log pi(y|x) of one response: sum over its positions i of
  log softmax(logits[i - 1])[tokens[i]], i in [PROMPT, PROMPT + n_resp)."""
  toks = tokens_T[None]
  pos = jnp.arange(T)[None]
  logits, _ = forward(params, toks, pos, jnp.ones_like(toks), cfg=CFG)
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  total = 0.0
  for i in range(PROMPT, T):
    inside = i < PROMPT + n_resp
    total = total + jnp.where(inside, logp[i - 1, tokens_T[i]], 0.0)
  return total


# One compile (n_resp is traced), so the reference stays cheap.
_seq_logp_and_grad = jax.jit(jax.value_and_grad(_seq_logp_row))


def _seq_logp(params, tokens_T, n_resp):
  return _seq_logp_and_grad(params, tokens_T, n_resp)[0]


def _params_pair():
  theta_i = init_params(CFG, jax.random.key(1), std=0.3)
  theta = init_params(CFG, jax.random.key(2), std=0.3)
  return theta_i, theta


def _explicit_grad(theta, theta_i, tokens, tau, r_bar_P):
  """(1/P) sum_p (1/K) sum_j -[g_j A_j - tau (s_j - ref_j) g_j]."""
  total = jax.tree.map(jnp.zeros_like, theta)
  for p in range(P):
    for j in range(K):
      n = int(RESP_LEN[p, j])
      s, g = _seq_logp_and_grad(theta, tokens[p, j], n)
      ref = _seq_logp(theta_i, tokens[p, j], n)
      adv = REWARD[p, j] - r_bar_P[p]
      coef = -(adv - tau * (s - ref)) / (P * K)
      total = jax.tree.map(lambda a, b: a + coef * b, total, g)
  return total


def _surrogate(theta, theta_i, tokens, reward, tau, kind):
  mask = _mask_PxKxT()
  ref = jnp.sum(_token_logp_PxKxT(theta_i, tokens) * mask, axis=-1)
  lp = _token_logp_PxKxT(theta, tokens)
  return mirror_descent_loss(lp, ref, mask, reward, tau=tau,
                             baseline_kind=kind)


_surrogate_and_grad = jax.jit(
    jax.value_and_grad(_surrogate, has_aux=True),
    static_argnames=("tau", "kind"))


def test_mirror_descent_gradient_equals_eq3():
  theta_i, theta = _params_pair()
  tokens = _tokens()
  tau = 0.7
  (_, metrics), got = _surrogate_and_grad(theta, theta_i, tokens, REWARD,
                                          tau=tau, kind="mean")
  r_bar = REWARD.mean(axis=1)
  want = _explicit_grad(theta, theta_i, tokens, tau, r_bar)
  for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got),
                        jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path[0]))
  # The penalty is really exercised: theta differs from theta_i.
  assert float(metrics["log_ratio_sq_mean"]) > 1e-2


def test_soft_baseline_gradient_wrt_token_logp():
  # d loss / d token_logp[p, j, t] = mask * (-(r_j - r_bar_p) + tau (s_j -
  # ref_j)) / (P K), with r_bar_p the soft baseline computed by hand here.
  rng = np.random.default_rng(3)
  lp = -rng.uniform(0.1, 2.0, size=(P, K, T)).astype(np.float32)
  mask = _mask_PxKxT()
  ref = (lp * mask).sum(-1) + rng.normal(size=(P, K)).astype(np.float32)
  tau = 0.7
  g = jax.grad(lambda x: mirror_descent_loss(
      x, ref, mask, REWARD, tau=tau, baseline_kind="soft")[0])(lp)
  for p in range(P):
    r_bar = tau * math.log(sum(math.exp(r / tau) for r in REWARD[p]) / K)
    for j in range(K):
      s = sum(float(lp[p, j, t]) for t in range(T) if mask[p, j, t])
      coef = (-(REWARD[p, j] - r_bar) + tau * (s - ref[p, j])) / (P * K)
      np.testing.assert_allclose(g[p, j], coef * mask[p, j], rtol=1e-5,
                                 atol=1e-7)


def test_equal_rewards_leave_only_the_penalty():
  theta_i, theta = _params_pair()
  tokens = _tokens()
  tau = 0.7
  equal = np.full((P, K), 0.8, np.float32)
  rng = np.random.default_rng(4)
  lp = -rng.uniform(0.1, 2.0, size=(P, K, T)).astype(np.float32)
  ref = rng.normal(size=(P, K)).astype(np.float32) - 5.0
  for kind in ("mean", "soft"):
    loss, m = mirror_descent_loss(lp, ref, _mask_PxKxT(), equal, tau=tau,
                                  baseline_kind=kind)
    assert abs(float(m["pg_term"])) < 1e-5
    assert float(m["advantage_abs_mean"]) < 1e-6
    np.testing.assert_allclose(float(loss), float(m["penalty_term"]),
                               rtol=1e-5)
  # And at theta = theta_i the whole gradient vanishes (relative to the
  # gradient with unequal rewards).
  def grad_norm(reward):
    _, g = _surrogate_and_grad(theta_i, theta_i, tokens, reward, tau=tau,
                               kind="mean")
    return float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
  assert grad_norm(equal) < 1e-4 * grad_norm(REWARD)


def test_soft_baseline_hand_values():
  # tau * log((e^{0/0.5} + e^{1/0.5}) / 2) = 0.5 * log((1 + 7.3890561) / 2)
  #   = 0.5 * log(4.19452805) = 0.5 * 1.43378110 = 0.71689055
  # 1.0 * log((e^1000 + e^0) / 2) = 1000 - log 2 = 999.30685282
  r = jnp.array([[0.0, 1.0], [1000.0, 0.0]])
  np.testing.assert_allclose(
      baseline(r[:1], tau=0.5, kind="soft"), [0.71689055], rtol=1e-6)
  np.testing.assert_allclose(
      baseline(r[1:], tau=1.0, kind="soft"), [999.30685282], rtol=1e-7)
  np.testing.assert_allclose(baseline(r, tau=1.0, kind="mean"), [0.5, 500.0])
  with pytest.raises(ValueError, match="baseline kind"):
    baseline(r, tau=1.0, kind="max")


def test_loss_value_hand_computed():
  # One prompt, K=2, tau=2, one token each: s = (-1, -2), ref = (-1.5, -2),
  # r = (1, 0), mean baseline 0.5 -> A = (0.5, -0.5).
  # pg = -(1/2)(-1*0.5 + -2*-0.5) = -0.25; penalty = (2/2)(1/2)(0.25 + 0) =
  # 0.125.
  lp = jnp.array([[[-1.0, -7.0], [-2.0, -9.0]]])
  mask = jnp.array([[[1.0, 0.0], [1.0, 0.0]]])
  loss, m = mirror_descent_loss(lp, jnp.array([[-1.5, -2.0]]), mask,
                                jnp.array([[1.0, 0.0]]), tau=2.0)
  np.testing.assert_allclose(float(m["pg_term"]), -0.25, rtol=1e-6)
  np.testing.assert_allclose(float(m["penalty_term"]), 0.125, rtol=1e-6)
  np.testing.assert_allclose(float(loss), -0.125, rtol=1e-6)
  np.testing.assert_allclose(float(m["seq_logp_mean"]), -1.5, rtol=1e-6)
  with pytest.raises(ValueError, match="tau"):
    mirror_descent_loss(lp, jnp.zeros((1, 2)), mask, jnp.zeros((1, 2)),
                        tau=0.0)


def _rest(theta, tokens, correct):
  lp = _token_logp_PxKxT(theta, tokens)
  return rest_loss(lp, jnp.asarray(_mask_PxKxT()), correct)


_rest_and_grad = jax.jit(jax.value_and_grad(_rest, has_aux=True))


def test_rest_ignores_incorrect_responses():
  _, theta = _params_pair()
  tokens = _tokens()
  correct = np.array([[True, False, True], [False, False, False]])

  def grad(th, tk):
    return _rest_and_grad(th, tk, correct)[1]

  g0 = grad(theta, tokens)
  # Perturb every response token of the incorrect responses.
  perturbed = tokens.copy()
  for p, j in zip(*np.nonzero(~correct)):
    perturbed[p, j, PROMPT:] = (perturbed[p, j, PROMPT:] + 7) % CFG.vocab_size
  g1 = grad(theta, perturbed)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(a, b)
  # Value: mean NLL over the 5 + 4 tokens of the two correct responses.
  n = RESP_LEN[0, 0] + RESP_LEN[0, 2]
  want = -(_seq_logp(theta, tokens[0, 0], 5) +
           _seq_logp(theta, tokens[0, 2], 4)) / n
  (loss, m), _ = _rest_and_grad(theta, tokens, correct)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  assert float(m["n_tokens"]) == n
  # The same perturbation applied to a correct response does change it.
  perturbed[0, 0, PROMPT:] = (perturbed[0, 0, PROMPT:] + 7) % CFG.vocab_size
  g3 = grad(theta, perturbed)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(g0), jax.tree.leaves(g3)))


def test_rest_no_correct_response_gives_zero():
  _, theta = _params_pair()
  tokens = _tokens()
  correct = np.zeros((P, K), bool)
  (loss, m), g = _rest_and_grad(theta, tokens, correct)
  assert float(loss) == 0.0 and float(m["n_tokens"]) == 0.0
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))


def test_padding_prompts_are_excluded():
  # A batch with two padding prompts (garbage, even NaN rewards) gives the
  # loss, gradient and metrics of the unpadded batch.
  rng = np.random.default_rng(5)
  lp = -rng.uniform(0.1, 2.0, size=(P, K, T)).astype(np.float32)
  mask = _mask_PxKxT()
  ref = (lp * mask).sum(-1) + rng.normal(size=(P, K)).astype(np.float32)
  pad_lp = np.concatenate([lp, -np.ones((2, K, T), np.float32)])
  pad_mask = np.concatenate([mask, np.ones((2, K, T), np.float32)])
  pad_ref = np.concatenate([ref, np.zeros((2, K), np.float32)])
  pad_reward = np.concatenate([REWARD, np.full((2, K), np.nan, np.float32)])
  valid = np.array([1, 1, 0, 0], np.float32)

  def run(x, m, r, w, v):
    return jax.value_and_grad(lambda y: mirror_descent_loss(
        y, r, m, w, tau=0.7, baseline_kind="soft", valid_P=v), has_aux=True
                              )(x)

  (loss, metrics), g = run(lp, mask, ref, REWARD, None)
  (p_loss, p_metrics), p_g = run(pad_lp, pad_mask, pad_ref, pad_reward, valid)
  np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-6)
  np.testing.assert_allclose(p_g[:P], g, rtol=1e-6)
  assert not np.any(p_g[P:])
  for name in metrics:
    np.testing.assert_allclose(float(p_metrics[name]), float(metrics[name]),
                               rtol=1e-6, err_msg=name)
