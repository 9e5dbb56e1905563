"""python launch/long2short.py --config experiments/long2short_tiny.py --workdir /tmp/l2s

Long2short on the tiny pointer-chasing task (docs/long2short.md, report 2.4
and 3.4). A base model learns the hidden permutation from plain chains. The
long-CoT model is the main job from that base on the task's recheck style:
three in four warm-start solutions verify the chain after writing it
(`check`, the problem restated, every step re-derived), so it writes about
1.8x the tokens of the shortest correct chain, and the verification never
changes an answer. The short-only baseline is the same recipe on the
short-CoT answer of this task, the answer alone (a model that never saw a
chain). Four long2short methods then start from the long model: merging
with the short model, shortest rejection sampling, DPO, and a second RL
phase with a heavier length penalty and a shorter rollout cap. Every model
is evaluated on the same held-out problems; `WORKDIR/long2short.json` and
`WORKDIR/token_efficiency.png` compare them.

`experiments/long2short_tiny.py:micro` is a seconds-scale variant for tests.
"""

import ml_collections

from experiments import tiny


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = tiny.get_config()
  # A chain has 3n + 3 tokens, a recheck 3n + 4 more: 55 at n = 8, 59 with
  # the prompt.
  c.model.max_seq_len = 64
  c.task.update(dict(
      eval_fraction=0.2,
      # No direct answers: every long-CoT solution is a chain, checked or
      # not (the short-only baseline's are direct: l2s.short_cot_style).
      direct_fraction=0.0,
      warmstart_fraction=1.0,
      cot_style="rechecks",
      recheck_rate=0.75,
      max_rechecks=1,
  ))
  c.sft.update(dict(steps=300, seq_len=64))
  c.sampler.update(dict(cache_len=64, prefill_buckets=(8, 16, 32, 64)))
  c.rl.update(dict(
      iterations=8,
      max_response_len=60,
      token_budget=20,
      # The long phase runs without the length penalty; raising it is the
      # long2short RL phase's job (l2s_rl below).
      length_reward_weight=0.0,
      length_reward_warmup=0,
      train_len_buckets=(16, 32, 48, 64),
      eval_every=0,
      # The main jobs' own evaluations are a side show; every model gets
      # l2s.eval_samples draws per problem in the comparison.
      eval_samples=1,
  ))
  c.checkpoint.update(dict(every_iterations=10, max_to_keep=1))

  c.l2s = ml_collections.ConfigDict(dict(
      base_sft_steps=500,
      base_seq_len=32,
      long_workdir="",
      short_workdir="",
      # The short-CoT answer of this task; "plain" (the shortest chain)
      # would be the ideal the methods compress towards, not a baseline.
      short_cot_style="direct",
      samples_per_prompt=8,  # the report's n
      sample_prompts=0,  # every train prompt
      eval_samples=8,
  ))
  c.merge = ml_collections.ConfigDict(dict(alpha=0.5))  # simple averaging
  c.shortest_rs = ml_collections.ConfigDict(dict(
      steps=60, batch_size=64, learning_rate=3e-4, warmup_steps=10))
  # 30 steps: at 60 the chosen responses' own log-ratio turns negative
  # after step 40 and the policy degenerates (pass@1 0.01 in one run).
  c.dpo = ml_collections.ConfigDict(dict(
      beta=0.1, long_ratio=1.5, steps=30, batch_pairs=32,
      learning_rate=1e-4, warmup_steps=10, grad_clip=1.0, nll_weight=0.0,
      checkpoint_every=100))  # steps between checkpoints a rerun resumes
  # The long RL phase's settings except: length penalty 0 -> 1 from the
  # first iteration, rollout cap 60 -> 32 tokens (the longest plain chain
  # has 27).
  c.l2s_rl = ml_collections.ConfigDict(dict(
      iterations=12, length_reward_weight=1.0, length_reward_warmup=0,
      max_response_len=32, token_budget=16, learning_rate=2e-4))
  if arg == "micro":
    shrink_to_micro(c)
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  return c


def shrink_to_micro(c: ml_collections.ConfigDict) -> None:
  """Seconds-scale variant for tests: every stage runs, briefly."""
  tiny.shrink_to_micro(c)
  # Chains of at most 3 steps: 24 tokens with detours, 27 with the prompt.
  c.task.max_steps = 3
  c.model.max_seq_len = 32
  c.sft.update(dict(steps=10, seq_len=32))
  c.sampler.update(dict(cache_len=32, prefill_buckets=(8, 16, 32)))
  c.rl.update(dict(iterations=1, max_response_len=24, token_budget=12,
                   train_len_buckets=(16, 32)))
  c.l2s.update(dict(base_sft_steps=5, base_seq_len=16, sample_prompts=8,
                    eval_samples=1))
  c.shortest_rs.update(dict(steps=2, batch_size=16, warmup_steps=0))
  c.dpo.update(dict(steps=2, batch_pairs=8, warmup_steps=0))
  c.l2s_rl.update(dict(iterations=1, max_response_len=16, token_budget=8))
