"""The real path end to end, as a user runs it: a tiny Qwen2 built with
transformers (no download) with a BPE tokenizer trained at test time and a
chat template (tests/hf_dirs.py), JSONL prompt, answer and SFT files with
math answers, and the `:cpu_smoke` command of experiments/qwen2_5_1_5b.py as
a subprocess. Then: SFT lowered its loss, RL ran its iterations scored by
the math verifier, the export in WORKDIR/hf_export loads in transformers
with our logits, and the same command again resumes instead of starting
over. Bad input (a broken line, a missing field, an empty file, an
unsupported architecture) stops the launcher with one line naming it.

The checkpoint answers every prompt `\\boxed{4}` or `\\boxed{7}` at random
(`make_answering_qwen2_dir`) and every answer in the files is written in
another form (`8/2`, `3+4`, `7.00`, ...), so a response is only ever
counted correct by a verifier that compares values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.hf_dirs import make_answering_qwen2_dir, make_unsupported_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

TRAIN_ANSWERS = ["8/2", "3+4", "4.0", "\\frac{14}{2}", "2+2", "7.00",
                 "\\frac{8}{2}", "14/2"]
EVAL_ANSWERS = ["2*2", "21/3", "4.00", "6+1"]


def _write_jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _data(d) -> dict[str, str]:
  os.makedirs(d, exist_ok=True)
  train = [{"prompt": f"Problem {i}: what is the value of the expression?",
            "answer": a, "difficulty": 1 + i % 3, "tags": ["arithmetic"]}
           for i, a in enumerate(TRAIN_ANSWERS)]
  held = [{"prompt": f"Held-out problem {i}: compute it.", "answer": a}
          for i, a in enumerate(EVAL_ANSWERS)]
  sft = [{"prompt": f"Problem {i}: what is the value of the expression?",
          "response": "\\boxed{%s}" % ("4" if i % 2 == 0 else "7")}
         for i in range(12)]
  sft.append({"messages": [
      {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "\\boxed{4}"}]})
  return {"train": _write_jsonl(os.path.join(d, "train.jsonl"), train),
          "eval": _write_jsonl(os.path.join(d, "eval.jsonl"), held),
          "sft": _write_jsonl(os.path.join(d, "sft.jsonl"), sft)}


def _command(workdir, hf, train, held, sft) -> list[str]:
  return [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"),
          "--config", os.path.join(ROOT, "experiments",
                                   "qwen2_5_1_5b.py:cpu_smoke"),
          "--workdir", str(workdir), f"--config.init_from_hf={hf}",
          f"--config.task.train_path={train}",
          f"--config.task.eval_path={held}", f"--config.sft.train_path={sft}"]


def _run(cmd, timeout=900) -> subprocess.CompletedProcess:
  # One CPU device, as on a laptop (the tests' 8 fake devices stay here).
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
  return subprocess.run(cmd, env=env, capture_output=True, text=True,
                        timeout=timeout, cwd=ROOT)


def _rows(workdir, stage: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["stage"] == stage]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The cpu_smoke command, run once for the tests of this module."""
  tmp = tmp_path_factory.mktemp("real_path")
  hf = make_answering_qwen2_dir(tmp / "hf")
  data = _data(tmp / "data")
  workdir = tmp / "run"
  cmd = _command(workdir, hf, data["train"], data["eval"], data["sft"])
  proc = _run(cmd)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return dict(tmp=tmp, hf=hf, data=data, workdir=str(workdir), cmd=cmd,
              proc=proc)


def test_sft_lowers_the_loss_on_packed_rows(run):
  rows = _rows(run["workdir"], "sft")
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[1]["loss"] < rows[0]["loss"]
  # Packed: more examples than the 4 rows of a batch.
  assert all(r["examples"] > 4 for r in rows)
  data = _rows(run["workdir"], "data")[0]
  assert (data["task_train_kept"], data["task_eval_kept"],
          data["sft_train_kept"], data["sft_train_skipped"]) == (8, 4, 13, 0)


def test_rl_runs_its_iterations_with_math_verify_rewards(run):
  rows = _rows(run["workdir"], "rl")
  assert [r["step"] for r in rows] == [1, 2]
  # Every answer in the files is written differently from the model's
  # \boxed{4} / \boxed{7}: only a value-comparing verifier finds them right.
  accuracy = [r["accuracy"] for r in rows]
  assert all(0 < a < 1 for a in accuracy), accuracy
  assert all("loss" in r and r["groups_trained"] > 0 for r in rows)
  with open(os.path.join(run["workdir"], "summary.json")) as f:
    summary = json.load(f)
  assert summary["iterations"] == 2
  assert 0 < summary["warmstart_eval"]["pass_at_1"] < 1
  assert summary["hf_export"] == os.path.join(run["workdir"], "hf_export")
  with open(os.path.join(run["workdir"], "config.json")) as f:
    config = json.load(f)
  assert config["task"]["reward"] == "math"
  # The model section came from the checkpoint, not the 1.5B placeholder.
  assert (config["model"]["d_model"], config["model"]["n_layers"]) == (64, 2)


def test_evaluate_reproduces_the_final_evaluation(run, tmp_path):
  # launch/evaluate.py through the Hugging Face tokenizer, chat template
  # and math-verify: the run's own final figures, from the run's held-out
  # set and from the same rows read as another file (--data).
  with open(os.path.join(run["workdir"], "summary.json")) as f:
    final = json.load(f)["final_eval"]
  for extra in ([], ["--data", run["data"]["eval"]]):
    out = tmp_path / f"out{len(extra)}"
    proc = _run([sys.executable, os.path.join(ROOT, "launch", "evaluate.py"),
                 "--workdir", run["workdir"], "--by", "answer", "--out",
                 str(out)] + extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "breakdown.json") as f:
      tables = json.load(f)["tables"]
    assert tables["all"][0]["pass_at_1"] == final["pass_at_1"]
    assert tables["all"][0]["greedy_accuracy"] == final["greedy_accuracy"]
    assert sorted(r["group"] for r in tables["answer"]) == sorted(
        EVAL_ANSWERS)


@pytest.mark.host_inputs
def test_export_loads_in_transformers_with_our_logits(run):
  import torch
  import transformers
  from kimi_jax.job import workdir as workdir_lib
  from kimi_jax.model import transformer
  out = os.path.join(run["workdir"], "hf_export")
  _, cfg = workdir_lib.load_run(run["workdir"])
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = transformer.abstract_params(cfg.model)
  params, step = workdir_lib.restore_params(
      run["workdir"], cfg, jax.tree.map(lambda _: device, abstract))
  assert step == cfg.sft.steps + 1 + cfg.rl.iterations
  tokens_BxT = np.random.RandomState(0).randint(0, 500, (2, 11)).astype(
      np.int32)
  B, T = tokens_BxT.shape
  positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  ours = np.asarray(transformer.forward(
      params, jax.device_put(tokens_BxT), jax.device_put(positions),
      jax.device_put(np.ones((B, T), np.int32)), cfg=cfg.model)[0])
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  source = transformers.AutoModelForCausalLM.from_pretrained(run["hf"]).eval()
  with torch.no_grad():
    ref = model(torch.tensor(tokens_BxT, dtype=torch.long)).logits.numpy()
    before = source(torch.tensor(tokens_BxT, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, ref, rtol=1e-4,
                             atol=1e-4 * np.abs(ref).max())
  assert not np.allclose(before, ref, atol=1e-3)  # SFT and RL moved it
  tok = transformers.AutoTokenizer.from_pretrained(out)
  chat = [{"role": "user", "content": "What is 2+2?"}]
  assert tok.apply_chat_template(chat, tokenize=False,
                                 add_generation_prompt=True).endswith(
                                     "<|im_start|>assistant\n")


@pytest.mark.host_inputs
def test_sample_writes_the_greedy_continuation_of_transformers(run, tmp_path):
  """launch/sample.py --greedy --json on the run: the prompt goes through the
  run's chat template as its RL prompts did (--raw: the bare text), and the
  continuation is the one transformers' greedy `generate` writes from the
  export, up to where kimi_jax stops."""
  import torch
  import transformers
  question = "What is 7 + 3?"
  out = {}
  for flag in ("", "--raw"):
    path = tmp_path / f"samples{flag}.json"
    proc = _run([sys.executable, os.path.join(ROOT, "launch", "sample.py"),
                 "--workdir", run["workdir"], "--prompt", question,
                 "--greedy", "--max_new_tokens", "12", "--json", str(path)]
                + ([flag] if flag else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(path) as f:
      out[flag] = json.load(f)
  record, raw = out[""][0], out["--raw"][0]
  assert set(record) == {"prompt", "sample", "prompt_tokens", "tokens",
                         "text", "logp", "finish"}
  export = os.path.join(run["workdir"], "hf_export")
  # The tokenizer.json as written (AutoTokenizer would rebuild this test
  # BPE as a Qwen2Tokenizer, whose digit-splitting regex the test tokenizer
  # does not have; a real Qwen2 tokenizer.json carries it).
  tok = transformers.PreTrainedTokenizerFast.from_pretrained(export)
  prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True,
                                   return_dict=False)
  assert record["prompt_tokens"] == prompt
  assert raw["prompt_tokens"] == tok(question)["input_ids"]
  assert len(raw["prompt_tokens"]) < len(prompt)
  model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  n = len(record["tokens"])
  with torch.no_grad():
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=n,
                               do_sample=False)
  assert generated[0, len(prompt):].tolist()[:n] == record["tokens"]
  assert record["text"] == tok.decode(record["tokens"],
                                      skip_special_tokens=True)
  assert len(record["logp"]) == n and record["finish"] in (
      "stop", "length", "repeat")


@pytest.mark.host_inputs
def test_export_hf_writes_any_step_of_the_run(run, tmp_path):
  """launch/export_hf.py on the job's own workdir (its config.json, its
  checkpoints and host items): the policy after RL iteration 1."""
  import torch
  import transformers
  from kimi_jax.job import run as job_lib
  from kimi_jax.job import workdir as workdir_lib
  from kimi_jax.model import hf
  _, cfg = workdir_lib.load_run(run["workdir"])
  step = job_lib.rl_step(cfg, 1)
  out = tmp_path / "step"
  proc = _run([sys.executable, os.path.join(ROOT, "launch", "export_hf.py"),
               "--workdir", run["workdir"], "--step", str(step), "--out",
               str(out)], timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"exported step {step}" in proc.stdout
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  from kimi_jax.model import transformer
  abstract = transformer.abstract_params(cfg.model)
  ours, _ = workdir_lib.restore_params(
      run["workdir"], cfg, jax.tree.map(lambda _: device, abstract), step)
  _, loaded = hf.load_hf_checkpoint(str(out))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  final = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.join(run["workdir"], "hf_export"))
  tokens = torch.tensor([[3, 17, 40, 2]])
  with torch.no_grad():
    assert not torch.allclose(model(tokens).logits, final(tokens).logits)


def test_the_same_command_again_resumes(run):
  before = {s: _rows(run["workdir"], s) for s in ("sft", "rl")}
  proc = _run(run["cmd"])
  assert proc.returncode == 0, proc.stderr[-4000:]
  log = proc.stdout + proc.stderr
  assert "resuming" in log and "new run" not in log
  assert "warm start:" not in log  # no SFT step ran again
  after = {s: _rows(run["workdir"], s) for s in ("sft", "rl")}
  assert after == before  # nothing trained twice, nothing logged twice
  assert [r["step"] for r in _rows(run["workdir"], "eval")] == [0, 2]
  assert os.path.isfile(os.path.join(run["workdir"], "hf_export",
                                     "model.safetensors"))


def _bad_input(run, tmp, **paths) -> subprocess.CompletedProcess:
  files = dict(hf=run["hf"], train=run["data"]["train"],
               held=run["data"]["eval"], sft=run["data"]["sft"])
  files.update(paths)
  return _run(_command(tmp / "bad_run", **files), timeout=600)


@pytest.mark.parametrize("case", ["broken_line", "missing_field",
                                  "empty_file", "unsupported_architecture"])
def test_bad_input_stops_the_launcher_naming_it(run, tmp_path, case):
  good = open(run["data"]["train"]).read().splitlines()
  if case == "broken_line":
    path = _write_jsonl(tmp_path / "t.jsonl",
                        good[:2] + ['{"prompt": "x", "answer": '] + good[2:])
    proc = _bad_input(run, tmp_path, train=path)
    needle = f"{path}:3: not valid JSON"
  elif case == "missing_field":
    path = _write_jsonl(tmp_path / "s.jsonl", [
        {"prompt": "What is 1+1?", "response": "\\boxed{2}"},
        {"prompt": "What is 2+2?", "reply": "\\boxed{4}"}])
    proc = _bad_input(run, tmp_path, sft=path)
    needle = f"{path}:2: field 'response': missing"
  elif case == "empty_file":
    path = _write_jsonl(tmp_path / "e.jsonl", [])
    proc = _bad_input(run, tmp_path, held=path)
    needle = f"{path}: empty file"
  else:
    hf = make_unsupported_dir(tmp_path / "gpt2")
    proc = _bad_input(run, tmp_path, hf=hf)
    needle = "unsupported architecture ['GPT2LMHeadModel']"
  assert proc.returncode != 0
  assert needle in proc.stderr, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  # Rejected before any weights loaded or any checkpoint was written.
  assert not os.path.exists(tmp_path / "bad_run" / "checkpoints")
