"""Decode steps per call (sampler.steps_per_call) change speed, not results;
the device stops slots at their limits and stop tokens, and reports exactly
the tokens a one-step-at-a-time decode gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.driver import (FINISH_REASONS, SampleRequest, Sampler,
                                     _Slots)
from kimi_jax.sampler.engine import (DEVICE_STOP_TOKENS, Engine, EngineConfig,
                                     FinishWatch)
from kimi_jax.sampler.repetition import (RepeatConfig, is_repeating,
                                         repeating, repeating_on_device,
                                         tails)
from kimi_jax.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=256, qkv_bias=True,
                  max_seq_len=48)


@pytest.fixture(scope="module")
def params():
  return jax.jit(
      lambda: transformer.init_params(CFG, jax.random.key(0), std=0.2))()


@pytest.fixture(scope="module")
def engine():
  return Engine(CFG, EngineConfig(max_slots=4, cache_len=48,
                                  prefill_buckets=(8, 32)))


def _prompt(seed, n):
  return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 64, n))


def _requests():
  """More requests than slots; budgets, stop tokens (one request with more
  than the device checks), greedy and seeded sampling, continuations."""
  reqs = []
  for i in range(11):
    stop = ()
    if i % 3 == 1:
      stop = (int(i * 5 % 64), int(i * 11 % 64))
    if i == 4:  # the host alone checks the stop tokens past the first 8
      stop = tuple(range(40, 40 + DEVICE_STOP_TOKENS)) + (17, 23, 31)
    reqs.append(SampleRequest(
        i, _prompt(700 + i, 3 + (i * 7) % 20), prefix=_prompt(800 + i, i % 3),
        max_new_tokens=(i % 3) + 5 + (i * 3) % 14,
        sampling=SamplingParams(greedy=True) if i % 4 == 0 else
        SamplingParams(seed=i), stop_tokens=stop,
        budget=4 if i % 5 == 1 else None))
  return reqs


def _same(got, want):
  assert [r is None for r in got] == [r is None for r in want]
  for a, b in zip(got, want):
    if a is not None:
      assert (a.id, a.tokens, a.finish_reason) == (b.id, b.tokens,
                                                   b.finish_reason)
      # Admission rounds group requests differently: the prefill batch size
      # may change a first log-prob's rounding.
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.slow
def test_results_do_not_depend_on_steps_per_call(params, engine):
  repeat = RepeatConfig(ngram=2, times=3)
  reqs = _requests()
  one = Sampler(engine, repeat, steps_per_call=1)
  want = one.generate(params, reqs)[0]
  want_window = one.generate(params, reqs, window=9, min_admit=2)[0]
  reasons = {r.finish_reason for r in want}
  assert {"length", "budget", "stop"} <= reasons, reasons
  assert any(r is None for r in want_window)  # the window left some out
  calls_window = one.generate(params, reqs, window=9,
                              min_admit=2)[1].generate_calls
  for steps in (4, 16):
    many = Sampler(engine, repeat, steps_per_call=steps)
    got, stats = many.generate(params, reqs)
    _same(got, want)
    assert stats.generate_calls < one.generate(params, reqs)[1].generate_calls
    got, stats = many.generate(params, reqs, window=9, min_admit=2)
    _same(got, want_window)
    # Queued requests wait inside the window, and calls still run several
    # steps: each ends at the first finish (engine.FinishWatch).
    assert stats.generate_calls < calls_window


def test_a_repeat_ends_a_watched_call_where_the_host_sees_it(params, engine):
  """Requests that loop (greedy on a repetitive prompt, repeat rule 1 x 3)
  and more of them than slots, in a window: the same results and fewer
  calls with 16 steps per call, so the device caught the repeats at the
  step the host does."""
  repeat = RepeatConfig(ngram=1, times=3)
  reqs = [SampleRequest(i, (5, 5, 5, 5) if i % 2 else _prompt(950 + i, 6),
                        max_new_tokens=30,
                        sampling=SamplingParams(greedy=i % 2 == 1, seed=i))
          for i in range(10)]
  want, one = Sampler(engine, repeat, steps_per_call=1).generate(
      params, reqs, window=24, min_admit=1)
  got, many = Sampler(engine, repeat, steps_per_call=16).generate(
      params, reqs, window=24, min_admit=1)
  assert "repeat" in {r.finish_reason for r in want if r is not None}
  _same(got, want)
  assert many.generate_calls < one.generate_calls


def _one_token_at_a_time(response, n_new, budget, max_new, stop, tokens,
                         repeat):
  """Reference: the finish rules applied after each token in turn; returns
  (tokens taken, finish reason or None)."""
  response = list(response)
  for n, token in enumerate(tokens):
    if token < 0:
      return n, None
    response.append(int(token))
    reason = None
    if repeat.enabled and is_repeating(response, repeat):
      reason = "repeat"
    if reason is None and n_new + n + 1 >= budget:
      reason = "budget"
    if len(response) >= max_new:
      reason = "length"
    if token in stop:
      reason = "stop"
    if reason:
      return n + 1, reason
  return len(tokens), None


@pytest.mark.parametrize("enabled", [True, False])
def test_a_calls_steps_appended_at_once_match_one_token_at_a_time(enabled):
  """The host takes a call's N steps in one pass (`_Slots.append_steps`):
  per slot, the tokens up to its first finish or the device's first -1,
  with the finish rules (stop over length over budget over repeat) of a
  token-by-token pass."""
  repeat = RepeatConfig(ngram=2, times=3, enabled=enabled)
  rng = np.random.default_rng(7)
  seen, past_row_end = set(), 0
  for trial in range(40):
    width = 20  # rows end where the device's stopped entries may not
    slots = _Slots(8, width, 2, experts=(2, 1, np.int32))
    chosen = np.sort(rng.choice(8, size=rng.integers(1, 9), replace=False))
    before = {}
    for slot in chosen:
      prefix = tuple(rng.integers(0, 3, rng.integers(0, 6)).tolist())
      req = SampleRequest(
          ("r", slot), (1, 2, 3), prefix=prefix,
          # prompt + max_new_tokens fit the row, as the engine checks.
          max_new_tokens=len(prefix) + int(rng.integers(3, width - 2 -
                                                        len(prefix))),
          budget=int(rng.integers(1, 16)),
          stop_tokens=tuple(rng.choice(6, rng.integers(0, 3), replace=False)
                            .tolist()))
      slots.admit(int(slot), int(slot), req)
      n_old = int(rng.integers(0, 3))  # tokens from earlier calls
      slots.response[slot, len(prefix):len(prefix) + n_old] = rng.integers(
          0, 3, n_old)
      slots.n_new[slot] = n_old
      before[slot] = (slots.response[slot, :len(prefix) + n_old].copy(),
                      n_old, req)
    N, B = int(rng.integers(1, 25)), len(chosen)
    tokens_NxB = rng.integers(0, 6 if trial % 2 else 3, (N, B))
    for b in range(B):  # the device's loop ended early for some slots
      if rng.random() < 0.3:
        tokens_NxB[rng.integers(0, N):, b] = -1
    logprobs_NxB = -rng.random((N, B)).astype(np.float32)
    experts_NxBx2x1 = rng.integers(0, 9, (N, B, 2, 1)).astype(np.int32)
    past_row_end += sum(
        len(before[slot][0]) + np.cumprod(tokens_NxB[:, b] >= 0).sum() > width
        for b, slot in enumerate(chosen))
    taken_B, code_B = slots.append_steps(chosen, tokens_NxB, logprobs_NxB,
                                         repeat, experts_NxBx2x1)
    for b, slot in enumerate(chosen):
      response, n_old, req = before[slot]
      want_taken, want_reason = _one_token_at_a_time(
          response, n_old, req.budget, req.max_new_tokens, req.stop_tokens,
          tokens_NxB[:, b], repeat)
      assert taken_B[b] == want_taken, (trial, b)
      got_reason = FINISH_REASONS[code_B[b] - 1] if code_B[b] else None
      assert got_reason == want_reason, (trial, b)
      seen.add((want_reason, want_taken < N and tokens_NxB[-1, b] >= 0))
      assert slots.n_new[slot] == n_old + want_taken
      total = len(response) + want_taken
      np.testing.assert_array_equal(
          slots.response[slot, :total],
          np.concatenate([response, tokens_NxB[:want_taken, b]]))
      np.testing.assert_array_equal(
          slots.logprobs[slot, len(response):total],
          logprobs_NxB[:want_taken, b])
      # Step n's experts belong to its input token, at prompt + total - 1.
      at = 3 + len(response) - 1 + np.arange(want_taken)
      np.testing.assert_array_equal(slots.experts[slot, at],
                                    experts_NxBx2x1[:want_taken, b])
  # Every rule ended some slot, some before the call's last step.
  reasons = {r for r, _ in seen}
  assert reasons == set(FINISH_REASONS[:2 + enabled] + ("budget", None))
  assert (("stop", True) in seen) and (("budget", True) in seen)
  assert past_row_end  # the device's entries ran past a row's end


def test_tails_of_chosen_rows_match_slicing_each_row():
  rng = np.random.default_rng(3)
  responses = rng.integers(0, 50, (9, 30))
  rows = np.array([7, 0, 4, 4])
  lengths = np.array([30, 0, 5, 12])
  got = tails(responses, lengths, 6, rows)
  for i, (row, n) in enumerate(zip(rows, lengths)):
    want = [-1] * max(0, 6 - n) + list(responses[row, max(0, n - 6):n])
    assert got[i].tolist() == want
  # Without rows, row i goes with length i.
  np.testing.assert_array_equal(tails(responses[rows], lengths, 6), got)


@pytest.mark.host_inputs
def test_repeat_rule_on_device_matches_the_host():
  rng = np.random.default_rng(0)
  for ngram, times in ((1, 2), (2, 3), (4, 4), (3, 5)):
    cfg = RepeatConfig(ngram=ngram, times=times)
    responses = rng.integers(0, 3, (64, 40))
    for b in range(0, 64, 3):  # plant loops of every period
      p = 1 + b % ngram
      end = p * times + b % (40 - p * times)
      responses[b, end - p * times:end] = np.tile(rng.integers(0, 3, p),
                                                  times)
    lengths = rng.integers(0, 41, 64)
    lengths[::3] = np.minimum(lengths[::3] + 40, 40)
    tail = tails(responses, lengths, cfg.window)
    want = repeating(tail, lengths, cfg)
    assert 0 < want.sum() < 64
    got = repeating_on_device(jnp.asarray(tail), jnp.asarray(lengths), ngram,
                              times)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_a_watch_ends_the_call_after_the_first_finish(params, engine):
  prompts = [_prompt(900 + i, 5) for i in range(4)]
  greedy = [SamplingParams(greedy=True)] * 4
  prefix = engine.prefill_batch(params, prompts, greedy, [0] * 4)

  def run(watch_steps):
    state = engine.insert_batch(prefix, engine.init_decode_state(), range(4))
    watch = FinishWatch(watch_steps, np.zeros((4, 0), np.int32),
                        np.full((4,), 1, np.int32), np.zeros((4,), bool), 0, 0)
    _, tokens, _ = engine.generate(params, state, 8, steps_left=[8, 3, 8, 5],
                                   watch=watch)
    return int(np.sum(np.asarray(tokens)[:, 0] >= 0))  # steps run

  assert run(0) == 8  # no watch: until n_steps
  assert run(8) == 3  # slot 1 ends after 3 steps
  assert run(3) == 3
  assert run(2) == 8  # every end (3, 5) is past the watched steps


def test_device_stops_slots_at_their_limits_and_stop_tokens(params, engine):
  prompts = [_prompt(900 + i, 5) for i in range(4)]
  greedy = [SamplingParams(greedy=True)] * 4

  def admitted():
    prefix = engine.prefill_batch(params, prompts, greedy, [0] * 4)
    return engine.insert_batch(prefix, engine.init_decode_state(), range(4))

  _, free_run, _ = engine.generate(params, admitted(), 6)
  free_run = np.asarray(free_run)
  stop_row1 = np.full((4, 2), -1)
  stop_row1[3, 1] = free_run[1, 3]  # slot 3 samples its stop token at row 1
  state, tokens, logprobs = engine.generate(
      params, admitted(), 6, steps_left=[6, 2, 0, 6], stop_tokens=stop_row1)
  tokens = np.asarray(tokens)
  ran = [6, 2, 0, 1 + list(free_run[:, 3]).index(free_run[1, 3])]
  for slot, n in enumerate(ran):
    np.testing.assert_array_equal(tokens[:n, slot], free_run[:n, slot])
    assert (tokens[n:, slot] == 0).all() and (
        np.asarray(logprobs)[n:, slot] == 0).all()
  lengths = np.asarray(state.lengths)
  np.testing.assert_array_equal(lengths, [5 + n for n in ran])
  # No slot runs: the call ends at once (its rows are -1), nothing advances.
  state, tokens, _ = engine.generate(params, state, 6,
                                     steps_left=[0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
  assert (np.asarray(tokens) == -1).all()


def test_a_stop_token_the_device_does_not_check_keeps_calls_to_one_step(
    params, engine):
  """A request ends on its ninth stop token (beyond the DEVICE_STOP_TOKENS
  the device checks) while others wait for its slot: with 16 steps per call
  the waiting request still starts at the step that slot frees up."""
  def reqs(stop):
    out = [SampleRequest(0, _prompt(960, 7), max_new_tokens=12, stop_tokens=stop,
                         sampling=SamplingParams(seed=1))]
    return out + [SampleRequest(i, _prompt(960 + i, 5 + i), max_new_tokens=12,
                                sampling=SamplingParams(seed=i))
                  for i in range(1, 7)]

  free = Sampler(engine, RepeatConfig(enabled=False), steps_per_call=1)
  tokens = free.generate(params, reqs(()))[0][0].tokens
  unseen = [t for t in range(64) if t not in tokens][:DEVICE_STOP_TOKENS]
  stop = tuple(unseen) + (tokens[2],)
  assert len(stop) == DEVICE_STOP_TOKENS + 1 and tokens[2] not in tokens[:2]
  want = free.generate(params, reqs(stop), window=10)[0]
  assert want[0].finish_reason == "stop" and len(want[0].tokens) == 3
  many = Sampler(engine, RepeatConfig(enabled=False), steps_per_call=16)
  _same(many.generate(params, reqs(stop), window=10)[0], want)
