"""Standard benchmarks at RL's evaluations (`rl.eval_benchmarks`).

A list of `NAME=FILE` (or `humaneval`) specs, read and checked when the
job is built: an unknown name, a bad file or a prompt the run's task format
cannot encode stops the run before any weights load, naming
`config.rl.eval_benchmarks`. At every held-out evaluation (after the warm
start, every `rl.eval_every` iterations, at the end) each benchmark is
sampled with the run's sampler, prompt format (the jsonl task's chat
template; with a vision tower, `<image>` markers become image tokens) and
sampling settings: `rl.eval_samples` draws per problem at
`sampler.sampling`'s temperature and top-p, `rl.max_response_len` tokens,
seed `seed + 1`. Its pass@1 is logged as stage "benchmarks", key
`<name>_pass_at_1` (metrics.jsonl, TensorBoard `benchmarks/<name>_pass_at_1`,
W&B when on).
"""

from __future__ import annotations

from typing import Any, Sequence

from kimi_jax.evaluation import benchmarks as benchmarks_lib
from kimi_jax.evaluation import run, sampling
from kimi_jax.infra.config import ConfigError
from kimi_jax.sampler import handoff


class TrainingBenchmarks:
  """`benchmarks(params) -> {"<name>_pass_at_1": value}` (module doc)."""

  def __init__(self, specs: Sequence[str], *, sampler: Any, tokenizer: Any,
               encode_record: Any, vision: Any, settings: sampling.Settings,
               progress: bool = False):
    try:
      self.loaded = benchmarks_lib.load_all(list(specs))
    except benchmarks_lib.BenchmarkError as exc:
      raise ConfigError(f"config.rl.eval_benchmarks: {exc}") from None
    self.sampler = sampler
    self.settings = settings
    self.progress = progress
    self._model = sampling.Model(
        sampler, None, tokenizer,
        lambda text: encode_record({"prompt": text}), vision)
    try:
      sampling.check_model(self._model, self.loaded)
    except benchmarks_lib.BenchmarkError as exc:
      raise ConfigError(f"config.rl.eval_benchmarks: {exc}") from None
    self._scorers = run.Scorers()

  @property
  def names(self) -> list[str]:
    return list(self.loaded)

  def __call__(self, params: Any) -> dict[str, float]:
    placed, _ = handoff.place_params(params,
                                     self.sampler.engine.param_shardings)
    model = sampling.Model(self._model.sampler, placed, self._model.tokenizer,
                      self._model.encode, self._model.vision)
    out = {}
    for name, (_, items) in self.loaded.items():
      rows, _ = run.run_benchmark(name, items, scorers=self._scorers,
                                  model=model, settings=self.settings,
                                  progress=self.progress)
      out[f"{name}_pass_at_1"] = run.summarize(rows, len(items))["pass_at_1"]
    return out

  def close(self) -> None:
    self._scorers.close()


def build(cfg: Any, task: Any, sampler: Any) -> TrainingBenchmarks | None:
  """The benchmarks of an ExperimentConfig's `rl.eval_benchmarks` for the
  job's task and sampler; None when it names none."""
  if not cfg.rl.eval_benchmarks:
    return None
  s = cfg.sampler.sampling
  settings = sampling.Settings(samples=cfg.rl.eval_samples,
                          temperature=s.temperature, top_p=s.top_p,
                          max_response_len=cfg.rl.max_response_len,
                          seed=cfg.seed + 1)
  return TrainingBenchmarks(
      cfg.rl.eval_benchmarks, sampler=sampler, tokenizer=task.tokenizer,
      encode_record=task.encode_prompt, vision=cfg.model.vision,
      settings=settings, progress=cfg.log.progress)
