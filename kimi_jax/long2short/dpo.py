"""DPO for long2short (report 2.4): preference pairs and the loss.

Pairs: "The shortest correct solution is selected as the positive sample,
while longer responses are treated as negative samples, including both wrong
longer responses and correct longer responses (1.5 times longer than the
chosen positive sample)." Per prompt: the shortest correct response y+ is
paired with every incorrect response and every correct response longer than
`long_ratio` x len(y+). A prompt with no correct response gives no pair.

Loss (Rafailov et al. 2023), per pair, with the frozen reference pi_ref (the
long model) and temperature beta:

  z    = beta * [(log pi(y+|x) - log pi_ref(y+|x))
                 - (log pi(y-|x) - log pi_ref(y-|x))]
  loss = -log sigmoid(z) = softplus(-z)

averaged over the real pairs of a batch. d loss / d log pi(y+|x) =
-beta * sigmoid(-z) and d loss / d log pi(y-|x) = +beta * sigmoid(-z).

DPO can lower the likelihood of the chosen responses too, as long as the
rejected ones fall faster, until the policy degenerates (the long2short
experiment saw it after 40 steps). `nll_weight` > 0 adds
`nll_weight * -log pi(y+|x) / |y+|` per pair (a negative log-likelihood
term on the chosen response per token, as in Pang et al. 2024, "Iterative
Reasoning Preference Optimization"; not in the report, 0 by default).

Batches pack the 2P sequences (prompt + response) of up to P pairs first-fit
into R rows of T tokens, each sequence its own segment (attention never
crosses sequences); `seq_RxT` tags each token with 2p (chosen) or 2p + 1
(rejected), 2P on padding, so the loss sums token log-probs back into
log pi(y|x) per response, as the RL minibatches do.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.long2short.samples import Samples
from kimi_jax.long2short.shortest import shortest_correct
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import losses, trainer
from kimi_jax.sharding import Sharder
from kimi_jax.token_rows import TokenRows, empty_rows


def preference_pairs(lengths_N: np.ndarray, correct_N: np.ndarray, *,
                     long_ratio: float = 1.5) -> list[tuple[int, int]]:
  """(chosen, rejected) response indices of one prompt's group."""
  best = shortest_correct(lengths_N, correct_N)
  if best is None:
    return []
  lengths_N = np.asarray(lengths_N)
  correct_N = np.asarray(correct_N, bool)
  limit = long_ratio * lengths_N[best]
  return [(best, j) for j in range(len(lengths_N))
          if not correct_N[j] or lengths_N[j] > limit]


@dataclasses.dataclass(frozen=True)
class Pair:
  """Token ids of one preference pair: prompt, chosen and rejected
  responses (each response ends with its stop token when it had one)."""

  prompt: tuple[int, ...]
  chosen: tuple[int, ...]
  rejected: tuple[int, ...]


def all_pairs(samples: Samples, *, long_ratio: float) -> list[Pair]:
  out = []
  for p in range(samples.n_prompts):
    for c, r in preference_pairs(samples.lengths_PxN[p],
                                 samples.correct_PxN[p],
                                 long_ratio=long_ratio):
      out.append(Pair(tuple(samples.prompts[p]), tuple(samples.tokens[p][c]),
                      tuple(samples.tokens[p][r])))
  return out


@flax.struct.dataclass
class PairBatch:
  """Up to P pairs packed into R x T rows.

  rows: model input; mask_RxT marks response targets.
  seq_RxT: 2p for tokens of pair p's chosen response sequence, 2p + 1 for
    its rejected one, 2P on padding.
  ref_logp_Px2: log pi_ref(y|x) of (chosen, rejected) (zeros until set).
  len_Px2: response tokens of (chosen, rejected) (0 on padding slots).
  valid_P: 1 for real pairs, 0 for padding slots.
  """

  rows: TokenRows
  seq_RxT: np.ndarray
  ref_logp_Px2: np.ndarray
  len_Px2: np.ndarray
  valid_P: np.ndarray

  @property
  def n_pairs(self) -> int:
    return int(self.valid_P.shape[0])


def pack_pairs(pairs: Sequence[Pair], *, n_pairs: int, n_rows: int,
               row_len: int, pad_id: int) -> tuple[PairBatch, int]:
  """Pairs `pairs[0], pairs[1], ...` packed first fit (both sequences of a
  pair or neither) into one batch; stops at `n_pairs` pairs or at the first
  pair that does not fit. Returns the batch and how many pairs it holds."""
  batch = PairBatch(rows=empty_rows(n_rows, row_len, pad_id),
                    seq_RxT=np.full((n_rows, row_len), 2 * n_pairs, np.int32),
                    ref_logp_Px2=np.zeros((n_pairs, 2), np.float32),
                    len_Px2=np.zeros((n_pairs, 2), np.float32),
                    valid_P=np.zeros((n_pairs,), np.float32))
  room = np.full(n_rows, row_len, np.int64)
  segments = np.zeros(n_rows, np.int32)
  placed = 0
  for pair in pairs[:n_pairs]:
    seqs = [list(pair.prompt) + list(pair.chosen),
            list(pair.prompt) + list(pair.rejected)]
    need = [len(s) - 1 for s in seqs]
    if max(need) > row_len:
      raise ValueError(f"a preference pair sequence of {max(need) + 1} "
                       f"tokens does not fit a row of {row_len}")
    trial = room.copy()
    where = []
    for n in need:
      fits = np.flatnonzero(trial >= n)
      if not len(fits):
        break
      where.append((fits[0], row_len - trial[fits[0]]))
      trial[fits[0]] -= n
    if len(where) < 2:
      break
    for side, (seq, n, (r, col)) in enumerate(zip(seqs, need, where)):
      segments[r] += 1
      span = slice(col, col + n)
      rows = batch.rows
      rows.tokens_RxT[r, span] = seq[:-1]
      rows.targets_RxT[r, span] = seq[1:]
      rows.positions_RxT[r, span] = np.arange(n)
      rows.segment_ids_RxT[r, span] = segments[r]
      rows.mask_RxT[r, col + len(pair.prompt) - 1:col + n] = 1.0
      batch.seq_RxT[r, span] = 2 * placed + side
      batch.len_Px2[placed, side] = n + 1 - len(pair.prompt)
    room = trial
    batch.valid_P[placed] = 1.0
    placed += 1
  return batch, placed


def make_batches(pairs: Sequence[Pair], *, n_pairs: int, n_rows: int,
                 row_len: int, pad_id: int) -> list[PairBatch]:
  """Every pair, in order, in batches of one shape (the last may hold
  fewer pairs)."""
  out, start = [], 0
  while start < len(pairs):
    batch, placed = pack_pairs(pairs[start:], n_pairs=n_pairs, n_rows=n_rows,
                               row_len=row_len, pad_id=pad_id)
    if placed == 0:
      raise ValueError(f"pair {start} fits no empty batch of {n_rows} rows "
                       f"x {row_len}")
    out.append(batch)
    start += placed
  return out


def dpo_loss(logp_Px2: jax.Array, ref_logp_Px2: jax.Array,
             valid_P: jax.Array, *, beta: float, nll_weight: float = 0.0,
             len_Px2: jax.Array | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean over valid pairs of softplus(-z), plus `nll_weight` x the chosen
  responses' negative log-likelihood per token (`len_Px2` counts them; see
  the module docstring)."""
  logp_Px2 = logp_Px2.astype(jnp.float32)
  ratio_Px2 = logp_Px2 - jax.lax.stop_gradient(ref_logp_Px2)
  margin_P = ratio_Px2[:, 0] - ratio_Px2[:, 1]
  z_P = beta * margin_P
  valid_P = valid_P.astype(jnp.float32)
  n = jnp.maximum(valid_P.sum(), 1.0)
  loss = (jax.nn.softplus(-z_P) * valid_P).sum() / n
  metrics = {
      "pairs": valid_P.sum(),
      "accuracy": ((z_P > 0).astype(jnp.float32) * valid_P).sum() / n,
      "margin": (margin_P * valid_P).sum() / n,
      "chosen_ratio": (ratio_Px2[:, 0] * valid_P).sum() / n,
      "rejected_ratio": (ratio_Px2[:, 1] * valid_P).sum() / n,
  }
  if nll_weight:
    if len_Px2 is None:
      raise ValueError("dpo_loss: nll_weight needs len_Px2")
    nll = (-logp_Px2[:, 0] / jnp.maximum(len_Px2[:, 0], 1.0) * valid_P
           ).sum() / n
    metrics["chosen_nll"] = nll
    loss = loss + nll_weight * nll
  return loss, metrics


def pair_logp(params, batch: PairBatch, *, cfg: ModelConfig,
              sharder: Sharder | None) -> jax.Array:
  """log pi(y|x) of every pair's (chosen, rejected) responses; P x 2."""
  token_logp_RxT = trainer.token_logp_RxT(params, batch.rows, cfg=cfg,
                                          sharder=sharder)
  return losses.packed_sequence_logp(token_logp_RxT, batch.rows.mask_RxT,
                                     batch.seq_RxT, batch.n_pairs, 2)


def batch_loss(params, batch: PairBatch, *, cfg: ModelConfig,
               sharder: Sharder | None, beta: float, nll_weight: float = 0.0):
  """The train step's loss: DPO on one packed batch."""
  return dpo_loss(pair_logp(params, batch, cfg=cfg, sharder=sharder),
                  batch.ref_logp_Px2, batch.valid_P, beta=beta,
                  nll_weight=nll_weight, len_Px2=batch.len_Px2)


def row_count(n_pairs: int, multiple_of: int) -> int:
  """Rows of a batch of up to `n_pairs` pairs: one row per pair (two
  packed sequences of up to half a row each, on average), rounded up to a
  multiple of the mesh's batch shards."""
  return -(-n_pairs // multiple_of) * multiple_of
