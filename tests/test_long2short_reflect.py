"""Long2short on the table-inversion task: the long model from the gym
pipeline, the short-only baseline from the same data and vanilla model,
the config's checks, and experiments/long2short_reflect.py:micro end to
end through launch/long2short.py."""

import filecmp
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import long2short_reflect, reflect_tiny
from kimi_jax.curation import gym_pipeline, text_tokenizer
from kimi_jax.data import reflect, tasks
from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import workdir as workdir_lib
from kimi_jax.long2short import config as l2s_config
from kimi_jax.long2short import dpo, merge, pipeline, policies, shortest
from kimi_jax.long2short.samples import Samples
from kimi_jax.rewards.reflect import ReflectReward
from kimi_jax.rl import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENT = "experiments/long2short_reflect.py"


def test_shortest_correct_response_is_the_bare_answer_in_tokens():
  records = reflect.make_records(8, seed=3)
  tok = text_tokenizer.build(text_tokenizer.frequent_words(
      {reflect.DATASET: [r["prompt"] for r in records]}, 0.1))
  reward = ReflectReward()
  for record in records:
    bare = "=" + record["answer"]
    # "=x" and eos, each character one token.
    assert reflect.minimal_length(record) == 3
    assert len(tok.encode(bare, add_special_tokens=False).ids) + 1 == 3
    assert reflect.bare_answer(reflect.problem_of(record)) == bare
    assert reward(record, bare).correct
    assert pipeline.shortest_solution_tokens(record) == 3
    # Anything shorter has no answer.
    assert not any(reward(record, text).correct for text in ("", "=", bare[1]))
  chain = {"n": 4, "answer": "55"}  # pointer chasing: 3n + 3
  assert pipeline.shortest_solution_tokens(chain) == 15


def _flat(node, prefix=""):
  if isinstance(node, dict):
    return {k: v for key, sub in node.items()
            for k, v in _flat(sub, f"{prefix}{key}.").items()}
  return {prefix[:-1]: node}


def test_short_recipe_changes_only_the_warmup_rows():
  sections = pipeline.job_sections(load_config(EXPERIMENT))
  short = pipeline.short_pipeline_config(sections)
  long_flat, short_flat = _flat(sections.to_dict()), _flat(short.to_dict())
  changed = {k for k in long_flat if long_flat[k] != short_flat[k]}
  assert changed == {"warmup.template", "warmup.keep", "warmup.accept"}
  assert set(short_flat) == set(long_flat)
  # The long model's rows answer the cue, the baseline's the plain prompt,
  # each prompt's shortest right answer.
  assert long_flat["warmup.template"] == "{prompt}" + reflect_tiny.COT_CUE
  assert short_flat["warmup.template"] == "{prompt}"
  assert (short_flat["warmup.keep"], short_flat["warmup.accept"]) == (
      "shortest", "answer")
  # Both pipelines' RL-stage configs are the same job.
  paths = gym_pipeline.Paths("/w")
  assert gym_pipeline.job_config(short, paths, stage="rl") == \
      gym_pipeline.job_config(sections, paths, stage="rl")


def test_configs_validate_and_l2s_rl_cuts_the_cap_and_raises_the_penalty():
  for arg in (None, "micro"):
    config = long2short_reflect.get_config(arg)
    l2s = pipeline.check(config)
    rl = config.rl
    assert l2s.l2s_rl.max_response_len < rl.max_response_len
    assert l2s.l2s_rl.length_reward_weight > rl.length_reward_weight == 0.0
  with pytest.raises(ValueError, match="unknown variant"):
    long2short_reflect.get_config("huge")
  # The tiny path is checked as before.
  assert pipeline.check(load_config("experiments/long2short_tiny.py")
                        ).l2s.short_cot_style == "direct"


@pytest.mark.parametrize("override, needle", [
    ({"l2s.base_sft_steps": 500}, "config.l2s.base_sft_steps"),
    ({"l2s.short_cot_style": "direct"}, "config.l2s.short_cot_style"),
    ({"l2s_rl.max_response_len": 56}, "config.l2s_rl.max_response_len"),
    ({"l2s.eval_val": True, "gym.val_size": 0}, "config.l2s.eval_val"),
    ({"gym.datasets": "spell_backward,reflect",
      "gym.options_json": "{}"}, "config.gym.datasets"),
])
def test_bad_reflect_config_names_the_key(override, needle):
  config = load_config(EXPERIMENT + ":micro", override)
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
    pipeline.check(config)


def _launch(workdir: str) -> subprocess.CompletedProcess:
  # The test run's compilation cache (conftest), not one per workdir.
  cmd = [sys.executable, "launch/long2short.py", "--config",
         EXPERIMENT + ":micro", "--workdir", workdir, "--nocompile_cache"]
  done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ,
                                                JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _params(workdir: str, shardings):
  return jax.device_get(policies.read_policy(workdir, shardings)[0])


@pytest.mark.slow
def test_micro_end_to_end_and_a_rerun_skips_every_stage(tmp_path):
  workdir = str(tmp_path / "l2s")
  _launch(workdir)
  with open(os.path.join(workdir, pipeline.RESULT_FILE)) as f:
    result = json.load(f)
  assert os.path.getsize(os.path.join(workdir, pipeline.FIGURE_FILE)) > 0
  config = load_config(EXPERIMENT + ":micro")
  n_eval, n_val = config.gym.eval_size, config.gym.val_size

  # Every method on the held-out and the validation problems.
  assert set(result["methods"]) == set(l2s_config.METHODS)
  for m in result["methods"].values():
    for split in (m, m["val"]):
      assert 0.0 <= split["pass_at_1"] <= 1.0 and split["mean_tokens"] > 0
  assert result["eval"]["problems"] == n_eval
  assert result["eval"]["val_problems"] == n_val
  assert result["shortest_solution_tokens"] == 3.0  # "=x" and eos
  long_dir, short_dir = (os.path.join(workdir, d)
                         for d in ("long", "short_baseline"))
  long, short = (gym_pipeline.Paths(d).rl for d in (long_dir, short_dir))
  assert result["methods"]["long"]["workdir"] == long
  assert result["methods"]["short_baseline"]["workdir"] == short

  # The two models share the data and the vanilla model, byte for byte.
  lp, sp = gym_pipeline.Paths(long_dir), gym_pipeline.Paths(short_dir)
  for name in ("train", "eval", "val", "sft"):
    assert filecmp.cmp(getattr(lp, name), getattr(sp, name), shallow=False)
  ckpt = lambda p: os.path.join(p.vanilla, "checkpoints")
  for root, _, files in os.walk(ckpt(lp)):
    for name in files:
      other = os.path.join(ckpt(sp), os.path.relpath(root, ckpt(lp)), name)
      assert filecmp.cmp(os.path.join(root, name), other, shallow=False)
  config_long, cfg = workdir_lib.load_run(long, jax.device_count())
  task = tasks.make_task(cfg.task, cfg.seed,
                         tasks.hf_tokenizer(cfg.init_from_hf, cfg.task))
  by_id = {r["id"]: r for r in task.train}
  # The baseline's warm-up rows: right answers to the plain prompt.
  answer = ReflectReward()
  short_rows = _jsonl(sp.warmup)
  assert short_rows and short_rows != _jsonl(lp.warmup)
  for row in short_rows:
    record = by_id[row["id"].split("#")[0]]
    assert row["prompt"] == record["prompt"]
    assert answer(record, row["response"]).correct
  # Merging averaged the two RL policies exactly.
  sharder = pipeline.job_lib.build(cfg, str(tmp_path / "tools")).sharder
  shardings = policies.param_shardings(cfg, sharder)
  mixed = jax.device_get(merge.interpolate(
      policies.read_policy(long, shardings)[0],
      policies.read_policy(short, shardings)[0], 0.5))
  for x, y in zip(jax.tree.leaves(mixed), jax.tree.leaves(_params(
      os.path.join(workdir, "merge"), shardings))):
    np.testing.assert_array_equal(x, y)

  # Shortest rejection sampling trained on each sampled prompt's shortest
  # correct response, re-scored here.
  with open(os.path.join(workdir, "samples.json")) as f:
    drawn = json.load(f)
  assert len(drawn["ids"]) == config.l2s.sample_prompts
  tok = task.tokenizer
  texts = [[rollout.response_text(t, tok) for t in row]
           for row in drawn["tokens"]]
  for i, row in zip(drawn["ids"], texts):
    assert [task.reward(by_id[i], t).correct for t in row] == \
        drawn["correct"][drawn["ids"].index(i)]
  want = []
  for p, i in enumerate(drawn["ids"]):
    ok = [j for j, c in enumerate(drawn["correct"][p]) if c]
    if ok:
      best = min(ok, key=lambda j: (drawn["lengths"][p][j], j))
      want.append({"id": i, "prompt": by_id[i]["prompt"],
                   "response": texts[p][best]})
  rows = _jsonl(os.path.join(workdir, "shortest_rs", pipeline.RS_ROWS_FILE))
  assert rows == want and rows  # the micro long model solves some
  rs_stage = policies.stage_done(os.path.join(workdir, "shortest_rs"))
  assert rs_stage["examples"] == len(rows) and "untrained" not in rs_stage
  with open(os.path.join(workdir, "shortest_rs", "config.json")) as f:
    rs_config = json.load(f)
  assert rs_config["sft"]["train_path"] == os.path.join(
      workdir, "shortest_rs", pipeline.RS_ROWS_FILE)
  # DPO's pairs are the samples' (shortest correct, incorrect or 1.5x
  # longer).
  samples = Samples(records=[by_id[i] for i in drawn["ids"]],
                    prompts=drawn["prompts"], tokens=drawn["tokens"],
                    lengths_PxN=np.array(drawn["lengths"]),
                    correct_PxN=np.array(drawn["correct"]))
  assert [drawn["ids"][p] for p, _ in shortest.select(samples)] == [
      r["id"] for r in rows]
  pairs = dpo.all_pairs(samples, long_ratio=config.dpo.long_ratio)
  assert policies.stage_done(os.path.join(workdir, "dpo"))["pairs"] == \
      len(pairs) > 0
  # Long2short RL: the long model's job, no SFT, the cut cap and the
  # length penalty from the first iteration.
  l2s_cfg = workdir_lib.load_run(os.path.join(workdir, "l2s_rl"))[1]
  assert l2s_cfg.sft.steps == 0
  assert l2s_cfg.rl.max_response_len == config.l2s_rl.max_response_len < \
      cfg.rl.max_response_len
  assert l2s_cfg.rl.length_reward_weight == 1.0
  assert l2s_cfg.rl.length_reward_warmup == 0
  assert l2s_cfg.task == cfg.task
  assert config_long.task.train_path == lp.curated

  # A rerun trains nothing: only the evaluations run, to the same figures.
  again = _launch(workdir)
  with open(os.path.join(workdir, pipeline.RESULT_FILE)) as f:
    rerun = json.load(f)
  assert set(rerun["seconds"]) == {"total"} | {
      f"eval_{m}" for m in l2s_config.METHODS}
  assert "gym pipeline" not in again.stdout + again.stderr
  assert "new run" not in again.stdout + again.stderr
  assert rerun["methods"] == result["methods"]
