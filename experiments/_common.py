"""Shared layout of the Qwen2.5 long-CoT RL experiments.

Not an experiment itself (the leading underscore keeps it out of the
experiment list). experiments/ is not a package, so the configs load this file
with `runpy.run_path`.

Choices not fixed by the Kimi k1.5 report are marked "ours" below. From the
report: mirror-descent loss with the mean-reward baseline, optimizer reset
every iteration, partial rollouts with a per-iteration token budget, repeat
detection with a penalty, the length reward switched on after a warm-up,
prioritized sampling by 1 - success rate, RoPE theta 1e6, and the long-CoT
SFT learning rate of 2e-5.
"""

from __future__ import annotations

import os
import runpy

import ml_collections

_HERE = os.path.dirname(os.path.abspath(__file__))


def _tiny() -> dict:
  """experiments/tiny.py's namespace (experiments/ is not a package)."""
  return runpy.run_path(os.path.join(_HERE, "tiny.py"))


def qwen2_5_model(*, vocab_size: int, d_model: int, n_layers: int,
                  n_heads: int, n_kv_heads: int, mlp_dim: int,
                  tie_embeddings: bool, max_seq_len: int
                  ) -> ml_collections.ConfigDict:
  """A Qwen2.5 model section: the family's fixed choices plus the sizes."""
  return ml_collections.ConfigDict(dict(
      vocab_size=vocab_size,
      d_model=d_model,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=128,
      mlp_dim=mlp_dim,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      tie_embeddings=tie_embeddings,
      qkv_bias=True,
      max_seq_len=max_seq_len,
      param_dtype="bfloat16",
      compute_dtype="bfloat16",
      remat=True,
  ))


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  out, n = [], lo
  while n < hi:
    out.append(n)
    n *= 2
  return tuple(out) + (hi,)


def long_cot_config(model: ml_collections.ConfigDict, *,
                    mesh: dict[str, int], max_slots: int,
                    prompts_per_iteration: int, minibatch_prompts: int,
                    learning_rate: float) -> ml_collections.ConfigDict:
  """The full experiment, in the same sections and keys as experiments/tiny.py.

  A sequence is prompt + response, at most `model.max_seq_len` tokens: the
  sampler's slots, the prefill buckets (a partial rollout re-prefills its
  prompt plus earlier segments, so buckets reach the full length) and the
  training length buckets all go up to it.
  """
  seq_len = model.max_seq_len
  max_prompt = 2048  # ours: longer math prompts are dropped by the task
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = model
  # A local Hugging Face directory (e.g. Qwen2.5-7B-Instruct); set per run.
  c.init_from_hf = ""
  c.mesh = ml_collections.ConfigDict(mesh)
  c.sharding = _tiny()["sharding_config"]()

  c.task = ml_collections.ConfigDict(dict(
      name="jsonl",
      train_path="",
      eval_path="",
      reward="math",
      prompt_field="prompt",
      answer_field="answer",
  ))

  # Long-CoT warm start (report 2.2 / 2.5.2): packed sequences at the full
  # length, learning rate 2e-5 as the report's first SFT stage.
  c.sft = ml_collections.ConfigDict(dict(
      steps=1000,
      batch_size=64,
      seq_len=seq_len,
      learning_rate=2e-5,
      warmup_steps=50,
      weight_decay=0.0,
      grad_clip=1.0,
  ))

  c.sampler = ml_collections.ConfigDict(dict(
      max_slots=max_slots,
      cache_len=seq_len,
      prefill_buckets=_powers_of_two(512, seq_len),
      # Long prompts are compute-bound already; bigger prefill batches would
      # only multiply the prefill's activation memory.
      prefill_batch_buckets=(1, 2, 4, 8),
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      # ours: long math text repeats short n-grams legitimately; only a block
      # of up to 64 tokens repeated 8 times in a row counts as a loop.
      repeat_ngram=64,
      repeat_times=8,
  ))

  c.rl = ml_collections.ConfigDict(dict(
      iterations=1000,
      prompts_per_iteration=prompts_per_iteration,
      samples_per_prompt=8,  # ours (the report's k is not given)
      loss="mirror_descent",
      tau=1.0,  # ours (not given)
      baseline="mean",  # the report: the empirical mean works well
      learning_rate=learning_rate,
      grad_clip=1.0,
      minibatch_prompts=minibatch_prompts,
      epochs=1,
      reset_optimizer=True,  # the report resets it every iteration
      max_response_len=seq_len - max_prompt,
      # Partial rollouts: a trajectory writes at most this many tokens per
      # iteration and continues from the replay buffer in the next one.
      token_budget=seq_len // 4,
      max_wait_iterations=4,
      # A queue of extra groups that take slots freed mid-window
      # (docs/loop.md); needs prompts_per_iteration x
      # samples_per_prompt <= sampler.max_slots. 0: off.
      queued_prompts=0,
      queued_min_tokens=1,
      train_on_old_segments=False,
      reference_logprobs="recompute",
      length_reward_weight=0.1,  # ours (the report gives no weight)
      length_reward_warmup=100,  # ours: off at first, then constant
      repeat_penalty=-1.0,
      train_len_buckets=_powers_of_two(4096, seq_len),
      pack_sequences=True,
      eval_every=20,
      eval_samples=4,
  ))

  # Report 2.3.4: prioritized sampling by 1 - success rate, as tiny.py. A
  # curriculum ("warmup_then_hard" / "stages") needs a `difficulty` field.
  c.prompt_sampling = _tiny()["prompt_sampling_config"]()

  c.checkpoint = ml_collections.ConfigDict(dict(every_iterations=5,
                                                max_to_keep=3))
  c.log = ml_collections.ConfigDict(dict(progress=True, plots=True))
  return c


def tiny_variant(model: ml_collections.ConfigDict
                 ) -> ml_collections.ConfigDict:
  """experiments/tiny.py with `model`'s architecture family at tiny sizes.

  Keeps what makes the family (query heads per kv head, tied or separate
  embeddings, qkv bias, remat) and takes every size, the float32 dtypes and
  the synthetic pointer-chasing task from tiny.py, so it runs on a laptop
  CPU with no downloads.
  """
  c = _tiny()["get_config"]()
  group = model.n_heads // model.n_kv_heads
  c.model.update(dict(
      n_heads=c.model.n_kv_heads * group,
      tie_embeddings=model.tie_embeddings,
      qkv_bias=model.qkv_bias,
      remat=model.remat,
      param_dtype="float32",
      compute_dtype="float32",
  ))
  return c


def select(arg: str | None, full: ml_collections.ConfigDict
           ) -> ml_collections.ConfigDict:
  """`get_config(arg)`: the full config, or its tiny variant for "tiny"."""
  if arg in (None, ""):
    return full
  if arg == "tiny":
    return tiny_variant(full.model)
  raise ValueError(f"unknown config variant {arg!r} (known: 'tiny')")
