"""Finished groups -> fixed-shape training arrays.

A row is prompt + response; the model reads row[:-1] and predicts row[1:].
Response token t sits at row index len(prompt) + t, i.e. target index
len(prompt) + t - 1. The loss mask marks response targets whose token was
sampled by the current policy (or all response tokens, when earlier segments
count); the response length used by the length reward is always the full
length over every segment, which is what `lengths_PxK` carries.

Shapes are padded to buckets so jitted steps compile a bounded number of
times: T to the smallest `len_buckets` entry that fits, P to a multiple of the
minibatch (padding prompts have an all-zero mask and `valid_P = 0`).
`sorted_minibatches` groups responses of similar length so each minibatch
is padded only to its own bucket.
"""

from __future__ import annotations

import numpy as np

from kimi_jax.rl import replay_buffer


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"training sequence of {n} tokens exceeds the largest "
                   f"length bucket {buckets[-1]} (config.rl.train_len_buckets)")


def group_arrays(groups: list[replay_buffer.Group],
                 prompts: list[list[int]], *, version: int,
                 train_on_old_segments: bool, len_buckets: tuple[int, ...],
                 pad_id: int, pad_prompts_to: int) -> dict[str, np.ndarray]:
  """Arrays of shape P x K x T (tokens, targets, positions, segment_ids,
  mask), P x K (lengths, sampler_seq_logp) and P (valid)."""
  if len(groups) != len(prompts):
    raise ValueError(f"{len(groups)} groups but {len(prompts)} prompts")
  k = len(groups[0].trajectories) if groups else 1
  longest = max([len(p) + t.length - 1 for g, p in zip(groups, prompts)
                 for t in g.trajectories] + [1])
  T = bucket_length(longest, len_buckets)
  n = len(groups)
  P = max(pad_prompts_to, -(-n // pad_prompts_to) * pad_prompts_to)
  out = {
      "tokens": np.full((P, k, T), pad_id, np.int32),
      "targets": np.full((P, k, T), pad_id, np.int32),
      "positions": np.zeros((P, k, T), np.int32),
      "segment_ids": np.zeros((P, k, T), np.int32),
      "mask": np.zeros((P, k, T), np.float32),
      "lengths": np.zeros((P, k), np.int32),
      "sampler_seq_logp": np.zeros((P, k), np.float32),
      "valid": np.zeros((P,), np.float32),
  }
  for p, (group, prompt) in enumerate(zip(groups, prompts)):
    out["valid"][p] = 1.0
    for j, traj in enumerate(group.trajectories):
      row = list(prompt) + list(traj.tokens)
      m = len(row) - 1
      out["tokens"][p, j, :m] = row[:-1]
      out["targets"][p, j, :m] = row[1:]
      out["positions"][p, j, :m] = np.arange(m)
      out["segment_ids"][p, j, :m] = 1
      resp_mask = replay_buffer.loss_mask(traj.token_versions(), version,
                                          train_on_old_segments)
      start = len(prompt) - 1
      out["mask"][p, j, start:start + traj.length] = resp_mask
      out["lengths"][p, j] = traj.length
      out["sampler_seq_logp"][p, j] = float(
          np.sum(np.asarray(traj.logprobs, np.float64)[resp_mask]))
  return out


def attach_scores(minibatches: list[dict[str, np.ndarray]],
                  members: list[list[int]], **per_group_PxK: np.ndarray
                  ) -> None:
  """Adds per-group arrays (reward, correct, ...) to each minibatch, in its
  group order and zero-padded like its padding prompts."""
  for mb, idx in zip(minibatches, members):
    pad = mb["valid"].shape[0] - len(idx)
    for name, values in per_group_PxK.items():
      mb[name] = np.pad(np.asarray(values)[idx], ((0, pad), (0, 0)))


def group_row_length(group: replay_buffer.Group, prompt: list[int]) -> int:
  """Model-input length of the group's longest row (prompt + response - 1)."""
  return len(prompt) + max(t.length for t in group.trajectories) - 1


def sorted_minibatches(groups: list[replay_buffer.Group],
                       prompts: list[list[int]], *, size: int, version: int,
                       train_on_old_segments: bool,
                       len_buckets: tuple[int, ...], pad_id: int
                       ) -> tuple[list[dict[str, np.ndarray]], list[int]]:
  """Minibatches of `size` prompts, each padded to its own length bucket.

  Groups are ordered by their longest row first, so a few long responses
  do not pad every row of the iteration to their length. Returns the
  minibatches and, for each, the indices of its groups in `groups`.
  """
  order = sorted(range(len(groups)),
                 key=lambda i: group_row_length(groups[i], prompts[i]))
  out, members = [], []
  for start in range(0, len(order), size):
    idx = order[start:start + size]
    out.append(group_arrays([groups[i] for i in idx],
                            [prompts[i] for i in idx], version=version,
                            train_on_old_segments=train_on_old_segments,
                            len_buckets=len_buckets, pad_id=pad_id,
                            pad_prompts_to=size))
    members.append(idx)
  return out, members
