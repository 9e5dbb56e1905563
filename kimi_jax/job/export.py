"""A run's checkpoint as a Hugging Face directory (`launch/export_hf.py`).

The contract with the job: `WORKDIR/config.json` holds the experiment's
ConfigDict as JSON and `WORKDIR/checkpoints` the Orbax steps written by
`kimi_jax.infra.checkpoint.Checkpointer`. The model comes from the config: from
`init_from_hf`'s config.json (with the run settings of `config.model`, e.g.
its param dtype) when the run started from a Hugging Face checkpoint, else
from `config.model`. Tokenizer files, chat templates and the generation
config are copied from `init_from_hf`, so that directory must still exist.

The params are restored onto this host's first device and written one
tensor at a time, so host memory peaks around the params plus one file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax

from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.model import hf, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.vision.hf import export_vision_hf

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


class ExportError(ValueError):
  """The workdir or step cannot be exported; the message says why."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
  out: str
  step: int
  model: ModelConfig
  source_dir: str


def read_run_config(workdir: str) -> dict[str, Any]:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ExportError(f"{path}: not found (the job writes the experiment "
                      f"config there); is {workdir} a run's workdir?")
  with open(path) as f:
    try:
      config = json.load(f)
    except json.JSONDecodeError as exc:
      raise ExportError(f"{path}: not valid JSON ({exc})") from None
  if not isinstance(config, dict) or not isinstance(config.get("model"),
                                                    dict):
    raise ExportError(f"{path}: expected an experiment config with a "
                      f"'model' section")
  return config


def run_model_config(config: Mapping[str, Any], *, where: str = CONFIG_FILE
                     ) -> tuple[ModelConfig, str]:
  """(ModelConfig the run trained, its Hugging Face source dir or "")."""
  model = dict(config["model"])
  source = str(config.get("init_from_hf") or "")
  if not source:
    try:
      return ModelConfig.from_mapping(model), ""
    except (TypeError, ValueError) as exc:
      raise ExportError(f"{where}: model section: {exc}") from None
  if not os.path.isdir(source):
    raise ExportError(f"{where}: init_from_hf={source!r} is not a directory; "
                      f"the export copies the tokenizer and chat template "
                      f"from it")
  settings = {k: model[k] for k in hf.RUN_SETTINGS if k in model}
  return hf.merge_model_config(hf.model_config_from_hf(source), settings,
                               source=source), source


def export_workdir(workdir: str, out: str, *, step: int | None = None,
                   max_shard_bytes: int | None = None) -> ExportResult:
  """Writes checkpoint `step` (default: the latest) of `workdir` to `out`."""
  config = read_run_config(workdir)
  cfg, source = run_model_config(config, where=os.path.join(workdir,
                                                            CONFIG_FILE))
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise ExportError(f"{ckpt_dir}: no checkpoints")
  checkpointer = ckpt_lib.Checkpointer(ckpt_dir, max_to_keep=None)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise ExportError(f"{ckpt_dir}: no checkpoints")
    if step is None:
      step = max(steps)
    elif step not in steps:
      raise ExportError(f"{ckpt_dir}: no step {step}; available: "
                        f"{sorted(steps)}")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = transformer.abstract_params(cfg)
    params, _, _ = checkpointer.restore(
        step, params_like=abstract,
        params_shardings=jax.tree.map(lambda _: device, abstract))
  finally:
    checkpointer.close()
  if cfg.vision is not None:
    # The language model as a Hugging Face directory, the tower beside it as
    # a SigLIP vision model (`out/vision`); the projector has no standard
    # Hugging Face format and stays in the checkpoint.
    export_vision_hf(params["vision"], cfg.vision, os.path.join(out, "vision"))
    params = {k: v for k, v in params.items()
              if k not in ("vision", "projector")}
    cfg = dataclasses.replace(cfg, vision=None)
  hf.export_hf_directory(params, cfg, out, source_dir=source or None,
                         max_shard_bytes=max_shard_bytes)
  return ExportResult(out=out, step=step, model=cfg, source_dir=source)
