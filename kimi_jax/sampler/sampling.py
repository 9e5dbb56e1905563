"""Per-slot token sampling: greedy, temperature, top-k, top-p, seeded.

Every slot carries its own settings as arrays, so one jitted call samples a
whole batch of requests with different settings. The random key of the token
at response index i of a request with seed s is fold_in(key(s), i): it does
not depend on the slot, the batch or on how the response was split into
partial rollouts.

The returned log-probability is always that of the *untempered, untruncated*
model distribution, log pi_theta(y_i | x, y_<i) = log_softmax(logits)[y_i],
whatever the temperature / top-k / top-p used to draw y_i. With the RL default
(temperature 1, top_k 0, top_p 1, not greedy) this is exactly the sampling
distribution and equals the trainer's `token_logprobs`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request draws its tokens.

  temperature: logits are divided by it before top-k / top-p; 0 means greedy.
  top_k: keep the k most likely tokens (0: all).
  top_p: keep the smallest set of most likely tokens whose probability
    reaches top_p, after top-k (1: all).
  greedy: argmax of the model logits (ignores the other settings and seed).
  seed: the request's random seed, 0 <= seed < 2**32.

  Construction never raises, so a bad value can be reported together with the
  request id that carries it; `errors()` lists what is wrong.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  seed: int = 0

  def errors(self) -> list[tuple[str, str]]:
    """(field, message) for every invalid setting; empty when valid."""
    out = []
    t = self.temperature
    if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
      out.append(("temperature", f"must be a finite number >= 0, got {t!r}"))
    if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
      out.append(("top_k", f"must be an integer >= 0, got {self.top_k!r}"))
    p = self.top_p
    if not isinstance(p, (int, float)) or not 0 < p <= 1:
      out.append(("top_p", f"must be in (0, 1], got {p!r}"))
    if not isinstance(self.greedy, (bool, np.bool_)):
      out.append(("greedy", f"must be a bool, got {self.greedy!r}"))
    if (not isinstance(self.seed, (int, np.integer)) or
        not 0 <= self.seed <= _MAX_SEED):
      out.append(("seed", f"must be an integer in [0, 2**32), got "
                          f"{self.seed!r}"))
    return out

  @property
  def is_greedy(self) -> bool:
    return bool(self.greedy) or self.temperature == 0

  @property
  def draws_by_rank(self) -> bool:
    """Top-k or top-p cuts this request's distribution (the host's side of
    `truncates`)."""
    return not self.is_greedy and (self.top_k > 0 or self.top_p < 1)


class SlotSampling(NamedTuple):
  """Sampling settings of B slots as arrays (B may be () for one request)."""

  seed: jax.Array         # uint32
  temperature: jax.Array  # float32, > 0 (1 for greedy slots)
  top_k: jax.Array        # int32, 0 = off
  top_p: jax.Array        # float32 in (0, 1]
  greedy: jax.Array       # bool


def slot_sampling(params: SamplingParams) -> SlotSampling:
  """Host arrays (shape ()) for one request's settings."""
  return SlotSampling(
      seed=np.uint32(params.seed),
      temperature=np.float32(1.0 if params.is_greedy else params.temperature),
      top_k=np.int32(params.top_k),
      top_p=np.float32(params.top_p),
      greedy=np.bool_(params.is_greedy))


def stacked_slot_sampling(params: Sequence[SamplingParams], size: int
                          ) -> SlotSampling:
  """Host arrays (size,) for several requests' settings; rows past
  len(params) are padding, set as an empty slot's (greedy)."""
  if size < 1 or len(params) > size:
    raise ValueError(f"{len(params)} sampling settings for size {size}")
  pad = [SamplingParams(greedy=True)] * (size - len(params))
  rows = [slot_sampling(p) for p in list(params) + pad]
  return SlotSampling(*(np.stack(col) for col in zip(*rows)))


def empty_slot_sampling(batch: int) -> SlotSampling:
  return SlotSampling(
      seed=jnp.zeros((batch,), jnp.uint32),
      temperature=jnp.ones((batch,), jnp.float32),
      top_k=jnp.zeros((batch,), jnp.int32),
      top_p=jnp.ones((batch,), jnp.float32),
      greedy=jnp.ones((batch,), bool))


def token_uniforms(seed_B: jax.Array, index_B: jax.Array) -> jax.Array:
  """u_b ~ U[0, 1) from key fold_in(key(seed_b), index_b): one per token."""
  return jax.vmap(lambda s, i: jax.random.uniform(
      jax.random.fold_in(jax.random.key(s), i)))(seed_B, index_B)


def order_keys(x_BxV: jax.Array) -> jax.Array:
  """int32 keys in the float total order of x (-0.0 below +0.0): the
  comparison `lax.top_k` sorts by, as one integer per element."""
  bits_BxV = jax.lax.bitcast_convert_type(x_BxV, jnp.int32)
  return jnp.where(bits_BxV < 0, bits_BxV ^ jnp.int32(0x7FFFFFFF), bits_BxV)


def sorted_descending(x_BxV: jax.Array) -> jax.Array:
  """The values of `lax.top_k(x, V)`, bit for bit, from a sort of one int32
  key array (about 10x faster on CPU than top_k's two-array sort with a
  total-order comparator). ~key sorts ascending as key descending."""
  desc_BxV = ~jax.lax.sort(~order_keys(x_BxV), dimension=x_BxV.ndim - 1)
  bits_BxV = jnp.where(desc_BxV < 0, desc_BxV ^ jnp.int32(0x7FFFFFFF),
                       desc_BxV)
  return jax.lax.bitcast_convert_type(bits_BxV, x_BxV.dtype)


def token_of_rank(x_BxV: jax.Array, sorted_BxV: jax.Array, rank_B: jax.Array
                  ) -> jax.Array:
  """order_BxV[b, rank_B[b]] for top_k's order (ties: lower index first),
  without the order: the j-th token, by index, among those equal to the
  value at that rank, where j counts the equal ranks before it."""
  keys_BxV = order_keys(x_BxV)
  key_B = order_keys(jnp.take_along_axis(sorted_BxV, rank_B[:, None],
                                         axis=-1))[:, 0]
  above_B = jnp.sum(keys_BxV > key_B[:, None], axis=-1, dtype=jnp.int32)
  equal_BxV = keys_BxV == key_B[:, None]
  nth_BxV = jnp.cumsum(equal_BxV.astype(jnp.int32), axis=-1)
  pick_BxV = equal_BxV & (nth_BxV == (rank_B - above_B + 1)[:, None])
  return jnp.argmax(pick_BxV, axis=-1).astype(jnp.int32)


def truncate_sorted(sorted_BxV: jax.Array, s: SlotSampling) -> jax.Array:
  """Top-k then top-p over tempered logits sorted by decreasing value;
  returns the renormalised probabilities of the ranks (see
  `truncated_probs`)."""
  V = sorted_BxV.shape[-1]
  rank_V = jnp.arange(V)
  k_B = jnp.where(s.top_k > 0, s.top_k, V)
  sorted_BxV = jnp.where(rank_V[None] < k_B[:, None], sorted_BxV, -jnp.inf)
  q_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  mass_before_BxV = jnp.cumsum(q_BxV, axis=-1) - q_BxV
  keep_BxV = (mass_before_BxV < s.top_p[:, None]) | (rank_V[None] == 0)
  probs_BxV = jnp.where(keep_BxV, q_BxV, 0.0)
  return probs_BxV / jnp.sum(probs_BxV, axis=-1, keepdims=True)


def truncated_probs(logits_BxV: jax.Array, s: SlotSampling
                    ) -> tuple[jax.Array, jax.Array]:
  """Sampling distribution over tokens sorted by decreasing logit.

  Returns (probs_BxV, order_BxV): order_BxV[b, r] is the token id of rank r,
  probs_BxV[b, r] its probability after temperature, top-k and top-p:
    q = softmax(logits / temperature) restricted to ranks r < k, renormalised;
    top-p keeps rank r when q's mass of the ranks before r is below top_p
    (so the most likely token always survives); renormalised again.
  """
  scaled_BxV = logits_BxV.astype(jnp.float32) / s.temperature[:, None]
  sorted_BxV, order_BxV = jax.lax.top_k(scaled_BxV, logits_BxV.shape[-1])
  return truncate_sorted(sorted_BxV, s), order_BxV


def truncates(s: SlotSampling) -> jax.Array:
  """Slots whose top-k or top-p cuts the distribution (B bool)."""
  return (s.top_k > 0) | (s.top_p < 1)


def draw_in_token_order(scaled_BxV: jax.Array, u_B: jax.Array) -> jax.Array:
  """Inverse-CDF draw over softmax(scaled) in token-id order: the first
  token whose cumulative probability exceeds u * total. A token of
  probability 0 (-inf) never has that first excess, even at u = 0."""
  cdf_BxV = jnp.cumsum(jax.nn.softmax(scaled_BxV, axis=-1), axis=-1)
  token_B = jnp.sum(cdf_BxV <= (u_B * cdf_BxV[:, -1])[:, None], axis=-1)
  return jnp.minimum(token_B, scaled_BxV.shape[-1] - 1)


def draw_by_rank(scaled_BxV: jax.Array, s: SlotSampling, u_B: jax.Array
                 ) -> jax.Array:
  """Inverse-CDF draw over the truncated distribution in rank order: the
  rank is the number of ranks whose cumulative probability is below
  u * total, so cut ranks (probability 0, at the end) are never picked.
  The sort is one int32-key sort of the values only; the drawn rank's
  token id is found afterwards (`token_of_rank`), the same id top_k's
  order would give."""
  sorted_BxV = sorted_descending(scaled_BxV)
  cdf_BxV = jnp.cumsum(truncate_sorted(sorted_BxV, s), axis=-1)
  rank_B = jnp.sum(cdf_BxV < (u_B * cdf_BxV[:, -1])[:, None], axis=-1)
  rank_B = jnp.minimum(rank_B, scaled_BxV.shape[-1] - 1)
  return token_of_rank(scaled_BxV, sorted_BxV, rank_B)


def sample_tokens(logits_BxV: jax.Array, s: SlotSampling, index_B: jax.Array,
                  never: int | None = None, ranked: bool = True
                  ) -> tuple[jax.Array, jax.Array]:
  """Draws one token per slot; returns (tokens_B int32, logprobs_B float32).

  One uniform per token (random-number code is slow to compile on CPU),
  turned into a token by the inverse CDF: in token-id order for a slot
  that samples the whole tempered distribution (the RL default), in rank
  order for a slot with top-k or top-p (`draw_by_rank`). A slot's draw
  depends only on its own settings, seed and index, never on the other
  slots. ranked=False leaves the ranking (its sort) out of the program:
  the caller, which knows every slot's settings on the host, promises that
  no slot truncates (`SamplingParams.draws_by_rank`). A static choice, not
  a `lax.cond`: on a multi-device CPU mesh a conditional holding
  collectives could deadlock.
  logprobs_B[b] = log_softmax(logits_BxV[b])[tokens_B[b]] (untempered).

  never: a token that is never drawn (a vision model's image placeholder:
  one in a response would be read as part of an image); the log-probs
  stay those of the full distribution, which the trainer computes too.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  full_BxV = logits_BxV
  if never is not None:
    logits_BxV = logits_BxV.at[:, never].set(-jnp.inf)
  scaled_BxV = logits_BxV / s.temperature[:, None]
  u_B = token_uniforms(s.seed, index_B)
  drawn_B = draw_in_token_order(scaled_BxV, u_B)
  if ranked:
    drawn_B = jnp.where(truncates(s), draw_by_rank(scaled_BxV, s, u_B),
                        drawn_B)
  tokens_B = jnp.where(s.greedy, jnp.argmax(logits_BxV, axis=-1),
                       drawn_B).astype(jnp.int32)
  logp_BxV = jax.nn.log_softmax(full_BxV, axis=-1)
  logprobs_B = jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, logprobs_B
