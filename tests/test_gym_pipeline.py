"""The raw-problems-to-RL pipeline (kimi_jax/curation/gym_pipeline.py): its
tokenizer against `transformers`, its worked solutions against
reasoning-gym's own scorer, and the whole job end to end on the micro
variant of experiments/gym_tiny.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments import gym_tiny
from kimi_jax.curation import gym_pipeline
from kimi_jax.curation import text_tokenizer
from kimi_jax.curation.gym_problems import GymConfig, vanilla_problems
from kimi_jax.infra.config import ConfigError
from kimi_jax.model.tokenizer import load_hf_tokenizer
from kimi_jax.rewards import registry
from kimi_jax.rewards.gym_solutions import solution, wrong_step
from kimi_jax.rewards.reasoning_gym import make_records
from kimi_jax.rl import breakdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(name: str, n: int = 40) -> list[dict]:
  return make_records(name, size=n, seed=3, prompt_suffix="",
                      **gym_tiny.GYM_OPTIONS[name])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  groups = {name: [r["prompt"] for r in _records(name)]
            for name in gym_tiny.GYM_OPTIONS}
  path = str(tmp_path_factory.mktemp("tok"))
  text_tokenizer.build_for(groups, path, min_fraction=0.1)
  return path


def test_text_tokenizer_round_trips_and_matches_transformers(tokenizer_dir):
  import transformers
  ours = load_hf_tokenizer(tokenizer_dir)
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=os.path.join(tokenizer_dir, "tokenizer.json"))
  texts = [r["prompt"] for name in gym_tiny.GYM_OPTIONS
           for r in _records(name, 10)]
  texts += ["1c 2a 3t\n3t 2a 1c\n<answer>tac</answer>", "there the ~{}"]
  for text in texts:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
  # Template words are one token each (with their space); the problem's
  # own word is spelled letter by letter; tags are single pieces.
  vocab = ours.tokenizer.get_vocab()
  assert " backward" in vocab and "Spell" in vocab
  word = _records("spell_backward", 1)[0]["metadata"]["word"]
  pieces = [ours.tokenizer.id_to_token(i) for i in ours.encode(
      f"Spell this word backward: {word}")]
  assert pieces[:4] == ["Spell", " this", " word", " backward"]
  assert pieces[-len(word):] == list(word)
  assert ours.encode("<answer>") == [vocab["<answer>"]]
  # A prompt as the job encodes it starts with BOS; EOS ends a response.
  assert ours.encode_with_special_tokens("x") == [ours.bos_id, vocab["x"]]
  assert ours.decode([vocab["x"], ours.eos_id]) == "x"


def test_frequent_words_take_words_common_in_one_group():
  groups = {"a": ["alpha beta", "alpha beta", "alpha gamma"],
            "b": ["zeta gamma", "eta"]}
  # Needs 0.6 x 3 texts in a, 0.6 x 2 in b: alpha (3) and " beta" (2) in
  # a; " gamma" is in one text of each, enough in neither.
  assert text_tokenizer.frequent_words(groups, 0.6) == [" beta", "alpha"]
  with pytest.raises(ValueError, match="min_fraction"):
    text_tokenizer.frequent_words(groups, 0.0)


@pytest.mark.parametrize("name", sorted(gym_tiny.GYM_OPTIONS))
def test_worked_solutions_are_right_by_reasoning_gyms_own_scorer(name):
  reward = registry.make_reward("reasoning_gym")
  for record in _records(name):
    for style in ("cot", "direct"):
      text = solution(record, style)
      assert reward(record, text).correct, (style, text)
    # A wrong final answer after the same steps fails: the scorer checks.
    wrong = solution(record, "cot").rsplit("<answer>", 1)[0] + \
        "<answer>" + record["answer"] + "x</answer>"
    assert not reward(record, wrong).correct


def test_chain_sum_steps_by_hand():
  record = {"rg": {"dataset": "chain_sum"},
            "metadata": {"expression": "4 - 7 + 9"}}
  assert solution(record, "cot") == "4 - 7 = -3\n-3 + 9 = 6\n<answer>6</answer>"
  assert solution(record, "direct") == "<answer>6</answer>"
  record = {"rg": {"dataset": "spell_backward"}, "metadata": {"word": "cat"}}
  assert solution(record, "cot") == "1c 2a 3t\n3t 2a 1c\n<answer>tac</answer>"
  record = {"rg": {"dataset": "letter_counting"},
            "metadata": {"target_letter": "a", "span": ["Banana", "cat"]}}
  assert solution(record, "cot") == ("Ba1na2na3\nca4t\n"
                                     "<answer>4</answer>")
  record["metadata"].update(target_letter="b", span=["Bob", "at"])
  assert solution(record, "cot") == "B1ob2\nat\n<answer>2</answer>"
  with pytest.raises(ValueError, match="no worked solutions"):
    solution({"rg": {"dataset": "leg_counting"}, "metadata": {}}, "cot")


def test_wrong_step_finds_the_first_step_off_the_worked_solution():
  record = _records("chain_sum", 40)[0]
  answer = solution(record, "cot").split("\n")[-1]
  assert wrong_step(record, solution(record, "cot")) is None
  assert wrong_step(record, answer) is None  # a direct answer: no steps
  # A hand-made chain sum: 4 + 3 - 9, worked as 4 + 3 = 7, 7 - 9 = -2.
  made = {"rg": {"dataset": "chain_sum"},
          "metadata": {"expression": "4 + 3 - 9"}}
  assert wrong_step(made, "4 + 3 = 7\n7 - 9 = -2\n<answer>-2</answer>") is None
  # The right answer after a wrong step (a false positive of the answer).
  assert wrong_step(made, "4 + 3 = 8\n8 - 9 = -2\n<answer>-2</answer>") == (
      "step 1: '4 + 3 = 8'")
  assert wrong_step(made, "4 + 3 = 7\n<answer>-2</answer>") == (
      "steps stop after 1 of 2")
  assert wrong_step(made, "4 + 3 = 7\n7 - 9 = -2\n-2 = -2\n<answer>-2"
                    "</answer>") == "step 3: '-2 = -2'"
  assert wrong_step({"rg": {"dataset": "leg_counting"}}, "x\n<answer>1"
                    "</answer>") is None  # no worked format known


def test_syllogism_is_answered_bare_and_caught_by_the_format_filter():
  """The guessable task of the default's raw pool: its solution is the
  verdict alone (right by reasoning-gym's scorer, a flipped one wrong), no
  steps are checked, and curation's format rule calls it true/false."""
  from kimi_jax.curation import question_format
  reward = registry.make_reward("reasoning_gym")
  records = make_records("syllogism", size=20, seed=0, prompt_suffix="")
  assert {r["answer"] for r in records} == {"Yes", "No"}
  for record in records:
    assert solution(record, "cot") == f"<answer>{record['answer']}</answer>"
    assert solution(record, "direct") == solution(record, "cot")
    assert reward(record, solution(record, "cot")).correct
    flipped = {"Yes": "No", "No": "Yes"}[record["answer"]]
    assert not reward(record, f"<answer>{flipped}</answer>").correct
    assert wrong_step(record, "1a 2b\n<answer>Yes</answer>") is None
    assert question_format.detect(record["question"],
                                  record["answer"]) == "true_false"


def test_vanilla_sft_rows_mix_direct_and_cued_steps():
  pipe = gym_pipeline.PipelineConfig(direct_fraction=0.25, cot_cue="\nCUE")
  records = _records("chain_sum", 200)
  rows = gym_pipeline.sft_rows(records, pipe, seed=0)
  direct = [r for r in rows if not r["prompt"].endswith("\nCUE")]
  assert 30 <= len(direct) <= 70  # a quarter of 200, seeded
  for row, record in zip(rows, records):
    cued = row["prompt"].endswith("\nCUE")
    assert row["response"] == solution(record, "cot" if cued else "direct")
  assert rows == gym_pipeline.sft_rows(records, pipe, seed=0)


def test_vanilla_sft_rows_can_ask_for_steps_without_the_cue():
  records = _records("chain_sum", 200)
  base = gym_pipeline.PipelineConfig(direct_fraction=0.25, cot_cue="\nCUE")
  half = gym_pipeline.PipelineConfig(direct_fraction=0.25, cot_cue="\nCUE",
                                     cued_fraction=0.5)
  before = gym_pipeline.sft_rows(records, base, seed=0)
  rows = gym_pipeline.sft_rows(records, half, seed=0)
  kinds = []
  for row, old, record in zip(rows, before, records):
    is_cot = row["response"] == solution(record, "cot")
    # The same problems are answered directly as without the knob.
    assert is_cot == (old["response"] == solution(record, "cot"))
    if not is_cot:
      assert row["response"] == solution(record, "direct")
      assert row["prompt"] == record["prompt"]
      continue
    cued = row["prompt"] == record["prompt"] + "\nCUE"
    assert cued or row["prompt"] == record["prompt"]
    kinds.append(cued)
  assert 0.35 <= sum(kinds) / len(kinds) <= 0.65  # half of ~150, seeded


def test_config_errors_name_the_key():
  config = gym_tiny.get_config("micro")
  config.pipeline.direct_fraction = 1.5
  with pytest.raises(ValueError, match="pipeline.direct_fraction"):
    gym_pipeline.check(config)
  config.pipeline.direct_fraction = 0.5
  config.pipeline.cued_fraction = -0.1
  with pytest.raises(ValueError, match="pipeline.cued_fraction"):
    gym_pipeline.check(config)
  # A JSONL task with neither a checkpoint nor a tokenizer of its own.
  from kimi_jax.job.experiment import parse_config
  config = gym_pipeline.job_config(gym_tiny.get_config("micro"),
                                   gym_pipeline.Paths("/w"), stage="rl")
  config.task.tokenizer = ""
  config.task.train_path = config.task.eval_path = __file__
  config.sft.steps = 0
  with pytest.raises(ConfigError, match="config.task.tokenizer"):
    parse_config(config)


def test_default_is_spelling_with_guessable_prompts_and_variants():
  """gym_tiny.py's default is `:spelling` with syllogisms added to the raw
  prompts only (no held-out or validation ones) and nothing else changed
  but the tokenizer's threshold and the vocabulary; `:three_tasks` (the
  former default) keeps the easy-to-hack step; an unknown variant names
  the known ones."""
  default, spelling = gym_tiny.get_config(), gym_tiny.get_config("spelling")
  changed = {k for k in ab_flat(default) if ab_flat(default)[k]
             != ab_flat(spelling).get(k)}
  assert changed == {"gym.datasets", "gym.sizes_json",
                     "pipeline.min_word_fraction", "model.vocab_size"}
  assert default.gym.datasets == "spell_backward,syllogism"
  assert spelling.gym.datasets == "spell_backward"
  assert json.loads(default.gym.sizes_json) == {
      "syllogism": {"eval_size": 0, "val_size": 0, "sft_problems": 2000}}
  assert not default.curate.easy_to_hack and default.curate.format_filter
  three = gym_tiny.get_config("three_tasks")
  assert three.gym.datasets.split(",") == list(gym_tiny.GYM_OPTIONS)
  assert three.curate.easy_to_hack
  assert three.pipeline.vanilla_stop_at_val == 0
  assert gym_tiny.get_config("micro").gym.datasets == three.gym.datasets
  with pytest.raises(ValueError, match="three_tasks"):
    gym_tiny.get_config("spelling_backward")


def ab_flat(config) -> dict:
  from kimi_jax.ablation import flatten
  return flatten(config.to_dict())


def test_default_data_stage_keeps_syllogisms_out_of_the_scored_sets(
    tmp_path):
  """The default's data stage: syllogisms in the raw prompts and the
  vanilla rows (bare verdicts, about a tenth), none held out or validated;
  the vocabulary fits the model and a syllogism prompt with the cue fits
  the largest prefill bucket; curation's format rule drops every
  syllogism and no spelling problem."""
  from kimi_jax.curation import curate as curate_lib
  from kimi_jax.curation import config as tools_config
  config = gym_tiny.get_config()
  config.gym.update(size=40, eval_size=5, val_size=5)
  # Enough syllogisms for their category words to pass the word threshold.
  config.gym.sizes_json = json.dumps({"syllogism": {
      "size": 200, "eval_size": 0, "val_size": 0, "sft_problems": 10}})
  config.pipeline.sft_problems = 90
  paths = gym_pipeline.Paths(str(tmp_path))
  gym_pipeline.stage_data(config, paths)
  rows = {name: [json.loads(l) for l in open(getattr(paths, name))]
          for name in ("train", "eval", "val", "sft")}

  def count(name, dataset="syllogism"):
    return sum(f"/{dataset}/" in r["id"] for r in rows[name])

  assert [count(n) for n in ("train", "eval", "val", "sft")] == [200, 0, 0,
                                                                 10]
  assert count("eval", "spell_backward") == 5
  verdicts = [r["response"] for r in rows["sft"] if "/syllogism/" in r["id"]]
  assert set(verdicts) <= {"<answer>Yes</answer>", "<answer>No</answer>"}
  tok = load_hf_tokenizer(paths.tokenizer)
  assert tok.vocab_size <= config.model.vocab_size
  longest = max(len(tok.encode(r["prompt"] + gym_tiny.COT_CUE))
                for r in rows["train"])
  assert longest <= max(config.sampler.prefill_buckets)
  cfg = dataclasses.replace(tools_config.curate_config(config),
                            pass_rate=False)
  result = curate_lib.curate(paths.train, cfg)
  assert {d.reason for d in result.dropped
          if "/syllogism/" in d.row.record.get("id", "")} == {"true_false"}
  assert sum("/syllogism/" in r.record["id"] for r in result.kept) == 0
  assert not [d for d in result.dropped if d.reason == "true_false"
              and "/spell_backward/" in d.row.record["id"]]


def test_spelling_variant_data_stage_and_job_configs(tmp_path):
  """gym_tiny.py:spelling (the default without its syllogisms): its data
  stage writes lower-case words of 3-7 letters only, in disjoint splits,
  and both of its training stages parse as main-job configs (the rest of
  the pipeline is the micro run's). Its stages verify as RL does, so the
  pipeline has no mismatch to warn of."""
  from kimi_jax.job.experiment import parse_config
  config = gym_tiny.get_config("spelling")
  config.gym.update(size=30, eval_size=5, val_size=5)
  config.pipeline.sft_problems = 40
  gym_pipeline.check(config)
  paths = gym_pipeline.Paths(str(tmp_path))
  gym_pipeline.stage_data(config, paths)
  rows = {name: [json.loads(l) for l in open(getattr(paths, name))]
          for name in ("train", "eval", "val", "sft")}
  assert [len(rows[n]) for n in ("train", "eval", "val", "sft")] == [
      30, 5, 5, 40]
  words = [r["metadata"]["word"] for n in ("train", "eval", "val")
           for r in rows[n]]
  assert all(w.islower() and 3 <= len(w) <= 7 for w in words)
  ids = [r["id"] for n in rows for r in rows[n]]
  assert len(ids) == len(set(ids))
  assert gym_pipeline.verifier_mismatch(
      config.reward.name, config.task.reward) is None
  # The RL stage reads curation's and the warm-up's files: stand-ins.
  shutil.copy(paths.train, paths.curated)
  with open(paths.warmup, "w") as f:
    f.write(json.dumps({"prompt": rows["train"][0]["prompt"],
                        "response": "<answer>x</answer>"}) + "\n")
  for stage in ("vanilla", "rl"):
    job = gym_pipeline.job_config(config, paths, stage=stage)
    parse_config(job)
  assert job.sft.learning_rate == 1e-4 and job.rl.iterations == 60
  vanilla = gym_pipeline.job_config(config, paths, stage="vanilla")
  assert (vanilla.sft.stop_at_val, vanilla.sft.stop_metric,
          vanilla.sft.steps) == (0.7, "greedy_accuracy", 1000)


def test_vanilla_stop_reaches_only_the_vanilla_stage_and_needs_validation():
  config = gym_tiny.get_config("micro")
  config.pipeline.update(vanilla_stop_at_val=0.4, vanilla_check_every=7,
                         vanilla_stop_metric="greedy_accuracy")
  config.gym.val_size = 2
  gym_pipeline.check(config)
  paths = gym_pipeline.Paths("/w")
  vanilla = gym_pipeline.job_config(config, paths, stage="vanilla").sft
  assert (vanilla.stop_at_val, vanilla.check_every, vanilla.stop_metric) == (
      0.4, 7, "greedy_accuracy")
  rl = gym_pipeline.job_config(config, paths, stage="rl").sft
  assert rl.stop_at_val == 0.0
  config.gym.val_size = 0
  with pytest.raises(ConfigError, match="gym.val_size"):
    gym_pipeline.check(config)
  config.pipeline.vanilla_stop_at_val = 1.2
  with pytest.raises(ValueError, match="pipeline.vanilla_stop_at_val"):
    gym_pipeline.check(config)
  config.pipeline.update(vanilla_stop_at_val=0.4, vanilla_stop_metric="x")
  with pytest.raises(ValueError, match="pipeline.vanilla_stop_metric"):
    gym_pipeline.check(config)


def test_verifier_mismatch_names_both_keys():
  assert gym_pipeline.verifier_mismatch("reasoning_gym",
                                        "reasoning_gym") is None
  warning = gym_pipeline.verifier_mismatch("reasoning_gym",
                                           "reasoning_gym_steps")
  assert "config.reward.name='reasoning_gym'" in warning
  assert "config.task.reward='reasoning_gym_steps'" in warning


def test_small_curated_set_warns_below_one_iteration():
  assert gym_pipeline.small_curated_set(32, 32) is None
  warning = gym_pipeline.small_curated_set(10, 32)
  assert "10 curated prompts" in warning and "prompts_per_iteration=32" in \
      warning


@pytest.mark.slow
def test_micro_pipeline_end_to_end_and_rerun_is_a_no_op(tmp_path):
  workdir = str(tmp_path / "w")
  # With a validation set (2 problems per generator) and an evaluation
  # every iteration, which reads it instead of the held-out set.
  cmd = [sys.executable, "launch/tpu_run.py", "--config",
         "experiments/gym_tiny.py:micro", "--workdir", workdir,
         "--config.gym.val_size=2", "--config.rl.eval_every=1"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  for key in ("curation", "warmup", "vanilla_eval", "warmstart_eval",
              "final_eval"):
    assert key in summary
  assert set(summary["final_eval"]["pass_at_1_by_task"]) == {
      f"rg/{n}" for n in gym_tiny.GYM_OPTIONS}
  n_val = 2 * len(gym_tiny.GYM_OPTIONS)
  for key in ("vanilla_val", "warmstart_val", "final_val"):
    assert summary[key]["n_problems"] == n_val
  assert summary["final_val"] != summary["final_eval"]
  # Nothing lost: every raw problem is curated or rejected with a reason.
  paths = gym_pipeline.Paths(workdir)
  count = lambda p: sum(1 for _ in open(p))
  assert count(paths.curated) + count(paths.rejected) == count(paths.train)
  assert summary["curation"]["kept"] == count(paths.curated)
  assert summary["curation"]["accounted"] is True
  # A curated set smaller than one iteration's draw is called out.
  per_iteration = gym_tiny.get_config("micro").rl.prompts_per_iteration
  assert ("fewer than one RL iteration draws" in done.stdout) == (
      summary["curation"]["kept"] < per_iteration)
  # The warm-up rows are verified responses to the clean problems: the
  # train problems past curation's data-quality steps (those it dropped for
  # difficulty included), in train order (pipeline.warmup_from).
  reward = registry.make_reward("reasoning_gym")
  rejected = [json.loads(l) for l in open(paths.rejected)]
  assert all(r["step"] in ("dedup", "easy_to_hack", "pass_rate",
                           "difficulty_balance") for r in rejected)
  unclean = {r["row"]["id"] for r in rejected if r["step"] == "dedup"}
  clean = [json.loads(l) for l in open(paths.clean)]
  assert [r["id"] for r in clean] == [
      json.loads(l)["id"] for l in open(paths.train)
      if json.loads(l)["id"] not in unclean]
  by_id = {r["id"]: r for r in clean}
  rows = [json.loads(l) for l in open(paths.warmup)]
  assert rows and len(rows) == summary["warmup"]["rows"]
  for row in rows:
    record = by_id[row["id"].split("#")[0]]
    assert row["prompt"] == record["prompt"]
    assert reward(record, row["response"]).correct
    # Tagged as curation tags them.
    assert row["tags"] == record["tags"] == [record["id"].rsplit("/", 2)[0]]
  # The RL run trained on the curated prompts, starting from the vanilla
  # policy, and read their measured pass rates.
  with open(os.path.join(workdir, "rl", "config.json")) as f:
    rl_config = json.load(f)
  assert rl_config["task"]["train_path"] == paths.curated
  assert rl_config["prompt_sampling"]["initial_success_field"] == "pass_rate"
  # launch/evaluate.py on the final checkpoint reproduces the job's own final
  # evaluations, split by generator as the job splits them by task.
  for split, key in (("eval", "final_eval"), ("val", "final_val")):
    out = str(tmp_path / f"breakdown_{split}")
    done = subprocess.run(
        [sys.executable, "launch/evaluate.py", "--workdir",
         os.path.join(workdir, "rl"), "--split", split, "--by",
         "rg.dataset", "--by", "long=metadata.word_len:^[4-9]", "--out",
         out], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "breakdown.json")) as f:
      tables = json.load(f)["tables"]
    (overall,) = tables["all"]
    assert overall["pass_at_1"] == summary[key]["pass_at_1"]
    assert overall["greedy_accuracy"] == summary[key]["greedy_accuracy"]
    assert overall["problems"] == summary[key]["n_problems"]
    assert {f"rg/{r['group']}": r["pass_at_1"] for r in tables[
        "rg.dataset"]} == summary[key]["pass_at_1_by_task"]
    # Only spelling problems have a word length.
    long = {r["group"]: r["problems"] for r in tables["long"]}
    assert sum(long.values()) == overall["problems"]
    assert long[breakdown.MISSING] == overall["problems"] * 2 // 3
    draws = rl_config["rl"]["eval_samples"] + 1
    responses = [json.loads(l) for l in open(os.path.join(
        out, "responses.jsonl"))]
    assert len(responses) == overall["problems"] * draws
    assert sum(r["correct"] for r in responses if r["draw"] >= 0) == round(
        overall["pass_at_1"] * overall["problems"] * (draws - 1))
    # Each response is the text its row says, judged by the task's verifier.
    verifier = registry.make_reward(rl_config["task"]["reward"])
    with open(paths.eval if split == "eval" else paths.val) as f:
      held = {r["id"]: r for r in map(json.loads, f)}
    assert all(verifier(held[r["id"]], r["text"]).correct == r["correct"]
               for r in responses)
  # More draws, and pass@k from them (k past the draws is refused).
  more = subprocess.run(
      [sys.executable, "launch/evaluate.py", "--workdir",
       os.path.join(workdir, "rl"), "--samples", "3", "--pass_at", "3",
       "--pass_at", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert more.returncode == 0, more.stderr[-3000:]
  header, overall = [l.split() for l in more.stdout.splitlines()
                     if l.startswith("all ")]
  assert header[-2:] == ["pass@2", "pass@3"]
  p1, p2, p3 = float(overall[3]), float(overall[-2]), float(overall[-1])
  assert p1 <= p2 <= p3
  refused = subprocess.run(
      [sys.executable, "launch/evaluate.py", "--workdir",
       os.path.join(workdir, "rl"), "--pass_at", "9"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert refused.returncode != 0
  assert "--pass_at [9]: each k must be in [1, " in refused.stderr
  # A rerun finds every stage finished and trains nothing.
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "new run" not in again.stderr + again.stdout
  with open(os.path.join(workdir, "summary.json")) as f:
    rerun = json.load(f)
  assert rerun["final_eval"] == summary["final_eval"]
  # The RL stage once more as if killed after its last checkpoint: it
  # resumes there, evaluates again and keeps every earlier row. The
  # held-out set is read before and after RL only; the validation set then
  # too, and at the periodic evaluation.
  from kimi_jax.long2short import policies
  os.remove(os.path.join(workdir, "rl", policies.STAGE_FILE))
  resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resuming" in resumed.stderr + resumed.stdout
  rows = [json.loads(l) for l in open(os.path.join(workdir, "rl",
                                                   "metrics.jsonl"))]
  steps = lambda stage: [r["step"] for r in rows if r["stage"] == stage]
  assert steps("eval") == [0, 2] and steps("val") == [0, 1, 2]
  assert [r["pass_at_1"] for r in rows if r["stage"] == "val"][::2] == [
      summary["warmstart_val"]["pass_at_1"], summary["final_val"]["pass_at_1"]]


def test_curation_guards_the_validation_problems_too(tmp_path):
  from kimi_jax.data.records import PromptFields
  paths = gym_pipeline.Paths(str(tmp_path))
  os.makedirs(os.path.dirname(paths.eval))
  rows = {"eval": ["1 + 2", "3 + 4"], "val": ["5 + 6"]}
  fields = PromptFields(kind="math")
  for name in ("eval", "val"):
    with open(getattr(paths, name), "w") as f:
      for prompt in rows[name]:
        f.write(json.dumps({"prompt": prompt, "answer": "0"}) + "\n")
  prompts = lambda: [r["prompt"] for r in gym_pipeline.guarded_records(
      paths, fields)]
  assert prompts() == ["1 + 2", "3 + 4", "5 + 6"]
  os.remove(paths.val)
  assert prompts() == ["1 + 2", "3 + 4"]


def test_validation_problems_are_the_items_after_the_held_out_ones():
  """gym.val_size takes items [size + eval_size, + val_size) of each
  generator; vanilla-SFT problems start after them (and where they always
  did when there is no validation set)."""
  from kimi_jax.curation.gym_problems import GymConfig, validation_set
  options = {"chain_sum": gym_tiny.GYM_OPTIONS["chain_sum"]}
  gym = GymConfig(datasets="chain_sum", size=5, eval_size=3, val_size=4,
                  options_json=json.dumps(options), prompt_suffix="")
  direct = make_records("chain_sum", size=20, seed=0, prompt_suffix="",
                        **options["chain_sum"])
  val = validation_set(gym)
  assert [r["question"] for r in val] == [r["question"] for r in direct[8:12]]
  assert [r["rg"]["index"] for r in val] == [8, 9, 10, 11]
  sft = vanilla_problems(gym, 3)
  assert [r["rg"]["index"] for r in sft] == [12, 13, 14]
  no_val = GymConfig(datasets="chain_sum", size=5, eval_size=3,
                     options_json=json.dumps(options), prompt_suffix="")
  assert validation_set(no_val) == []
  assert [r["rg"]["index"] for r in vanilla_problems(
      no_val, 2)] == [8, 9]
  with pytest.raises(ValueError, match="gym.val_size"):
    GymConfig(val_size=-1)


def test_sizes_json_replaces_one_datasets_sizes_and_leaves_the_others():
  """gym.sizes_json: syllogism with 3 train, no held-out or validation
  items and 2 vanilla-SFT problems; chain sums keep the section's sizes and
  exactly the items they have without the override."""
  from kimi_jax.curation.gym_problems import problem_sets, validation_set
  options = json.dumps({"chain_sum": gym_tiny.GYM_OPTIONS["chain_sum"]})
  base = dict(size=4, eval_size=2, val_size=1, options_json=options,
              prompt_suffix="")
  sizes = {"syllogism": {"size": 3, "eval_size": 0, "val_size": 0,
                         "sft_problems": 2}}
  gym = GymConfig(datasets="chain_sum,syllogism",
                  sizes_json=json.dumps(sizes), **base)
  alone = GymConfig(datasets="chain_sum", **base)
  train, held = problem_sets(gym)

  def ids(rows, dataset):
    return [r["rg"]["index"] for r in rows if r["rg"]["dataset"] == dataset]

  assert ids(train, "syllogism") == [0, 1, 2]
  assert ids(held, "syllogism") == [] == ids(validation_set(gym),
                                             "syllogism")
  assert ids(vanilla_problems(gym, 5), "syllogism") == [3, 4]
  assert ids(vanilla_problems(gym, 5), "chain_sum") == [7, 8, 9, 10, 11]
  assert [r["id"] for r in train if "chain_sum" in r["id"]] == [
      r["id"] for r in problem_sets(alone)[0]]
  assert validation_set(gym) == validation_set(alone)
  no_val = dict(base, val_size=0)
  assert GymConfig(datasets="chain_sum,syllogism", **no_val, sizes_json=json.dumps(
      {"syllogism": {"val_size": 2}})).has_val()
  assert not GymConfig(datasets="chain_sum,syllogism", **no_val).has_val()


@pytest.mark.parametrize("sizes, match", [
    ({"leg_counting": {"size": 1}}, "not in gym.datasets"),
    ({"chain_sum": {"train": 1}}, "chain_sum.*unknown key 'train'"),
    ({"chain_sum": {"size": -1}}, "chain_sum.*'size'.*integer >= 0"),
    ({"chain_sum": {"size": 1.5}}, "integer >= 0"),
    ({"chain_sum": 3}, "object of objects"),
])
def test_sizes_json_errors_name_the_key(sizes, match):
  with pytest.raises(ValueError, match=match):
    GymConfig(datasets="chain_sum", sizes_json=json.dumps(sizes))


def test_where_filter_takes_the_matching_items_in_generator_order():
  """gym.where_json: item k of a set is the k-th generator item whose
  field matches, computed here from the unfiltered generator."""
  from kimi_jax.curation.gym_problems import (GymConfig, problem_sets,
                                              validation_set)
  options = {"spell_backward": {"min_word_len": 3, "max_word_len": 7}}
  where = {"spell_backward": {"metadata.word": "^[A-Z]"}}
  gym = GymConfig(datasets="spell_backward", size=6, eval_size=3,
                  val_size=2, options_json=json.dumps(options),
                  where_json=json.dumps(where), prompt_suffix="")
  direct = make_records("spell_backward", size=400, seed=0,
                        prompt_suffix="", **options["spell_backward"])
  capitalised = [r for r in direct if r["metadata"]["word"][0].isupper()]
  # Proper nouns are about one word in seven: the filter must skip items.
  assert capitalised[10]["rg"]["index"] > 10
  train, held = problem_sets(gym)
  val = validation_set(gym)
  sft = vanilla_problems(gym, 3)
  got = [r["rg"]["index"] for r in train + held + val + sft]
  assert got == [r["rg"]["index"] for r in capitalised[:14]]
  assert [r["question"] for r in train] == [
      r["question"] for r in capitalised[:6]]
  # Each filtered record still verifies with reasoning-gym's scorer.
  from kimi_jax.rewards.reasoning_gym import ReasoningGymReward
  result = ReasoningGymReward()(held[0],
                                f"<answer>{held[0]['answer']}</answer>")
  assert result.verified and result.score == 1.0


@pytest.mark.parametrize("where, match", [
    ({"chain_sum": {"metadata.word": "x"}}, "not in gym.datasets"),
    ({"spell_backward": {"metadata.word": "(["}}, "spell_backward.*bad"),
    ({"spell_backward": "^a"}, "object of objects"),
])
def test_where_filter_errors_name_the_key(where, match):
  from kimi_jax.curation.gym_problems import GymConfig
  with pytest.raises(ValueError, match=match):
    GymConfig(datasets="spell_backward", where_json=json.dumps(where))


def test_where_filter_that_matches_nothing_is_an_error():
  from kimi_jax.curation.gym_problems import GymConfig, problem_sets
  gym = GymConfig(datasets="spell_backward", size=2, eval_size=0,
                  where_json=json.dumps(
                      {"spell_backward": {"metadata.word": "^[0-9]+$"}}))
  with pytest.raises(ValueError, match="only 0 of .* items match"):
    problem_sets(gym)


def test_copy_first_stages_needs_finished_ones_and_replaces_a_partial_copy(
    tmp_path):
  """The copy a pipeline ablation starts each arm from: refused from a
  source whose stages have not finished; over a killed copy (no data
  marker, a stray file in vanilla/) it leaves exactly the source's files."""
  src, dst = gym_pipeline.Paths(str(tmp_path / "src")), gym_pipeline.Paths(
      str(tmp_path / "dst"))
  for name in ("train", "eval", "sft"):
    os.makedirs(os.path.dirname(getattr(src, name)), exist_ok=True)
    with open(getattr(src, name), "w") as f:
      f.write(name + "\n")
  os.makedirs(src.tokenizer)
  with open(os.path.join(src.tokenizer, "tokenizer.json"), "w") as f:
    f.write("{}")
  os.makedirs(src.vanilla)
  with pytest.raises(FileNotFoundError, match="not finished"):
    gym_pipeline.copy_first_stages(src.workdir, dst.workdir)
  with open(src.data_done, "w") as f:
    f.write('{"train": 1}')
  with pytest.raises(FileNotFoundError, match="not finished"):
    gym_pipeline.copy_first_stages(src.workdir, dst.workdir)  # no vanilla
  with open(os.path.join(src.vanilla, "stage.json"), "w") as f:
    f.write('{"summary": {}}')
  with open(os.path.join(src.vanilla, "config.json"), "w") as f:
    json.dump({"task": {"tokenizer": src.tokenizer, "train_path": src.train,
                        "other": src.workdir + "_other/x"},
               "paths": [src.eval], "seed": 3}, f)
  os.makedirs(dst.vanilla)
  with open(os.path.join(dst.vanilla, "stray"), "w") as f:
    f.write("left by a killed copy")
  assert not gym_pipeline.first_stages_done(dst.workdir)
  gym_pipeline.copy_first_stages(src.workdir, dst.workdir)
  assert gym_pipeline.first_stages_done(dst.workdir)
  assert sorted(os.listdir(dst.vanilla)) == ["config.json", "stage.json"]
  # The copy's config names the copy's files; other paths stay as they are.
  with open(os.path.join(dst.vanilla, "config.json")) as f:
    assert json.load(f) == {
        "task": {"tokenizer": dst.tokenizer, "train_path": dst.train,
                 "other": src.workdir + "_other/x"},
        "paths": [dst.eval], "seed": 3}
  for name in ("train", "eval", "sft", "data_done"):
    with open(getattr(src, name)) as a, open(getattr(dst, name)) as b:
      assert a.read() == b.read()
  assert os.listdir(dst.tokenizer) == ["tokenizer.json"]
