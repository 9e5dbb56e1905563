"""The decode engine: JetStream's Engine contract over the policy's KV cache.

  init_decode_state()                  -> DecodeState (all slots free)
  prefill(params, tokens, sampling, i) -> Prefix (prompt cache + first token)
  insert(prefix, state, slot)          -> DecodeState (prefix now in `slot`)
  generate(params, state, n_steps)     -> (DecodeState, tokens_NxB, logp_NxB)
  free_resource(state, slot)           -> DecodeState (slot free again)
  max_concurrent_decodes               -> number of slots B

and their batched forms, which the driver uses to cut the per-request host
cost (one jitted call and one host read per batch instead of per request):

  prefill_batch(params, seqs, samplings, first_indices) -> Prefix (leading N)
  insert_batch(prefix, state, slots)   -> DecodeState (row i now in slots[i])
  free_slots(state, mask_B)            -> DecodeState (masked slots free)

Every call is one jitted function. The decode state is donated, so the cache
is updated in place. On a mesh (`sharder`), slots are split over the batch
mesh axes (data, fsdp) and key/value heads over `tensor`, exactly as the
trainer shards activations; params keep the trainer's shardings.

Compilations are bounded: a prefill pads the prompt to the smallest of a few
length buckets, so prefill and insert compile once per bucket used; a batched
prefill also pads its batch to the smallest of a few batch buckets, so
prefill_batch and insert_batch compile at most once per (length bucket, batch
bucket) pair used; generate once per distinct `n_steps`; init, free_resource
and free_slots once. `compile_count()` reports the traces so far (each trace
is one compilation); `warm_up_admission` compiles every batched pair ahead.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler import handoff
from kimi_jax.sampler.sampling import (SamplingParams, SlotSampling,
                                       empty_slot_sampling, sample_tokens,
                                       slot_sampling, stacked_slot_sampling)
from kimi_jax.sharding import Sharder

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """max_slots: concurrent sequences B. cache_len: tokens a slot holds (prompt
  plus response). prefill_buckets: padded prompt lengths (default: powers of
  two from 16 up to cache_len, plus cache_len). prefill_batch_buckets: padded
  batch sizes of a batched prefill (default: powers of two from 1 up to
  max_slots, plus max_slots); the largest caps a batch, and with it the
  prefill's activations (batch x length bucket)."""

  max_slots: int
  cache_len: int
  prefill_buckets: tuple[int, ...] | None = None
  prefill_batch_buckets: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.max_slots < 1:
      raise ValueError(f"sampler.max_slots must be >= 1, got {self.max_slots}")
    if self.cache_len < 2:
      raise ValueError(f"sampler.cache_len must be >= 2, got {self.cache_len}")
    b = self.buckets
    if list(b) != sorted(set(b)) or b[0] < 1 or b[-1] > self.cache_len:
      raise ValueError(f"sampler.prefill_buckets must be increasing, in "
                       f"[1, cache_len={self.cache_len}], got {b}")
    n = self.batch_buckets
    if not n or list(n) != sorted(set(n)) or n[0] < 1 or n[-1] > self.max_slots:
      raise ValueError(f"sampler.prefill_batch_buckets must be increasing, in "
                       f"[1, max_slots={self.max_slots}], got {n}")

  @property
  def buckets(self) -> tuple[int, ...]:
    if self.prefill_buckets is not None:
      return tuple(int(x) for x in self.prefill_buckets)
    out, n = [], 16
    while n < self.cache_len:
      out.append(n)
      n *= 2
    return tuple(out) + (self.cache_len,)

  @property
  def batch_buckets(self) -> tuple[int, ...]:
    if self.prefill_batch_buckets is not None:
      return tuple(int(x) for x in self.prefill_batch_buckets)
    out, n = [], 1
    while n < self.max_slots:
      out.append(n)
      n *= 2
    return tuple(out) + (self.max_slots,)


class DecodeState(NamedTuple):
  """Everything about the B slots that lives on device.

  cache: the KV cache; cache.lengths_B = tokens of each slot in the cache.
  tokens_B: the last sampled token of each slot (input of the next step).
  index_B: response index of the next token to sample (its key's fold-in).
  active_B: slots holding a live sequence.
  sampling: per-slot sampling settings.
  """

  cache: transformer.KVCache
  tokens: jax.Array
  index: jax.Array
  active: jax.Array
  sampling: SlotSampling


class Prefix(NamedTuple):
  """A prefilled sequence, ready to insert into a slot (batch dim of 1).

  k, v: cache entries, (L, 1, bucket, K, Dh); entries past `length` are
  padding. token/logprob: the first sampled token and its log-prob.
  index: response index of the token after `token`.

  From `prefill_batch`, N sequences: k, v are (L, N, bucket, K, Dh) and every
  other field has a leading N; rows past the real sequences are padding.
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  token: jax.Array
  logprob: jax.Array
  index: jax.Array
  sampling: SlotSampling


class Engine:
  """Prefill / insert / generate over the policy's KV-cache slots."""

  def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               sharder: Sharder | None = None, params: Params | None = None):
    if engine_cfg.cache_len > cfg.max_seq_len:
      raise ValueError(f"sampler.cache_len {engine_cfg.cache_len} exceeds "
                       f"model.max_seq_len {cfg.max_seq_len}")
    self.cfg = cfg
    self.engine_cfg = engine_cfg
    self.sharder = sharder
    self._traces: collections.Counter[str] = collections.Counter()
    self._param_shardings = self._make_param_shardings()
    self._state_shardings = self._make_state_shardings()
    self._init_jit = jax.jit(self._init_fn,
                             out_shardings=self._state_shardings)
    self._prefill_jit = jax.jit(self._prefill_fn)
    self._insert_jit = jax.jit(self._insert_fn, donate_argnums=(1,),
                               out_shardings=self._state_shardings)
    self._generate_jit = jax.jit(self._generate_fn, static_argnums=(2,),
                                 donate_argnums=(1,))
    self._free_jit = jax.jit(self._free_fn, donate_argnums=(0,),
                             out_shardings=self._state_shardings)
    self._prefill_batch_jit = jax.jit(self._prefill_batch_fn)
    self._insert_batch_jit = jax.jit(self._insert_batch_fn,
                                     donate_argnums=(1,),
                                     out_shardings=self._state_shardings)
    self._free_slots_jit = jax.jit(self._free_slots_fn, donate_argnums=(0,),
                                   out_shardings=self._state_shardings)
    self.params: Params | None = None
    if params is not None:
      self.load_params(params)

  # ---- configuration -------------------------------------------------------

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine_cfg.max_slots

  @property
  def cache_len(self) -> int:
    return self.engine_cfg.cache_len

  @property
  def max_prefill_len(self) -> int:
    return self.engine_cfg.buckets[-1]

  def bucket_for(self, n_tokens: int) -> int:
    for b in self.engine_cfg.buckets:
      if n_tokens <= b:
        return b
    raise ValueError(f"{n_tokens} prefill tokens exceed the largest bucket "
                     f"{self.max_prefill_len}")

  @property
  def max_prefill_batch(self) -> int:
    return self.engine_cfg.batch_buckets[-1]

  def batch_bucket_for(self, n_seqs: int) -> int:
    for b in self.engine_cfg.batch_buckets:
      if n_seqs <= b:
        return b
    raise ValueError(f"{n_seqs} sequences exceed the largest prefill batch "
                     f"bucket {self.max_prefill_batch}")

  def compile_count(self) -> dict[str, int]:
    """Compilations so far per function (a jit traces once per compile)."""
    return dict(self._traces)

  def _make_param_shardings(self) -> Params:
    if self.sharder is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return jax.tree_util.tree_map(lambda _: device,
                                    transformer.abstract_params(self.cfg))
    return transformer.param_shardings(self.cfg, self.sharder)

  def _make_state_shardings(self) -> DecodeState | None:
    abstract = jax.eval_shape(self._init_state)
    if self.sharder is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return jax.tree_util.tree_map(lambda _: device, abstract)
    s = self.sharder
    cache_sh = s.param_sharding("decode_state.cache.k", abstract.cache.k.shape,
                                transformer.CACHE_LOGICAL)
    slot_sh = s.param_sharding("decode_state slots", (self.max_concurrent_decodes,),
                               ("batch",))
    cache = transformer.KVCache(k=cache_sh, v=cache_sh, lengths=slot_sh)
    return DecodeState(cache=cache, tokens=slot_sh, index=slot_sh,
                       active=slot_sh,
                       sampling=SlotSampling(*([slot_sh] * 5)))

  # ---- weights -------------------------------------------------------------

  @property
  def param_shardings(self) -> Params:
    return self._param_shardings

  def load_params(self, params: Params) -> handoff.Handoff:
    """Takes the trainer's params: shared when shardings agree, else resharded."""
    self.params, report = handoff.place_params(params, self._param_shardings)
    return report

  def load_checkpoint(self, directory: str) -> handoff.Handoff:
    """Restores params saved by `handoff.save_params` into our shardings."""
    self.params, report = handoff.restore_params(
        directory, transformer.abstract_params(self.cfg),
        self._param_shardings)
    return report

  # ---- the contract --------------------------------------------------------

  def init_decode_state(self) -> DecodeState:
    return self._init_jit()

  def prefill(self, params: Params, tokens: Sequence[int],
              sampling: SamplingParams, first_index: int = 0) -> Prefix:
    """Runs the prompt (plus any continued prefix) and samples one token.

    first_index: response index of the token sampled here (the length of the
    continued prefix), so its key is the same as in an uninterrupted run.
    """
    n = len(tokens)
    if n == 0:
      raise ValueError("prefill needs at least one token")
    bucket = self.bucket_for(n)
    tokens_1xT = np.zeros((1, bucket), np.int32)
    tokens_1xT[0, :n] = tokens
    return self._prefill_jit(params, tokens_1xT, np.int32(n),
                             slot_sampling(sampling), np.int32(first_index))

  def insert(self, prefix: Prefix, state: DecodeState, slot: int
             ) -> DecodeState:
    self._check_slot(slot)
    return self._insert_jit(prefix, state, np.int32(slot))

  def generate(self, params: Params, state: DecodeState, n_steps: int = 1
               ) -> tuple[DecodeState, jax.Array, jax.Array]:
    """n_steps decode steps for every slot in one call.

    Returns tokens_NxB and logprobs_NxB; rows of free slots are meaningless.
    Every active slot advances n_steps tokens: the caller discards what a
    slot produced after its stop.
    """
    if n_steps < 1:
      raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    return self._generate_jit(params, state, int(n_steps))

  def free_resource(self, state: DecodeState, slot: int) -> DecodeState:
    self._check_slot(slot)
    return self._free_jit(state, np.int32(slot))

  # ---- batched forms ------------------------------------------------------

  def prefill_batch(self, params: Params, token_seqs: Sequence[Sequence[int]],
                    samplings: Sequence[SamplingParams],
                    first_indices: Sequence[int]) -> Prefix:
    """`prefill` of N sequences in one call; row i of the result is what
    `prefill(params, token_seqs[i], samplings[i], first_indices[i])` gives
    (up to float rounding of the logits).

    Tokens pad to the bucket of the longest sequence, N to a batch bucket:
    group sequences of similar length so short ones are not padded far.
    """
    n = len(token_seqs)
    if not (n == len(samplings) == len(first_indices)):
      raise ValueError(f"prefill_batch: {n} sequences, {len(samplings)} "
                       f"samplings, {len(first_indices)} first indices")
    if n == 0 or min(len(t) for t in token_seqs) == 0:
      raise ValueError("prefill needs at least one token per sequence")
    T = self.bucket_for(max(len(t) for t in token_seqs))
    N = self.batch_bucket_for(n)
    tokens_NxT = np.zeros((N, T), np.int32)
    # Padding rows hold one token 0: a valid, finite forward; never inserted.
    lengths_N = np.ones((N,), np.int32)
    first_N = np.zeros((N,), np.int32)
    for i, seq in enumerate(token_seqs):
      tokens_NxT[i, :len(seq)] = seq
      lengths_N[i] = len(seq)
      first_N[i] = first_indices[i]
    return self._prefill_batch_jit(params, tokens_NxT, lengths_N,
                                   stacked_slot_sampling(samplings, N),
                                   first_N)

  def insert_batch(self, prefix: Prefix, state: DecodeState,
                   slots: Sequence[int | None]) -> DecodeState:
    """Puts row i of a `prefill_batch` prefix into slots[i] in one call.

    Rows whose slot is None, and rows past len(slots) (the padding), are
    not inserted.
    """
    if np.ndim(prefix.token) != 1:
      raise ValueError("insert_batch takes a prefix from prefill_batch")
    N, B = prefix.token.shape[0], self.max_concurrent_decodes
    if len(slots) > N:
      raise ValueError(f"{len(slots)} slots for a prefix of {N} rows")
    real = [s for s in slots if s is not None]
    for s in real:
      self._check_slot(s)
    if len(set(real)) != len(real):
      raise ValueError(f"insert_batch: slots repeat: {list(slots)}")
    slots_N = np.full((N,), B, np.int32)  # B: out of range, dropped
    slots_N[:len(slots)] = [B if s is None else s for s in slots]
    return self._insert_batch_jit(prefix, state, slots_N)

  def free_slots(self, state: DecodeState, mask_B) -> DecodeState:
    """Frees every slot whose mask entry is true, in one call."""
    mask_B = np.asarray(mask_B, bool)
    if mask_B.shape != (self.max_concurrent_decodes,):
      raise ValueError(f"free_slots: mask of shape {mask_B.shape}, want "
                       f"({self.max_concurrent_decodes},)")
    return self._free_slots_jit(state, mask_B)

  def warm_up_admission(self, params: Params,
                        lengths: Sequence[int] | None = None) -> int:
    """Compiles prefill_batch and insert_batch for every batch bucket and
    the length buckets of `lengths` (default: all), and free_slots, so that
    timed work meets no compilation. Returns the (length, batch) pairs."""
    buckets = (self.engine_cfg.buckets if lengths is None else
               sorted({self.bucket_for(n) for n in lengths}))
    state = self.init_decode_state()
    for T in buckets:
      for N in self.engine_cfg.batch_buckets:
        prefix = self.prefill_batch(params, [[0] * T] * N,
                                    [SamplingParams()] * N, [0] * N)
        state = self.insert_batch(prefix, state, range(N))
    jax.block_until_ready(self.free_slots(
        state, np.ones((self.max_concurrent_decodes,), bool)))
    return len(buckets) * len(self.engine_cfg.batch_buckets)

  def _check_slot(self, slot: int) -> None:
    if not 0 <= slot < self.max_concurrent_decodes:
      raise ValueError(f"slot {slot} outside [0, "
                       f"{self.max_concurrent_decodes})")

  # ---- traced functions ----------------------------------------------------

  def _init_state(self) -> DecodeState:
    B = self.max_concurrent_decodes
    zeros_B = jnp.zeros((B,), jnp.int32)
    return DecodeState(
        cache=transformer.init_cache(self.cfg, B, self.cache_len),
        tokens=zeros_B, index=zeros_B, active=jnp.zeros((B,), bool),
        sampling=empty_slot_sampling(B))

  def _init_fn(self) -> DecodeState:
    self._traces["init_decode_state"] += 1
    return self._init_state()

  def _prefill_fn(self, params, tokens_1xT, length, sampling: SlotSampling,
                  first_index) -> Prefix:
    self._traces["prefill"] += 1
    T = tokens_1xT.shape[1]
    positions_1xT = jnp.arange(T, dtype=jnp.int32)[None]
    segments_1xT = (positions_1xT < length).astype(jnp.int32)
    cache = transformer.init_cache(self.cfg, 1, T)
    logits_1xTxV, cache = transformer.forward(
        params, tokens_1xT, positions_1xT, segments_1xT, cfg=self.cfg,
        cache=cache, sharder=self.sharder)
    last_1xV = jax.lax.dynamic_index_in_dim(logits_1xTxV[0], length - 1,
                                            keepdims=True)
    batched = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], sampling)
    token_1, logprob_1 = self._replicated(
        sample_tokens(last_1xV, batched, first_index[None]))
    return Prefix(k=cache.k, v=cache.v, length=length, token=token_1[0],
                  logprob=logprob_1[0], index=first_index + 1,
                  sampling=sampling)

  def _insert_fn(self, prefix: Prefix, state: DecodeState, slot
                 ) -> DecodeState:
    self._traces["insert"] += 1
    start = (0, slot, 0, 0, 0)
    cache = transformer.KVCache(
        k=jax.lax.dynamic_update_slice(state.cache.k, prefix.k, start),
        v=jax.lax.dynamic_update_slice(state.cache.v, prefix.v, start),
        lengths=state.cache.lengths.at[slot].set(prefix.length))
    sampling = SlotSampling(*[
        cur.at[slot].set(new) for cur, new in zip(state.sampling,
                                                  prefix.sampling)])
    return DecodeState(cache=cache,
                       tokens=state.tokens.at[slot].set(prefix.token),
                       index=state.index.at[slot].set(prefix.index),
                       active=state.active.at[slot].set(True),
                       sampling=sampling)

  def _prefill_batch_fn(self, params, tokens_NxT, lengths_N,
                        sampling_N: SlotSampling, first_N) -> Prefix:
    self._traces["prefill_batch"] += 1
    N, T = tokens_NxT.shape
    positions_NxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    segments_NxT = (positions_NxT < lengths_N[:, None]).astype(jnp.int32)
    cache = transformer.init_cache(self.cfg, N, T)
    logits_NxTxV, cache = transformer.forward(
        params, tokens_NxT, positions_NxT, segments_NxT, cfg=self.cfg,
        cache=cache, sharder=self.sharder)
    last_NxV = jnp.take_along_axis(
        logits_NxTxV, (lengths_N - 1)[:, None, None], axis=1)[:, 0]
    tokens_N, logprobs_N = self._replicated(
        sample_tokens(last_NxV, sampling_N, first_N))
    return Prefix(k=cache.k, v=cache.v, length=lengths_N, token=tokens_N,
                  logprob=logprobs_N, index=first_N + 1, sampling=sampling_N)

  def _insert_batch_fn(self, prefix: Prefix, state: DecodeState, slots_N
                       ) -> DecodeState:
    """Scatters row i into slot slots_N[i]; out-of-range slots (padding,
    skipped rows) are dropped. The prefix covers cache entries [0, bucket)."""
    self._traces["insert_batch"] += 1
    T = prefix.k.shape[2]

    def put(cur_B, new_N):
      return cur_B.at[slots_N].set(new_N, mode="drop")

    cache = transformer.KVCache(
        k=state.cache.k.at[:, slots_N, :T].set(prefix.k, mode="drop"),
        v=state.cache.v.at[:, slots_N, :T].set(prefix.v, mode="drop"),
        lengths=put(state.cache.lengths, prefix.length))
    return DecodeState(
        cache=cache, tokens=put(state.tokens, prefix.token),
        index=put(state.index, prefix.index),
        active=put(state.active, jnp.ones_like(prefix.length, bool)),
        sampling=SlotSampling(*map(put, state.sampling, prefix.sampling)))

  def _step(self, params, state: DecodeState
            ) -> tuple[DecodeState, tuple[jax.Array, jax.Array]]:
    """One token for every slot; free slots compute but do not advance."""
    segments_Bx1 = state.active.astype(jnp.int32)[:, None]
    positions_Bx1 = state.cache.lengths[:, None]
    logits_Bx1xV, cache = transformer.forward(
        params, state.tokens[:, None], positions_Bx1, segments_Bx1,
        cfg=self.cfg, cache=state.cache, sharder=self.sharder)
    tokens_B, logprobs_B = sample_tokens(logits_Bx1xV[:, 0], state.sampling,
                                         state.index)
    new = state._replace(
        cache=cache,
        tokens=jnp.where(state.active, tokens_B, state.tokens),
        index=state.index + state.active.astype(jnp.int32))
    return new, (tokens_B, logprobs_B)

  def _generate_fn(self, params, state: DecodeState, n_steps: int):
    self._traces["generate"] += 1
    state, (tokens_NxB, logprobs_NxB) = jax.lax.scan(
        lambda s, _: self._step(params, s), state, None, length=n_steps)
    if self._state_shardings is not None:
      state = jax.lax.with_sharding_constraint(state, self._state_shardings)
    tokens_NxB, logprobs_NxB = self._replicated((tokens_NxB, logprobs_NxB))
    return state, tokens_NxB, logprobs_NxB

  def _replicated(self, tree):
    """What the host reads back is replicated, so every process (multi-host
    runs) can read all of it."""
    if self.sharder is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, self.sharder.replicated())

  def _free_fn(self, state: DecodeState, slot) -> DecodeState:
    self._traces["free_resource"] += 1
    return state._replace(
        cache=state.cache._replace(
            lengths=state.cache.lengths.at[slot].set(0)),
        active=state.active.at[slot].set(False))

  def _free_slots_fn(self, state: DecodeState, mask_B) -> DecodeState:
    self._traces["free_slots"] += 1
    return state._replace(
        cache=state.cache._replace(
            lengths=jnp.where(mask_B, 0, state.cache.lengths)),
        active=state.active & ~mask_B)
