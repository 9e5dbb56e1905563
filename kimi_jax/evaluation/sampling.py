"""Drawing a benchmark's responses from a model: K samples per problem,
seeded per (seed, benchmark, problem, draw), prompts in the policy's own
format (images as the vision model's placeholder tokens)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from kimi_jax.data.tasks import image_prompt_ids
from kimi_jax.evaluation import mathvista
from kimi_jax.evaluation.benchmarks import BENCHMARKS, BenchmarkError
from kimi_jax.model.tokenizer import HFTokenizer
from kimi_jax.rl import rollout
from kimi_jax.sampler.driver import SampleRequest
from kimi_jax.sampler.sampling import SamplingParams

# Per-problem samples by default: the k1.5 report (section 3.4) gives AIME
# pass@1 "averaged over 8 runs".
DEFAULT_SAMPLES = 8
# Requests handed to the sampler per call, one journal entry: enough to
# keep its slots full, few enough that a kill loses little.
REQUESTS_PER_CALL = 1024


@dataclasses.dataclass(frozen=True)
class Settings:
  """How responses are drawn (unused when they are read from a file).
  chunk_problems: problems per sampler call and journal entry (0: as many
  as make REQUESTS_PER_CALL requests)."""

  samples: int = DEFAULT_SAMPLES
  temperature: float = 1.0
  top_p: float = 1.0
  max_response_len: int = 1024
  seed: int = 0
  pass_at: tuple[int, ...] = ()
  chunk_problems: int = 0

  @property
  def chunk(self) -> int:
    return self.chunk_problems or max(1, REQUESTS_PER_CALL // self.samples)

  def sampling(self) -> dict[str, Any]:
    """What the responses depend on (part of the journal's key)."""
    return dict(samples=self.samples, temperature=self.temperature,
                top_p=self.top_p, max_response_len=self.max_response_len,
                seed=self.seed)


@dataclasses.dataclass(frozen=True)
class Model:
  """What sampling needs of a policy: its sampler and placed params, the
  tokenizer, `encode` (prompt text, `<image>` markers included -> ids, in
  the policy's prompt format), the model's vision tower config (None: a
  text model) and which weights these are."""

  sampler: Any
  params: Any
  tokenizer: Any
  encode: Callable[[str], list[int]]
  vision: Any = None
  identity: str = ""


def image_encoder(tokenizer: Any, vision: Any, task: Any
                  ) -> Callable[[str], list[int]]:
  """Prompt text with `<image>` markers -> ids with the vision model's
  placeholder runs, in the prompt format of the config section `task`
  (chat template, system prompt, thinking), as RL prompts its image
  records (data/tasks.py)."""
  chat = (isinstance(tokenizer, HFTokenizer) and
          bool(getattr(task, "chat_template", True)))
  return lambda text: image_prompt_ids(
      tokenizer, text, vision, chat_template=chat,
      system_prompt=str(getattr(task, "system_prompt", "")),
      thinking=str(getattr(task, "thinking", "template")))


def model_of_policy(policy: Any, task: Any) -> Model:
  """The Model of a `curation.policy.SamplerPolicy` whose config's task
  section is `task`."""
  vision = policy.sampler.engine.cfg.vision
  encode = (policy.encode_prompt if vision is None else
            image_encoder(policy.tokenizer, vision, task))
  return Model(policy.sampler, policy.params, policy.tokenizer, encode,
               vision, policy.identity)


@dataclasses.dataclass
class Drawn:
  """The responses of one problem: texts and their token counts (None:
  unknown)."""

  texts: list[str] = dataclasses.field(default_factory=list)
  tokens: list[int | None] = dataclasses.field(default_factory=list)


Loaded = Mapping[str, tuple[str, Sequence[Mapping[str, Any]]]]


def check_model(model: Model, loaded: Loaded) -> None:
  """A vision benchmark needs a vision model; every prompt must leave room
  for a response. Raises BenchmarkError naming the benchmark (and item)."""
  engine = model.sampler.engine
  for name, (_, items) in loaded.items():
    if BENCHMARKS[name].vision and model.vision is None:
      raise BenchmarkError(
          f"{name}: its problems are images and need a vision model "
          f"(model.vision); {model.identity or 'this checkpoint'} is a "
          f"text model")
    for item in items:
      try:
        n = len(model.encode(item["prompt"]))
      except (ValueError, KeyError) as exc:  # a word tokenizer's unknown
        # word; a task whose prompts are not text
        raise BenchmarkError(f"{name} {item['id']}: the tokenizer cannot "
                             f"encode the prompt ({exc})") from None
      if n > engine.max_prefill_len or engine.cache_len - n < 2:
        raise BenchmarkError(
            f"{name} {item['id']}: {n} prompt tokens leave no room for a "
            f"response in the sampler (cache_len {engine.cache_len}, "
            f"largest prefill {engine.max_prefill_len})")


def _images(model: Model, item: Mapping[str, Any]) -> Any:
  if "image" not in item:
    return None
  v = model.vision
  return mathvista.pixels(item, v.image_size, v.channels)


def sample(model: Model, name: str, items: Sequence[Mapping[str, Any]],
           settings: Settings, first: int = 0) -> list[Drawn]:
  """`settings.samples` responses per item, in one sampler call. Item i is
  problem `first + i` of the benchmark: its draw j is seeded by (seed,
  benchmark, first + i, j) alone, so it does not depend on the other
  benchmarks or on how problems are cut into calls."""
  k = settings.samples
  stops = rollout.stop_tokens(model.tokenizer)
  engine = model.sampler.engine
  which = list(BENCHMARKS).index(name)
  requests = []
  for i, item in enumerate(items):
    ids = tuple(model.encode(item["prompt"]))
    images = _images(model, item)
    for j in range(k):
      requests.append(SampleRequest(
          id=(i, j), prompt=ids, stop_tokens=stops, images=images,
          max_new_tokens=min(settings.max_response_len,
                             engine.cache_len - len(ids)),
          sampling=SamplingParams(
              temperature=settings.temperature, top_p=settings.top_p,
              greedy=settings.temperature == 0,
              seed=rollout.request_seed(settings.seed, which, first + i,
                                        j))))
  results, _ = model.sampler.generate(model.params, requests)
  out = [Drawn() for _ in items]
  for request, result in zip(requests, results):
    drawn = out[request.id[0]]
    drawn.texts.append(rollout.response_text(result.tokens,
                                             model.tokenizer))
    drawn.tokens.append(len(result.tokens))
  return out
