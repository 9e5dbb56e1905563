"""Packed minibatches: layout against a direct per-response reconstruction,
and the loss and gradient against the unpacked layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model.config import ModelConfig
from kimi_jax.model.transformer import forward, init_params, token_logprobs
from kimi_jax.rl import batching, losses, replay_buffer, trainer
from kimi_jax.rl.config import RLConfig
from kimi_jax.token_rows import ImageSlots

CFG = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                  n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64)
K = 3
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
# Per group, per response: segments of (n tokens, policy version).
SEGMENTS = [[[(4, 1)], [(2, 0), (3, 1)], [(1, 1)]],
            [[(9, 1)], [(3, 1)], [(2, 0), (2, 1)]],
            [[(1, 1)], [(2, 1)], [(5, 1)]]]
VERSION = 1


def _groups(seed=0):
  rng = np.random.default_rng(seed)
  buf = replay_buffer.RolloutBuffer(group_size=K, max_wait_iterations=5)
  for p, per_response in enumerate(SEGMENTS):
    gid = buf.new_group(prompt_index=p)
    for j, segs in enumerate(per_response):
      for s, (n, version) in enumerate(segs):
        last = s == len(segs) - 1
        buf.add_segment(gid, j, [int(t) for t in rng.integers(1, 32, n)],
                        [float(x) for x in -rng.uniform(0.1, 3.0, n)],
                        version=version,
                        finish_reason="stop" if last else None)
  return buf.complete_groups()


def _params(seed):
  return jax.jit(lambda: init_params(CFG, jax.random.key(seed), std=0.3))()


def _seq_logp(params, mb):
  return np.asarray(jax.jit(functools.partial(
      trainer.seq_logp, cfg=CFG, sharder=None))(params, jax.device_put(mb)))


def _minibatch(pack, old=False, rows=(2, 4, 8, 9), pad_to=4):
  return batching.packed_minibatch(
      _groups(), PROMPTS, version=VERSION, train_on_old_segments=old,
      len_buckets=(8, 16), rows=rows, pad_id=0, pad_prompts_to=pad_to,
      pack=pack)


def test_pack_rows_first_fit_decreasing_hand_case():
  rows = batching.pack_rows([5, 3, 3, 2, 7], 8)
  assert rows == [[4], [0, 1], [2, 3]]
  assert batching.pack_rows([5, 3], 8, pack=False) == [[0], [1]]
  with pytest.raises(ValueError, match="9 tokens"):
    batching.pack_rows([9], 8)


def test_pack_rows_places_every_sequence_once_within_the_row():
  rng = np.random.default_rng(1)
  for _ in range(50):
    lengths = list(rng.integers(1, 33, rng.integers(1, 40)))
    rows = batching.pack_rows(lengths, 32)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 32 for r in rows)
    # Never worse than one row per sequence, never below the volume bound.
    assert -(-sum(lengths) // 32) <= len(rows) <= len(lengths)


def test_row_buckets_divide_over_batch_shards():
  assert batching.row_buckets(16) == (1, 2, 3, 4, 6, 8, 12, 16)
  assert batching.row_buckets(32, 4) == (4, 8, 12, 16, 24, 32)
  assert batching.row_buckets(16, 8) == (8, 16)
  assert batching.row_buckets(12, 4) == (4, 8, 12)
  with pytest.raises(ValueError, match="do not divide"):
    batching.row_buckets(10, 4)


@pytest.mark.parametrize("old", [False, True])
def test_layout_matches_each_response_built_directly(old):
  mb = _minibatch(pack=True, old=old)
  rows = mb.rows
  groups = _groups()
  R, T = rows.shape
  assert (R, T) == (4, 16)  # 9 sequences of 2..13 input tokens in 4 rows
  assert mb.valid_P.tolist() == [1, 1, 1, 0]
  for p, (group, prompt) in enumerate(zip(groups, PROMPTS)):
    for j, traj in enumerate(group.trajectories):
      seq = list(prompt) + list(traj.tokens)
      where = mb.seq_RxT == p * K + j
      (row,) = set(np.nonzero(where)[0])  # one sequence, one row
      assert rows.tokens_RxT[where].tolist() == seq[:-1]
      assert rows.targets_RxT[where].tolist() == seq[1:]
      assert rows.positions_RxT[where].tolist() == list(range(len(seq) - 1))
      assert len(set(rows.segment_ids_RxT[where].tolist())) == 1
      versions = [v for n, v in SEGMENTS[p][j] for _ in range(n)]
      want_mask = [0.0] * (len(prompt) - 1) + [
          1.0 if old or v == VERSION else 0.0 for v in versions]
      assert rows.mask_RxT[where].tolist() == want_mask
      assert mb.lengths_PxK[p, j] == len(traj.tokens)
      lp = np.asarray(traj.logprobs)
      np.testing.assert_allclose(mb.sampler_seq_logp_PxK[p, j],
                                 lp[np.asarray(want_mask[len(prompt) - 1:])
                                    > 0].sum(), rtol=1e-6)
  # Segment ids differ between the sequences that share a row; padding is 0.
  pad = mb.seq_RxT == 3 * K + 0  # the padding index P*K (P = 4 here)
  assert (rows.segment_ids_RxT[pad] == 0).all()
  assert (rows.mask_RxT[pad] == 0).all()
  for r in range(R):
    seqs = set(mb.seq_RxT[r][~pad[r]].tolist())
    segs = set(rows.segment_ids_RxT[r][~pad[r]].tolist())
    assert len(seqs) == len(segs)


def _loss_and_grad(mb, rl, params, ref):
  batch = mb.replace(
      reward_PxK=np.array([[1, 0, .5], [0, 0, 1], [1, 1, 0], [0, 0, 0]],
                          np.float32),
      correct_PxK=np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]],
                           bool), ref_seq_logp_PxK=ref)
  fn = lambda p, b: trainer.policy_loss(p, b, cfg=CFG, rl=rl, sharder=None)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(
      params, jax.device_put(batch))
  return loss, metrics, grads


@pytest.mark.parametrize("loss", ["mirror_descent", "rest"])
def test_packed_loss_and_gradient_equal_the_unpacked_ones(loss):
  rl = RLConfig(iterations=1, prompts_per_iteration=4, samples_per_prompt=K,
                minibatch_prompts=4, loss=loss, tau=0.5)
  params = _params(0)
  packed, unpacked = _minibatch(pack=True), _minibatch(pack=False)
  assert packed.rows.shape[0] < unpacked.rows.shape[0]
  ref = _seq_logp(_params(1), unpacked)
  np.testing.assert_allclose(ref, _seq_logp(_params(1), packed), rtol=1e-5,
                             atol=1e-5)
  got = _loss_and_grad(packed, rl, params, ref)
  want = _loss_and_grad(unpacked, rl, params, ref)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  assert float(got[1]["n_tokens"]) == float(want[1]["n_tokens"]) > 0
  for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got[2])) > 0


def test_packed_seq_logp_equals_a_separate_forward_per_response():
  params = _params(2)
  mb = _minibatch(pack=True, old=True)
  got = _seq_logp(params, mb)

  @jax.jit
  def alone(params, seq_1xN):
    n = seq_1xN.shape[1] - 1
    logits, _ = forward(params, seq_1xN[:, :-1], jnp.arange(n)[None],
                        jnp.ones((1, n), jnp.int32), cfg=CFG)
    return token_logprobs(logits, seq_1xN[:, 1:])[0]

  for p, (group, prompt) in enumerate(zip(_groups(), PROMPTS)):
    for j, traj in enumerate(group.trajectories):
      seq = np.array([list(prompt) + list(traj.tokens)], np.int32)
      lp = np.asarray(alone(params, jax.device_put(seq)))[len(prompt) - 1:]
      np.testing.assert_allclose(got[p, j], float(lp.sum()), rtol=1e-5)
  assert (got[3] == 0).all()  # the padding prompt owns no tokens


def test_packed_sums_drop_padding():
  x = np.array([[1., 2., 3.], [4., 5., 6.]], np.float32)
  seq = np.array([[0, 0, 2], [1, 2, 1]])  # 2 = padding for n_seq = 2
  got = jax.jit(losses.packed_sums, static_argnums=2)(
      *jax.device_put((x, seq)), 2)
  np.testing.assert_allclose(got, [3., 10.])


def test_pack_rows_respects_the_rows_image_slots():
  # Lengths alone would put 0, 1 and 2 together (3 + 3 + 2 <= 8); 0 and 1
  # have 2 images each and a row has 3 slots.
  rows = batching.pack_rows([3, 3, 2], 8, images=[2, 2, 1], image_slots=3)
  assert rows == [[0, 2], [1]]
  with pytest.raises(ValueError, match="max_images"):
    batching.pack_rows([3], 8, images=[4], image_slots=3)


def test_packed_rows_carry_each_sequences_images_in_placeholder_order():
  # Group p's prompt has p images (pixels filled with 10 * p + image index);
  # every sequence's images must sit in its row's slots in the order its
  # segment appears in the row, which is the order of the row's
  # placeholder runs.
  like = (2, 2, 1)
  pixels = [np.stack([np.full(like, 10.0 * p + j, np.float32)
                      for j in range(p)]) if p else
            np.zeros((0,) + like, np.float32) for p in range(3)]
  mb = batching.packed_minibatch(
      _groups(), PROMPTS, version=VERSION, train_on_old_segments=False,
      len_buckets=(16,), rows=(2, 4, 8, 9), pad_id=0, pad_prompts_to=4,
      images=batching.ImageInputs(pixels, ImageSlots(3, like)))
  images = mb.rows.images
  assert images.pixels_BxIxHxWxC.shape[1:] == (3,) + like
  for r in range(mb.rows.shape[0]):
    segs = mb.rows.segment_ids_RxT[r]
    want = []
    for s in sorted(set(segs[segs > 0])):
      p = int(mb.seq_RxT[r][segs == s][0]) // K
      want += [10.0 * p + j for j in range(p)]
    assert len(want) <= 3
    got = images.pixels_BxIxHxWxC[r, :, 0, 0, 0]
    np.testing.assert_array_equal(images.mask_BxI[r],
                                  np.arange(3) < len(want))
    np.testing.assert_array_equal(got[:len(want)], want)
  # Every sequence's images are there: 3 responses x (0 + 1 + 2) images.
  assert images.mask_BxI.sum() == K * 3
