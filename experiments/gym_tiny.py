"""python launch/tpu_run.py --config experiments/gym_tiny.py --workdir /tmp/kimi_gym

From raw reasoning-gym problems to an RL-trained policy in one job, on a
laptop CPU (kimi_jax/curation/gym_pipeline.py, docs/gym_pipeline.md):
problems from reasoning-gym's generators and a tokenizer built on them;
vanilla SFT of a small model from scratch on worked solutions; curation of
the RL prompts
with that model (pass-rate step, report 2.1); long-CoT warm-up rows by
rejection sampling it (2.2); then the main job: long-CoT SFT on those rows
and Kimi k1.5 RL on the curated prompts. W/summary.json: curation, warmup,
vanilla_eval, warmstart_eval, final_eval (pass@1 overall and per task), and
the same three on the validation set (vanilla_val, warmstart_val,
final_val; RL's periodic evaluations read it).

Variants:
  (default)    `spelling`, whose raw prompts also hold 1000 syllogisms, a
               guessable yes/no task (70% of the answers are "Yes") that
               the vanilla stage teaches as a bare verdict and that is
               neither held out nor validated: curation's format rule
               removes them (report 2.1), the run without curation trains
               on them (about 10 minutes for seed 0 on 2 cores; five seeds
               in docs/gym_pipeline.md).
  spelling     spelling backward, lower-case words of 3-7 letters: a
               vanilla stage that stops once greedy answers are right on
               70% of the validation problems, 60 RL iterations, 500
               held-out problems; room for RL, nothing guessable for
               curation to remove.
  three_tasks  chain sums, spelling backward and letter counting, 1500
               vanilla steps, the easy-to-hack step on: every curation
               step at work, but nearly solved before RL (about 9.5
               minutes).
  micro        three_tasks at seconds scale, for tests.

The same run without curation: --config.pipeline.curate=False (the same
warm-up rows and warm start; only the RL prompts differ).
"""

import json

import ml_collections

from experiments import tiny
from kimi_jax.curation.curate import CurateConfig
from kimi_jax.curation.gym_pipeline import PipelineConfig
from kimi_jax.curation.gym_problems import GymConfig
from kimi_jax.curation.warmup import WarmupConfig
from kimi_jax.infra.config import from_dataclass

# Generators and sizes a ~1M-parameter model can learn in minutes (ours).
GYM_OPTIONS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                  "max_digits": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "letter_counting": {"min_words": 2, "max_words": 3},
}
# The spelling variant: lower-case words of 3-7 letters.
SPELLING_OPTIONS = {"spell_backward": {"min_word_len": 3, "max_word_len": 7}}
SPELLING_WHERE = {"spell_backward": {"metadata.word": "^[a-z]+$"}}
# The default's guessable task: raw RL prompts and a tenth of the vanilla
# rows, never held out or validated (the benchmark is spelling).
GUESSABLE = "syllogism"
GUESSABLE_SIZES = {GUESSABLE: {"eval_size": 0, "val_size": 0,
                               "sft_problems": 2000}}
COT_CUE = "\nThink step by step."


def pipeline_task(reward: str) -> ml_collections.ConfigDict:
  """The jsonl task a gym pipeline writes; its paths are filled in by the
  pipeline (W/data, W/tokenizer)."""
  return ml_collections.ConfigDict(dict(
      name="jsonl", train_path="", eval_path="", reward=reward,
      prompt_field="prompt", answer_field="answer",
      difficulty_field="difficulty", tags_field="tags", tests_field="tests",
      tokenizer="", chat_template=False, system_prompt="",
      on_bad_row="error"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = tiny.get_config()
  c.model.update(vocab_size=160, d_model=128, n_layers=4, n_heads=4,
                 n_kv_heads=2, head_dim=32, mlp_dim=512, max_seq_len=128)
  c.task = pipeline_task("reasoning_gym")
  c.sft.update(batch_size=32, seq_len=128, learning_rate=2e-3,
               warmup_steps=20, decay="cosine", final_learning_rate=2e-4)
  c.sampler.update(cache_len=112, prefill_buckets=(32, 64), max_slots=128)
  c.rl.update(iterations=30, prompts_per_iteration=32, samples_per_prompt=8,
              minibatch_prompts=16, learning_rate=5e-5, max_response_len=48,
              token_budget=48, length_reward_warmup=20,
              length_reward_weight=0.1, train_len_buckets=(64, 96, 128),
              eval_every=10, eval_samples=4)
  c.prompt_sampling.initial_success_field = "pass_rate"

  # 20000 problems per generator: 1500 steps see each about twice, so the
  # model learns to copy and compute rather than memorising 400 problems
  # 44 times over (its loss still fell at 600 steps); half the worked
  # solutions answer the plain prompt, so the long-CoT stage (plain
  # prompts, worked answers) shifts the mode mix instead of breaking the
  # copying (docs/gym_pipeline.md, "What did not work").
  # One in ten vanilla rows answers directly: enough for the no-CoT guesses
  # of the easy-to-hack step, while the plain prompt mostly gets steps
  # (better models and a smaller curated-RL loss than one in two; measured).
  c.pipeline = from_dataclass(PipelineConfig, cot_cue=COT_CUE,
                              vanilla_sft_steps=1500, sft_problems=20000,
                              direct_fraction=0.1, cued_fraction=0.5,
                              long_cot_sft_steps=20)
  # 1000 raw problems per generator: the easy-to-hack step drops most, and
  # RL needs more prompts left than one iteration draws (32). 50 more are
  # a validation set: RL's periodic evaluations read it, so settings can
  # be chosen without looking at the 50 held-out ones.
  c.gym = from_dataclass(GymConfig, datasets=",".join(GYM_OPTIONS),
                         size=1000, eval_size=50, val_size=50,
                         options_json=json.dumps(GYM_OPTIONS),
                         prompt_suffix="")
  c.reward = ml_collections.ConfigDict(dict(name="reasoning_gym",
                                            options={}))
  # The bare problem is the prompt, and "<answer>" opens a no-CoT guess.
  # Difficulty is the pass rate of the mode RL trains: step by step, asked
  # with the cue (plain prompts get this model's direct answers).
  c.curate = from_dataclass(CurateConfig, hack_template="{question}",
                            hack_max_tokens=8, pass_max_tokens=48,
                            pass_template="{prompt}" + COT_CUE,
                            max_pass_rate=0.9)
  c.warmup = from_dataclass(WarmupConfig, template="{prompt}" + COT_CUE,
                            samples=8, max_new_tokens=48,
                            keep="shortest")  # a departure: spelling_with_room
  if arg in (None, "", "spelling"):
    spelling_with_room(c)
    if not arg:
      with_guessable_prompts(c)
  elif arg == "micro":
    shrink_to_micro(c)
  elif arg != "three_tasks":
    raise ValueError(f"unknown variant {arg!r} (known: spelling, "
                     f"three_tasks, micro)")
  return c


def spelling_with_room(c: ml_collections.ConfigDict) -> None:
  """One task with room for RL, on a held-out set large enough to tell
  the arms apart (500 problems: a standard error near 0.01, where 50 gave
  0.03-0.05).

  Lower-case words only: reasoning-gym's word list holds proper nouns
  (about one word in six), whose capital first letter this model rarely
  sees and cannot learn to copy, so they capped every run near 0.8
  (docs/gym_pipeline.md). The vanilla stage stops once greedy answers are
  right on 70% of the validation problems (checked every 25 steps, at
  most 1000): the model learns to copy letters suddenly, after 200 to 700
  steps depending on the seed, so a fixed count left one seed unable to
  start and another with nothing left to gain; greedy accuracy says when
  the model's mode is right while sampled answers still leave RL room (a
  stop at sampled pass@1 0.25 left seed 1 with a mode right on 0.56 and a
  gain of +0.125). Steps are checked (reasoning_gym_steps): a lucky answer
  after a wrong copy earns nothing. Curation keeps every difficulty
  (balancing the buckets to the smallest left 198 prompts, each drawn
  about 19 times, and ended lower on 486 fresh problems; measured), and
  skips the easy-to-hack step: a word spelled backward cannot be guessed,
  so a right answer without steps means the model can do the task, and
  after a longer vanilla stage the step dropped 627 of 1000 prompts and
  left RL +0.010 (docs/gym_pipeline.md). RL's prioritized sampling starts
  from each prompt's measured pass rate, and the long-CoT stage peaks at
  1e-4.
  """
  c.gym.update(datasets="spell_backward",
               options_json=json.dumps(SPELLING_OPTIONS),
               where_json=json.dumps(SPELLING_WHERE), eval_size=500)
  c.pipeline.update(vanilla_sft_steps=1000, vanilla_stop_at_val=0.7,
                    vanilla_stop_metric="greedy_accuracy",
                    vanilla_check_every=25, long_cot_learning_rate=1e-4)
  c.task.reward = "reasoning_gym_steps"
  # The data stages count an answer right as RL does; the step check only
  # changes the score (kimi_jax/curation/policy.py).
  c.reward.name = "reasoning_gym_steps"
  c.sampler.cache_len = 128
  # Three departures from the report, measured together against its recipe
  # as written (ablations.py:recipe, seeds 0-3, the default variant):
  # Adam's state kept across iterations (2.3.2 resets it), the easy-to-hack
  # step off (2.1; it dropped 28, 30, 2 and 9 of 2000 prompts) and the
  # shortest verified warm-up response kept (the base's warmup.keep; 2.2
  # asks for none in particular). Validation pass@1 after RL 0.785 against
  # 0.763, the recipe lower on three seeds of four; held out 0.754 against
  # 0.746.
  c.rl.update(iterations=60, eval_every=20, reset_optimizer=False,
              max_response_len=64, token_budget=64)
  c.curate.update(pass_max_tokens=64, easy_to_hack=False)
  c.warmup.max_new_tokens = 64


def with_guessable_prompts(c: ml_collections.ConfigDict) -> None:
  """A raw prompt pool with something for curation to remove: next to the
  1000 spelling problems, 1000 of reasoning-gym's syllogisms, yes/no
  questions of the kind report 2.1 excludes as easy to hack (70% of the
  answers are "Yes", so a constant guess earns most of the reward).

  The vanilla stage learns them as a bare verdict (a tenth of its rows),
  so the model can answer them; they are neither held out nor validated,
  the benchmark staying the spelling task (the report's benchmarks hold no
  yes/no questions either). Curation's format rule drops all of them; the
  run without curation trains on them. Their category words are one token
  each (a lower word threshold), so a syllogism fits a prefill bucket.
  """
  c.gym.update(datasets=f"spell_backward,{GUESSABLE}",
               sizes_json=json.dumps(GUESSABLE_SIZES))
  c.pipeline.min_word_fraction = 0.05
  c.model.vocab_size = 192


def shrink_to_micro(c: ml_collections.ConfigDict) -> None:
  """Seconds-scale: a handful of problems, steps and iterations."""
  # Big enough to learn the answer format in its few steps, so that the
  # warm-up stage finds verified responses (small counts are often right).
  c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=16, mlp_dim=256)
  c.pipeline.update(vanilla_sft_steps=150, sft_problems=8,
                    long_cot_sft_steps=4, long_cot_warmup_steps=1)
  c.gym.update(size=6, eval_size=2, val_size=0)
  c.sft.update(batch_size=8, warmup_steps=1, learning_rate=3e-3)
  c.sampler.max_slots = 32
  c.rl.update(iterations=2, prompts_per_iteration=4, samples_per_prompt=4,
              minibatch_prompts=4, length_reward_warmup=1, eval_every=0,
              eval_samples=1)
  c.curate.update(pass_samples=2, hack_guesses=2)
  c.warmup.update(samples=8)
  c.log.update(progress=False, plots=False)
