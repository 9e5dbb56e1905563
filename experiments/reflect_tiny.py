"""python launch/tpu_run.py --config experiments/reflect_tiny.py --workdir /tmp/reflect

A task where thinking longer pays (kimi_jax/data/reflect.py,
docs/reflect_task.md): find the x with f^n(x) = y for a table f of N digits
shown in the prompt, by trying candidates, checking each with n lookups and
backtracking on a miss (`02:7- 37:7+ =3`). Four levels, 4, 5, 6 and 8
candidates, one lookup per check. A bare answer is a guess; each
checked candidate raises the chance of being right; harder levels need
more checks.

The gym pipeline (kimi_jax/curation/gym_pipeline.py, docs/gym_pipeline.md)
runs it from scratch: vanilla SFT of a small model on scripted worked
solutions (bare answers and short searches for the plain prompt, full
searches under a cue), curation of the RL prompts (format, dedup against
the held-out and validation problems), long-CoT warm-up rows by rejection
sampling the vanilla model under the cue (report 2.2: only responses whose
answer and every lookup are right), a short long-CoT SFT on them, then
Kimi k1.5 RL. W/summary.json: vanilla_eval, warmstart_eval and final_eval
(held-out) and vanilla_val, warmstart_val and final_val (validation), each
with `by_difficulty: {level: {pass_at_1, mean_length, n_problems}}`.
Settings are chosen on validation; held out is read before and after RL.

Variants:
  (default)  levels 1-4, 200 held-out and 200 validation problems.
  micro      seconds-scale, for tests.
"""

import json

import ml_collections

from experiments import gym_tiny, tiny
from kimi_jax.curation.curate import CurateConfig
from kimi_jax.curation.gym_pipeline import PipelineConfig
from kimi_jax.curation.gym_problems import GymConfig
from kimi_jax.curation.warmup import WarmupConfig
from kimi_jax.data import reflect
from kimi_jax.infra.config import from_dataclass

# The prompt engineering of report 2.2 for a model that has only seen this
# cue: under it the vanilla worked solutions search until a candidate
# checks out.
COT_CUE = "\nCheck every candidate."
# Plain-prompt worked solutions check 1 or 2 candidates, then answer.
OPTIONS = {reflect.DATASET: {"levels": list(reflect.LEVELS),
                             "plain_budget": 2}}
# The longest prompt (8 pairs and `?>y`, 26 tokens, with BOS and the cue
# 32) and the longest full search (8 attempts of 5 and the answer, 51
# tokens with EOS) fit a 96-token sequence.
SEQ_LEN = 96
MAX_RESPONSE = 56


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = tiny.get_config()
  c.model.update(vocab_size=128, d_model=128, n_layers=4, n_heads=4,
                 n_kv_heads=2, head_dim=32, mlp_dim=512, max_seq_len=SEQ_LEN)
  c.task = gym_tiny.pipeline_task("reflect")
  c.sft.update(batch_size=32, seq_len=SEQ_LEN, learning_rate=2e-3,
               warmup_steps=20, decay="cosine", final_learning_rate=2e-4)
  c.sampler.update(cache_len=SEQ_LEN, prefill_buckets=(16, 32, 40),
                   max_slots=128)
  # The report's recipe: mirror descent with the mean-reward baseline
  # (eq. 3) and the optimizer reset every iteration (2.3.2). No length
  # penalty: the report warms it up after a phase without it (2.3.3), and
  # this short run is that first phase, whose length growth is what it
  # studies.
  # 16 prompts x 8 samples, one pass in two minibatches, so 40 iterations
  # fit the experiment's 15 minutes on 2 cores. Learning rate 1e-4, chosen
  # on validation over seeds 0-4 (ablations.py:reflect_lr): final
  # validation pass@1 0.451 against 0.442 at 5e-5 and 0.307 at 2e-4, where
  # RL fell far below the warm start on two seeds (docs/reflect_task.md).
  c.rl.update(iterations=40, prompts_per_iteration=16, samples_per_prompt=8,
              minibatch_prompts=8, learning_rate=1e-4, epochs=1,
              reset_optimizer=True, baseline="mean", loss="mirror_descent",
              max_response_len=MAX_RESPONSE, token_budget=MAX_RESPONSE,
              length_reward_weight=0.0, length_reward_warmup=0,
              train_len_buckets=(48, 72, SEQ_LEN), eval_every=10,
              eval_samples=4)
  c.prompt_sampling.initial_success_field = ""
  # Every level in equal shares; one vanilla problem in ten answered
  # bare, the rest worked: half under the cue (a full search), half
  # plain (a short one).
  c.pipeline = from_dataclass(PipelineConfig, cot_cue=COT_CUE,
                              vanilla_sft_steps=600, sft_problems=20000,
                              direct_fraction=0.1, cued_fraction=0.5,
                              long_cot_sft_steps=10,
                              long_cot_learning_rate=2e-4,
                              long_cot_warmup_steps=2)
  c.gym = from_dataclass(GymConfig, datasets=reflect.DATASET, size=800,
                         eval_size=200, val_size=200,
                         options_json=json.dumps(OPTIONS), prompt_suffix="")
  # Curation and the warm-up judge answers and every lookup; RL and
  # evaluation the answer alone (a search with a slip in a rejected
  # candidate still found the answer).
  c.reward = ml_collections.ConfigDict(dict(name="reflect_steps",
                                            options={}))
  # A departure from report 2.1: every prompt is guessable at about 1/N
  # by design (the bare answer is the task's shortest response), so the
  # easy-to-hack step drops most of every level (measured with seed 0's
  # vanilla model, bare answers after "=": 534 of 800 prompts, 140 of 200
  # at level 1 and 127 of 200 at level 4; docs/reflect_task.md). Every
  # level stays in the RL set, so no pass-rate step either. Prompts of digit pairs share most character 5-grams:
  # exact dedup only.
  c.curate = from_dataclass(CurateConfig, easy_to_hack=False,
                            pass_rate=False, dedup_near=False,
                            pass_max_tokens=MAX_RESPONSE)
  c.warmup = from_dataclass(WarmupConfig, template="{prompt}" + COT_CUE,
                            samples=4, max_new_tokens=MAX_RESPONSE,
                            keep="all", max_per_prompt=1, accept="score")
  if arg == "micro":
    shrink_to_micro(c)
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  return c


def shrink_to_micro(c: ml_collections.ConfigDict) -> None:
  """Seconds-scale: a handful of problems, steps and iterations."""
  c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=16, mlp_dim=256)
  # The two easiest levels, and answers judged alone in the data stages:
  # a model this briefly trained finds right answers, not
  # yet verified searches (1 in 3 or 4 by luck).
  c.pipeline.update(vanilla_sft_steps=150, sft_problems=400,
                    long_cot_sft_steps=4, long_cot_warmup_steps=1)
  c.gym.update(size=16, eval_size=8, val_size=8, options_json=json.dumps(
      {reflect.DATASET: {"levels": [1, 2], "plain_budget": 2}}))
  c.reward.name = "reflect"
  c.warmup.accept = "answer"
  c.sft.update(batch_size=8, warmup_steps=1, learning_rate=3e-3)
  c.sampler.max_slots = 32
  c.rl.update(iterations=2, prompts_per_iteration=4, samples_per_prompt=4,
              minibatch_prompts=4, eval_every=0, eval_samples=1)
  c.warmup.update(samples=8)
  c.log.update(progress=False, plots=False)
