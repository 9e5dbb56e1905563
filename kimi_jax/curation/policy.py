"""The model the data tools ask: N responses per prompt through our sampler.

Curation (pass rates, no-CoT guesses) and rejection sampling need "sample n
responses to these prompt texts". `SamplerPolicy` does it with the real
`Sampler.generate` (continuous batching, stop tokens, seeds per request);
`load_policy` builds one from a kimi_jax workdir (its config.json, tokenizer
and latest or chosen checkpoint) or from a Hugging Face directory.

Prompts are encoded the way the RL task encodes them: through the chat
template (task.chat_template, task.system_prompt) for a Hugging Face
tokenizer, bos + text otherwise. A `response_prefix` is put into the
response before sampling (as a partial rollout's prefix): "<answer>" forces
an immediate answer with no chain of thought, for any model.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Callable, Mapping, Protocol, Sequence

from kimi_jax.data import tasks
from kimi_jax.infra.config import to_dataclass
from kimi_jax.job import workdir as workdir_lib
from kimi_jax.job.experiment import model_config
from kimi_jax.job.workdir import prompt_encoder
from kimi_jax.model import hf, transformer
from kimi_jax.rewards.base import RewardFn, score_all
from kimi_jax.rl import rollout
from kimi_jax.sampler import handoff
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh, rules_from_config


class Policy(Protocol):
  """Samples responses; `prompt_problem` says why a prompt cannot be run."""

  def prompt_problem(self, prompt: str) -> str | None:
    ...

  def sample(self, prompts: Sequence[str], n: int, *, temperature: float,
             max_new_tokens: int, seed: int, response_prefix: str = "",
             first_index: int = 0) -> list[list[str]]:
    """n response texts per prompt (each starting with response_prefix);
    prompt i's draws are seeded as prompt first_index + i's, so a list
    asked in chunks gets the draws of the whole list asked at once."""
    ...


ACCEPT = ("answer", "score")


def verified(result: Any, accept: str = "answer") -> bool:
  """Whether a scored response passes: "answer" reads the answer's verdict
  alone; "score" also needs a positive score, so a process check that
  scores a right answer reached through a wrong step 0 (reasoning_gym_steps)
  rejects it."""
  if accept not in ACCEPT:
    raise ValueError(f"accept must be one of {ACCEPT}, got {accept!r}")
  return bool(result.correct) if accept == "answer" else result.verified


def sample_verified(policy: Policy, reward: RewardFn,
                    items: Sequence[tuple[Mapping[str, Any], str]], n: int,
                    accept: str = "answer", **sample_kwargs: Any
                    ) -> list[tuple[list[str], list[bool]]]:
  """(responses, verified flags; see `verified`) for each (record, prompt
  text): n samples of `policy.sample(..., **sample_kwargs)`, scored by
  `reward`."""
  texts = policy.sample([p for _, p in items], n, **sample_kwargs)
  flat_records = [r for (r, _), t in zip(items, texts) for _ in t]
  scored = score_all(reward, flat_records, [x for t in texts for x in t])
  out, k = [], 0
  for t in texts:
    out.append((list(t), [verified(s, accept) for s in scored[k:k + len(t)]]))
    k += len(t)
  return out


@dataclasses.dataclass
class SamplerPolicy:
  """A policy's params behind our Sampler (see the module doc)."""

  sampler: Sampler
  params: Any  # already placed in sampler.engine.param_shardings
  tokenizer: Any
  encode_prompt: Callable[[str], list[int]]
  top_p: float = 1.0
  # Which weights answer (run and checkpoint step, or checkpoint
  # directory): part of what a data tool's journal keys results by.
  identity: str = ""

  def _room(self, prompt_ids: Sequence[int], prefix_ids: Sequence[int]
            ) -> int:
    engine = self.sampler.engine
    if len(prompt_ids) + len(prefix_ids) > engine.max_prefill_len:
      return 0
    return engine.cache_len - len(prompt_ids)

  def prompt_problem(self, prompt: str) -> str | None:
    try:
      ids = self.encode_prompt(prompt)
    except ValueError as exc:  # e.g. a word tokenizer's unknown word
      return f"the tokenizer cannot encode it: {exc}"
    if self._room(ids, ()) < 2:
      return (f"{len(ids)} prompt tokens leave no room for a response in "
              f"the sampler (cache_len {self.sampler.engine.cache_len}, "
              f"largest prefill {self.sampler.engine.max_prefill_len})")
    return None

  def sample(self, prompts: Sequence[str], n: int, *, temperature: float,
             max_new_tokens: int, seed: int, response_prefix: str = "",
             first_index: int = 0) -> list[list[str]]:
    try:
      prefix = tuple(self.tokenizer.encode(response_prefix)
                     ) if response_prefix else ()
    except ValueError as exc:
      raise ValueError(f"response prefix {response_prefix!r}: the "
                       f"tokenizer cannot encode it ({exc}); set another "
                       f"(curate.hack_response_prefix)") from None
    stop = rollout.stop_tokens(self.tokenizer)
    requests = []
    for i, text in enumerate(prompts):
      ids = tuple(self.encode_prompt(text))
      room = self._room(ids, prefix)
      limit = min(len(prefix) + max_new_tokens, room)
      if limit <= len(prefix):
        raise ValueError(f"prompt {i}: {len(ids)} tokens (+ {len(prefix)} "
                         f"prefix) leave no room to sample; check "
                         f"prompt_problem first")
      for j in range(n):
        requests.append(SampleRequest(
            id=(i, j), prompt=ids, prefix=prefix, max_new_tokens=limit,
            stop_tokens=stop, sampling=SamplingParams(
                temperature=temperature, top_p=self.top_p,
                greedy=temperature == 0,
                seed=rollout.request_seed(seed, first_index + i, j))))
    results, _ = self.sampler.generate(self.params, requests)
    out: list[list[str]] = [[] for _ in prompts]
    for request, result in zip(requests, results):
      text = rollout.response_text(request.prefix + result.tokens,
                                   self.tokenizer)
      out[request.id[0]].append(text)
    return out


def load_policy(*, workdir: str = "", config: Any = None,
                step: int | None = None, top_p: float = 1.0
                ) -> SamplerPolicy:
  """The policy of a kimi_jax run `workdir` (checkpoint `step`, default the
  latest), or of an experiment `config` (a ConfigDict): the Hugging Face
  checkpoint its init_from_hf names, else its seeded random init.

  Only the sections a sampler needs are read (model, mesh, sharding,
  sampler, the task's prompt format and tokenizer), so the run's data files
  need not exist here.
  """
  if bool(workdir) == (config is not None):
    raise ValueError("load_policy: pass exactly one of workdir or config")
  if workdir:
    config = workdir_lib.load_config(workdir)
  model = model_config(config)
  sharder = Sharder(make_mesh(to_dataclass(MeshConfig, config.mesh, "mesh")),
                    rules_from_config(config.sharding.rules))
  sampler_cfg = to_dataclass(SamplerConfig, config.sampler, "sampler")
  sampler = make_sampler(model, sampler_cfg, sharder)
  engine = sampler.engine
  hf_dir = str(config.init_from_hf)
  tok = tasks.hf_tokenizer(hf_dir, config.task)
  if tok is None:
    tok = tasks.make_task(tasks.task_config(config.task),
                          int(config.seed)).tokenizer
  if workdir:
    # restore_params reads only the model section of the run's config.
    params, step = workdir_lib.restore_params(
        workdir, types.SimpleNamespace(model=model), engine.param_shardings,
        step)
    identity = f"run {os.path.abspath(workdir)} step {step}"
  elif hf_dir:
    _, params = hf.load_hf_checkpoint(hf_dir, sharder=sharder,
                                      param_dtype=model.param_dtype)
    identity = f"hf {os.path.abspath(hf_dir)}"
  else:
    params = transformer.init_sharded(model, int(config.seed), sharder)
    identity = f"random init seed {int(config.seed)} of {model}"
  params, _ = handoff.place_params(params, engine.param_shardings)
  return SamplerPolicy(sampler, params, tok, prompt_encoder(config.task, tok), top_p,
                       identity)
