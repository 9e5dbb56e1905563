"""The data tools with real models through our sampler.

1. Pass rates agree with the job's held-out evaluation: the tiny policy
   (experiments/tiny.py:micro, seeded init) is asked through
   `SamplerPolicy` with the seeds `Evaluator` uses, and curation's mean
   pass rate must equal the Evaluator's pass@1 (sampled) and greedy
   accuracy (temperature 0) on the same records: two code paths, one
   answer.
2. The demo on reasoning-gym problems, as a user runs it: launch/gym_data.py,
   launch/curate.py (every step, with a Hugging Face Qwen2 checkpoint built
   at test time as the policy) and launch/warmup_data.py, in subprocesses.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kimi_jax.curation import curate as C
from kimi_jax.data import pointer_chase
from kimi_jax.rewards.base import RewardResult
from tests.hf_dirs import make_answering_qwen2_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


class MentionsC1:
  """A verifier a random policy passes about a quarter of the time: the
  response contains the word `c1`."""

  def __call__(self, record, response):
    ok = "c1" in response.split()
    return RewardResult(float(ok), ok)


def test_pass_rates_equal_the_evaluators_pass_at_1(tmp_path):
  from kimi_jax.curation.policy import SamplerPolicy
  from kimi_jax.data.tasks import Task
  from kimi_jax.rl.evaluation import Evaluator
  from tests.tiny_sampler import tiny_micro_sampler
  cfg, sampler, params = tiny_micro_sampler(3)
  _, held = pointer_chase.make_problems(cfg.task, cfg.seed)
  held = [dict(r, tags=[f"n{r['n']}"]) for r in held]
  tok = pointer_chase.tokenizer()
  encode = lambda text: [tok.bos_id] + tok.encode(text)
  samples, max_len = 4, cfg.rl.max_response_len
  evaluator = Evaluator(sampler, Task(
      "pc", train=held, eval=held, reward=MentionsC1(), tokenizer=tok,
      encode_prompt=lambda r: encode(r["prompt"])), samples=samples,
      max_response_len=max_len, seed=1, settings=cfg.sampler.sampling)
  want = evaluator(params)
  assert 0.05 < want.pass_at_1 < 0.95  # the check below is not vacuous

  path = tmp_path / "held.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in held))
  policy = SamplerPolicy(sampler, params, tok, encode)

  def mean_pass_rate(**changes):
    # seed 0: the pass-rate step samples with seed + 1, the Evaluator's.
    result = C.curate(str(path), C.CurateConfig(
        kind="math", easy_to_hack=False, max_pass_rate=1.0,
        pass_max_tokens=max_len, seed=0, **changes),
        policy=policy, reward=MentionsC1())
    assert len(result.kept) == len(held) and not result.dropped
    return {r.record["id"]: r.added["pass_rate"] for r in result.kept}

  rates = mean_pass_rate(pass_samples=samples, pass_temperature=1.0)
  assert np.mean(list(rates.values())) == pytest.approx(want.pass_at_1,
                                                        abs=1e-12)
  # Per task (here: the step count n as a tag), the same split.
  by_n = {}
  for record in held:
    by_n.setdefault(f"n{record['n']}", []).append(rates[record["id"]])
  assert want.pass_at_1_by_task == pytest.approx(
      {k: np.mean(v) for k, v in by_n.items()}, abs=1e-12)
  assert len(want.pass_at_1_by_task) == cfg.task.max_steps
  greedy = mean_pass_rate(pass_samples=1, pass_temperature=0.0)
  assert np.mean(list(greedy.values())) == pytest.approx(
      want.greedy_accuracy, abs=1e-12)
  # Asked in chunks of 3 prompts (draws seeded by each prompt's index in
  # the whole list), the real sampler gives the same pass rates.
  assert len(held) > 6
  assert mean_pass_rate(pass_samples=samples, pass_temperature=1.0,
                        chunk_prompts=3) == rates


def _run(*args, expect_ok=True):
  proc = subprocess.run([sys.executable, *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  if expect_ok:
    assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_gym_demo_through_the_launchers(tmp_path):
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  config = "experiments/data/gym_curate.py:cpu_test"
  raw, held = tmp_path / "raw.jsonl", tmp_path / "eval.jsonl"
  val = tmp_path / "val.jsonl"
  _run("launch/gym_data.py", f"--config={config}", f"--train={raw}",
       f"--eval={held}", f"--val={val}", "--config.gym.val_size=1")
  rows = [json.loads(line) for line in raw.read_text().splitlines()]
  val_rows = [json.loads(line) for line in val.read_text().splitlines()]
  n_datasets = len({r["rg"]["dataset"] for r in rows})
  assert len(val_rows) == n_datasets
  # Validation items follow the held-out ones of each generator.
  held_rows = [json.loads(line) for line in held.read_text().splitlines()]
  last_held = {r["rg"]["dataset"]: r["rg"]["index"] for r in held_rows}
  assert all(r["rg"]["index"] == last_held[r["rg"]["dataset"]] + 1
             for r in val_rows)
  # A reworded copy and an exact copy of the first problem.
  first = rows[0]
  near = dict(first, id="near",
              question=first["question"].replace("answer", "answers"))
  # And a copy of a validation problem (spelling: a template apart from the
  # near copy's, whose common-shingle counts it leaves as they were).
  with open(raw, "a") as f:
    f.write(json.dumps(near) + "\n" + json.dumps(dict(first, id="copy"))
            + "\n" + json.dumps(dict(val_rows[1], id="val_copy")) + "\n"
            + "{broken\n")
  out = tmp_path / "curated.jsonl"
  policy = ["--config.policy.experiment=experiments/qwen2_5_1_5b.py:"
            "cpu_smoke", f"--config.policy.init_from_hf={hf_dir}"]
  bad = _run("launch/curate.py", f"--config={config}", f"--in={raw}",
             f"--out={out}", f"--report={tmp_path / 'r.json'}", *policy,
             expect_ok=False)
  assert bad.returncode != 0
  assert f"data error: {raw}:{len(rows) + 4}" in bad.stderr
  args = ("launch/curate.py", f"--config={config}", f"--in={raw}",
          f"--out={out}", f"--report={tmp_path / 'report.json'}",
          f"--held_out={held}", f"--held_out={val}",
          "--config.curate.on_bad_row=reject",
          "--config.curate.bucket_shares=(1, 1, 1)",
          "--config.curate.bucket_min_rows=1",
          "--config.curate.chunk_prompts=16", *policy)
  _run(*args)
  first = out.read_text()
  # The same command again reads every chunk of model answers back from
  # the journal (OUT.journal.jsonl) and writes the same set.
  again = _run(*args)
  journal = tmp_path / "curated.journal.jsonl"
  chunks = len(journal.read_text().splitlines())
  assert chunks >= 4
  assert f"resumed: {chunks} chunks" in again.stderr
  assert out.read_text() == first
  report = json.loads((tmp_path / "report.json").read_text())
  kept = [json.loads(line) for line in out.read_text().splitlines()]
  rejected = [json.loads(line) for line in
              (tmp_path / "curated.rejected.jsonl").read_text().splitlines()]
  assert report["rows"] == len(rows) + 4 == len(kept) + len(rejected)
  assert report["accounted"]
  by_reason = report["dropped_by_reason"]
  # Every syllogism is a yes/no question; both copies are caught.
  assert by_reason["true_false"] == sum(
      r["rg"]["dataset"] == "syllogism" for r in rows)
  assert by_reason["bad_row"] == 1
  why = {r["row"]["id"]: r["reason"] for r in rejected if "row" in r}
  assert (why["near"], why["copy"]) == ("near_duplicate", "exact_duplicate")
  assert why["val_copy"].startswith("held_out_")
  steps = {s["name"]: s for s in report["steps"]}
  assert steps["easy_to_hack"]["enabled"] and steps["pass_rate"]["enabled"]
  from kimi_jax.curation.dedup import normalise
  held_questions = {normalise(json.loads(line)["question"])
                    for line in held.read_text().splitlines()}
  for row in kept:
    assert normalise(row["question"]) not in held_questions
    assert row["tags"][0].startswith("rg/")
    assert 0 <= row["pass_rate"] <= 1
    assert row["difficulty_bucket"] in ("easy", "medium", "hard")
  # The difficulty balance from the command line: the non-empty buckets
  # end equal.
  balance = steps["difficulty_balance"]
  assert balance["enabled"]
  assert sum(balance["info"]["by_bucket_before"].values()) == (
      steps["pass_rate"]["kept"])
  buckets = collections.Counter(row["difficulty_bucket"] for row in kept)
  assert len(set(buckets.values())) == 1
  # Rejection sampling: a policy that only ever writes \\boxed{4} or
  # \\boxed{7} solves no reasoning-gym problem, and the tool says so
  # instead of writing an empty SFT set.
  warm = _run("launch/warmup_data.py", f"--config={config}", f"--in={out}",
              f"--out={tmp_path / 'warmup.jsonl'}",
              f"--report={tmp_path / 'warmup.json'}", *policy,
              expect_ok=False)
  assert "no verified response" in warm.stderr
  warm_report = json.loads((tmp_path / "warmup.json").read_text())
  assert warm_report["prompts"] == len(kept)
  assert warm_report["responses"] == 4 * len(kept)


def test_a_checkpoint_with_known_answers(tmp_path):
  """The Hugging Face checkpoint of tests/hf_dirs.py answers every chat
  prompt \\boxed{4} or \\boxed{7} at random, through our sampler and chat
  template, checked by the math verifier: a prompt whose answer is 5 has
  pass rate 0 and survives the no-CoT guesses, those whose answer is 4 or
  7 (8/2 counts as 4) are guessed and dropped, and rejection sampling keeps
  exactly the responses with the right value."""
  from kimi_jax.infra.config import load_config
  from kimi_jax.curation import policy as policy_lib
  from kimi_jax.curation import warmup
  from kimi_jax.rewards.registry import make_reward
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")
  policy = policy_lib.load_policy(config=load_config(
      "experiments/qwen2_5_1_5b.py:cpu_smoke", {"init_from_hf": hf_dir}))
  rows = [{"prompt": "What is 2 + 2?", "answer": "4"},
          {"prompt": "What is 3 + 4?", "answer": "7"},
          {"prompt": "What is 2 + 3?", "answer": "5"},
          {"prompt": "What is 16 / 4?", "answer": "8/2"}]
  path = tmp_path / "raw.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  reward = make_reward("math")
  measured = C.curate(str(path), C.CurateConfig(
      kind="math", easy_to_hack=False, pass_max_tokens=16), policy=policy,
      reward=reward)
  rate = {r.record["answer"]: r.added["pass_rate"] for r in measured.kept}
  assert rate["5"] == 0.0
  for answer in ("4", "7", "8/2"):
    assert 0.0 < rate[answer] < 1.0, rate
  hacked = C.curate(str(path), C.CurateConfig(
      kind="math", pass_rate=False, hack_template="{question}",
      hack_response_prefix=""), policy=policy, reward=reward)
  assert [r.record["answer"] for r in hacked.kept] == ["5"]
  assert sorted(d.row.record["answer"] for d in hacked.dropped) == [
      "4", "7", "8/2"]

  records = [dict(r, id=str(i)) for i, r in enumerate(rows)]
  result = warmup.rejection_sample(
      records, warmup.WarmupConfig(samples=6, max_per_prompt=6,
                                   max_new_tokens=16),
      policy=policy, reward=reward)
  value = {"4": "4", "7": "7", "5": "5", "8/2": "4"}
  for record, responses, correct in result.samples:
    want = [r.strip() == f"\\boxed{{{value[record['answer']]}}}"
            for r in responses]
    assert correct == want, (record, responses)
  kept = [(r["prompt"], r["response"]) for r in result.rows]
  assert kept == [(rec["prompt"], resp) for rec, resps, ok in result.samples
                  for resp, good in zip(resps, ok) if good]
  assert not [k for k in kept if k[0] == "What is 2 + 3?"]
  assert result.report()["acceptance_rate"] == pytest.approx(
      len(kept) / (6 * len(rows)))
