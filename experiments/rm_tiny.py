"""python launch/rm_study.py --config experiments/rm_tiny.py --workdir /tmp/rm_tiny

Reward models on a task with exact ground truth (report 2.3.5 at tiny
scale): the tiny pointer-chasing experiment (experiments/tiny.py), whose
verifier is exact. The study (kimi_jax/reward_models/study.py):

  1. warm start: the tiny job's SFT stage (and its held-out evaluation);
  2. launch/train_rm.py's pipeline on that policy: labelled responses
     (rm_data), the classic value-head model (rm_value) and the
     chain-of-thought model (rm_cot), both judged on held-out prompts
     against the exact verifier (rm_eval.json);
  3. RL from the same warm start, one run per arm of `study.arms`: the
     exact verifier, the CoT model, the classic model (task.reward), each
     `study.rl_iterations` iterations; held-out pass@1 always by the exact
     verifier, the reward models audited against it every iteration;
  4. rm_study.json / the printed table: agreement of both models with the
     exact verifier, final pass@1 of each arm, |CoT - exact| <= 0.05, and
     reward-hacking signs (training reward up while the audited accuracy
     stays flat).

`experiments/rm_tiny.py:micro` runs the same steps at seconds scale (the
micro job, a few dozen labelled responses, two RL iterations) for
tests/test_reward_models.py. Train the models alone with
`python launch/train_rm.py --config experiments/rm_tiny.py --workdir W
--policy_workdir WARM`. Timings on 2 CPU cores: docs/rewards.md.
"""

import ml_collections

from experiments import tiny


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "micro"):
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  micro = arg == "micro"
  c = tiny.get_config("micro" if micro else None)
  c.log.progress = False

  # Labelled data: the warm-started policy's answers, labelled by the exact
  # verifier. Inputs: bos + 'Question: x cN =' + 'Reference: y' +
  # 'Response:' + up to 32 response tokens + 'Judge:' <= 48 tokens.
  c.rm_data = ml_collections.ConfigDict(dict(
      samples_per_prompt=2 if micro else 4,
      train_prompts=32 if micro else 0,  # 0: every training prompt
      eval_prompts=16 if micro else 0,  # 0: every held-out prompt
      temperature=1.0,
      max_response_len=0,  # 0: rl.max_response_len
      max_input_len=48,
      min_response_tokens=8,
      instruction="",  # the tiny vocabulary has no room for prose
      hand_labelled="",
      hand_verifier="math",
      models=("value", "cot"),
  ))
  c.rm_value = ml_collections.ConfigDict(dict(
      loss="bce",  # or "bradley_terry"
      steps=10 if micro else 400,
      batch_rows=8 if micro else 16,
      row_len=48,
      learning_rate=1e-3,
      warmup_steps=2 if micro else 20,
      weight_decay=0.0,
      grad_clip=1.0,
      checkpoint_every=100,  # steps between checkpoints a rerun resumes
  ))
  c.rm_cot = ml_collections.ConfigDict(dict(
      seed_examples=16 if micro else 128,
      seed_steps=30 if micro else 100,
      rejection_samples=1 if micro else 2,
      rejection_temperature=1.0,
      steps=10 if micro else 300,
      batch_rows=8 if micro else 16,
      row_len=64,
      learning_rate=3e-3 if micro else 1e-3,
      warmup_steps=2 if micro else 20,
      weight_decay=0.0,
      grad_clip=1.0,
      max_new_tokens=12,  # 'final y Reference: y same {"correct": true}' + eos
      max_slots=32 if micro else 128,
      checkpoint_every=100,  # per SFT stage
  ))
  c.reward_model.max_slots = 32 if micro else 128
  c.reward_model.audit = True  # the exact verifier beside every RM call
  c.study = ml_collections.ConfigDict(dict(
      # 20 of tiny.py's 80 iterations: the exact-verifier arm is past 0.85
      # pass@1 by then, and three arms fit about half an hour on 2 cores
      # (docs/rewards.md). Longer runs: --config.study.rl_iterations=80.
      rl_iterations=1 if micro else 20,
      eval_every=0 if micro else 10,
      arms=("pointer_chase", "rm_cot", "rm_value"),
      # The claim checked: RL on the CoT model ends within this of RL on
      # the exact verifier (held-out pass@1, exact verifier).
      tolerance=0.05,
  ))
  return c
