"""Continuous batching: a host loop that keeps every engine slot busy.

Requests are validated up front: if any is bad, `SampleRequestError` lists
every bad (request id, field) and nothing runs; the good requests are left
untouched, to be resubmitted without the bad ones.

Lengths, for a request with prefix P (already generated earlier) that now
generates the tokens G:
  - the response is P + G; `max_new_tokens` bounds len(P + G)  -> "length";
  - `budget` bounds len(G), the tokens generated in this call  -> "budget"
    (a partial rollout: continue it later with `continuation`);
  - a stop token ends the response and is kept as its last token -> "stop";
  - a loop caught by the repeat detector on P + G              -> "repeat".
When several hold at the same token the first in the list above wins, with
"repeat" before "budget" (a looping response is not worth continuing).

`SampleResult.tokens` are G only; `logprobs` are log pi_theta of each token
of G under the untempered model (see `sampling`). An engine that records
experts (routing replay) also gives `SampleResult.experts`: the experts
every model input of prompt + P + G (all but the last token) went to, each
as the last forward pass that read it routed it: a prefill for the prompt
and P, a decode step for each token of G.

With a paged engine whose pool holds fewer pages than every slot at full
length (`EngineConfig.kv_pages`), a request is admitted only while the pool
has pages for its prompt and its first decode call, and when the running
requests outgrow the pool the most recently admitted one is preempted: its
slot and pages are freed and it goes back to the front of the queue with
what it generated as a continued prefix (its sampling keys are per token
index, so it resumes where it stopped). Its result joins both parts.

`generate(..., keep_cut_kv=True)` keeps the slots of requests the budget
cut (once no other request can start in that call) with their caches, so
that the next `generate` call continues each of them in place when it is
given the request's `continuation` (same id, prompt, and prefix ending with
the cut tokens): no prefill, only the new sampling settings. The next call
frees every kept slot no request of it continues. If the weights changed in
between (a partial rollout across an RL update), the kept keys and values
are those of the earlier weights, so the continued tokens' log-probs are
not what a prefill under the new weights would give; the option is off by
default.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Hashable, NamedTuple, Sequence

import jax
import numpy as np

from kimi_jax.sampler import repetition
from kimi_jax.sampler.engine import (DEVICE_STOP_TOKENS, DecodeState, Engine,
                                     FinishWatch, Prefix)
from kimi_jax.sampler.repetition import RepeatConfig, repeating, tails
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.vision import merge

FINISH_REASONS = ("stop", "length", "repeat", "budget")
_STOP, _LENGTH, _REPEAT, _BUDGET = 1, 2, 3, 4  # 0: still running


@dataclasses.dataclass(frozen=True)
class SampleRequest:
  """One response to generate (or to continue, when `prefix` is given)."""

  id: Hashable
  prompt: tuple[int, ...]
  _: dataclasses.KW_ONLY
  max_new_tokens: int
  prefix: tuple[int, ...] = ()
  sampling: SamplingParams = SamplingParams()
  stop_tokens: tuple[int, ...] = ()
  budget: int | None = None
  # A vision model's prompt images, n x H x W x C pixels in the order of the
  # prompt's placeholder runs; prefilled again with the prompt when a
  # partial rollout is continued.
  images: Any = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    # Lists are accepted for convenience; stored as tuples (hashable, frozen).
    for field in ("prompt", "prefix", "stop_tokens"):
      object.__setattr__(self, field, tuple(getattr(self, field)))


@dataclasses.dataclass(frozen=True)
class SampleResult:
  """tokens/logprobs: generated in this call; finish_reason in
  FINISH_REASONS."""

  id: Hashable
  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]
  finish_reason: str
  # Routing replay: (len(prompt + prefix + tokens) - 1) x Lm x K expert
  # ids (see the module doc); None when the engine records none.
  experts: np.ndarray | None = dataclasses.field(default=None,
                                                 compare=False)


def continuation(request: SampleRequest, result: SampleResult,
                 budget: int | None = None) -> SampleRequest:
  """The request that continues a budget-stopped result (new budget)."""
  if result.finish_reason != "budget":
    raise ValueError(f"request {request.id!r}: only a 'budget' result can be "
                     f"continued, this one finished with "
                     f"{result.finish_reason!r}")
  return dataclasses.replace(request, prefix=request.prefix + result.tokens,
                             budget=budget)


class SampleRequestError(ValueError):
  """Bad requests; `problems` holds (request id, field, message) triples."""

  def __init__(self, problems: Sequence[tuple[Hashable, str, str]]):
    self.problems = tuple(problems)
    lines = [f"  request {rid!r}: {field}: {msg}"
             for rid, field, msg in self.problems]
    super().__init__(f"{len({p[0] for p in self.problems})} invalid sample "
                     f"request(s), nothing was run:\n" + "\n".join(lines))


def request_problems(req: SampleRequest, engine: Engine
                     ) -> list[tuple[str, str]]:
  """(field, message) for everything wrong with one request."""
  out: list[tuple[str, str]] = []
  vocab = engine.cfg.vocab_size
  for field in ("prompt", "prefix", "stop_tokens"):
    ids = getattr(req, field)
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < vocab
           for t in ids):
      out.append((field, f"token ids must be integers in [0, {vocab})"))
  if len(req.prompt) == 0:
    out.append(("prompt", "is empty"))
  n_in = len(req.prompt) + len(req.prefix)
  if n_in > engine.max_prefill_len:
    out.append(("prompt", f"prompt + prefix is {n_in} tokens, longer than "
                          f"the largest prefill bucket "
                          f"{engine.max_prefill_len} (cache {engine.cache_len})"))
  m = req.max_new_tokens
  if not isinstance(m, (int, np.integer)) or m < 1:
    out.append(("max_new_tokens", f"must be an integer >= 1, got {m!r}"))
  else:
    if len(req.prefix) >= m:
      out.append(("prefix", f"already {len(req.prefix)} tokens, nothing left "
                            f"under max_new_tokens={m}"))
    if len(req.prompt) + m > engine.cache_len:
      out.append(("max_new_tokens", f"prompt ({len(req.prompt)}) + "
                                    f"max_new_tokens ({m}) exceed the cache "
                                    f"length {engine.cache_len}"))
  b = req.budget
  if b is not None:
    if not isinstance(b, (int, np.integer)) or b < 1:
      out.append(("budget", f"must be None or an integer >= 1, got {b!r}"))
    elif isinstance(m, (int, np.integer)) and b > m:
      out.append(("budget", f"{b} is larger than max_new_tokens={m}"))
  out += [(f"sampling.{f}", msg) for f, msg in req.sampling.errors()]
  return out + image_problems(req, engine)


def image_problems(req: SampleRequest, engine: Engine
                   ) -> list[tuple[str, str]]:
  """(field, message) for a request's images that the model cannot take:
  no vision tower, wrong pixel shape or channels, more images than slots,
  or placeholders that do not match them."""
  v = engine.cfg.vision
  n = 0 if req.images is None else len(req.images)
  if v is None:
    return [("images", "the model has no vision tower (model.vision)")] if n \
        else []
  if n:
    shape = tuple(np.shape(req.images)[1:])
    want = (v.image_size, v.image_size, v.channels)
    if shape != want:
      return [("images", f"pixels of shape {shape}, the model takes "
                         f"{want} (image_size x image_size x channels)")]
  try:
    merge.check_placeholders(req.prompt, n, v, "prompt")
  except ValueError as exc:
    return [("images", str(exc))]
  return []


@dataclasses.dataclass(frozen=True)
class SamplerStats:
  """Of one `generate` call. requests: those admitted (all of them unless a
  window closed first). slot_utilisation = kept decode tokens / (decode
  steps x slots). preemptions: requests a paged pool ran out for (see the
  module doc); peak_pages: most pool pages held at once (0 for rows)."""

  requests: int
  tokens_generated: int
  prefill_tokens: int
  decode_steps: int
  generate_calls: int
  slot_utilisation: float
  wall_seconds: float
  preemptions: int = 0
  peak_pages: int = 0
  resumed: int = 0  # requests continued in their kept slot (no prefill)

  @property
  def tokens_per_second(self) -> float:
    return self.tokens_generated / max(self.wall_seconds, 1e-9)


class _Slots:
  """Host bookkeeping of every slot, as numpy arrays."""

  def __init__(self, n_slots: int, width: int, n_stop: int,
               experts: tuple[int, int, Any] | None = None):
    self.request = np.full((n_slots,), -1, np.int64)  # -1: free
    self.response = np.zeros((n_slots, width), np.int64)  # prefix + new
    self.logprobs = np.zeros((n_slots, width), np.float32)
    self.n_prefix = np.zeros((n_slots,), np.int64)
    self.n_new = np.zeros((n_slots,), np.int64)
    self.stop = np.full((n_slots, n_stop), -1, np.int64)
    self.max_new = np.zeros((n_slots,), np.int64)
    self.budget = np.zeros((n_slots,), np.int64)
    # Slots whose first token (sampled by the prefill) is not read back yet.
    self.first_pending = np.zeros((n_slots,), bool)
    self.admitted_at = np.zeros((n_slots,), np.int64)  # admission order
    self._admissions = 0
    # Routing replay: the experts of each slot's model inputs, prompt
    # included (Lm x K per token; `width` bounds prompt + response).
    self.n_prompt = np.zeros((n_slots,), np.int64)
    self.experts = None
    if experts is not None:
      Lm, K, dtype = experts
      self.experts = np.zeros((n_slots, width, Lm, K), dtype)

  def admit(self, slot: int, index: int, req: SampleRequest,
            budget_cap: int | None = None) -> None:
    self.request[slot] = index
    self._admissions += 1
    self.admitted_at[slot] = self._admissions
    self.n_prefix[slot] = len(req.prefix)
    self.n_prompt[slot] = len(req.prompt)
    self.n_new[slot] = 0
    self.response[slot, :len(req.prefix)] = req.prefix
    self.stop[slot] = -1
    self.stop[slot, :len(req.stop_tokens)] = req.stop_tokens
    self.max_new[slot] = req.max_new_tokens
    self.budget[slot] = min(
        req.max_new_tokens if req.budget is None else req.budget,
        budget_cap or req.max_new_tokens)

  def set_prefill_experts(self, slots: np.ndarray,
                          experts_NxTxLxK: np.ndarray) -> None:
    """Row i of a prefill's experts for slots[i]'s prompt and prefix."""
    for i, slot in enumerate(slots):
      n = self.n_prompt[slot] + self.n_prefix[slot]
      self.experts[slot, :n] = experts_NxTxLxK[i, :n]

  def append_steps(self, slots_B: np.ndarray, tokens_NxB: np.ndarray,
                   logprobs_NxB: np.ndarray, repeat: RepeatConfig,
                   experts_NxBxLxK: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Adds N steps' tokens to each of `slots_B`, in order, up to the first
    that ends its request or the first -1 (past the end of the device's
    loop); returns (tokens taken, finish code, 0 if still running) per
    slot. All N steps are checked at once: a loop over the steps cost the
    host about half of what a small model's decode step costs a GPU.
    experts: each step's experts of the slot's input token (the token
    before the new one)."""
    N, B = tokens_NxB.shape
    if N == 0 or B == 0:
      return np.zeros((B,), np.int64), np.zeros((B,), np.int64)
    step_Nx1 = np.arange(N)[:, None]
    pos_NxB = self.n_prefix[slots_B] + self.n_new[slots_B] + step_Nx1
    # A slot's entries after the device stopped it are 0, and may run past
    # the row's end; they all come after a finish, which the length rule
    # makes sure happens within the row.
    valid_NxB = np.cumprod((tokens_NxB >= 0) &
                           (pos_NxB < self.response.shape[1]),
                           axis=0).astype(bool)
    rows_NxB = np.broadcast_to(slots_B, (N, B))
    # Every valid token is written, also past a finish: those entries lie
    # beyond the request's length and are never read.
    at = (rows_NxB[valid_NxB], pos_NxB[valid_NxB])
    self.response[at] = tokens_NxB[valid_NxB]
    self.logprobs[at] = logprobs_NxB[valid_NxB]
    total_NxB = pos_NxB + 1
    code_NxB = np.zeros((N, B), np.int64)
    if repeat.enabled:
      n_V, b_V = np.nonzero(valid_NxB)
      total_V = total_NxB[n_V, b_V]
      caught_V = repeating(
          tails(self.response, total_V, repeat.window, slots_B[b_V]),
          total_V, repeat)
      code_NxB[n_V, b_V] = np.where(caught_V, _REPEAT, 0)
    n_new_NxB = self.n_new[slots_B] + step_Nx1 + 1
    code_NxB = np.where((code_NxB == 0) & (n_new_NxB >= self.budget[slots_B]),
                        _BUDGET, code_NxB)
    code_NxB = np.where(total_NxB >= self.max_new[slots_B], _LENGTH, code_NxB)
    stop_NxB = np.any(self.stop[slots_B][None] == tokens_NxB[..., None],
                      axis=2)
    code_NxB = np.where(stop_NxB, _STOP, code_NxB)
    ends_NxB = valid_NxB & (code_NxB > 0)
    ended_B = ends_NxB.any(axis=0)
    first_B = np.argmax(ends_NxB, axis=0)
    taken_B = np.where(ended_B, first_B + 1, valid_NxB.sum(axis=0))
    code_B = np.where(ended_B, code_NxB[first_B, np.arange(B)], 0)
    if experts_NxBxLxK is not None and self.experts is not None:
      kept_NxB = step_Nx1 < taken_B
      at_input = (self.n_prompt[slots_B] + pos_NxB - 1)[kept_NxB]
      self.experts[rows_NxB[kept_NxB], at_input] = experts_NxBxLxK[kept_NxB]
    self.n_new[slots_B] += taken_B
    return taken_B, code_B

  def device_sees_every_stop(self) -> bool:
    """Whether the device checks all stop tokens of every running slot."""
    running = self.request >= 0
    return not (self.stop[running, DEVICE_STOP_TOKENS:] >= 0).any()

  def steps_left(self) -> np.ndarray:
    """Tokens each slot may still produce before its length or budget stop
    (0 for free slots): the device ends a slot there."""
    n_new = self.n_new + self.first_pending
    left = np.minimum(self.max_new - self.n_prefix - n_new,
                      self.budget - n_new)
    return np.where(self.request >= 0, left, 0)

  def generated(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and log-probs `slot` generated since its admission."""
    lo, hi = self.n_prefix[slot], self.n_prefix[slot] + self.n_new[slot]
    return self.response[slot, lo:hi], self.logprobs[slot, lo:hi]

  def inputs_experts(self, slot: int) -> np.ndarray | None:
    """The experts of the slot's model inputs so far (prompt, prefix and
    every generated token but the last); None when none are recorded."""
    if self.experts is None:
      return None
    n = self.n_prompt[slot] + self.n_prefix[slot] + self.n_new[slot] - 1
    return self.experts[slot, :n].copy()

  def result(self, slot: int, req: SampleRequest, code: int) -> SampleResult:
    tokens, logprobs = self.generated(slot)
    return SampleResult(
        id=req.id, tokens=tuple(tokens.tolist()),
        logprobs=tuple(logprobs.tolist()),
        finish_reason=FINISH_REASONS[code - 1],
        experts=self.inputs_experts(slot))


def admission_groups(lengths: Sequence[int], bucket_for, max_batch: int
                     ) -> list[list[int]]:
  """Positions of `lengths` grouped by prefill length bucket, in order, each
  group cut to at most `max_batch`: one batched prefill per group, so a short
  prompt is never padded to a long continuation's bucket."""
  by_bucket: dict[int, list[int]] = collections.defaultdict(list)
  for j, n in enumerate(lengths):
    by_bucket[bucket_for(n)].append(j)
  return [group[k:k + max_batch] for _, group in sorted(by_bucket.items())
          for k in range(0, len(group), max_batch)]


class Sampler:
  """Runs requests through an engine with continuous batching.

  steps_per_call: decode steps per jitted call (host round trip) at most.
  More steps cut host overhead. The device stops each slot at its length or
  budget limit and at its stop tokens, and ends the call when no slot runs;
  a slot that finishes mid-call otherwise idles until the call ends, and new
  requests wait for it. Results do not depend on it: keys are per request
  and token index, and with a `window`, while queued requests could still
  start, each call ends at the first step a slot finishes (the device
  applies every finish rule: `engine.FinishWatch`), so they start at the
  same step as with 1.

  The decode state (the KV cache) stays allocated between `generate` calls
  and is reused, every slot free, by the next one (allocating and zeroing
  a cache of slots x cache_len entries costs a second per gigabyte on a
  CPU); `release()` drops it.
  """

  def __init__(self, engine: Engine, repeat: RepeatConfig = RepeatConfig(),
               steps_per_call: int = 1):
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    self.engine = engine
    self.repeat = repeat
    self.steps_per_call = steps_per_call
    # The decode state of the last call, every slot free but those in
    # `_kept`: the next call reuses its buffers instead of allocating and
    # zeroing a cache again.
    self._state: DecodeState | None = None
    # Budget-cut requests kept in their slots (`keep_cut_kv`): the key of
    # the request that continues each (`_kept_key`) -> its slot.
    self._kept: dict[tuple, int] = {}

  def _take_state(self) -> DecodeState:
    state, self._state = self._state, None
    if state is None:
      return self.engine.init_decode_state()
    if state.host.pages is not None:
      state.host.pages.peak = 0
    return state

  def release(self) -> None:
    """Drops the decode state kept between calls (its cache memory) and
    with it the kept slots."""
    self._state = None
    self._kept = {}

  def validate(self, requests: Sequence[SampleRequest]) -> None:
    problems = [(r.id, f, m) for r in requests
                for f, m in request_problems(r, self.engine)]
    if problems:
      raise SampleRequestError(problems)

  def generate(self, params, requests: Sequence[SampleRequest], *,
               progress: bool = False, window: int | None = None,
               min_admit: int = 1, keep_cut_kv: bool = False
               ) -> tuple[list[SampleResult | None], SamplerStats]:
    """Results in the order of `requests`, and the call's statistics.

    params: the policy weights, already in `engine.param_shardings` (see
    `kimi_jax.sampler.handoff.place_params`).

    window: a rollout window of at most this many tokens per slot (the
    prefill token included). A request admitted after s decode steps gets a
    budget of at most window - s, so requests queued beyond the slots take
    slots that free up mid-window and stop ("budget") when it closes. While
    fewer than `min_admit` tokens of the window remain no request is started
    (a sliver of a segment would cost a prefill and a carry-over); requests
    never started get None. Without a window every request runs to its end.

    keep_cut_kv: keep the slots of requests the budget cuts once no other
    request can start in this call, for the next call to continue them in
    place (see the module doc). Requests that continue a slot kept by the
    previous call resume there whatever this flag says.
    """
    self.validate(requests)
    _check_window(window, min_admit)
    engine = self.engine
    if keep_cut_kv and engine.expert_record is not None:
      raise ValueError("keep_cut_kv cannot keep a slot's routing record "
                       "(routing replay needs the prefill's experts)")
    start = time.perf_counter()
    # What each request runs as now: the request itself, or after a
    # preemption its continuation; `carried` holds the preempted parts.
    requests, given = list(requests), requests
    carried: dict[int, tuple[tuple, tuple, Any]] = {}
    slots = _Slots(engine.max_concurrent_decodes, engine.cache_len,
                   max([len(r.stop_tokens) for r in requests] + [1]),
                   engine.expert_record)
    results: list[SampleResult | None] = [None] * len(requests)
    pending = collections.deque(range(len(requests)))
    state = self._take_state() if requests else None
    resumed = 0
    if state is not None:
      state, resumed = self._resume_kept(requests, pending, slots, state,
                                         window)
    decode_params = engine.decode_params(params) if requests else None
    steps = calls = kept = prefill_tokens = preemptions = admissions = 0
    last_report = start

    # Rounds whose first tokens are read back with the next decode output.
    late: list[_Late] = []
    while True:
      left = None if window is None else window - steps
      if _window_open(window, steps, min_admit):
        state, n_tokens, n_admitted, round_late = self._admit_free_slots(
            params, requests, pending, slots, state, results, left)
        prefill_tokens += n_tokens
        kept += n_admitted
        admissions += n_admitted
        late += round_late
      if not (slots.request >= 0).any():
        break  # all done, or the window has no room left for new requests
      # A window's queued requests must start at the step a slot frees up
      # (their budget is what is left of the window). Without a window a
      # request's tokens do not depend on when it starts.
      watch_steps = (window - steps - min_admit if pending and
                     window is not None else 0)
      state, n_out = self._make_room(state, slots, requests, pending,
                                     carried)
      preemptions += n_out
      state, tokens_NxB, logprobs_NxB, experts, firsts, rows = \
          self._decode_call(decode_params, state, slots, late, watch_steps)
      calls += 1
      cut: dict[int, tuple] | None = {} if keep_cut_kv else None
      done_B, n_steps, n_kept = self._harvest(
          late, firsts, tokens_NxB, logprobs_NxB, rows, requests, slots,
          results, experts, cut)
      late = []
      steps += n_steps
      kept += n_kept
      if cut and not (pending and _window_open(window, steps, min_admit)):
        # No request can take these slots any more in this call.
        for slot, key in cut.items():
          self._kept[key] = slot
          done_B[slot] = False
      if done_B.any():
        state = engine.free_slots(state, done_B)
      if progress and time.perf_counter() - last_report > 5:
        last_report = time.perf_counter()
        done = sum(r is not None for r in results)
        print(f"sampler: {done}/{len(requests)} done, {kept} tokens, "
              f"{kept / (last_report - start):.0f} tok/s", file=sys.stderr)

    results = _join_carried(results, carried, given)
    if state is not None:
      self._state = state  # every slot is free again
    wall = time.perf_counter() - start
    admitted = len(requests) - len(pending)  # all, unless a window closed
    admitted += sum(i in pending for i in carried)
    decode_kept = kept - admissions
    stats = SamplerStats(
        requests=admitted, tokens_generated=kept,
        prefill_tokens=prefill_tokens, decode_steps=steps,
        generate_calls=calls,
        slot_utilisation=decode_kept / max(steps * len(slots.request), 1),
        wall_seconds=wall, preemptions=preemptions,
        peak_pages=0 if state is None or state.host.pages is None else
        state.host.pages.peak, resumed=resumed)
    if progress:
      print(f"sampler: {len(requests)} requests, {kept} tokens in "
            f"{wall:.2f}s ({stats.tokens_per_second:.0f} tok/s)",
            file=sys.stderr)
    return results, stats

  def _resume_kept(self, requests: Sequence[SampleRequest],
                   pending: collections.deque, slots: _Slots,
                   state: DecodeState, budget_cap: int | None
                   ) -> tuple[DecodeState, int]:
    """Continues each pending request whose slot the last call kept there
    (taking it out of `pending`) and frees the kept slots no request
    continues. Returns (state, requests continued)."""
    kept, self._kept = self._kept, {}
    if not kept:
      return state, 0
    claims = {}
    for i in pending:
      slot = kept.pop(_kept_key(requests[i]), None)
      if slot is not None:
        claims[i] = slot
    if kept:
      state = self._free(state, kept.values())
    if not claims:
      return state, 0
    rest = [i for i in pending if i not in claims]
    pending.clear()
    pending.extend(rest)
    for i, slot in claims.items():
      slots.admit(slot, i, requests[i], budget_cap)
    state = self.engine.set_sampling(
        state, list(claims.values()), [requests[i].sampling for i in claims])
    return state, len(claims)

  def _free(self, state: DecodeState, slots_to_free) -> DecodeState:
    mask_B = np.zeros((self.engine.max_concurrent_decodes,), bool)
    mask_B[list(slots_to_free)] = True
    return self.engine.free_slots(state, mask_B)

  def _drop_kept(self, state: DecodeState, only=None) -> DecodeState:
    """Frees the kept slots (those among `only`, when given)."""
    drop = {k: b for k, b in self._kept.items() if only is None or b in only}
    if not drop:
      return state
    for k in drop:
      del self._kept[k]
    return self._free(state, drop.values())

  def _admit_free_slots(self, params, requests: Sequence[SampleRequest],
                        pending: collections.deque, slots: _Slots,
                        state: DecodeState, results: list,
                        budget_cap: int | None
                        ) -> tuple[DecodeState, int, int, list[_Late]]:
    """Admits pending requests into the free slots, round after round: a
    request may finish on the token its prefill sampled, leaving its slot
    free for another round before decoding.

    Returns (state, prefill tokens, requests admitted, late groups).
    """
    prefill_tokens = admitted = 0
    late: list[_Late] = []
    while pending and (slots.request < 0).any():
      state, n_tokens, n_admitted, round_late = self._admit(
          params, requests, pending, slots, state, results, budget_cap)
      prefill_tokens += n_tokens
      admitted += n_admitted
      late += round_late
      if not n_admitted:  # the pool has no pages for the next one yet
        break
    return state, prefill_tokens, admitted, late

  def _make_room(self, state: DecodeState, slots: _Slots,
                 requests: list[SampleRequest], pending: collections.deque,
                 carried: dict) -> tuple[DecodeState, int]:
    """Preempts the most recently admitted running requests of each pool
    shard short of pages until every shard has the pages of the next
    decode call (a no-op for rows or a pool of every slot at full length).
    Returns (state, requests preempted)."""
    engine, pages = self.engine, state.host.pages
    if pages is None:
      return state, 0
    n_out = 0
    while True:
      steps_B = np.minimum(slots.steps_left(), self.steps_per_call)
      short = engine.pages_for_call(state, steps_B) > pages.free_per_shard()
      if not short.any():
        return state, n_out
      if self._kept:  # kept slots give their pages back before any preemption
        state = self._drop_kept(state)
        continue
      # A preempted request resumes by a prefill of all it holds.
      fits = (slots.n_prefix + slots.n_new + self._prompt_lens(
          slots, requests) <= engine.max_prefill_len)
      live = np.flatnonzero((slots.request >= 0) & ~slots.first_pending &
                            fits & short[pages.shard_of])
      if len(live) == 0:
        raise RuntimeError(
            f"sampler.kv_pages ({pages.n_pages} pages) cannot hold the "
            f"running requests' next {self.steps_per_call} steps, and none "
            f"can be preempted (its prompt and response exceed the largest "
            f"prefill bucket {engine.max_prefill_len})")
      slot = int(live[np.argmax(slots.admitted_at[live])])
      self._preempt(slot, slots, requests, pending, carried)
      state = self._free(state, [slot])
      n_out += 1

  @staticmethod
  def _preempt(slot: int, slots: _Slots, requests: list[SampleRequest],
               pending: collections.deque, carried: dict) -> None:
    """Puts slot's request back at the front of the queue as the
    continuation of what it generated, kept in `carried`."""
    i = int(slots.request[slot])
    tokens, logprobs = slots.generated(slot)
    tokens = tuple(int(t) for t in tokens)
    before = carried.get(i, ((), (), None))
    # The resumed part's prefill routes everything before it again; these
    # experts stand only if it never resumes.
    carried[i] = (before[0] + tokens,
                  before[1] + tuple(float(x) for x in logprobs),
                  slots.inputs_experts(slot))
    requests[i] = dataclasses.replace(
        requests[i], prefix=requests[i].prefix + tokens,
        budget=int(slots.budget[slot] - slots.n_new[slot]))
    slots.request[slot] = -1
    pending.appendleft(i)

  @staticmethod
  def _prompt_lens(slots: _Slots, requests: Sequence[SampleRequest]
                   ) -> np.ndarray:
    """Prompt length of each slot's request (0 for free slots)."""
    return np.asarray([len(requests[i].prompt) if i >= 0 else 0
                       for i in slots.request], np.int64)

  def _decode_call(self, decode_params, state: DecodeState, slots: _Slots,
                   late: list[_Late], watch_steps: int
                   ) -> tuple[DecodeState, np.ndarray, np.ndarray,
                              np.ndarray | None, list, int]:
    """One jitted call of up to `steps_per_call` decode steps, ended at the
    first finish within `watch_steps` steps when that is positive.

    Returns (state, tokens N x B, log-probs N x B, experts N x B x Lm x K
    or None, the `late` groups' first tokens, log-probs and prefill
    experts, the steps the call ran), all read in one host round trip.
    """
    rows = self.steps_per_call
    watch = FinishWatch.off(len(slots.request),
                            *repetition.device_rule(self.repeat))
    if watch_steps > 0:
      if slots.device_sees_every_stop():
        watch = self._watch(slots, watch_steps)
      else:  # the device could miss a finish: one step per call
        rows = 1
    state, tokens_NxB, logprobs_NxB, experts = self.engine.traced_generate(
        decode_params, state, self.steps_per_call,
        steps_left=np.minimum(slots.steps_left(), rows),
        stop_tokens=slots.stop, watch=watch)
    # One host read per call: the decode output and the first tokens of
    # the rounds admitted before it.
    tokens_NxB, logprobs_NxB, experts, firsts = jax.device_get(
        (tokens_NxB, logprobs_NxB, experts, [_firsts(x.prefix)
                                             for x in late]))
    # Steps it ran (a mesh whose devices loop apart may stop its devices'
    # slots at different steps: -1 marks a step not run).
    rows = min(rows, int(np.max(np.sum(tokens_NxB >= 0, axis=0))))
    return state, tokens_NxB, logprobs_NxB, experts, firsts, rows

  def _harvest(self, late: list[_Late], firsts: list,
               tokens_NxB: np.ndarray, logprobs_NxB: np.ndarray, rows: int,
               requests: Sequence[SampleRequest], slots: _Slots,
               results: list, experts_NxBxLxK: np.ndarray | None = None,
               cut: dict[int, tuple] | None = None
               ) -> tuple[np.ndarray, int, int]:
    """Appends one call's output to the slots (the `late` groups' first
    tokens, then `rows` decode steps) and finishes the requests it ends;
    `cut` gets the slot of each request the budget ended, with the key of
    its continuation.

    Returns (which slots finished, decode steps taken, tokens kept).
    """
    done_B = np.zeros((len(slots.request),), bool)
    for x, first in zip(late, firsts):
      done_B[x.slots] = self._first_tokens(x.slots, *first, requests, slots,
                                           results, cut)
    live_B = np.flatnonzero(slots.request >= 0)
    taken_B, code_B = slots.append_steps(
        live_B, tokens_NxB[:rows, live_B], logprobs_NxB[:rows, live_B],
        self.repeat,
        None if experts_NxBxLxK is None else experts_NxBxLxK[:rows, live_B])
    ended = np.flatnonzero(code_B > 0)
    # In the order a step-by-step pass ends them: by step, then by slot.
    for j in ended[np.argsort(taken_B[ended], kind="stable")]:
      _finish(live_B[j], code_B[j], requests, slots, results, cut)
      done_B[live_B[j]] = True
    return done_B, int(taken_B.max(initial=0)), int(taken_B.sum())

  def _admit(self, params, requests: Sequence[SampleRequest],
             pending: collections.deque, slots: _Slots,
             state: DecodeState, results: list, budget_cap: int | None
             ) -> tuple[DecodeState, int, int, list[_Late]]:
    """One admission round: as many pending requests as free slots, one
    `prefill_batch` per length bucket and one `insert_batch` per bucket.

    The first tokens are read back at once (one host read for all groups)
    when one of them could end its request while requests are still
    pending: then the freed slot goes to another round before decoding, and
    only the requests still running are inserted. Otherwise every request
    is inserted and its first token is read with the next decode output
    (returned as `_Late` groups): one host round trip less per round, the
    same results (the device does not decode a slot whose token is one of
    its stop tokens or which has no steps left).

    Returns (state, prefill tokens, requests admitted, late groups).
    """
    engine = self.engine
    free = self._admissible(state, requests, pending, slots,
                            np.flatnonzero(slots.request < 0),
                            min(int((slots.request < 0).sum()), len(pending)))
    if not len(free):
      return state, 0, 0, []
    state = self._drop_kept(state, only=set(int(b) for b in free))
    taken = [pending.popleft() for _ in range(len(free))]
    seqs = [requests[i].prompt + requests[i].prefix for i in taken]
    groups = admission_groups([len(q) for q in seqs], engine.bucket_for,
                              engine.max_prefill_batch)
    prefixes = [engine.prefill_batch(
        params, [seqs[j] for j in g],
        [requests[taken[j]].sampling for j in g],
        [len(requests[taken[j]].prefix) for j in g],
        **_images_of([requests[taken[j]] for j in g])) for g in groups]
    for j, slot in enumerate(free[:len(taken)]):
      slots.admit(slot, taken[j], requests[taken[j]], budget_cap)
    defer = not pending or not any(
        self._first_may_finish(requests[i], slots.budget[slot])
        for i, slot in zip(taken, free))
    late = []
    if defer:
      for g, prefix in zip(groups, prefixes):
        slots_g = free[g]
        slots.first_pending[slots_g] = True
        state = engine.insert_batch(prefix, state, [int(s) for s in slots_g])
        late.append(_Late(slots_g, prefix))
      return state, sum(len(q) for q in seqs), len(taken), late
    firsts = jax.device_get([_firsts(p) for p in prefixes])
    for g, prefix, first in zip(groups, prefixes, firsts):
      slots_g = free[g]
      done_g = self._first_tokens(slots_g, *first, requests, slots, results)
      if not done_g.all():
        state = engine.insert_batch(prefix, state, [
            None if done else int(slot)
            for slot, done in zip(slots_g, done_g)])
    return state, sum(len(q) for q in seqs), len(taken), late

  def _admissible(self, state: DecodeState,
                  requests: Sequence[SampleRequest],
                  pending: collections.deque, slots: _Slots, free: np.ndarray,
                  n: int) -> np.ndarray:
    """The free slots the first pending requests take, in order, as far as
    the pool has pages for each one's prompt and prefix and its first
    decode call in its slot's shard, after those the running requests need
    for their next call (all of free[:n] for rows). At least one when
    nothing runs (a shard holds one full slot)."""
    engine = self.engine
    pages = state.host.pages
    if pages is None or n == 0:
      return free[:n]
    steps = self.steps_per_call
    room = pages.free_per_shard() - engine.pages_for_call(
        state, np.minimum(slots.steps_left(), steps))
    nothing_runs = not (slots.request >= 0).any()
    chosen = []
    left = list(free)
    for k in range(n):
      req = requests[pending[k]]
      need = engine.pages_for_tokens(min(
          len(req.prompt) + len(req.prefix) + steps, engine.cache_len))
      slot = next((b for b in left if room[pages.shard_of[b]] >= need), None)
      if slot is None and nothing_runs and not chosen:
        slot = left[0]
      if slot is None:
        break
      chosen.append(slot)
      left.remove(slot)
      room[pages.shard_of[slot]] -= need
    return np.asarray(chosen, np.int64)

  def _watch(self, slots: _Slots, steps: int) -> FinishWatch:
    """The device's view of every finish rule, to end a call at the first
    finish within `steps` steps (see `engine.FinishWatch`)."""
    ngram, times = repetition.device_rule(self.repeat)
    total_B = slots.n_prefix + slots.n_new
    tail_BxW = repetition.tails(slots.response, total_B, ngram * times)
    return FinishWatch(steps, tail_BxW, total_B, slots.first_pending.copy(),
                       ngram, times)

  def _first_may_finish(self, req: SampleRequest, budget: int) -> bool:
    """Whether the token a prefill samples could end `req` (admitted with
    this budget): a stop token, a budget or length of one token, or a
    repeat completed by it."""
    return (bool(req.stop_tokens) or budget <= 1 or
            req.max_new_tokens - len(req.prefix) <= 1 or
            (self.repeat.enabled and len(req.prefix) + 1 >= self.repeat.times))

  def _first_tokens(self, slots_g: np.ndarray, token_N: np.ndarray,
                    logprob_N: np.ndarray, experts_N: np.ndarray | None,
                    requests: Sequence[SampleRequest], slots: _Slots,
                    results: list, cut: dict[int, tuple] | None = None
                    ) -> np.ndarray:
    """Appends a prefill group's first tokens to its slots (and its
    experts, when recorded) and finishes the requests they end (`cut` as
    in `_harvest`); returns which of `slots_g` finished."""
    n = len(slots_g)
    slots.first_pending[slots_g] = False
    if experts_N is not None:
      slots.set_prefill_experts(slots_g, experts_N)
    _, codes = slots.append_steps(slots_g, token_N[None, :n],
                                  logprob_N[None, :n], self.repeat)
    for slot, code in zip(slots_g[codes > 0], codes[codes > 0]):
      _finish(slot, code, requests, slots, results, cut)
    return codes > 0


def _finish(slot: int, code: int, requests: Sequence[SampleRequest],
            slots: _Slots, results: list, cut: dict[int, tuple] | None
            ) -> None:
  """Ends slot's request with this finish code: its result, its slot
  free on the host (the caller frees it on the device or keeps it)."""
  i = slots.request[slot]
  results[i] = slots.result(slot, requests[i], code)
  if cut is not None and code == _BUDGET:
    req = requests[i]
    cut[int(slot)] = _kept_key(dataclasses.replace(
        req, prefix=req.prefix + results[i].tokens))
  slots.request[slot] = -1


def _kept_key(request: SampleRequest) -> tuple:
  """What a kept slot is matched on: the request that continues it has
  this id and prompt, and its prefix is all the slot generated."""
  return (request.id, request.prompt, request.prefix)


def _join_carried(results: list[SampleResult | None], carried: dict,
                  given: Sequence[SampleRequest]) -> list[SampleResult | None]:
  """Results of preempted requests with their earlier parts in front; one
  that never resumed (its window closed) ends as a "budget" result."""
  out = list(results)
  for i, (tokens, logprobs, experts) in carried.items():
    last = out[i]
    if last is None:
      out[i] = SampleResult(given[i].id, tokens, logprobs, "budget",
                            experts)
    else:
      out[i] = dataclasses.replace(last, tokens=tokens + last.tokens,
                                   logprobs=logprobs + last.logprobs)
  return out


def _firsts(prefix: Prefix) -> tuple[jax.Array, jax.Array,
                                      jax.Array | None]:
  """What the host reads of a prefill: its first tokens, their log-probs
  and (routing replay) its experts."""
  return prefix.token, prefix.logprob, prefix.experts


def _window_open(window: int | None, steps: int, min_admit: int) -> bool:
  """Whether requests may still start after `steps` decode steps: always
  without a window, else while at least `min_admit` of its tokens remain."""
  return window is None or window - steps >= min_admit


def _check_window(window: int | None, min_admit: int) -> None:
  if window is not None and window < 1:
    raise ValueError(f"window must be None or >= 1, got {window}")
  if min_admit < 1:
    raise ValueError(f"min_admit must be >= 1, got {min_admit}")


def _images_of(group: Sequence[SampleRequest]) -> dict[str, Any]:
  """`prefill_batch`'s images argument for a group, when it has any."""
  if all(r.images is None for r in group):
    return {}
  return {"images": [r.images for r in group]}


class _Late(NamedTuple):
  """An admitted prefill group whose first tokens are not read yet."""

  slots: np.ndarray
  prefix: Prefix
