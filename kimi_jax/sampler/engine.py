"""The decode engine: JetStream's Engine contract over the policy's KV cache.

  init_decode_state()                  -> DecodeState (all slots free)
  prefill(params, tokens, sampling, i) -> Prefix (prompt cache + first token)
  insert(prefix, state, slot)          -> DecodeState (prefix now in `slot`)
  generate(params, state, n_steps)     -> (DecodeState, tokens_NxB, logp_NxB)
  free_resource(state, slot)           -> DecodeState (slot free again)
  max_concurrent_decodes               -> number of slots B

The work is done by their batched forms, which the driver uses to cut the
per-request host cost (one jitted call and one host read per batch instead
of per request); the single-request methods are those with one row:

  prefill_batch(params, seqs, samplings, first_indices) -> Prefix (leading N)
  insert_batch(prefix, state, slots)   -> DecodeState (row i now in slots[i])
  free_slots(state, mask_B)            -> DecodeState (masked slots free)
  set_sampling(state, slots, samplings) -> DecodeState (new settings for
                                          sequences already in `slots`)

Every call is one jitted function. The decode state is donated, so the cache
is updated in place.

Routing replay (`EngineConfig.record_experts`, an MoE model): a prefill also
returns the experts each of its tokens went to (`Prefix.experts`) and
`traced_generate` the experts of each decode step's input token, so the
trainer can route every token as the sampler did (kimi_jax/model/moe.py).

The cache of the full-attention layers is either rows (every slot owns
`cache_len` entries) or pages (`EngineConfig.page_size` > 0: one pool of
`kv_pages` pages shared by the slots, taken when a slot needs them and
given back when it is freed; see `kimi_jax.sampler.pages`). Either way a
decode step reads, per slot, only up to a bound the host picks per
`generate` call from the longest live slot (the next of a few view
lengths), so its cost follows the live tokens, not the reserved length
(`kimi_jax.model.decode`). The engine keeps, on the host, each slot's cache
length and its pages: one decode state per engine is live at a time
(`init_decode_state` starts a fresh one). On a mesh (`sharder`), slots are split over the batch
mesh axes (data, fsdp) and key/value heads over `tensor`, exactly as the
trainer shards activations; params keep the trainer's shardings.

Compilations are bounded: a prefill pads its prompts to the smallest of a
few length buckets and its batch to the smallest of a few batch buckets, so
prefill_batch and insert_batch compile at most once per (length bucket, batch
bucket) pair used; generate once per distinct (`n_steps`, view length) pair; init and
free_slots once. `compile_count()` reports the traces so far (each trace
is one compilation); `warm_up_admission` compiles every batched pair ahead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.infra.dtypes import check_matmul_dtype
from kimi_jax.model import decode, moe, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.pages import HostBook, PageTable, PoolExhausted
from kimi_jax.sampler.repetition import repeating_on_device
from kimi_jax.sampler.sampling import (SamplingParams, SlotSampling,
                                       empty_slot_sampling, sample_tokens,
                                       stacked_slot_sampling)
from kimi_jax.sharding import Sharder, abstract_arrays, tree_bytes_per_device
from kimi_jax.token_rows import image_slots, put_images
from kimi_jax.vision.merge import RowImages

Params = dict[str, Any]
# Stop tokens per slot the device checks to end a `generate` call early; the
# driver checks all of a request's stop tokens on the host either way.
DEVICE_STOP_TOKENS = 8


class FinishWatch(NamedTuple):
  """Ends a `generate` call at the first step where a slot finishes.

  While requests wait for a slot inside a rollout window, they must start at
  the step a slot frees up (their budget is what is left of the window);
  without a watch the driver must decode one step per call. With one, a
  call of many steps ends right after the first step (within the first
  `steps` ones) at which a running slot stops: its stop token, its steps
  left, or the repeat rule of `repetition.repeating` (checked on device
  over the tails given here). The host then finds the same finish at the
  same step.

  steps: finishes after more steps than this do not end the call (no
    request could start then). tail_BxW: the last W = ngram * times tokens
    of each slot's response as the host holds it (-1 where shorter);
    length_B: those response lengths; first_B: slots whose current token
    (sampled by their prefill) the host has not appended yet. ngram, times:
    the repeat rule (ngram 0: no repeat check).
  """

  steps: int
  tail_BxW: np.ndarray
  length_B: np.ndarray
  first_B: np.ndarray
  ngram: int
  times: int

  @classmethod
  def off(cls, B: int, ngram: int = 0, times: int = 0) -> "FinishWatch":
    """A watch that never ends a call, shaped for this repeat rule (so a
    call with it and one with a real watch share one compiled program)."""
    return cls(0, np.zeros((B, ngram * times), np.int32),
               np.zeros((B,), np.int32), np.zeros((B,), bool), ngram, times)


ATTENTION_KERNELS = ("xla", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """max_slots: concurrent sequences B. cache_len: tokens a slot holds (prompt
  plus response). prefill_buckets: padded prompt lengths (default: powers of
  two from 16 up to cache_len, plus cache_len). prefill_batch_buckets: padded
  batch sizes of a batched prefill (default: powers of two from 1 up to
  max_slots, plus max_slots); the largest caps a batch, and with it the
  prefill's activations (batch x length bucket).

  page_size: 0 keeps each slot's full-attention cache as a row of
  cache_len entries; > 0 keeps one pool of `kv_pages` pages of page_size
  entries (default kv_pages: enough for every slot at cache_len; fewer
  bound the concurrent sequences by live tokens instead, and the sampler
  preempts a sequence when they run out). min_view: the shortest cache
  view a decode step reads (views are min_view x 2^i, capped at
  cache_len); each view length used compiles `generate` once.

  attention_kernel: how a decode step attends over pages. "xla" gathers
  each slot's pages in view and attends with XLA ops (any backend;
  bit-identical to rows). "pallas_tpu" runs Pallas's TPU paged attention
  kernel, which copies only the pages up to each slot's length into VMEM
  and keeps the pool in the kernel's layout (see `decode.py`); off a TPU
  it runs in Pallas's TPU interpreter, which is for tests only (slow).
  It multiplies the query by the score scale in the compute dtype and
  the TPU rounds the kernel's float32 matmuls through bfloat16, so its
  log-probs differ from "xla"'s in the last bits.

  matmul_dtype: the dtype the engine's weight matmuls round their inputs
  to, accumulating in the model's compute dtype (`model.matmul_dtype`);
  "": the model's own. "bfloat16" under a float32 model is how a TPU runs
  float32 matmuls at default precision, and on CPUs with bfloat16 matrix
  units (AMX, AVX512-BF16) a decode step several times cheaper in its
  matmuls; the sampled log-probs then differ from the trainer's (the
  `logprob_gap_*` metrics; `rl.tis_cap` corrects for it)."""

  max_slots: int
  cache_len: int
  prefill_buckets: tuple[int, ...] | None = None
  prefill_batch_buckets: tuple[int, ...] | None = None
  page_size: int = 0
  kv_pages: int | None = None
  min_view: int = 64
  attention_kernel: str = "xla"
  # Routing replay: record each token's experts (MoE models only).
  record_experts: bool = False
  matmul_dtype: str = ""

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
    if self.page_size < 0:
      raise ValueError(f"sampler.page_size must be >= 0 (0: rows), got "
                       f"{self.page_size}")
    if self.kv_pages is not None and (not self.page_size or
                                      self.kv_pages < self.pages_per_slot):
      raise ValueError(f"sampler.kv_pages needs sampler.page_size > 0 and at "
                       f"least one full slot ({self.pages_per_slot} pages), "
                       f"got kv_pages={self.kv_pages}, page_size="
                       f"{self.page_size}")
    if self.min_view < 1:
      raise ValueError(f"sampler.min_view must be >= 1, got {self.min_view}")
    if self.attention_kernel not in ATTENTION_KERNELS:
      raise ValueError(f"sampler.attention_kernel must be one of "
                       f"{ATTENTION_KERNELS}, got {self.attention_kernel!r}")
    check_matmul_dtype(self.matmul_dtype, "sampler.matmul_dtype")
    if self.attention_kernel != "xla" and not self.paged:
      raise ValueError(f"sampler.attention_kernel={self.attention_kernel!r} "
                       f"reads a paged cache: set sampler.page_size > 0")

  @property
  def paged(self) -> bool:
    return self.page_size > 0

  @property
  def pages_per_slot(self) -> int:
    """Pages that hold a full slot (cache_len entries)."""
    return -(-self.cache_len // max(self.page_size, 1))

  @property
  def n_pages(self) -> int:
    """The pool's pages (paged only)."""
    if self.kv_pages is not None:
      return self.kv_pages
    return self.max_slots * self.pages_per_slot

  @property
  def views(self) -> tuple[int, ...]:
    """The view lengths a decode step may read: entries per row, or (paged)
    pages per slot."""
    if self.paged:
      top, n = self.pages_per_slot, -(-self.min_view // self.page_size)
    else:
      top, n = self.cache_len, self.min_view
    out = []
    while n < top:
      out.append(n)
      n *= 2
    return tuple(out) + (top,)

  def view_for(self, n_entries: int) -> int:
    """The smallest view that covers n_entries entries of every slot."""
    unit = self.page_size if self.paged else 1
    for v in self.views:
      if v * unit >= n_entries:
        return v
    return self.views[-1]

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

  cache: the KV cache (`decode.DecodeCache`, rows or pages).
  lengths_B: tokens of each slot in the cache.
  tokens_B: the last sampled token of each slot (input of the next step).
  index_B: response index of the next token to sample (its key's fold-in).
  active_B: slots holding a live sequence.
  sampling: per-slot sampling settings.
  """

  cache: decode.DecodeCache
  lengths: jax.Array
  tokens: jax.Array
  index: jax.Array
  active: jax.Array
  sampling: SlotSampling
  host: HostBook | None = None


class Prefix(NamedTuple):
  """N prefilled sequences (N = a batch bucket, 1 for `prefill`), ready to
  insert into slots.

  k, v: cache entries, (L, N, bucket, K, Dh); entries past a row's `length`
  are padding. local_k, local_v: a sliding-window model's rings (see
  `transformer.KVCache`; None otherwise). token/logprob: each row's first
  sampled token and its log-prob. index: response index of the token after
  `token`. Every field but the caches has a leading N; rows past the real
  sequences are padding. host_length: the real lengths as the host knows
  them, host_ranked: whether each row's request draws by rank (numpy; not
  passed to the device). experts: with
  `EngineConfig.record_experts`, the experts every prefilled token went to
  in each MoE layer (N x bucket x Lm x K, `moe.expert_id_dtype`; entries
  past a row's length are padding); None otherwise.
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  token: jax.Array
  logprob: jax.Array
  index: jax.Array
  sampling: SlotSampling
  local_k: jax.Array | None = None
  local_v: jax.Array | None = None
  host_length: np.ndarray | None = None
  experts: jax.Array | None = None
  host_ranked: np.ndarray | None = None


def _with_matmul_dtype(cfg: ModelConfig, matmul_dtype: str) -> ModelConfig:
  """The model as the engine runs it: `sampler.matmul_dtype` where set."""
  if not matmul_dtype:
    return cfg
  check_matmul_dtype(matmul_dtype, "sampler.matmul_dtype", cfg.compute_dtype)
  return dataclasses.replace(cfg, matmul_dtype=matmul_dtype)


class Engine:
  """Prefill / insert / generate over the policy's KV-cache slots."""

  def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               sharder: Sharder | None = None):
    if engine_cfg.cache_len > cfg.max_seq_len:
      raise ValueError(f"sampler.cache_len {engine_cfg.cache_len} exceeds "
                       f"model.max_seq_len {cfg.max_seq_len}")
    if engine_cfg.record_experts and not cfg.n_experts:
      raise ValueError("routing replay (rl.routing_replay) records experts, "
                       "but the model is dense (model.n_experts is 0)")
    self.cfg = _with_matmul_dtype(cfg, engine_cfg.matmul_dtype)
    self.engine_cfg = engine_cfg
    self.sharder = sharder
    self._record = engine_cfg.record_experts
    self._id_dtype = (moe.expert_id_dtype(cfg.n_experts) if self._record
                      else None)
    # The TPU kernel's pool layout: keys and values both K x P x page x Dh.
    self._kernel_layout = engine_cfg.attention_kernel != "xla"
    if (self._kernel_layout and cfg.head_dim % 128 and
        decode.on_tpu(sharder)):
      raise ValueError(f"sampler.attention_kernel='pallas_tpu' needs "
                       f"model.head_dim a multiple of 128 (the TPU's lane "
                       f"width), got {cfg.head_dim}")
    # A vision model never samples its image placeholder (see sample_tokens).
    self._never = None if cfg.vision is None else cfg.vision.image_token_id
    self._decode_params_jit = jax.jit(lambda p: decode.to_decode_params(
        transformer.round_weights(p, self.cfg)))
    self._traces: collections.Counter[str] = collections.Counter()
    self._param_shardings = self._make_param_shardings()
    self._host_sharding = (
        jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if sharder is None else sharder.replicated())
    self._state_shardings = self._make_state_shardings()
    # A paged pool splits over the batch axes as the slots do.
    self._pool_shards = 1
    if engine_cfg.paged and sharder is not None:
      self._pool_shards = sharder.axis_size(sharder.rule_map.get("batch",
                                                                 ()))
    self._new_book()  # a pool that cannot split fails here, naming its key
    self._loop_axes = self._per_device_loop_axes()
    self._init_jit = jax.jit(self._init_fn,
                             out_shardings=self._state_shardings)
    self._generate_jit = jax.jit(self._generate_fn,
                                 static_argnums=(2, 3, 4, 5, 6),
                                 donate_argnums=(0,))
    self._prefill_batch_jit = jax.jit(self._prefill_batch_fn,
                                      static_argnames=("ranked",))
    self._insert_batch_jit = jax.jit(self._insert_batch_fn,
                                     donate_argnums=(0,),
                                     out_shardings=self._state_shardings)
    self._free_slots_jit = jax.jit(self._free_slots_fn, donate_argnums=(0,),
                                   out_shardings=self._state_shardings)
    self._set_sampling_jit = jax.jit(self._set_sampling_fn,
                                     donate_argnums=(0,),
                                     out_shardings=self._state_shardings)

  # ---- configuration -------------------------------------------------------

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine_cfg.max_slots

  @property
  def cache_len(self) -> int:
    return self.engine_cfg.cache_len

  @property
  def expert_record(self) -> tuple[int, int, Any] | None:
    """(Lm, K, id dtype) of the experts each token's record holds with
    `EngineConfig.record_experts`; None when the engine records none."""
    return moe.replay_record(self.cfg) if self._record else None

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

  def _per_device_loop_axes(self) -> tuple[str, ...]:
    """The mesh axes the slots split over when a generate call can step
    each device's slots in a loop of its own: every device holds whole
    weights and its own slots and pages (no other mesh axis has more than
    one device, and the pool is not in the TPU kernel's layout). A loop
    over all slots decides at every step, across the devices, whether to go
    on; per device, no step waits for another device. () otherwise."""
    s = self.sharder
    if s is None or self._kernel_layout:
      return ()
    axes = s.rule_map.get("batch", ())
    others = [n for a, n in s.mesh.shape.items() if a not in axes]
    if s.axis_size(axes) < 2 or any(n > 1 for n in others):
      return ()
    return axes

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
    # Rows: slots over the batch axes, kv heads over `tensor`. Pages: the
    # pool's pages over the batch axes too, each shard's slots taking pages
    # of its own part (see decode.py).
    first = "batch"

    def layers(name, xs, first, transposed=False):
      logical = (first, "kv_heads", "length", "head_dim")
      if transposed:
        logical = (first, "kv_heads", "head_dim", "length")
      if name in ("kt", "v") and self._kernel_layout:
        logical = ("kv_heads", first, "length", "head_dim")
      return [s.param_sharding(f"decode_state.cache.{name}[{i}]", x.shape,
                               logical) for i, x in enumerate(xs)]

    c = abstract.cache
    local = lambda name, xs, t=False: None if xs is None else layers(
        name, xs, "batch", t)
    cache = decode.DecodeCache(
        kt=layers("kt", c.kt, first, True), v=layers("v", c.v, first),
        local_kt=local("local_kt", c.local_kt, True),
        local_v=local("local_v", c.local_v))
    slot_sh = s.param_sharding("decode_state slots", (self.max_concurrent_decodes,),
                               ("batch",))
    return DecodeState(cache=cache, lengths=slot_sh, tokens=slot_sh,
                       index=slot_sh, active=slot_sh,
                       sampling=SlotSampling(*([slot_sh] * 5)))

  # ---- host bookkeeping ------------------------------------------------------

  def _new_book(self) -> HostBook:
    B, e = self.max_concurrent_decodes, self.engine_cfg
    return HostBook(B, PageTable(e.n_pages, e.page_size, B, e.pages_per_slot,
                                 self._pool_shards) if e.paged else None)

  @staticmethod
  def _book(state: DecodeState) -> HostBook:
    if state.host is None:
      raise ValueError("a decode state without its host record: use the "
                       "state the engine's last call returned")
    return state.host

  def _call(self, fn, state: DecodeState, *args):
    """A jitted call on a state: its host record stays out of the call and
    comes back on the state it returns (the first output)."""
    book = self._book(state)
    out = fn(state._replace(host=None), *args)
    if isinstance(out, DecodeState):
      return out._replace(host=book)
    return (out[0]._replace(host=book),) + tuple(out[1:])

  def host_lengths(self, state: DecodeState) -> np.ndarray:
    """Each slot's cache length, as the host knows it (a copy)."""
    return self._book(state).lengths.copy()

  def free_pages(self, state: DecodeState) -> int | None:
    """Free pages of the state's pool (None for rows)."""
    pages = self._book(state).pages
    return None if pages is None else pages.free_pages

  def pages_for_call(self, state: DecodeState, steps_left_B) -> np.ndarray:
    """Pages each pool shard's running slots must take before a generate
    call in which slot b takes at most steps_left_B[b] steps (one shard
    without a mesh; zeros for rows)."""
    book = self._book(state)
    if book.pages is None:
      return np.zeros((1,), np.int64)
    running_B, reach_B = book.reach(np.asarray(steps_left_B), self.cache_len)
    return book.pages.extra_per_shard(np.flatnonzero(running_B),
                                      reach_B[running_B])

  def pages_for_tokens(self, n_tokens: int) -> int:
    """Pages a sequence of n_tokens cache entries holds (0 for rows)."""
    e = self.engine_cfg
    return -(-n_tokens // e.page_size) if e.paged else 0

  # ---- weights -------------------------------------------------------------

  @property
  def param_shardings(self) -> Params:
    """Where the engine's functions expect params; hand them over with
    `handoff.place_params(params, engine.param_shardings)`."""
    return self._param_shardings

  # ---- the contract --------------------------------------------------------

  def init_decode_state(self) -> DecodeState:
    """A fresh decode state (every slot free); the host bookkeeping of any
    earlier one is dropped."""
    return self._init_jit()._replace(host=self._new_book())

  def prefill(self, params: Params, tokens: Sequence[int],
              sampling: SamplingParams, first_index: int = 0,
              images: np.ndarray | None = None) -> Prefix:
    """Runs the prompt (plus any continued prefix) and samples one token:
    `prefill_batch` of one sequence (a prefix of one row).

    first_index: response index of the token sampled here (the length of the
    continued prefix), so its key is the same as in an uninterrupted run.
    images: a vision model's prompt images (n x H x W x C pixels, in the
    order of their placeholder runs).
    """
    if images is None:
      return self.prefill_batch(params, [tokens], [sampling], [first_index])
    return self.prefill_batch(params, [tokens], [sampling], [first_index],
                              images=[images])

  def insert(self, prefix: Prefix, state: DecodeState, slot: int
             ) -> DecodeState:
    """Row 0 of `prefix` into `slot`: `insert_batch` of one slot."""
    return self.insert_batch(prefix, state, [slot])

  def decode_params(self, params: Params) -> decode.DecodeParams:
    """Params split per layer for `generate` (a copy of the layer weights).
    Pass the result to every `generate` call of a rollout; given the
    stacked params, `generate` splits them on each call."""
    return self._decode_params_jit(params)

  def generate(self, params: Params | decode.DecodeParams,
               state: DecodeState, n_steps: int = 1, *, steps_left=None,
               stop_tokens=None, watch: FinishWatch | None = None
               ) -> tuple[DecodeState, jax.Array, jax.Array]:
    """`traced_generate` without the experts."""
    return self.traced_generate(params, state, n_steps,
                                steps_left=steps_left,
                                stop_tokens=stop_tokens, watch=watch)[:3]

  def traced_generate(self, params: Params | decode.DecodeParams,
                      state: DecodeState, n_steps: int = 1, *,
                      steps_left=None, stop_tokens=None,
                      watch: FinishWatch | None = None
                      ) -> tuple[DecodeState, jax.Array, jax.Array,
                                 jax.Array | None]:
    """n_steps decode steps for every slot in one call.

    Returns tokens_NxB and logprobs_NxB; rows of free slots are meaningless.
    Without the keywords every active slot advances n_steps tokens and the
    caller discards what a slot produced after its stop. With them the
    device stops a slot early: steps_left[b] is how many more tokens slot b
    may produce (its length or budget limit), stop_tokens[b] up to
    `DEVICE_STOP_TOKENS` of its stop tokens (-1: none); a stopped slot no
    longer advances (its later entries are 0), and a slot whose current
    token is one of its stop tokens does not run at all. The call ends once no slot
    runs, or with `watch` after the first step at which a slot finishes (see
    `FinishWatch`); the tokens of steps it did not run are -1. The host
    still applies every finish rule itself.

    Also returns, with `EngineConfig.record_experts`, experts_NxBxLxK: at
    step n, the experts of slot b's input token (the token sampled before
    tokens_NxB[n, b]) in each MoE layer; None otherwise.
    """
    if n_steps < 1:
      raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if not isinstance(params, decode.DecodeParams):
      params = self.decode_params(params)
    B = self.max_concurrent_decodes
    left_B = np.full((B,), n_steps, np.int32)
    if steps_left is not None:
      left_B[:] = np.minimum(np.asarray(steps_left), n_steps)
    stop_BxW = np.full((B, DEVICE_STOP_TOKENS), -1, np.int32)
    if stop_tokens is not None:
      stop = np.asarray(stop_tokens, np.int32)[:, :DEVICE_STOP_TOKENS]
      stop_BxW[:, :stop.shape[1]] = stop
    if watch is None:
      watch = FinishWatch.off(B)
    W = watch.ngram * watch.times
    if watch.tail_BxW.shape != (B, W):
      raise ValueError(f"watch.tail_BxW must be {B} x {W} (slots x ngram * "
                       f"times), got {watch.tail_BxW.shape}")
    book = self._book(state)
    view, pages_BxV = self._view_for_call(book, left_B)
    state, tokens_NxB, logprobs_NxB, experts, lengths_B = self._call(
        self._generate_jit, state, params, int(n_steps),
        (watch.ngram, watch.times), view, book.any_ranked(),
        bool(self._loop_axes) and watch.steps == 0,
        *self._put_slots((left_B, stop_BxW,
                          np.asarray(watch.tail_BxW, np.int32),
                          np.asarray(watch.length_B, np.int32),
                          np.asarray(watch.first_B, bool)) + pages_BxV),
        jax.device_put(np.int32(watch.steps), self._host_sharding))
    book.after_generate(lengths_B)
    return state, tokens_NxB, logprobs_NxB, experts

  def _view_for_call(self, book: HostBook, left_B: np.ndarray
                     ) -> tuple[int, tuple[np.ndarray, ...]]:
    """The view of a generate call whose slots take at most left_B steps:
    the smallest that covers every position a slot writes or reads during
    it, and (paged) the pages of those positions, taken from the pool."""
    running_B, reach_B = book.reach(left_B, self.cache_len)
    view = self.engine_cfg.view_for(int(reach_B.max(initial=1)))
    if book.pages is None:
      return view, ()
    for b in np.flatnonzero(running_B):
      book.pages.grow(int(b), int(reach_B[b]))
    return view, (book.pages.table[:, :view].copy(),)

  def _slot_sharding(self, ndim: int) -> jax.sharding.Sharding:
    """How an array with a leading slot axis (and ndim - 1 more) lies: as
    the slots of the decode state."""
    sharding = self._state_shardings.active
    if isinstance(sharding, jax.sharding.NamedSharding) and ndim > 1:
      sharding = jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(
              *sharding.spec, *([None] * (ndim - 1))))
    return sharding

  def _put_slots(self, xs: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
    """Host arrays with a leading slot axis, placed as the slots lie (one
    transfer for all)."""
    return jax.device_put(xs, tuple(self._slot_sharding(x.ndim) for x in xs))

  def free_resource(self, state: DecodeState, slot: int) -> DecodeState:
    """`free_slots` of one slot."""
    self._check_slot(slot)
    return self.free_slots(state, np.arange(self.max_concurrent_decodes) ==
                           slot)

  # ---- batched forms ------------------------------------------------------

  def prefill_batch(self, params: Params, token_seqs: Sequence[Sequence[int]],
                    samplings: Sequence[SamplingParams],
                    first_indices: Sequence[int],
                    images: Sequence[np.ndarray | None] | None = None
                    ) -> Prefix:
    """`prefill` of N sequences in one call; row i of the result is what
    `prefill(params, token_seqs[i], samplings[i], first_indices[i])` gives
    (up to float rounding of the logits).

    Tokens pad to the bucket of the longest sequence, N to a batch bucket:
    group sequences of similar length so short ones are not padded far.
    images: per sequence, its images (n_i x H x W x C) or None. A vision
    model's prefill always takes `vision.max_images` slots per row (empty
    ones masked), so image and text prompts share one compilation; the
    image embeddings are computed here, once per request, and live on in
    the KV cache.
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
    ranked_N = np.zeros((N,), bool)
    ranked_N[:n] = [p.draws_by_rank for p in samplings]
    prefix = self._prefill_batch_jit(params, *self._put((
        tokens_NxT, lengths_N, stacked_slot_sampling(samplings, N), first_N,
        self._row_images(images, n, N))), ranked=bool(ranked_N.any()))
    return prefix._replace(host_length=lengths_N, host_ranked=ranked_N)

  def _row_images(self, images: Sequence[np.ndarray | None] | None, n: int,
                  N: int) -> RowImages | None:
    """Host `RowImages` of N prefill rows (None for a text-only model)."""
    given = [] if images is None else list(images)
    if given and len(given) != n:
      raise ValueError(f"prefill_batch: {n} sequences, {len(given)} image "
                       f"lists")
    slots = image_slots(self.cfg.vision)
    if slots is None:
      if any(x is not None and len(x) for x in given):
        raise ValueError("prefill_batch: images for a model without "
                         "model.vision")
      return None
    rows = slots.empty(N)
    for i, x in enumerate(given):
      if x is None or not len(x):
        continue
      x = np.asarray(x, np.float32)
      if len(x) > slots.slots or x.shape[1:] != tuple(slots.like):
        raise ValueError(f"prefill_batch: sequence {i}: images of shape "
                         f"{x.shape}, expected at most {slots.slots} x "
                         f"{slots.like}")
      put_images(rows, i, 0, x)
    return rows

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
    host_N = (np.asarray(prefix.length) if prefix.host_length is None else
              prefix.host_length)
    book = self._book(state)
    pages = ()
    if book.pages is not None:
      pages = (self._insert_pages(book.pages, slots, host_N,
                                  prefix.k.shape[2]),)
    ranked_N = (np.ones((N,), bool) if prefix.host_ranked is None else
                prefix.host_ranked)
    for i, slot in enumerate(slots):
      if slot is not None:
        book.set(slot, int(host_N[i]), bool(ranked_N[i]))
    return self._call(self._insert_batch_jit, state,
                      prefix._replace(host_length=None, experts=None,
                                      host_ranked=None),
                      *self._put((slots_N,) + pages))

  @staticmethod
  def _insert_pages(table: PageTable, slots: Sequence[int | None],
                    host_N: np.ndarray, T: int) -> np.ndarray:
    """Pages for each inserted row's real entries (pool size P where a row
    has none: padding, skipped rows, entries past its length), N x ceil(T /
    page). Raises PoolExhausted, taking nothing, when the pool is short."""
    real = [(i, s) for i, s in enumerate(slots) if s is not None]
    for _, s in real:
      table.release(s)
    idx = np.asarray([s for _, s in real], np.int64)
    lengths = np.asarray([host_N[i] for i, _ in real], np.int64)
    if table.shortfall(idx, lengths):
      raise PoolExhausted(
          f"insert of {len(real)} sequences needs "
          f"{int(table.pages_for(lengths).sum())} KV pages, "
          f"{table.free_pages} of {table.n_pages} are free (sampler.kv_pages)")
    n_pages = -(-T // table.page_size)
    # Global page ids: the insert scatters into the whole (sharded) pool.
    pages_NxM = np.full((len(host_N), n_pages), table.n_pages, np.int32)
    for (i, s), n in zip(real, lengths):
      table.grow(s, int(n))
      held = int(table.held[s])
      pages_NxM[i, :held] = (table.table[s, :held] +
                             table.shard_of[s] * table.local_pages)
    return pages_NxM

  def free_slots(self, state: DecodeState, mask_B) -> DecodeState:
    """Frees every slot whose mask entry is true, in one call."""
    mask_B = np.asarray(mask_B, bool)
    if mask_B.shape != (self.max_concurrent_decodes,):
      raise ValueError(f"free_slots: mask of shape {mask_B.shape}, want "
                       f"({self.max_concurrent_decodes},)")
    self._book(state).clear(mask_B)
    return self._call(self._free_slots_jit, state, self._put(mask_B))

  def set_sampling(self, state: DecodeState, slots: Sequence[int],
                   samplings: Sequence[SamplingParams]) -> DecodeState:
    """Gives the sequences in `slots` new sampling settings (a request
    continued in the slot it was cut in: its cache, length, last token and
    token index stay), in one call."""
    B = self.max_concurrent_decodes
    if len(slots) != len(samplings):
      raise ValueError(f"set_sampling: {len(slots)} slots, "
                       f"{len(samplings)} sampling settings")
    book = self._book(state)
    for s in slots:
      self._check_slot(s)
      if not book.active[s]:
        raise ValueError(f"set_sampling: slot {s} holds no sequence")
    slots_B = np.full((B,), B, np.int32)  # B: out of range, dropped
    slots_B[:len(slots)] = slots
    for s, p in zip(slots, samplings):
      book.ranked[s] = p.draws_by_rank
    return self._call(self._set_sampling_jit, state, *self._put(
        (slots_B, stacked_slot_sampling(samplings, B))))

  def aot_functions(self, n_steps: int, repeat_rule: tuple[int, int] = (0, 0)
                    ) -> dict[str, tuple[Any, tuple]]:
    """The engine's jitted functions at their largest shapes, with abstract
    sharded arguments, for ahead-of-time compilation (`kimi_jax.infra.aot`): the
    batched prefill at the largest length and batch bucket, and `generate`
    of `n_steps` decode steps over every slot of a full cache, with the
    driver's repeat rule (ngram, times; 0, 0 when it has none)."""
    params = abstract_arrays(transformer.abstract_params(self.cfg),
                             self._param_shardings)
    N, T = self.max_prefill_batch, self.max_prefill_len
    host = lambda shape, dtype: jax.ShapeDtypeStruct(
        shape, dtype, sharding=self._host_sharding)
    sampling = abstract_arrays(
        stacked_slot_sampling([SamplingParams()] * N, N), self._host_sharding)
    images = (None if self.cfg.vision is None else abstract_arrays(
        self._row_images(None, 0, N), self._host_sharding))
    prefill = (params, host((N, T), np.int32), host((N,), np.int32), sampling,
               host((N,), np.int32), images)
    # Decode params: each layer's leaves keep their sharding without the
    # leading (unsharded) layer axis.
    drop_layer_axis = lambda s: (jax.sharding.NamedSharding(
        s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])) if isinstance(
            s, jax.sharding.NamedSharding) else s)
    shardings = self._param_shardings
    decode_params = abstract_arrays(
        jax.eval_shape(decode.to_decode_params, params),
        decode.DecodeParams(
            top={k: v for k, v in shardings.items() if k != "layers"},
            layers=[jax.tree.map(drop_layer_axis, shardings["layers"])]
            * self.cfg.n_layers))
    state = abstract_arrays(jax.eval_shape(self._init_state),
                            self._state_shardings)
    B = self.max_concurrent_decodes
    slots = lambda *shape, dtype=np.int32: jax.ShapeDtypeStruct(
        (B,) + shape, dtype, sharding=self._slot_sharding(1 + len(shape)))
    ngram, times = repeat_rule
    view = self.engine_cfg.views[-1]  # every slot at full length
    pages = (slots(view),) if self.engine_cfg.paged else ()
    return {
        "sampler_prefill": (self._prefill_batch_jit, prefill),
        "sampler_generate": (self._generate_jit, (
            state, decode_params, int(n_steps), (ngram, times), view, True,
            bool(self._loop_axes), slots(), slots(DEVICE_STOP_TOKENS),
            slots(ngram * times), slots(), slots(dtype=np.bool_)) + pages + (
                host((), np.int32),)),
    }

  def kv_capacity(self, mean_live: Sequence[int]) -> dict[str, Any]:
    """The decode state's KV cache per device and the sequences it holds:
    rows always hold max_slots; a pool holds its entries / L sequences of
    mean live length L (at most max_slots)."""
    e = self.engine_cfg
    per_device = tree_bytes_per_device(jax.eval_shape(self._init_state).cache,
                                       self._state_shardings.cache)
    entries = e.n_pages * e.page_size if e.paged else e.max_slots * e.cache_len
    fit = lambda n: e.max_slots if not e.paged else min(e.max_slots,
                                                       entries // n)
    return dict(layout="pages" if e.paged else "rows", slots=e.max_slots,
                cache_len=e.cache_len, page_size=e.page_size,
                entries_per_layer=entries, bytes_per_device=int(per_device),
                sequences_at_mean_live={str(n): fit(n) for n in mean_live})

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

  def _put(self, host_tree):
    """Host inputs of a call, placed explicitly (replicated: they are a few
    ints per slot or per prompt token)."""
    return jax.device_put(host_tree, self._host_sharding)

  def _check_slot(self, slot: int) -> None:
    if not 0 <= slot < self.max_concurrent_decodes:
      raise ValueError(f"slot {slot} outside [0, "
                       f"{self.max_concurrent_decodes})")

  # ---- traced functions ----------------------------------------------------

  def _init_state(self) -> DecodeState:
    B, e = self.max_concurrent_decodes, self.engine_cfg
    zeros_B = jnp.zeros((B,), jnp.int32)
    rows = decode.to_decode_cache(
        transformer.init_cache(self.cfg, B, self.cache_len))
    cache = rows
    if e.paged:
      n_full = len(rows.kt)
      dt, K, Dh = self.cfg.compute_jnp_dtype, self.cfg.n_kv_heads, \
          self.cfg.head_dim
      kt_shape, v_shape = ((e.n_pages, K, Dh, e.page_size),
                           (e.n_pages, K, e.page_size, Dh))
      if self._kernel_layout:
        kt_shape = v_shape = (K, e.n_pages, e.page_size, Dh)
      cache = rows._replace(kt=[jnp.zeros(kt_shape, dt)] * n_full,
                            v=[jnp.zeros(v_shape, dt)] * n_full)
    return DecodeState(cache=cache, lengths=zeros_B, tokens=zeros_B,
                       index=zeros_B, active=jnp.zeros((B,), bool),
                       sampling=empty_slot_sampling(B))

  def _init_fn(self) -> DecodeState:
    self._traces["init_decode_state"] += 1
    return self._init_state()

  def _prefill_batch_fn(self, params, tokens_NxT, lengths_N,
                        sampling_N: SlotSampling, first_N,
                        images: RowImages | None = None, *,
                        ranked: bool = True) -> Prefix:
    self._traces["prefill_batch"] += 1
    N, T = tokens_NxT.shape
    positions_NxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    segments_NxT = (positions_NxT < lengths_N[:, None]).astype(jnp.int32)
    cache = transformer.init_cache(self.cfg, N, T)
    x_NxTxD, cache, trace = transformer.traced_hidden_states(
        params, tokens_NxT, positions_NxT, segments_NxT, cfg=self.cfg,
        cache=cache, prefill=True, sharder=self.sharder, images=images)
    experts = None
    if self._record:
      experts = self._replicated(
          moe.experts_BxTxLxK(trace).astype(self._id_dtype))
    # Logits of each row's last real token only: never N x T x V.
    last_Nx1xD = jnp.take_along_axis(x_NxTxD, (lengths_N - 1)[:, None, None],
                                     axis=1)
    last_NxV = transformer.unembed(params, last_Nx1xD, cfg=self.cfg)[:, 0]
    tokens_N, logprobs_N = self._replicated(
        sample_tokens(last_NxV, sampling_N, first_N, self._never, ranked))
    return Prefix(k=cache.k, v=cache.v, length=lengths_N, token=tokens_N,
                  logprob=logprobs_N, index=first_N + 1, sampling=sampling_N,
                  local_k=cache.local_k, local_v=cache.local_v,
                  experts=experts)

  def _insert_batch_fn(self, state: DecodeState, prefix: Prefix, slots_N,
                       pages_NxM=None) -> DecodeState:
    """Scatters row i into slot slots_N[i] (paged: its entries into the
    pages of row i of pages_NxM); out-of-range slots and pages (padding,
    skipped rows) are dropped. The prefix covers cache entries [0, bucket)
    (ring entries [0, min(window, bucket)): positions below the bucket sit
    where the slot's ring keeps them)."""
    self._traces["insert_batch"] += 1

    def put(cur_B, new_N):
      return cur_B.at[slots_N].set(new_N, mode="drop")

    def put_rows(cur, new, axis):
      # cur: B x K x S x Dh (axis 2) or B x K x Dh x S (axis 3).
      idx = (slots_N, slice(None)) + (slice(None),) * (axis - 2) + (
          slice(0, new.shape[axis]),)
      return cur.at[idx].set(new.astype(cur.dtype), mode="drop")

    def put_pages(pool, new, axis):
      # new N x K x T x Dh (axis 2) or N x K x Dh x T (axis 3), cut into
      # N x M pages of the pool's page size.
      if self._kernel_layout:  # pool K x P x page x Dh, keys untransposed
        return put_kernel_pages(pool, new if axis == 2 else
                                jnp.swapaxes(new, 2, 3))
      page, M = pool.shape[axis], pages_NxM.shape[1]
      pad = [(0, 0)] * 4
      pad[axis] = (0, M * page - new.shape[axis])
      new = jnp.pad(new, pad)
      shape = new.shape[:axis] + (M, page) + new.shape[axis + 1:]
      paged = jnp.moveaxis(new.reshape(shape), axis, 1)  # N x M x K x ...
      return pool.at[pages_NxM].set(paged.astype(pool.dtype), mode="drop")

    def put_kernel_pages(pool_KxPxNxDh, new_NxKxTxDh):
      N, K, T, Dh = new_NxKxTxDh.shape
      page, M = pool_KxPxNxDh.shape[2], pages_NxM.shape[1]
      new = jnp.pad(new_NxKxTxDh, ((0, 0), (0, 0), (0, M * page - T), (0, 0)))
      paged_KxNxMxpagexDh = new.reshape(N, K, M, page, Dh).transpose(
          1, 0, 2, 3, 4)
      return pool_KxPxNxDh.at[:, pages_NxM].set(
          paged_KxNxMxpagexDh.astype(pool_KxPxNxDh.dtype), mode="drop")

    rows = decode.to_decode_cache(transformer.KVCache(
        k=prefix.k, v=prefix.v, lengths=prefix.length, local_k=prefix.local_k,
        local_v=prefix.local_v))
    full = put_rows if pages_NxM is None else put_pages
    c = state.cache
    cache = decode.DecodeCache(
        kt=[full(a, b, 3) for a, b in zip(c.kt, rows.kt)],
        v=[full(a, b, 2) for a, b in zip(c.v, rows.v)],
        local_kt=None if c.local_kt is None else [
            put_rows(a, b, 3) for a, b in zip(c.local_kt, rows.local_kt)],
        local_v=None if c.local_v is None else [
            put_rows(a, b, 2) for a, b in zip(c.local_v, rows.local_v)])
    return DecodeState(
        cache=cache, lengths=put(state.lengths, prefix.length),
        tokens=put(state.tokens, prefix.token),
        index=put(state.index, prefix.index),
        active=put(state.active, jnp.ones_like(prefix.length, bool)),
        sampling=SlotSampling(*map(put, state.sampling, prefix.sampling)))

  def _generate_fn(self, state: DecodeState,
                   params: decode.DecodeParams, n_steps: int,
                   repeat_rule: tuple[int, int], view: int, ranked: bool,
                   apart: bool, steps_left_B, stop_BxW, tail_BxW, length_B,
                   first_B, *rest):
    """Up to n_steps tokens for every running slot, in one while loop.

    A slot runs while it is active, has steps left and has not sampled one
    of its stop tokens; the loop ends after n_steps or when no slot runs,
    and with watch_steps > 0 also after the first step (among the first
    watch_steps) at which a running slot stops or completes a repeat
    (`FinishWatch`). ranked: whether an active slot draws by rank (else the
    sampling sort is left out, see `sample_tokens`). apart: each device
    steps its own slots in its own loop (`_per_device_loop_axes`; a call
    with a watch keeps one loop, so that the first finish anywhere ends
    it). Entries of slots not running are 0; rows past the end of their
    loop, -1. A step reads `view` entries of each row, or (paged, rest =
    (pages_BxV, watch_steps)) the `view` pages of pages_BxV; otherwise rest
    = (watch_steps,). Also returns the experts of each step's input tokens
    (n_steps x B x Lm x K; None unless recorded) and the cache lengths
    apart, for the host.
    """
    pages_BxV = rest[0] if len(rest) == 2 else None
    watch_steps = rest[-1]
    self._traces["generate"] += 1
    # Rows: the loop steps over the view alone (`decode.rows_prefix`).
    rows = (pages_BxV is None and bool(state.cache.v)
            and view < state.cache.v[0].shape[2])
    cache = decode.rows_prefix(state.cache, view) if rows else state.cache
    axes = self._loop_axes if apart else ()
    loop = functools.partial(
        self._decode_loop, n_steps=n_steps, repeat_rule=repeat_rule,
        view_len=None if pages_BxV is not None or rows else view,
        ranked=ranked, sharder=None if axes else self.sharder)
    args = (params, state._replace(cache=cache), steps_left_B, stop_BxW,
            tail_BxW, length_B, first_B, watch_steps, pages_BxV)
    if axes:  # each device steps its own slots, in its own loop
      P = jax.sharding.PartitionSpec
      slots, steps = P(axes), P(None, axes)
      loop = jax.shard_map(
          loop, mesh=self.sharder.mesh,
          in_specs=(P(),) + (slots,) * 6 + (P(), slots),
          out_specs=(slots, (steps,) * (3 if self._record else 2)),
          check_vma=False)
    full_cache, start_B = state.cache, state.lengths
    state, outputs = loop(*args)
    if rows:
      state = state._replace(cache=decode.with_rows_written(
          full_cache, state.cache, start_B, n_steps))
    if self._state_shardings is not None:
      state = jax.lax.with_sharding_constraint(state, self._state_shardings)
    tokens_NxB, logprobs_NxB, lengths_B = self._replicated(
        outputs[:2] + (state.lengths,))
    experts_NxBxLxK = (self._replicated(outputs[2]) if self._record
                       else None)
    return state, tokens_NxB, logprobs_NxB, experts_NxBxLxK, lengths_B

  def _decode_loop(self, params, state: DecodeState, steps_left_B, stop_BxW,
                   tail_BxW, length_B, first_B, watch_steps, pages_BxV, *,
                   n_steps: int, repeat_rule: tuple[int, int],
                   view_len: int | None, ranked: bool,
                   sharder: Sharder | None) -> tuple[DecodeState, tuple]:
    """`_generate_fn`'s while loop over the slots of `state` (all of them,
    or one device's: then sharder is None and page ids are the device's).
    Returns the state with the new cache, tokens, indices and lengths, and
    the outputs (tokens_NxB, logprobs_NxB[, experts_NxBxLxK])."""
    B = state.tokens.shape[0]
    ngram, times = repeat_rule
    # A slot whose last token is one of its stop tokens has finished (its
    # first token, when the driver inserted it before reading it).
    running_B = (state.active & (steps_left_B > 0) &
                 ~jnp.any(stop_BxW == state.tokens[:, None], axis=1))
    # An active slot that does not run finished at its first token: the host
    # frees it after this call's first step.
    finished = jnp.any(state.active & ~running_B)
    # The host's tails lack the first token of a slot it has not read yet.
    tail_BxW, length_B = self._with_token(tail_BxW, length_B, state.tokens,
                                          first_B)
    outputs = (jnp.full((n_steps, B), -1, jnp.int32),
               jnp.zeros((n_steps, B), jnp.float32))
    if self._record:
      Lm, K = len(self.cfg.moe_layers), self.cfg.n_experts_per_token
      outputs += (jnp.zeros((n_steps, B, Lm, K), self._id_dtype),)

    def go_on(carry):
      i, running_B, finished = carry[0], carry[4], carry[8]
      watched_end = (watch_steps > 0) & finished & (i > 0)
      return (i < n_steps) & jnp.any(running_B) & ~watched_end

    def step(carry):
      (i, tokens_B, index_B, lengths_B, running_B, left_B, cache,
       outputs, finished, tail_BxW, length_B) = carry
      tokens_NxB, logprobs_NxB = outputs[:2]
      logits_Bx1xV, cache, experts_BxLxK = decode.traced_decode_step(
          params, tokens_B, lengths_B, cache, cfg=self.cfg, sharder=sharder,
          view_len=view_len, pages_BxV=pages_BxV,
          kernel=self.engine_cfg.attention_kernel)
      new_B, logprobs_B = sample_tokens(logits_Bx1xV[:, 0], state.sampling,
                                        index_B, self._never, ranked)
      run_B = running_B.astype(jnp.int32)
      stopped_B = jnp.any(stop_BxW == new_B[:, None], axis=1)
      left_B = left_B - run_B
      new_outputs = (
          jax.lax.dynamic_update_index_in_dim(
              tokens_NxB, jnp.where(running_B, new_B, 0), i, 0),
          jax.lax.dynamic_update_index_in_dim(
              logprobs_NxB, jnp.where(running_B, logprobs_B, 0.0), i, 0))
      if self._record:
        new_outputs += (jax.lax.dynamic_update_index_in_dim(
            outputs[2], experts_BxLxK.astype(self._id_dtype), i, 0),)
      outputs = new_outputs
      still_B = running_B & (left_B > 0) & ~stopped_B
      tail_BxW, length_B = self._with_token(tail_BxW, length_B, new_B,
                                            running_B)
      ended_B = running_B & ~still_B
      if ngram:
        ended_B |= running_B & repeating_on_device(tail_BxW, length_B,
                                                   ngram, times)
      finished |= jnp.any(ended_B) & (i < watch_steps)
      return (i + 1, jnp.where(running_B, new_B, tokens_B), index_B + run_B,
              lengths_B + run_B, still_B, left_B, cache, outputs, finished,
              tail_BxW, length_B)

    carry = (jnp.int32(0), state.tokens, state.index, state.lengths,
             running_B, steps_left_B, state.cache, outputs, finished,
             tail_BxW, length_B)
    (_, tokens_B, index_B, lengths_B, _, _, cache,
     outputs, *_) = jax.lax.while_loop(go_on, step, carry)
    return state._replace(cache=cache, tokens=tokens_B, index=index_B,
                          lengths=lengths_B), outputs

  @staticmethod
  def _with_token(tail_BxW, length_B, token_B, where_B):
    """Tails (and lengths) with token_B appended where where_B holds."""
    length_B = length_B + where_B.astype(length_B.dtype)
    if tail_BxW.shape[1] == 0:  # no repeat rule: no tails to keep
      return tail_BxW, length_B
    shifted = jnp.concatenate([tail_BxW[:, 1:], token_B[:, None]], axis=1)
    return jnp.where(where_B[:, None], shifted, tail_BxW), length_B

  def _replicated(self, tree):
    """What the host reads back is replicated, so every process (multi-host
    runs) can read all of it."""
    if self.sharder is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, self.sharder.replicated())

  def _set_sampling_fn(self, state: DecodeState, slots_B,
                       sampling_B: SlotSampling) -> DecodeState:
    self._traces["set_sampling"] += 1
    put = lambda cur, new: cur.at[slots_B].set(new, mode="drop")
    return state._replace(sampling=jax.tree_util.tree_map(
        put, state.sampling, sampling_B))

  def _free_slots_fn(self, state: DecodeState, mask_B) -> DecodeState:
    self._traces["free_slots"] += 1
    return state._replace(lengths=jnp.where(mask_B, 0, state.lengths),
                          active=state.active & ~mask_B)
