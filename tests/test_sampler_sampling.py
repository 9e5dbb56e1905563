"""Token sampling and the repeat detector, against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.sampler import sampling
from kimi_jax.sampler.repetition import RepeatConfig, is_repeating
from kimi_jax.sampler.sampling import SamplingParams, SlotSampling

# Numerics of pure functions on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs


# Jitted once per shape: op-by-op execution would compile every primitive.
_sample = jax.jit(sampling.sample_tokens)
_truncated = jax.jit(sampling.truncated_probs)


def _slots(n, temperature=1.0, top_k=0, top_p=1.0, greedy=False, seed=None):
  return SlotSampling(
      seed=jnp.asarray(np.arange(n) if seed is None else np.full(n, seed),
                       jnp.uint32),
      temperature=jnp.full((n,), temperature, jnp.float32),
      top_k=jnp.full((n,), top_k, jnp.int32),
      top_p=jnp.full((n,), top_p, jnp.float32),
      greedy=jnp.full((n,), greedy, bool))


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


LOGITS = np.array([0.5, 2.0, -1.0, 1.0, 0.0], np.float32)  # ranks: 1,3,0,4,2


@pytest.mark.parametrize("temperature,top_k,top_p,expected_tokens", [
    (1.0, 0, 1.0, [1, 3, 0, 4, 2]),
    (1.0, 2, 1.0, [1, 3]),
    (0.5, 0, 0.9, [1, 3]),   # tempered q = .84, .11, ...: .84 < .9 keeps #2
    (1.0, 0, 0.5, [1]),      # q(1) = .53 >= .5: only the top token
    (1.0, 3, 0.7, [1, 3]),   # top-3 renormalised: .61, .22: .61 < .7 keeps #2
])
def test_truncated_probs_hand_values(temperature, top_k, top_p,
                                     expected_tokens):
  probs, order = _truncated(
      jnp.asarray(LOGITS)[None], _slots(1, temperature, top_k, top_p))
  probs, order = np.asarray(probs[0]), np.asarray(order[0])
  np.testing.assert_array_equal(order, [1, 3, 0, 4, 2])
  kept = np.array(expected_tokens)
  want = _softmax(LOGITS[kept] / temperature)
  np.testing.assert_allclose(probs[:len(kept)], want, rtol=1e-5)
  np.testing.assert_array_equal(probs[len(kept):], 0.0)


def test_sampled_frequencies_follow_truncated_distribution():
  n = 6000
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 5))
  tokens, logprobs = _sample(
      logits, _slots(n, 0.8, 3, 1.0, seed=7), jnp.arange(n, dtype=jnp.int32))
  tokens = np.asarray(tokens)
  freq = np.bincount(tokens, minlength=5) / n
  want = np.zeros(5)
  want[[1, 3, 0]] = _softmax(LOGITS[[1, 3, 0]] / 0.8)
  # 4 standard errors of a binomial proportion.
  np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))
  assert freq[2] == 0 and freq[4] == 0
  # Log-probs are of the untempered, untruncated model distribution.
  log_model = LOGITS - np.log(np.exp(LOGITS).sum())
  np.testing.assert_allclose(np.asarray(logprobs), log_model[tokens],
                             atol=1e-5)


@pytest.mark.parametrize("never", [None, 1])
def test_untruncated_draws_follow_the_tempered_distribution(never):
  """Slots without top-k / top-p draw in token order (no sort): the
  frequencies still follow softmax(logits / T), and `never` is never drawn."""
  n = 6000
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 5))
  tokens, logprobs = jax.jit(sampling.sample_tokens, static_argnums=3)(
      logits, _slots(n, 0.8, seed=3), jnp.arange(n, dtype=jnp.int32), never)
  freq = np.bincount(np.asarray(tokens), minlength=5) / n
  kept = [t for t in range(5) if t != never]
  want = np.zeros(5)
  want[kept] = _softmax(LOGITS[kept] / 0.8)
  np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))
  log_model = LOGITS - np.log(np.exp(LOGITS).sum())
  np.testing.assert_allclose(np.asarray(logprobs),
                             log_model[np.asarray(tokens)], atol=1e-5)


@pytest.mark.parametrize("u,token", [
    (0.0, 1), (0.2499, 1), (0.25, 2), (0.7499, 2), (0.75, 4), (0.9999, 4)])
def test_token_order_draw_hand_cases(u, token):
  """probs (0, 1/4, 1/2, 0, 1/4): token j takes u in [cdf_{j-1}, cdf_j),
  so the zero-probability tokens 0 and 3 are never drawn, even at u = 0."""
  scaled = jnp.log(jnp.asarray([[0.0, 0.25, 0.5, 0.0, 0.25]], jnp.float32))
  got = sampling.draw_in_token_order(scaled, jnp.asarray([u], jnp.float32))
  assert int(got[0]) == token


def test_a_slots_draw_does_not_depend_on_the_other_slots_settings():
  """Whether any slot truncates (and so whether the sort runs) changes no
  other slot's token."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
  index = jnp.arange(16, dtype=jnp.int32)
  plain = _slots(16, 0.9)
  mixed = plain._replace(top_k=plain.top_k.at[0].set(3),
                         top_p=plain.top_p.at[1].set(0.5))
  plain_tokens, _ = _sample(logits, plain, index)
  mixed_tokens, _ = _sample(logits, mixed, index)
  np.testing.assert_array_equal(np.asarray(plain_tokens)[2:],
                                np.asarray(mixed_tokens)[2:])
  # Without the ranking compiled in (no slot truncates), the same draws.
  unranked, _ = jax.jit(sampling.sample_tokens, static_argnums=(3, 4))(
      logits, plain, index, None, False)
  np.testing.assert_array_equal(np.asarray(unranked), np.asarray(plain_tokens))
  for b in (0, 1):  # the truncating slots draw from what they keep
    one = jax.tree_util.tree_map(lambda x: x[b:b + 1], mixed)
    probs, order = _truncated(logits[b:b + 1], one)
    kept = set(np.asarray(order)[np.asarray(probs) > 0].tolist())
    assert len(kept) < 50 and int(mixed_tokens[b]) in kept


def test_keys_depend_on_seed_and_index_not_on_slot():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(64, 50)), jnp.float32)
  seeds = jnp.asarray(rng.integers(0, 5, size=64), jnp.uint32)
  index = jnp.asarray(rng.integers(0, 3, size=64), jnp.int32)
  s = _slots(64)._replace(seed=seeds)
  tokens, _ = _sample(logits, s, index)
  perm = rng.permutation(64)
  s_perm = jax.tree_util.tree_map(lambda x: x[perm], s)
  tokens_perm, _ = _sample(logits[perm], s_perm, index[perm])
  np.testing.assert_array_equal(np.asarray(tokens)[perm],
                                np.asarray(tokens_perm))
  # Same logits, different (seed, index): the draws must not all agree.
  same = jnp.broadcast_to(logits[0], (64, 50))
  draws, _ = _sample(same, _slots(64, seed=1),
                                    jnp.arange(64, dtype=jnp.int32))
  assert len(set(np.asarray(draws).tolist())) > 10


def test_greedy_and_zero_temperature_take_argmax():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(64, 50)), jnp.float32)
  want = np.argmax(np.asarray(logits), axis=-1)
  for params in (SamplingParams(greedy=True, seed=5, top_k=3),
                 SamplingParams(temperature=0.0, seed=11)):
    one = sampling.slot_sampling(params)
    s = jax.tree_util.tree_map(lambda x: jnp.full((64,), x), one)
    tokens, _ = _sample(logits, s, jnp.arange(64, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(tokens), want)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=-3), "seed"),
    (dict(seed=2**32), "seed"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
  errors = SamplingParams(**kwargs).errors()
  assert [f for f, _ in errors] == [field]
  assert SamplingParams().errors() == []


@pytest.mark.parametrize("tokens,caught", [
    ([5, 1, 2, 1, 2, 1, 2, 1, 2], True),          # period 2, 4 copies
    ([5, 1, 2, 1, 2, 1, 2, 1, 3], False),         # last copy broken
    ([9, 9, 9, 9], True),                          # period 1, 4 copies
    ([9, 9, 9], False),                            # only 3 copies
    ([1, 2, 3] * 4, True),                         # period 3 = ngram
    ([1, 2, 3, 4] * 4, False),                     # period 4 > ngram
    ([7, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], False),  # 3 full copies + part
    ([4, 4, 4, 4, 8], False),                      # loop left behind
    ([], False),
])
def test_repeat_detector_hand_cases(tokens, caught):
  assert is_repeating(tokens, RepeatConfig(ngram=3, times=4)) is caught


def test_repeat_detector_disabled_and_config_checked():
  assert not is_repeating([9] * 20, RepeatConfig(enabled=False))
  with pytest.raises(ValueError, match="repeat.times"):
    RepeatConfig(times=1)
  with pytest.raises(ValueError, match="repeat.ngram"):
    RepeatConfig(ngram=0)


def test_int_key_sort_and_token_of_rank_match_top_k_with_ties():
  """The sampling sort (one int32-key sort plus token_of_rank) gives top_k's
  values and order exactly, ties (equal values, -0.0 / +0.0) included."""
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, (6, 40)).astype(np.float32) / 2  # many ties
  x[0, :5] = [0.0, -0.0, 0.0, -0.0, 1.0]
  x[1] = rng.standard_normal(40).astype(np.float32)
  x_BxV = jnp.asarray(x)
  want_vals, want_order = jax.lax.top_k(x_BxV, 40)
  got_vals = sampling.sorted_descending(x_BxV)
  np.testing.assert_array_equal(np.asarray(got_vals).view(np.uint32),
                                np.asarray(want_vals).view(np.uint32))
  for r in range(40):
    rank_B = jnp.full((6,), r, jnp.int32)
    np.testing.assert_array_equal(
        sampling.token_of_rank(x_BxV, got_vals, rank_B), want_order[:, r])
