"""The real path end to end for each open-model experiment: Qwen3
(experiments/qwen3_8b.py, thinking on), Llama 3.1 (llama3_1_8b.py, llama3
rope scaling) and Gemma 3 (gemma3_4b.py, interleaved sliding-window
layers). For each, a tiny random checkpoint of that architecture with a
tokenizer and chat template of its family's style (tests/hf_dirs.py: no
download), the `:cpu_smoke` command as a user runs it (packed SFT, RL, the
export to WORKDIR/hf_export), then `launch/sample.py --greedy` on the run,
whose continuation must be the one transformers' greedy `generate` writes
from the export through the same chat template.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from tests.hf_dirs import make_family_dir
from tests.test_real_path import ROOT, _data, _rows, _run, _write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.host_inputs]

# TINY_FAMILIES name -> (experiment, the chat-template variables its
# task.thinking passes).
EXPERIMENTS = {
    "qwen3": ("qwen3_8b.py", {"enable_thinking": True}),
    "llama3": ("llama3_1_8b.py", {}),
    "gemma3": ("gemma3_4b.py", {}),
}
QUESTION = "What is 7 + 3?"
# An SFT row with a reasoning block (the thinking template keeps it).
THINKING_ROW = {"prompt": "What is 2+2?",
                "response": "<think>\n2 and 2 make 4\n</think>\n\n\\boxed{4}"}


def _smoke(name: str, tmp) -> tuple[str, str, dict]:
  """(checkpoint dir, workdir, data files) after the `:cpu_smoke` run."""
  hf = make_family_dir(tmp / "hf", name, max_position_embeddings=512)
  data = _data(tmp / "data")
  if name == "qwen3":
    rows = open(data["sft"]).read().splitlines() + [json.dumps(THINKING_ROW)]
    _write_jsonl(data["sft"], rows)
  workdir = str(tmp / "run")
  experiment = EXPERIMENTS[name][0]
  proc = _run([
      sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"),
      "--config", os.path.join(ROOT, "experiments", experiment + ":cpu_smoke"),
      "--workdir", workdir, f"--config.init_from_hf={hf}",
      f"--config.task.train_path={data['train']}",
      f"--config.task.eval_path={data['eval']}",
      f"--config.sft.train_path={data['sft']}"])
  assert proc.returncode == 0, proc.stderr[-4000:]
  return hf, workdir, data


def _greedy_sample(workdir: str, path) -> dict:
  proc = _run([sys.executable, os.path.join(ROOT, "launch", "sample.py"),
               "--workdir", workdir, "--prompt", QUESTION, "--greedy",
               "--max_new_tokens", "12", "--json", str(path)])
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(path) as f:
    [record] = json.load(f)
  return record


def check_greedy_against_transformers(record: dict, export: str,
                                      template_kwargs: dict) -> None:
  """`launch/sample.py`'s greedy record is transformers' greedy
  continuation from the export through its chat template, token for token,
  with each token's log-prob (a random tied-embedding model may repeat one
  token, whose probability still depends on every layer)."""
  import torch
  import transformers
  # The tokenizer.json as written (see tests/test_real_path.py: the test
  # BPE is not what AutoTokenizer's per-family classes expect).
  tok = transformers.PreTrainedTokenizerFast.from_pretrained(export)
  prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True,
                                   return_dict=False, **template_kwargs)
  assert record["prompt_tokens"] == prompt
  model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  n = len(record["tokens"])
  assert n > 0
  with torch.no_grad():
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=n,
                               do_sample=False)
  assert generated[0, len(prompt):].tolist()[:n] == record["tokens"]
  with torch.no_grad():
    logits = model(torch.tensor([prompt + record["tokens"]])).logits[0]
  ref = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)[
      torch.arange(n), torch.tensor(record["tokens"])].numpy()
  np.testing.assert_allclose(record["logp"], ref, rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_cpu_smoke_trains_exports_and_samples_as_transformers(name,
                                                              tmp_path):
  from kimi_jax.model import families, hf as hf_lib
  from safetensors.numpy import load_file
  source, workdir, data = _smoke(name, tmp_path)
  # SFT, RL and the export all ran, on the checkpoint's architecture.
  assert [r["step"] for r in _rows(workdir, "sft")] == [1, 2]
  assert [r["step"] for r in _rows(workdir, "rl")] == [1, 2]
  kept = _rows(workdir, "data")[0]["sft_train_kept"]
  assert kept == len(open(data["sft"]).read().splitlines())
  export = os.path.join(workdir, "hf_export")
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["hf_export"] == export
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  assert config["task"]["thinking"] == ("on" if name == "qwen3" else
                                        "template")
  ours, theirs = (hf_lib.model_config_from_hf(p) for p in (export, source))
  assert families.architecture_of(ours) == families.architecture_of(theirs)
  with open(os.path.join(export, "config.json")) as f:
    with open(os.path.join(source, "config.json")) as g:
      assert json.load(f)["architectures"] == json.load(g)["architectures"]
  before = load_file(os.path.join(source, "model.safetensors"))
  after = load_file(os.path.join(export, "model.safetensors"))
  assert before.keys() == after.keys()
  assert any(not np.allclose(before[k], after[k]) for k in before)

  # launch/sample.py's greedy continuation, through the run's chat
  # template, is transformers' greedy continuation from the export.
  record = _greedy_sample(workdir, tmp_path / "samples.json")
  assert record["finish"] in ("stop", "length", "repeat")
  check_greedy_against_transformers(record, export, EXPERIMENTS[name][1])
