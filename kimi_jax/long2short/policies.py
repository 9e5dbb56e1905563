"""A policy as a run workdir: what long2short's stages write and read.

Every model of a long2short experiment lives in a directory laid out as a
main-job run (`kimi_jax/job/workdir.py`): `config.json` (the experiment it
belongs to), the task's tokenizer and `checkpoints/` with the policy as the
last step of a finished RL stage (`{"stage": "rl", "loop": ...}` at
iteration `rl.iterations`, no optimizer state). So `launch/export_hf.py`
exports it, `launch/sample.py` samples it, and the job resumes it (running
no further iteration unless `rl.iterations` is raised).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from kimi_jax.data.tasks import hf_tokenizer, make_task
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra.files import write_json
from kimi_jax.job import workdir as workdir_lib
from kimi_jax.job.experiment import ExperimentConfig, parse_config
from kimi_jax.job.run import rl_step
from kimi_jax.model import transformer
from kimi_jax.rl.loop_state import LoopState

STAGE_FILE = "stage.json"


def write_policy(workdir: str, config: ml_collections.ConfigDict, params: Any
                 ) -> int:
  """Writes `params` as the finished policy of a run of `config` in
  `workdir`; returns the checkpoint step."""
  cfg = parse_config(config)
  os.makedirs(workdir, exist_ok=True)
  # A jsonl task reads its tokenizer from the directory the config names.
  task = make_task(cfg.task, cfg.seed, hf_tokenizer(cfg.init_from_hf,
                                                    cfg.task))
  if jax.process_index() == 0:
    with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    if hasattr(task.tokenizer, "save"):
      task.tokenizer.save(workdir)
  rl = cfg.rl
  loop = dataclasses.replace(
      LoopState.initial(group_size=rl.samples_per_prompt,
                        max_wait_iterations=rl.max_wait_iterations,
                        records=task.train,
                        prompt_sampling=cfg.prompt_sampling),
      iteration=rl.iterations)
  step = rl_step(cfg, rl.iterations)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=None)
  try:
    checkpointer.save(step, params=params,
                      host={"stage": "rl", "loop": loop.to_json()})
  finally:
    checkpointer.close()
  return step


def read_policy(workdir: str, shardings: Any, step: int | None = None
                ) -> tuple[Any, ExperimentConfig]:
  """(params of `workdir`'s latest checkpoint placed in `shardings`, the
  run's typed config)."""
  _, cfg = workdir_lib.load_run(workdir)
  params, _ = workdir_lib.restore_params(workdir, cfg, shardings, step)
  return params, cfg


def param_shardings(cfg: ExperimentConfig, sharder) -> Any:
  return transformer.param_shardings(cfg.model, sharder)


def stage_done(workdir: str) -> dict | None:
  """What a finished stage recorded in `workdir`, or None if it has not
  finished."""
  path = os.path.join(workdir, STAGE_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def mark_done(workdir: str, record: dict) -> None:
  if jax.process_index() != 0:
    return
  write_json(os.path.join(workdir, STAGE_FILE), record)
