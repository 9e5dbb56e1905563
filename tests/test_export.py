"""Hugging Face export from a run's workdir: tiny random Qwen2 and Llama
models built with transformers (no download) are imported, changed, saved
as a run would save them (the real Checkpointer, the experiment config as
JSON), exported with launch/export_hf.py, and loaded back with transformers:
logits equal ours, and the tokenizer, chat template and generation config
round-trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra.config import load_config
from kimi_jax.job.export import ExportError, export_workdir
from kimi_jax.model import hf, transformer
from kimi_jax.model.tokenizer import load_hf_tokenizer
from tests.hf_dirs import make_llama_style_dir, make_qwen_style_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT = os.path.join(ROOT, "launch", "export_hf.py")
sys.path.insert(0, os.path.join(ROOT, "launch"))
import export_hf  # noqa: E402  (launch/ is not a package)

# Numerics against transformers on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

_SIZES = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0)
TOKENS_BxT = np.random.RandomState(0).randint(0, 500, (2, 13)).astype(
    np.int32)
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 times 7?"}]


def _source_dir(path, arch: str) -> str:
  """A random HF model with a tokenizer and chat template, as downloaded.
  The Llama one has no generation_config.json (the export makes one)."""
  torch.manual_seed(0)
  if arch == "qwen2":
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_SIZES, tie_word_embeddings=True))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_SIZES, head_dim=24, tie_word_embeddings=False))
  model.save_pretrained(path)
  if arch == "qwen2":
    make_qwen_style_dir(path)
  else:
    make_llama_style_dir(path)
    os.remove(os.path.join(path, "generation_config.json"))
  return str(path)


def _our_logits(params, cfg) -> np.ndarray:
  B, T = TOKENS_BxT.shape
  inputs = jax.device_put(dict(
      tokens=TOKENS_BxT, positions=np.tile(np.arange(T, dtype=np.int32),
                                           (B, 1)),
      segments=np.ones((B, T), np.int32)))
  fwd = jax.jit(lambda p, x: transformer.forward(
      p, x["tokens"], x["positions"], x["segments"], cfg=cfg)[0])
  return np.asarray(fwd(params, inputs))


def _write_run(workdir, source: str, params, step: int) -> None:
  """What the job leaves behind: config.json and an Orbax step."""
  config = load_config(os.path.join(ROOT, "experiments",
                                    "qwen2_5_1_5b.py:tiny"),
                       {"init_from_hf": source})
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json())
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  ckpt.save(step, params=params, host={"stage": "rl", "iteration": 1})
  ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_export_from_workdir_loads_in_transformers(arch, tmp_path):
  source = _source_dir(tmp_path / "source", arch)
  cfg, params = hf.load_hf_checkpoint(source)
  # "Training": move every parameter, so the export must carry our weights.
  rng = np.random.RandomState(1)
  params = jax.tree.map(
      lambda x: jax.device_put(np.asarray(x) + 0.05 * rng.normal(
          size=x.shape).astype(np.float32)), params)
  _write_run(tmp_path / "run", source, params, step=7)
  out = str(tmp_path / "export")
  export_hf.main(["--workdir", str(tmp_path / "run"), "--out", out,
                  "--step", "7"])

  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM",
                                  "llama": "LlamaForCausalLM"}[arch]
  with torch.no_grad():
    ref = model(torch.tensor(TOKENS_BxT, dtype=torch.long)).logits.numpy()
  ours = _our_logits(params, cfg)
  assert np.abs(ref).max() > 0.1
  np.testing.assert_allclose(ours, ref, rtol=1e-4,
                             atol=1e-4 * np.abs(ref).max())
  # The source's own logits differ: the export is the trained policy.
  src_model = transformers.AutoModelForCausalLM.from_pretrained(source)
  with torch.no_grad():
    src = src_model(torch.tensor(TOKENS_BxT, dtype=torch.long)).logits
  assert not np.allclose(src.numpy(), ref, atol=1e-3)

  # Tokenizer, chat template and generation config round-trip.
  tok_src = transformers.AutoTokenizer.from_pretrained(source)
  tok_out = transformers.AutoTokenizer.from_pretrained(out)
  for gen in (True, False):
    assert tok_out.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=gen) == \
        tok_src.apply_chat_template(CHAT, tokenize=False,
                                    add_generation_prompt=gen)
  ours_src, ours_out = load_hf_tokenizer(source), load_hf_tokenizer(out)
  assert (ours_out.eos_id, ours_out.pad_id, ours_out.bos_id,
          ours_out.stop_ids) == (ours_src.eos_id, ours_src.pad_id,
                                 ours_src.bos_id, ours_src.stop_ids)
  assert ours_out.chat_template.source == ours_src.chat_template.source
  gen_config = transformers.GenerationConfig.from_pretrained(out)
  want_eos = list(ours_src.stop_ids)
  got_eos = gen_config.eos_token_id
  assert (got_eos if isinstance(got_eos, list) else [got_eos]) == want_eos
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["max_position_embeddings"] == 256  # the source's


def test_export_errors_name_the_problem(tmp_path):
  with pytest.raises(ExportError, match=r"config\.json: not found"):
    export_workdir(str(tmp_path / "nowhere"), str(tmp_path / "out"))
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps(
      {"model": {}, "init_from_hf": str(tmp_path / "gone")}))
  with pytest.raises(ExportError, match=r"init_from_hf=.*gone.* is not a "
                     r"directory"):
    export_workdir(str(run), str(tmp_path / "out"))
  source = make_qwen_style_dir(tmp_path / "src")
  with open(os.path.join(source, "config.json"), "w") as f:
    json.dump(dict(_SIZES, architectures=["Qwen2ForCausalLM"]), f)
  (run / "config.json").write_text(json.dumps(
      {"model": {"param_dtype": "float32"}, "init_from_hf": source}))
  with pytest.raises(ExportError, match=r"checkpoints: no checkpoints"):
    export_workdir(str(run), str(tmp_path / "out"))


@pytest.mark.slow
def test_missing_step_lists_the_available_ones(tmp_path):
  source = _source_dir(tmp_path / "source", "qwen2")
  _, params = hf.load_hf_checkpoint(source)
  _write_run(tmp_path / "run", source, params, step=3)
  with pytest.raises(ExportError, match=r"no step 5; available: \[3\]"):
    export_workdir(str(tmp_path / "run"), str(tmp_path / "out"), step=5)
  with pytest.raises(SystemExit, match="export error: .*no step 5"):
    export_hf.main(["--workdir", str(tmp_path / "run"), "--out",
                    str(tmp_path / "out"), "--step", "5"])


def test_help_describes_the_command():
  out = subprocess.run([sys.executable, EXPORT, "--help"], check=True,
                       capture_output=True, text=True).stdout
  for flag in ("--workdir", "--out", "--step"):
    assert flag in out
