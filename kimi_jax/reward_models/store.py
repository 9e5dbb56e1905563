"""A trained reward model on disk, and its Hugging Face export.

A reward-model directory (written by `launch/train_rm.py`, read by the RL
job through `config.reward_model.path`):

  rm.json              {"kind": "value" | "cot", "model": {ModelConfig},
                        "template": {RMTemplate}, "tokenizer": {"type":
                        "words"} | {"type": "hf", "path": DIR},
                        "logit_offset": c, "max_new_tokens": n, "report": {}}
  word_tokenizer.json  the reward model's word tokenizer (type "words")
  checkpoints/         Orbax step 0: the params (value: {"model", "head"})

Hugging Face export of a value model (`export_value_hf`): the base model's
weights as `export_hf_checkpoint` writes them (Qwen2 / Llama names), plus
`score.weight`, the head as a [1, D] matrix (in model.safetensors, or in
`value_head.safetensors` named by the index of a sharded export);
config.json names `Qwen2ForSequenceClassification` /
`LlamaForSequenceClassification` with `num_labels: 1`, and keeps
`kimi_jax_reward_model: {"logit_offset", "template"}`. transformers loads it
with `AutoModelForSequenceClassification`: its logit for an input is ours
(P(correct) = sigmoid(logit + logit_offset)). An LM head of an untied
model stays in the files (transformers ignores it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from kimi_jax.data.word_tokenizer import WordTokenizer
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.model import hf, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.tokenizer import load_hf_tokenizer
from kimi_jax.reward_models import value_model
from kimi_jax.reward_models.template import RMTemplate
from kimi_jax.sharding import Sharder

RM_FILE = "rm.json"
KINDS = ("value", "cot")
HEAD_FILE = "value_head.safetensors"
_CLASSIFIERS = {hf.QWEN2: "Qwen2ForSequenceClassification",
                hf.LLAMA: "LlamaForSequenceClassification",
                hf.QWEN3: "Qwen3ForSequenceClassification"}


@dataclasses.dataclass(frozen=True)
class RewardModel:
  """A loaded reward model: what serving and evaluation need."""

  kind: str
  model: ModelConfig
  template: RMTemplate
  tokenizer: Any
  params: Any
  logit_offset: float = 0.0
  max_new_tokens: int = 0
  report: dict = dataclasses.field(default_factory=dict)


def _tokenizer_spec(tokenizer: Any, tokenizer_dir: str) -> dict[str, Any]:
  if isinstance(tokenizer, WordTokenizer):
    return {"type": "words"}
  if not tokenizer_dir:
    raise ValueError("a Hugging Face tokenizer needs its directory "
                     "(tokenizer_dir) to be saved with the reward model")
  return {"type": "hf", "path": os.path.abspath(tokenizer_dir)}


def save(path: str, rm: RewardModel, *, tokenizer_dir: str = "") -> None:
  """Writes `rm` to directory `path` (see the module doc)."""
  if rm.kind not in KINDS:
    raise ValueError(f"reward model kind must be one of {KINDS}")
  os.makedirs(path, exist_ok=True)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(path, "checkpoints"),
                                       max_to_keep=1)
  try:
    checkpointer.save(0, params=rm.params, host={"kind": rm.kind})
  finally:
    checkpointer.close()
  spec = _tokenizer_spec(rm.tokenizer, tokenizer_dir)
  if spec["type"] == "words" and jax.process_index() == 0:
    rm.tokenizer.save(path)
  meta = {"kind": rm.kind, "model": dataclasses.asdict(rm.model),
          "template": dataclasses.asdict(rm.template), "tokenizer": spec,
          "logit_offset": rm.logit_offset,
          "max_new_tokens": rm.max_new_tokens, "report": rm.report}
  if jax.process_index() == 0:
    with open(os.path.join(path, RM_FILE + ".tmp"), "w") as f:
      json.dump(meta, f, indent=2)
    os.replace(os.path.join(path, RM_FILE + ".tmp"),
               os.path.join(path, RM_FILE))


def read_meta(path: str) -> dict[str, Any]:
  file = os.path.join(path, RM_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{file}: not found; is {path} a reward-model "
                            f"directory written by launch/train_rm.py?")
  with open(file) as f:
    meta = json.load(f)
  if meta.get("kind") not in KINDS:
    raise ValueError(f"{file}: kind must be one of {KINDS}, got "
                     f"{meta.get('kind')!r}")
  return meta


def load(path: str, sharder: Sharder, *, params_shardings: Any = None
         ) -> RewardModel:
  """The reward model in `path`, its params placed in their training
  shardings on `sharder`'s mesh (or `params_shardings`)."""
  meta = read_meta(path)
  model = ModelConfig.from_mapping(meta["model"])
  if meta["kind"] == "value":
    abstract = value_model.abstract_params(model)
    shardings = value_model.param_shardings(model, sharder)
  else:
    abstract = transformer.abstract_params(model)
    shardings = transformer.param_shardings(model, sharder)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(path, "checkpoints"),
                                       max_to_keep=None)
  try:
    params, _, _ = checkpointer.restore(
        0, params_like=abstract,
        params_shardings=params_shardings or shardings)
  finally:
    checkpointer.close()
  spec = meta["tokenizer"]
  if spec["type"] == "words":
    tokenizer = WordTokenizer.load(path)
  else:
    tokenizer = load_hf_tokenizer(spec["path"])
  return RewardModel(kind=meta["kind"], model=model,
                     template=RMTemplate(**meta["template"]),
                     tokenizer=tokenizer, params=params,
                     logit_offset=float(meta.get("logit_offset", 0.0)),
                     max_new_tokens=int(meta.get("max_new_tokens", 0)),
                     report=meta.get("report", {}))


def export_value_hf(rm: RewardModel, out: str) -> None:
  """A value model as a Hugging Face sequence-classification directory
  (see the module doc)."""
  if rm.kind != "value":
    raise ValueError(f"only a value model exports with a head, got "
                     f"{rm.kind!r}")
  hf.export_hf_checkpoint(rm.params["model"], rm.model, out)
  if jax.process_index() != 0:
    return
  w = np.asarray(jax.device_get(rm.params["head"]["w_D"]))[None, :]
  index_path = os.path.join(out, hf.INDEX_FILE)
  if os.path.isfile(index_path):
    # Sharded export: the head is one more file in the index.
    save_file({"score.weight": w}, os.path.join(out, HEAD_FILE),
              metadata={"format": "pt"})
    with open(index_path) as f:
      index = json.load(f)
    index["weight_map"]["score.weight"] = HEAD_FILE
    with open(index_path, "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  else:
    # One file: transformers reads model.safetensors and ignores an index
    # beside it, so the head goes into that file.
    single = os.path.join(out, hf.SINGLE_FILE)
    with safe_open(single, "np") as f:
      tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["score.weight"] = w.astype(next(iter(tensors.values())).dtype)
    save_file(tensors, single, metadata={"format": "pt"})
  config_path = os.path.join(out, hf.CONFIG_FILE)
  with open(config_path) as f:
    config = json.load(f)
  arch = config["architectures"][0]
  if arch not in _CLASSIFIERS:
    raise ValueError(f"{out}: no Hugging Face classifier export for a "
                     f"{arch} reward model (known: {sorted(_CLASSIFIERS)})")
  config["architectures"] = [_CLASSIFIERS[arch]]
  config["num_labels"] = 1
  config["id2label"] = {"0": "LABEL_0"}
  config["label2id"] = {"LABEL_0": 0}
  config["kimi_jax_reward_model"] = {
      "logit_offset": rm.logit_offset,
      "template": dataclasses.asdict(rm.template)}
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
