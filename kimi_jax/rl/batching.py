"""Finished groups -> packed, fixed-shape training minibatches.

A sequence is prompt + response; the model reads seq[:-1] and predicts
seq[1:]. Response token t sits at sequence index len(prompt) + t, i.e. target
index len(prompt) + t - 1. The loss mask marks response targets whose token
was sampled by the current policy (or all response tokens, when earlier
segments count); the response length used by the length reward is always the
full length over every segment, which is what `lengths_PxK` carries.

A minibatch holds `size` whole groups (P prompts x K responses), so the
group baseline and eq. 3's per-prompt average are unchanged. Its P*K
sequences are packed into R rows of T tokens (first fit, longest first):
each packed sequence gets its own segment id (1, 2, ...) and positions from
0, so attention never crosses sequences (`attention.packed_causal_mask`), and
`seq_RxT` says which (p, k) = p*K + k every token belongs to (P*K on
padding), so the loss sums token log-probs back into log pi(y|x) per
response. A minibatch is a typed pytree (`Minibatch`): the model's rows plus
the per-response arrays of its P prompts x K responses; stages add the
rewards and the reference log-probs with `.replace(...)`. Without packing a long response in a group pads every row of its
minibatch to its length; packed, short responses fill the room beside it.

Shapes are bucketed so jitted steps compile a bounded number of times: T is
the smallest `len_buckets` entry that fits the minibatch's longest sequence,
R the smallest `row_buckets` entry that fits its rows, P a multiple of the
minibatch (padding prompts own no tokens and have `valid_P = 0`).

Routing replay (an MoE policy, rl.routing_replay): trajectories that carry
the sampler's experts put them in `rows.experts_RxTxLxK`, one entry per
model input (padding entries are expert 0 and never reach a real token), so
the reference pass and the train step route every token as the sampler did.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.struct
import jax
import numpy as np

from kimi_jax.rl import replay_buffer
from kimi_jax.token_rows import (ImageSlots, TokenRows, empty_rows,
                                 put_images)


@flax.struct.dataclass
class Minibatch:
  """Whole groups of one train step: P prompts x K responses packed in R x T.

  rows: the model's input rows (`TokenRows`); its mask marks the response
    targets that get a gradient.
  seq_RxT: response p*K + k of every token; P*K on padding.
  lengths_PxK: full response lengths (all segments), for the length reward.
  valid_P: 1 for real prompts, 0 for padding prompts (own no tokens).
  reward_PxK, correct_PxK: scores of each response (zeros until scored);
    correct_PxK is what ReST fits (RewardResult.verified).
  ref_seq_logp_PxK: log pi_theta_i(y|x) over the mask, the iteration's
    reference (zeros until computed).
  sampler_seq_logp_PxK: the same sum from the sampler's log-probs.
  sampler_logp_RxT: the sampler's log-prob of every response target (each
    segment's from the policy that sampled it); 0 elsewhere.
  current_RxT: True on response targets sampled in this iteration (by
    pi_theta_i, the weights the trainer starts from): the tokens the
    sampler-trainer gap is measured on.
  ref_logp_RxT: log pi_theta_i of every target, the trainer's; computed
    only for truncated importance sampling (rl.tis_cap), zeros otherwise.
  """

  rows: TokenRows
  seq_RxT: np.ndarray
  lengths_PxK: np.ndarray
  valid_P: np.ndarray
  reward_PxK: np.ndarray
  correct_PxK: np.ndarray
  ref_seq_logp_PxK: np.ndarray
  sampler_seq_logp_PxK: np.ndarray
  sampler_logp_RxT: np.ndarray
  current_RxT: np.ndarray
  ref_logp_RxT: np.ndarray

  @property
  def group_shape(self) -> tuple[int, int]:
    """(P, K)."""
    return tuple(self.lengths_PxK.shape)


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"training sequence of {n} tokens exceeds the largest "
                   f"length bucket {buckets[-1]} (config.rl.train_len_buckets)")


def row_buckets(max_rows: int, multiple_of: int = 1) -> tuple[int, ...]:
  """Row counts a packed minibatch is padded to: `multiple_of` (the batch
  shards of the mesh) times 1, 2, 3, 4, 6, 8, 12, ... (powers of two and
  their halfway points, so padding stays under a third of a minibatch with
  twice the compilations of powers of two alone), capped by `max_rows` (P*K,
  what an unpacked minibatch needs), which must itself be a multiple."""
  if max_rows % multiple_of:
    raise ValueError(f"{max_rows} rows do not divide over {multiple_of} "
                     f"batch shards")
  out, n = [], 1
  while n * multiple_of < max_rows:
    out.append(n * multiple_of)
    if n >= 2 and 3 * n // 2 * multiple_of < max_rows:
      out.append(3 * n // 2 * multiple_of)
    n *= 2
  return tuple(sorted(out)) + (max_rows,)


def pack_rows(lengths: list[int], row_len: int, pack: bool = True, *,
              images: list[int] | None = None, image_slots: int = 0
              ) -> list[list[int]]:
  """Indices of `lengths` per row; each row's lengths sum to <= row_len.

  First fit decreasing: at most 11/9 OPT + 1 rows. pack=False gives every
  sequence its own row (the unpacked layout, same code path). With
  `images` (each sequence's image count) a row also holds at most
  `image_slots` images: a vision model's rows carry their images in that
  many fixed slots.
  """
  if any(n > row_len for n in lengths):
    raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a "
                     f"row of {row_len}")
  need = images or [0] * len(lengths)
  if any(n > image_slots for n in need):
    raise ValueError(f"a sequence with {max(need)} images does not fit a "
                     f"row's {image_slots} image slots (model.vision."
                     f"max_images)")
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  if not pack:
    return [[i] for i in order]
  rows: list[list[int]] = []
  room: list[int] = []
  slots: list[int] = []
  for i in order:
    for r, free in enumerate(room):
      if lengths[i] <= free and need[i] <= slots[r]:
        rows[r].append(i)
        room[r] -= lengths[i]
        slots[r] -= need[i]
        break
    else:
      rows.append([i])
      room.append(row_len - lengths[i])
      slots.append(image_slots - need[i])
  return rows


class ImageInputs(NamedTuple):
  """A vision model's images for `packed_minibatch`: `pixels[p]` the
  images of group p's prompt (n x H x W x C), and the rows' `slots`."""

  pixels: Sequence[np.ndarray]
  slots: ImageSlots


def empty_minibatch(P: int, K: int, R: int, T: int, pad_id: int,
                    images: ImageSlots | None = None,
                    experts: tuple[int, int, Any] | None = None
                    ) -> Minibatch:
  """The arrays of one minibatch, all padding: R x T rows, P x K per
  response, P per prompt. Real minibatches fill these in. With `images`
  the rows carry empty image slots; with `experts` ((Lm, K, id dtype),
  `moe.replay_record`) an R x T x Lm x K routing replay."""
  rows = empty_rows(R, T, pad_id, images)
  if experts is not None:
    Lm, Ke, dtype = experts
    rows = rows.replace(experts_RxTxLxK=np.zeros((R, T, Lm, Ke), dtype))
  return Minibatch(
      rows=rows,
      seq_RxT=np.full((R, T), P * K, np.int32),
      lengths_PxK=np.zeros((P, K), np.int32),
      valid_P=np.zeros((P,), np.float32),
      reward_PxK=np.zeros((P, K), np.float32),
      correct_PxK=np.zeros((P, K), bool),
      ref_seq_logp_PxK=np.zeros((P, K), np.float32),
      sampler_seq_logp_PxK=np.zeros((P, K), np.float32),
      sampler_logp_RxT=np.zeros((R, T), np.float32),
      current_RxT=np.zeros((R, T), bool),
      ref_logp_RxT=np.zeros((R, T), np.float32))


def abstract_minibatch(P: int, K: int, R: int, T: int,
                       images: ImageSlots | None = None,
                       experts: tuple[int, int, Any] | None = None
                       ) -> Minibatch:
  """A minibatch's shapes and dtypes (ShapeDtypeStructs), by the suffix of
  each field's name, without allocating it (ahead-of-time compiles)."""
  dims = {"RxT": (R, T), "PxK": (P, K), "P": (P,)}
  if images is not None:
    dims.update(BxI=(R, images.slots),
                BxIxHxWxC=(R, images.slots) + tuple(images.like))
  if experts is not None:
    dims.update(RxTxLxK=(R, T) + tuple(experts[:2]))
  like = empty_minibatch(P, K, 1, 1, 0, images, experts)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jax.ShapeDtypeStruct(
          dims[str(path[-1].name).rsplit("_", 1)[1]], x.dtype), like)


def packed_minibatch(groups: list[replay_buffer.Group],
                     prompts: list[list[int]], *, version: int,
                     train_on_old_segments: bool, len_buckets: tuple[int, ...],
                     rows: tuple[int, ...], pad_id: int, pad_prompts_to: int,
                     pack: bool = True,
                     images: ImageInputs | None = None) -> Minibatch:
  """One minibatch of whole groups; see the module docstring for layout.

  images: a vision model's prompt images, one array (n x H x W x C, n may
  be 0) per group, and the rows' image slots; each sequence's images go to
  its row's next free slots, in packing order, so a row's placeholder runs
  and its slots line up."""
  if len(groups) != len(prompts):
    raise ValueError(f"{len(groups)} groups but {len(prompts)} prompts")
  if len(groups) > pad_prompts_to:
    raise ValueError(f"{len(groups)} groups exceed the minibatch of "
                     f"{pad_prompts_to} prompts")
  K = len(groups[0].trajectories) if groups else 1
  seqs = [(p, j, list(prompt) + list(traj.tokens), traj)
          for p, (group, prompt) in enumerate(zip(groups, prompts))
          for j, traj in enumerate(group.trajectories)]
  n_in = [len(s) - 1 for _, _, s, _ in seqs]
  T = bucket_length(max(n_in + [1]), len_buckets)
  per_seq = None if images is None else [
      images.pixels[p] for p, _, _, _ in seqs]
  layout = pack_rows(
      n_in, T, pack, images=None if per_seq is None else
      [len(x) for x in per_seq],
      image_slots=0 if images is None else images.slots.slots)
  R = bucket_length(len(layout), rows) if layout else rows[0]
  out = empty_minibatch(pad_prompts_to, K, R, T, pad_id,
                        None if images is None else images.slots,
                        _replay_record(seqs))
  rows_ = out.rows
  out.valid_P[:len(groups)] = 1.0
  for r, members in enumerate(layout):
    col = slot = 0
    for segment, i in enumerate(members, start=1):
      p, j, seq, traj = seqs[i]
      if per_seq is not None:
        slot = put_images(rows_.images, r, slot, per_seq[i])
      m = n_in[i]
      span = slice(col, col + m)
      rows_.tokens_RxT[r, span] = seq[:-1]
      rows_.targets_RxT[r, span] = seq[1:]
      rows_.positions_RxT[r, span] = np.arange(m)
      rows_.segment_ids_RxT[r, span] = segment
      if rows_.experts_RxTxLxK is not None:
        rows_.experts_RxTxLxK[r, span] = traj.experts
      out.seq_RxT[r, span] = p * K + j
      versions = traj.token_versions()
      resp_mask = replay_buffer.loss_mask(versions, version,
                                          train_on_old_segments)
      start = col + len(seq) - traj.length - 1
      resp = slice(start, start + traj.length)
      rows_.mask_RxT[r, resp] = resp_mask
      logprobs = np.asarray(traj.logprobs, np.float64)
      out.sampler_logp_RxT[r, resp] = logprobs
      out.current_RxT[r, resp] = versions == version
      out.lengths_PxK[p, j] = traj.length
      out.sampler_seq_logp_PxK[p, j] = float(np.sum(logprobs[resp_mask]))
      col += m
  return out


def _replay_record(seqs) -> tuple[int, int, Any] | None:
  """(Lm, K, dtype) of the routing replay the sequences' trajectories
  carry, checked to cover every model input; None when none carries one."""
  have = [traj.experts is not None for _, _, _, traj in seqs]
  if not any(have):
    return None
  shape = dtype = None
  for _, _, seq, traj in seqs:
    where = f"response {traj.sample_index} of group {traj.group_id}"
    if traj.experts is None:
      raise ValueError(f"routing replay: {where} carries no experts while "
                       f"others do (every segment of a run with "
                       f"rl.routing_replay records them)")
    x = traj.experts
    if len(x) != len(seq) - 1 or shape not in (None, x.shape[1:]):
      raise ValueError(f"routing replay: {where} holds experts of shape "
                       f"{x.shape}, want ({len(seq) - 1}, Lm, K) for its "
                       f"{len(seq)} prompt and response tokens")
    shape, dtype = x.shape[1:], x.dtype
  return shape + (dtype,)


def with_scores(minibatches: list[Minibatch], members: list[list[int]], *,
                reward_PxK: np.ndarray, correct_PxK: np.ndarray
                ) -> list[Minibatch]:
  """Each minibatch with its groups' rewards and correctness, in its group
  order and zero-padded like its padding prompts."""
  out = []
  for mb, idx in zip(minibatches, members):
    pad = ((0, mb.valid_P.shape[0] - len(idx)), (0, 0))
    out.append(mb.replace(
        reward_PxK=np.pad(np.asarray(reward_PxK, np.float32)[idx], pad),
        correct_PxK=np.pad(np.asarray(correct_PxK, bool)[idx], pad)))
  return out


def group_row_length(group: replay_buffer.Group, prompt: list[int]) -> int:
  """Model-input length of the group's longest row (prompt + response - 1)."""
  return len(prompt) + max(t.length for t in group.trajectories) - 1


def sorted_minibatches(groups: list[replay_buffer.Group],
                       prompts: list[list[int]], *, size: int, version: int,
                       train_on_old_segments: bool,
                       len_buckets: tuple[int, ...], pad_id: int,
                       rows: tuple[int, ...] | None = None, pack: bool = True,
                       images: ImageInputs | None = None
                       ) -> tuple[list[Minibatch], list[list[int]]]:
  """Minibatches of `size` whole groups, each packed into its own bucket.

  Groups are ordered by their longest sequence first, so a few long
  responses share minibatches. `rows` defaults to `row_buckets(size * K)`.
  Returns the minibatches and, for each, the indices of its groups.
  """
  if rows is None:
    k = len(groups[0].trajectories) if groups else 1
    rows = row_buckets(size * k)
  order = sorted(range(len(groups)),
                 key=lambda i: group_row_length(groups[i], prompts[i]))
  out, members = [], []
  for start in range(0, len(order), size):
    idx = order[start:start + size]
    out.append(packed_minibatch(
        [groups[i] for i in idx], [prompts[i] for i in idx], version=version,
        train_on_old_segments=train_on_old_segments, len_buckets=len_buckets,
        rows=rows, pad_id=pad_id, pad_prompts_to=size, pack=pack,
        images=None if images is None else images._replace(
            pixels=[images.pixels[i] for i in idx])))
    members.append(idx)
  return out, members
