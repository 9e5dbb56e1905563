"""What a run leaves in its workdir, read back: the experiment config
(`config.json`), the Orbax checkpoints (`checkpoints/`) and the tokenizer.
Tools that act on a finished or running job (sampling, export) start here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import ml_collections

from kimi_jax import checkpoint as ckpt_lib
from kimi_jax.config import ConfigError
from kimi_jax.experiment import ExperimentConfig, parse_config
from kimi_jax.model import transformer
from kimi_jax.sampler.driver import SampleRequest, SampleResult, Sampler
from kimi_jax.sampler.engine import Engine
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import Sharder, make_mesh

CONFIG_FILE = "config.json"


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The ConfigDict the run in `workdir` was started with."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise ConfigError(f"{path}: not found; is {workdir} a kimi_jax workdir?")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.lock()
  return config


def tokenizer(cfg: ExperimentConfig) -> Any:
  """The tokenizer the run trained with: Hugging Face's when it started from
  a Hugging Face directory, else the task's own."""
  from kimi_jax.data.tasks import hf_tokenizer, make_task
  tok = hf_tokenizer(cfg.init_from_hf, cfg.task)
  return make_task(cfg.task, cfg.seed).tokenizer if tok is None else tok


def restore_params(workdir: str, cfg: ExperimentConfig, shardings: Any,
                   step: int | None = None) -> tuple[Any, int]:
  """(params of checkpoint `step` (default: the latest), that step), placed
  in `shardings`."""
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{workdir}: no checkpoint yet")
    if step not in checkpointer.all_steps():
      raise FileNotFoundError(f"{workdir}: no checkpoint step {step} (have "
                              f"{checkpointer.all_steps()})")
    params, _, _ = checkpointer.restore(
        step, params_like=transformer.abstract_params(cfg.model),
        params_shardings=shardings)
  finally:
    checkpointer.close()
  return params, step


def load_run(workdir: str, n_devices: int | None = None
             ) -> tuple[ml_collections.ConfigDict, ExperimentConfig]:
  config = load_config(workdir)
  return config, parse_config(config, n_devices)


def encode_text_prompt(tok: Any, text: str) -> list[int]:
  """Prompt ids as the tasks build them: bos first when the tokenizer has
  one."""
  bos = getattr(tok, "bos_id", None)
  return ([bos] if bos is not None else []) + list(tok.encode(text))


def complete(workdir: str, prompts: Sequence[str], *, step: int | None = None,
             num_samples: int = 1, max_new_tokens: int | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, greedy: bool = False, seed: int = 0
             ) -> tuple[list[SampleResult], list[str]]:
  """Completions of the run's policy: (results, one printable line each).

  Sampling settings default to the config's sampler section; sample j of
  every prompt uses seed `seed + j`.
  """
  _, cfg = load_run(workdir)
  tok = tokenizer(cfg)
  engine = Engine(cfg.model, cfg.sampler.engine,
                  sharder=Sharder(make_mesh(cfg.mesh), cfg.rules))
  params, _ = restore_params(workdir, cfg, engine.param_shardings, step)
  s = cfg.sampler
  requests = []
  for i, text in enumerate(prompts):
    prompt = encode_text_prompt(tok, text)
    room = engine.cache_len - len(prompt)
    if room < 1:
      raise ValueError(f"prompt {i}: {len(prompt)} tokens leave no room in "
                       f"the sampler cache of {engine.cache_len}")
    for j in range(num_samples):
      requests.append(SampleRequest(
          (i, j), tuple(prompt),
          max_new_tokens=min(max_new_tokens or room, room),
          stop_tokens=() if tok.eos_id is None else (tok.eos_id,),
          sampling=SamplingParams(
              temperature=s.temperature if temperature is None else
              temperature,
              top_k=s.top_k if top_k is None else top_k,
              top_p=s.top_p if top_p is None else top_p,
              greedy=greedy, seed=seed + j)))
  results, _ = Sampler(engine, s.repeat, s.steps_per_call).generate(
      params, requests)
  lines = []
  for req, res in zip(requests, results):
    tokens = [t for t in res.tokens if t != tok.eos_id]
    lines.append(f"[prompt {req.id[0]} sample {req.id[1]}] "
                 f"({res.finish_reason}, {len(res.tokens)} tokens, logp "
                 f"{sum(res.logprobs):.2f}) {prompts[req.id[0]]} -> "
                 f"{tok.decode(tokens)}")
  return results, lines
