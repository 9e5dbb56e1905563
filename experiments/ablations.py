"""python launch/ablate.py --config experiments/ablations.py:loss --workdir /tmp/ablate_loss --seeds 3

The report's comparative claims about its RL recipe, at tiny scale: each
variant is an ablation, a set of arms that change a few keys of the tiny
experiment (experiments/tiny.py), run with several seeds by
launch/ablate.py (kimi_jax/ablation/). Results: docs/ablations.md.

  loss              mirror descent vs ReST (report 3.5, Figure 10)
  sampling          curriculum vs uniform (Figure 9), prioritized vs uniform
                    (2.3.4)
  length_penalty    length reward after a warm-up vs none, and with vs
                    without the warm-up (2.3.3)
  partial_segments  training on earlier segments of partial rollouts vs
                    masking them out of the loss (2.6.2)
  baseline          mean-reward baseline vs the tau*logZ ("soft") baseline
                    at three taus (2.3.2)
  curation          the gym pipeline on three tasks
                    (experiments/gym_tiny.py:three_tasks) with prompt-set
                    curation vs without it (2.1); each run is the whole
                    pipeline, the arms of a seed share its data and vanilla
                    SFT
  curation_spelling the same on experiments/gym_tiny.py:spelling
                    (spelling backward, a task with room for RL, where
                    curation has little to remove)
  curation_guessable the same on experiments/gym_tiny.py as shipped
                    (spelling, with guessable yes/no syllogisms in the raw
                    prompts), plus a raw arm with as many spelling updates
                    as the curated one; the micro variant of every curation
                    ablation is curation's
  recipe            experiments/gym_tiny.py as shipped against the report's
                    recipe as written (the optimizer reset every iteration,
                    2.3.2; the easy-to-hack step on, 2.1; warm-up rows kept
                    as sampled under the long-CoT cue rather than the
                    shortest, 2.2), whole pipeline per arm
  reflect_loss      mirror descent vs ReST (Figure 10) on
                    experiments/reflect_tiny.py, the task where thinking
                    longer pays: each run is its whole pipeline, the arms
                    of a seed share its data and vanilla SFT; its mirror
                    descent arm is the shipped experiment, so the sweep
                    also gives that experiment's seeds (Figure 5)
  reflect_lr        reflect_tiny's RL learning rate, chosen on validation:
                    2e-4, 1e-4 (the shipped one, chosen by this sweep) and
                    5e-5 (mirror descent)
  reflect_sampling, reflect_length_penalty, reflect_segments,
  reflect_baseline  sampling, length_penalty, partial_segments and
                    baseline on experiments/reflect_tiny.py; each has the
                    shipped experiment as one arm
  reflect_warmup    reflect_tiny from its long-CoT warm-up (shipped)
                    against a short one (long2short_reflect.py's short
                    baseline)

`NAME,micro` (e.g. `experiments/ablations.py:loss,micro`) puts the micro
experiment (tiny.py:micro, 3 RL iterations; gym_tiny.py:micro for
`curation`) under the same arms, so a test runs an ablation end to end in
seconds.

Budget: every run is the tiny experiment with RL_ITERATIONS RL iterations
instead of 80 (the length-reward warm-up and the curriculum's warm-up scale
with it, see below), aiming at an ablation of 3 seeds in about 30 minutes
on 2 CPU cores (docs/ablations.md has the measured times); the arms of a
seed share one warm start (kimi_jax/ablation/sweep.py). The arms are set
from the report's descriptions and the tiny config's defaults, never tuned
to make one win.
"""

from __future__ import annotations

import ml_collections

from experiments import gym_tiny, reflect_tiny, tiny
from kimi_jax.ablation import nest
from kimi_jax.long2short.pipeline import SHORT_WARMUP

# RL iterations of every run (tiny.py: 80). The tiny run's held-out pass@1
# is near its final value by iteration 40 (docs/img/eval_curves.png).
RL_ITERATIONS = 40
EVAL_EVERY = 5
# A continued segment prefills its prompt (up to 32 tokens) and the
# response so far (up to 48), beyond reflect_tiny's largest bucket (40).
SEGMENT_BUCKETS = (16, 32, 48, 64, 96)
# RL iterations of experiments/reflect_tiny.py, which its ablations keep.
REFLECT_ITERATIONS = reflect_tiny.get_config().rl.iterations


def sampling_arms(iterations: int, hard_threshold: float) -> dict:
  """Uniform, a curriculum (every problem for a warm-up of the first
  quarter of the run, then difficulty >= hard_threshold only) and
  prioritized sampling."""
  return {
      "uniform": {"prompt_sampling.prioritized": False},
      "curriculum": {"prompt_sampling.prioritized": False,
                     "prompt_sampling.curriculum": "warmup_then_hard",
                     "prompt_sampling.warmup_iterations": iterations // 4,
                     "prompt_sampling.hard_threshold": hard_threshold},
      "prioritized": {"prompt_sampling.prioritized": True},
  }


# The curation ablations' arms: the pipeline with curation on, then off.
CURATION_ARMS = {
    "curated": {"pipeline.curate": True},
    "uncurated": {"pipeline.curate": False},
}


def matched_curation_arms(base: ml_collections.ConfigDict) -> dict:
  """The curation arms and a compute-matched control for a raw pool whose
  guessable prompts are as many as the benchmark task's (gym_tiny.py's
  default: 1000 spelling problems, 1000 syllogisms). The raw arm spends
  about half its groups on syllogisms, so it makes half as many spelling
  updates as the curated arm; `uncurated_matched` draws twice the prompts
  per iteration in minibatches twice as large: the same iterations and
  optimizer steps as the curated arm, and about as many spelling groups in
  each step. Each arm's groups per task are in the results
  (`groups_by_task`), so the match is measured, not assumed."""
  rl = base.rl
  return {**CURATION_ARMS, "uncurated_matched": {
      "pipeline.curate": False,
      "rl.prompts_per_iteration": 2 * rl.prompts_per_iteration,
      "rl.minibatch_prompts": 2 * rl.minibatch_prompts}}


ABLATIONS = {
    "loss": dict(
        description=(
            "Report 3.5, Figure 10: mirror descent, which also learns from "
            "negative samples, learns faster and ends higher than ReST, "
            "which fits the best response sampled per prompt."),
        arms={
            "mirror_descent": {"rl.loss": "mirror_descent"},
            "rest": {"rl.loss": "rest"},
        }),
    "sampling": dict(
        description=(
            "Report 3.5, Figure 9: a curriculum (the whole set for a warm-up, "
            "then hard problems only) beats uniform sampling; 2.3.4: "
            "prioritized sampling by 1 - success rate learns faster and "
            "ends higher than uniform."),
        # Hard: difficulty (the number of steps n, 1..8) >= 5, the upper
        # half.
        arms=sampling_arms(RL_ITERATIONS, hard_threshold=5.0)),
    "length_penalty": dict(
        description=(
            "Report 2.3.3: the length reward restrains the growth of "
            "response length (shorter responses at about equal accuracy); "
            "switched on from the start it slows early training, hence a "
            "warm-up without it."),
        arms={
            "none": {"rl.length_reward_weight": 0.0},
            # tiny.py: weight 0.1 after a warm-up of half the run.
            "after_warmup": {"rl.length_reward_weight": 0.1},
            "no_warmup": {"rl.length_reward_weight": 0.1,
                          "rl.length_reward_warmup": 0},
        }),
    "partial_segments": dict(
        description=(
            "Report 2.6.2: with partial rollouts, segments written by earlier "
            "policies 'can be excluded from loss computation'. tiny.py "
            "trains on them (docs/loop.md: masked, one run stalled at "
            "held-out pass@1 0.65)."),
        arms={
            "train_old": {"rl.train_on_old_segments": True},
            "mask_old": {"rl.train_on_old_segments": False},
        }),
    "baseline": dict(
        description=(
            "Report 2.3.2: tau*logZ, estimated as tau*log mean exp(r/tau), "
            "is the baseline the derivation gives; the empirical mean "
            "reward 'yields effective practical results' (the limit "
            "tau -> inf). tau also scales the squared log-ratio penalty, "
            "so only the tau=1 pair isolates the baseline."),
        arms={
            "mean_tau1": {"rl.baseline": "mean", "rl.tau": 1.0},
            "soft_tau0_25": {"rl.baseline": "soft", "rl.tau": 0.25},
            "soft_tau1": {"rl.baseline": "soft", "rl.tau": 1.0},
            "soft_tau4": {"rl.baseline": "soft", "rl.tau": 4.0},
        }),
    "curation": dict(
        description=(
            "Report 2.1: RL prompts curated for difficulty and accurate "
            "evaluability (easy-to-hack prompts, those a model answers "
            "within N=8 guesses without CoT, removed) against the raw "
            "prompt set, on gym_tiny.py:three_tasks: held-out pass@1 after "
            "RL, and its gain over the shared warm start."),
        experiment="gym_tiny:three_tasks",
        arms=CURATION_ARMS),
    "curation_spelling": dict(
        description=(
            "Report 2.1's curation against raw prompts on "
            "gym_tiny.py:spelling (spelling backward, lower-case words of "
            "3-7 letters, a vanilla stage that stops at a competence level, "
            "60 RL iterations, 500 held-out problems), where RL has room to "
            "gain."),
        experiment="gym_tiny:spelling",
        arms=CURATION_ARMS),
    "curation_guessable": dict(
        description=(
            "Report 2.1's curation against raw prompts on gym_tiny.py as "
            "shipped: the spelling task's raw prompts plus as many "
            "syllogisms, yes/no questions (70% 'Yes') of the kind 2.1 "
            "excludes as easy to hack; held out: spelling only. A third "
            "arm matches the raw arm's spelling updates to the curated "
            "arm's (twice the prompts per iteration and per minibatch)."),
        experiment="gym_tiny",
        arms=matched_curation_arms),
    "recipe": dict(
        description=(
            "gym_tiny.py's departures from the report against its recipe "
            "as written: Adam's state kept across iterations vs reset at "
            "each (2.3.2), the easy-to-hack step off vs on (2.1: prompts a "
            "model answers within N=8 guesses without CoT removed), the "
            "shortest verified warm-up response per prompt vs the first "
            "(2.2); validation pass@1 decides the default."),
        experiment="gym_tiny",
        arms={
            "shipped": {"rl.reset_optimizer": False,
                        "curate.easy_to_hack": False,
                        "warmup.keep": "shortest"},
            "report_recipe": {"rl.reset_optimizer": True,
                              "curate.easy_to_hack": True,
                              "warmup.keep": "all"},
        }),
    "reflect_lr": dict(
        description=(
            "reflect_tiny.py's RL learning rate for mirror descent (report "
            "2.3.2's policy optimization with the optimizer reset each "
            "iteration): 2e-4, 1e-4 and 5e-5, chosen on validation "
            "pass@1; the same shared warm start per seed."),
        experiment="reflect_tiny",
        arms={
            "lr_2e-4": {"rl.learning_rate": 2e-4},
            "lr_1e-4": {"rl.learning_rate": 1e-4},
            "lr_5e-5": {"rl.learning_rate": 5e-5},
        }),
    "reflect_loss": dict(
        description=(
            "Report 3.5, Figure 10, on reflect_tiny.py, where responses "
            "vary in length and checking more candidates pays: mirror "
            "descent against ReST, which fits the best verified response "
            "sampled per prompt; both from the shared warm start, same "
            "learning rate and iterations."),
        experiment="reflect_tiny",
        arms={
            "mirror_descent": {"rl.loss": "mirror_descent"},
            "rest": {"rl.loss": "rest"},
        }),
    "reflect_sampling": dict(
        description=(
            "Report 3.5, Figure 9, on reflect_tiny.py: a curriculum (every "
            "level for a warm-up of a quarter of the run, then levels 3 and "
            "4 only) against uniform sampling; 2.3.4: prioritized sampling "
            "by 1 - success rate (the shipped setting) against uniform."),
        experiment="reflect_tiny",
        arms=sampling_arms(REFLECT_ITERATIONS, hard_threshold=3.0)),
    "reflect_length_penalty": dict(
        description=(
            "Report 2.3.3 on reflect_tiny.py, where correct responses vary "
            "in length: the length reward added to the task reward as the "
            "report writes it (weight 1) after a warm-up of half the run, "
            "from the start, or not at all (the shipped setting): tokens "
            "against accuracy."),
        experiment="reflect_tiny",
        arms={
            "none": {"rl.length_reward_weight": 0.0},
            "after_warmup": {"rl.length_reward_weight": 1.0,
                             "rl.length_reward_warmup":
                                 REFLECT_ITERATIONS // 2},
            "no_warmup": {"rl.length_reward_weight": 1.0,
                          "rl.length_reward_warmup": 0},
        }),
    "reflect_segments": dict(
        description=(
            "Report 2.6.2 on reflect_tiny.py: partial rollouts with a "
            "budget of 24 tokens per iteration (a level-4 search of up to "
            "51 tokens spans three), training on the segments earlier "
            "policies wrote or masking them out of the loss; and whole "
            "responses in one iteration (the shipped setting)."),
        experiment="reflect_tiny",
        arms={
            "train_old": {"rl.token_budget": 24,
                          "rl.train_on_old_segments": True,
                          "sampler.prefill_buckets": SEGMENT_BUCKETS},
            "mask_old": {"rl.token_budget": 24,
                         "rl.train_on_old_segments": False,
                         "sampler.prefill_buckets": SEGMENT_BUCKETS},
            "full_rollouts": {"rl.token_budget": reflect_tiny.MAX_RESPONSE},
        }),
    "reflect_warmup": dict(
        description=(
            "Report 2.2 and 3.3 (Figure 5) on reflect_tiny.py: RL from the "
            "long-CoT warm-up (rows sampled under the cue that asks for a "
            "full search, the shipped setting) against RL from a short "
            "warm-up (rows sampled for the plain prompt, each prompt's "
            "shortest right answer: long2short_reflect.py's short-only "
            "baseline); does RL lengthen the short model's responses, most "
            "on the hardest level?"),
        experiment="reflect_tiny",
        arms={
            "long_cot": {},
            "short": {f"warmup.{k}": v for k, v in SHORT_WARMUP.items()},
        }),
    "reflect_baseline": dict(
        description=(
            "Report 2.3.2 on reflect_tiny.py: the mean-reward baseline (the "
            "shipped setting) against tau*logZ estimated as tau*log mean "
            "exp(r/tau), both at tau = 1, so only the baseline differs."),
        experiment="reflect_tiny",
        arms={
            "mean": {"rl.baseline": "mean", "rl.tau": 1.0},
            "soft": {"rl.baseline": "soft", "rl.tau": 1.0},
        }),
}


def base_config(micro: bool, experiment: str = "tiny"
                ) -> ml_collections.ConfigDict:
  """The experiment every arm starts from."""
  if experiment == "reflect_tiny":
    c = reflect_tiny.get_config("micro" if micro else None)
    c.log.progress = False
    c.log.plots = False
    return c
  if experiment.startswith("gym_tiny"):
    # The shipped pipeline as it is (its own RL length); no per-stage plots.
    # "gym_tiny:VARIANT" names a variant; micro is always gym_tiny's own.
    variant = experiment.partition(":")[2] or None
    c = gym_tiny.get_config("micro" if micro else variant)
    c.log.progress = False
    c.log.plots = False
    return c
  c = tiny.get_config("micro" if micro else None)
  if not micro:
    c.rl.iterations = RL_ITERATIONS
    # tiny.py switches the length reward on at half the run (40 of 80).
    c.rl.length_reward_warmup = RL_ITERATIONS // 2
    c.rl.eval_every = EVAL_EVERY
    # Checkpoint every 5 iterations: a killed run loses at most 5.
    c.checkpoint.every_iterations = 5
  c.log.progress = False
  c.log.plots = False
  return c


def _micro_value(key: str, value):
  if key.endswith("warmup_iterations"):
    return min(value, 1)
  if key.endswith("hard_threshold"):
    return min(value, 2.0)
  return value


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name, _, modifier = (arg or "").partition(",")
  if name not in ABLATIONS:
    raise ValueError(f"unknown ablation {arg!r} (known: "
                     f"{', '.join(ABLATIONS)}; add ',micro' for the test "
                     f"size)")
  if modifier not in ("", "micro"):
    raise ValueError(f"unknown modifier {modifier!r} in {arg!r} (known: "
                     f"micro)")
  micro = modifier == "micro"
  spec = ABLATIONS[name]
  base = base_config(micro, spec.get("experiment", "tiny"))
  # An ablation's arms may depend on its base (matched_curation_arms).
  arms = dict(spec["arms"](base) if callable(spec["arms"]) else
              spec["arms"])
  if micro:
    # 3 RL iterations: the curriculum's hard phase starts after one, on
    # difficulty >= 2 (the micro tasks stop at 3 steps or level 2).
    arms = {arm: {k: _micro_value(k, v) for k, v in overrides.items()}
            for arm, overrides in arms.items()}
  c = ml_collections.ConfigDict()
  c.name = name + (",micro" if micro else "")
  c.description = spec["description"]
  c.base = base
  # In the order above: the reference arm first.
  c.arms = ml_collections.ConfigDict(
      {arm: nest(overrides) for arm, overrides in arms.items()},
      sort_keys=False)
  # The key the sweep sets to first_seed + k for seed k. It seeds the whole
  # run: the task's hidden permutation and held-out split, the model's
  # init, the warm start and every sampling seed; the arms of one seed share
  # all of it (paired comparisons).
  c.seed_key = "seed"
  c.first_seed = 0
  return c
