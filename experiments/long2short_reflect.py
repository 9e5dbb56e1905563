"""python launch/long2short.py --config experiments/long2short_reflect.py --workdir W

Long2short (docs/long2short.md, report 2.4 and 3.4) on the table-inversion
task (kimi_jax/data/reflect.py, docs/reflect_task.md), where a longer
search is more often right. The long-CoT model is experiments/
reflect_tiny.py as shipped: its gym pipeline in W/long (data, vanilla SFT,
curation, long-CoT warm-up rows by rejection sampling under the cue,
long-CoT SFT, RL), the policy W/long/rl. The short-only baseline, in
W/short_baseline, is the same pipeline from a copy of long's data and
vanilla model, its warm-up rows sampled for the plain prompt (no cue: the
vanilla model's short mode, a search of one or two candidates or a bare
answer) keeping each prompt's shortest right answer; the same long-CoT SFT
and RL settings follow. Both descend from one vanilla model, so merging
averages two fine-tunes of one ancestor. Merging, shortest rejection
sampling, DPO and long2short RL then start from the long model, and every
model is evaluated on the pipeline's held-out and validation problems.

The long2short settings follow experiments/long2short_tiny.py, scaled by
the rules stated at each, not chosen on any result of this task.

`experiments/long2short_reflect.py:micro` is a variant of a few minutes
for tests.
"""

import ml_collections

from experiments import long2short_tiny, reflect_tiny

# k attempts and the answer take 6k + 3 tokens with eos (one token per
# character): 33 fits the full search of 5 candidates, every search of
# levels 1 and 2 and those that end by the 5th candidate at levels 3 and 4.
# About the tiny's cut (60 -> 32 tokens, 0.53x): 56 -> 33, 0.59x.
L2S_RL_CAP = 33


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = reflect_tiny.get_config()
  c.l2s = ml_collections.ConfigDict(dict(
      # The pipeline's vanilla model is the common ancestor: no base.
      base_sft_steps=0,
      long_workdir="",
      short_workdir="",
      short_cot_style="plain",  # the plain prompt, without the cue
      samples_per_prompt=8,  # the report's n
      sample_prompts=0,  # every curated train prompt
      eval_samples=8,
      eval_val=True,
  ))
  tiny_l2s = long2short_tiny.get_config()
  # Simple averaging, as in the tiny.
  c.merge = ml_collections.ConfigDict(tiny_l2s.merge.to_dict())
  # The tiny's 60 steps and constant rate at a tenth of the first SFT's
  # (3e-3 there, 2e-3 here, so 2e-4: the long-CoT stage's peak), in
  # reflect_tiny's batches of 32 rows of 96 tokens: 60 x 32 x 96 = 184k
  # row tokens in all against the tiny's 60 x 64 x 64 = 246k.
  c.shortest_rs = ml_collections.ConfigDict(dict(
      steps=60, batch_size=32, learning_rate=2e-4, warmup_steps=10))
  # The tiny's DPO as it is (30 steps: its collapse came after 40).
  c.dpo = ml_collections.ConfigDict(tiny_l2s.dpo.to_dict())
  # The long RL phase's settings except: length penalty 0 -> 1 from the
  # first iteration (the tiny's weight), rollout cap 56 -> 33 (above), and
  # as many prompts as the tiny's phase saw of its train set (12 x 32 of
  # 648, 0.6 of an epoch: 30 x 16 of 800); the long phase's learning rate,
  # as in the tiny.
  c.l2s_rl = ml_collections.ConfigDict(dict(
      iterations=30, length_reward_weight=1.0, length_reward_warmup=0,
      max_response_len=L2S_RL_CAP, token_budget=L2S_RL_CAP,
      learning_rate=c.rl.learning_rate))
  if arg == "micro":
    shrink_to_micro(c)
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  return c


def shrink_to_micro(c: ml_collections.ConfigDict) -> None:
  """A variant of a few minutes for tests: reflect_tiny's micro pipeline
  twice, then every long2short stage, briefly."""
  reflect_tiny.shrink_to_micro(c)
  c.l2s.update(dict(sample_prompts=8, eval_samples=1))
  c.shortest_rs.update(dict(steps=2, batch_size=8, warmup_steps=0))
  c.dpo.update(dict(steps=2, batch_pairs=8, warmup_steps=0))
  c.l2s_rl.update(dict(iterations=1))
