"""What a run leaves in its workdir, read back: the experiment config
(`config.json`), the Orbax checkpoints (`checkpoints/`) and the tokenizer.
Tools that act on a finished or running job (sampling, export) start here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import ml_collections

from kimi_jax.data import pointer_chase, tasks
from kimi_jax.data.tasks import hf_tokenizer, make_task
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra.config import ConfigError
from kimi_jax.job.experiment import ExperimentConfig, parse_config
from kimi_jax.model import transformer
from kimi_jax.model.tokenizer import HFTokenizer, prompt_ids
from kimi_jax.rl import rollout
from kimi_jax.rl.evaluation import Evaluator, SPLITS
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.driver import SampleRequest
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


def prompt_encoder(task: Any, tok: Any, raw: bool = False
                   ) -> Callable[[str], list[int]]:
  """Prompt text -> ids as the run's task prompted its policy: a Hugging
  Face tokenizer through the chat template when the task used one
  (task.chat_template, system_prompt, thinking; `task` a typed section or
  a ConfigDict), else bos + text. raw=True: bos + text, no template."""
  if raw or not isinstance(tok, HFTokenizer):
    return lambda text: encode_text_prompt(tok, text)
  return lambda text: prompt_ids(
      tok, text, chat_template=bool(getattr(task, "chat_template", True)),
      system_prompt=str(getattr(task, "system_prompt", "")),
      thinking=str(getattr(task, "thinking", "template")))


def complete(workdir: str, prompts: Sequence[str], *, step: int | None = None,
             num_samples: int = 1, max_new_tokens: int | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, greedy: bool = False, seed: int = 0,
             raw: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
  """Completions of the run's policy: (one record per sample, one printable
  line each).

  Prompts are formatted as the run's task formatted them (its chat
  template, system prompt and thinking setting; `prompt_encoder`), or
  taken as plain text with raw=True. Sampling settings default to the
  config's sampler section; sample j of every prompt uses seed `seed + j`.
  A record holds `prompt` (the text given), `prompt_tokens`, `tokens` (the
  response's ids, its stop token included), `text` (decoded without special
  tokens), `logp` (per response token) and `finish` (the finish reason).
  """
  _, cfg = load_run(workdir)
  tok = tokenizer(cfg)
  encode = prompt_encoder(cfg.task, tok, raw=raw)
  sampler = make_sampler(cfg.model, cfg.sampler,
                         Sharder(make_mesh(cfg.mesh), cfg.rules))
  engine = sampler.engine
  params, _ = restore_params(workdir, cfg, engine.param_shardings, step)
  s = cfg.sampler
  stops = rollout.stop_tokens(tok)
  requests, prompt_tokens = [], []
  for i, text in enumerate(prompts):
    prompt = encode(text)
    prompt_tokens.append(prompt)
    room = engine.cache_len - len(prompt)
    if room < 1:
      raise ValueError(f"prompt {i}: {len(prompt)} tokens leave no room in "
                       f"the sampler cache of {engine.cache_len}")
    for j in range(num_samples):
      requests.append(SampleRequest(
          (i, j), tuple(prompt),
          max_new_tokens=min(max_new_tokens or room, room),
          stop_tokens=stops,
          sampling=SamplingParams(
              temperature=s.temperature if temperature is None else
              temperature,
              top_k=s.top_k if top_k is None else top_k,
              top_p=s.top_p if top_p is None else top_p,
              greedy=greedy, seed=seed + j)))
  results, _ = sampler.generate(params, requests)
  records, lines = [], []
  for req, res in zip(requests, results):
    i, j = req.id
    text = rollout.response_text(res.tokens, tok)
    records.append({"prompt": prompts[i], "sample": j,
                    "prompt_tokens": [int(t) for t in prompt_tokens[i]],
                    "tokens": [int(t) for t in res.tokens], "text": text,
                    "logp": [float(x) for x in res.logprobs],
                    "finish": res.finish_reason})
    lines.append(f"[prompt {i} sample {j}] ({res.finish_reason}, "
                 f"{len(res.tokens)} tokens, logp {sum(res.logprobs):.2f}) "
                 f"{prompts[i]} -> {text}")
  return records, lines


def evaluator(workdir: str, *, split: str = "eval", data: str = "",
              samples: int | None = None) -> tuple[Any, ExperimentConfig]:
  """(the run's held-out Evaluator, its typed config): the sampler, task,
  seed and sampling settings of the job's own evaluations, so the latest
  checkpoint reproduces the job's final figures. `data`: a JSONL file read
  in place of the split's (the task's fields, tokenizer and verifier);
  `samples`: draws per problem (default `rl.eval_samples`)."""
  import dataclasses
  _, cfg = load_run(workdir)
  if split not in SPLITS:
    raise ConfigError(f"split {split!r}: expected one of {SPLITS}")
  task_cfg = cfg.task
  if data:
    if not isinstance(task_cfg, tasks.JsonlTaskConfig):
      raise ConfigError(f"{workdir}: task {task_cfg.name!r} generates its "
                        f"problems; only a jsonl task reads another file")
    if not os.path.exists(data):
      raise ConfigError(f"{data}: not found")
    # The file stands in for every split (only the asked one is sampled),
    # so the run's own data files need not exist here.
    task_cfg = dataclasses.replace(task_cfg, train_path=data, eval_path=data,
                                   val_path=data)
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  task = tasks.make_task(
      task_cfg, cfg.seed, tasks.hf_tokenizer(cfg.init_from_hf, task_cfg),
      max_prompt_tokens=cfg.sampler.cache_len - cfg.rl.max_response_len,
      vision=cfg.model.vision)
  if not len(getattr(task, split)):
    hint = (" (task.val_path is empty)" if isinstance(
        task_cfg, tasks.JsonlTaskConfig) else " (task.val_fraction is 0)"
            if isinstance(task_cfg, pointer_chase.PointerChaseConfig) and
            split == "val" else "")
    raise ConfigError(f"{workdir}: the run has no {split} problems{hint}")
  sampler = make_sampler(cfg.model, cfg.sampler, sharder)
  n = cfg.rl.eval_samples if samples is None else samples
  if n < 1:
    raise ConfigError(f"samples must be >= 1, got {n}")
  # seed + 1: the job's evaluator (kimi_jax/job/run.py), same draws.
  return Evaluator(sampler, task, samples=n,
                   max_response_len=cfg.rl.max_response_len,
                   seed=cfg.seed + 1, settings=cfg.sampler.sampling,
                   split=split), cfg
