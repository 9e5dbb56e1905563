"""The sampler section of an experiment config, typed.

One flat section (`config.sampler.*`) holds what the engine, the sampling
settings of RL rollouts and the repeat detector need; the properties split
it into the typed configs each of them takes.
"""

from __future__ import annotations

import dataclasses

from kimi_jax.sampler.engine import EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """How RL rollouts and held-out evaluation draw tokens."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Every field mirrors `config.sampler.<field>`; errors name that key.

  steps_per_call: decode steps per jitted engine call (one host round trip);
  more steps cut host overhead, a slot that stops mid-call idles for the
  rest of it. Results do not depend on it. The default, 16, is what every
  shipped experiment uses.

  page_size, kv_pages, min_view, attention_kernel: the KV cache's layout
  and how decoding reads it (see `EngineConfig`): page_size 0 keeps a row
  of cache_len entries per slot; kv_pages 0 sizes the pool for every slot
  at cache_len.

  matmul_dtype: the engine's weight-matmul dtype (see `EngineConfig`);
  "" (the default) computes as the trainer does.
  """

  max_slots: int
  cache_len: int
  prefill_buckets: tuple[int, ...] = ()
  prefill_batch_buckets: tuple[int, ...] = ()
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  repeat_ngram: int = 3
  repeat_times: int = 4
  steps_per_call: int = 16
  page_size: int = 0
  kv_pages: int = 0
  min_view: int = 64
  attention_kernel: str = "xla"
  matmul_dtype: str = ""

  def __post_init__(self):
    if self.steps_per_call < 1:
      raise ValueError(f"config.sampler.steps_per_call must be >= 1, got "
                       f"{self.steps_per_call}")
    # Build the parts once so a bad value fails here, naming its key.
    self.engine, self.repeat  # noqa: B018
    if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"config.sampler: temperature >= 0, top_k >= 0 and "
                       f"0 < top_p <= 1 are required, got {self.temperature}, "
                       f"{self.top_k}, {self.top_p}")

  @property
  def engine(self) -> EngineConfig:
    return EngineConfig(
        max_slots=self.max_slots, cache_len=self.cache_len,
        prefill_buckets=tuple(self.prefill_buckets) or None,
        prefill_batch_buckets=tuple(self.prefill_batch_buckets) or None,
        page_size=self.page_size, kv_pages=self.kv_pages or None,
        min_view=self.min_view, attention_kernel=self.attention_kernel,
        matmul_dtype=self.matmul_dtype)

  @property
  def sampling(self) -> SamplingSettings:
    return SamplingSettings(temperature=self.temperature, top_k=self.top_k,
                            top_p=self.top_p)

  @property
  def repeat(self) -> RepeatConfig:
    try:
      return RepeatConfig(ngram=self.repeat_ngram, times=self.repeat_times)
    except ValueError as exc:
      raise ValueError(f"config.sampler.repeat_ngram / repeat_times: {exc}"
                       ) from None
