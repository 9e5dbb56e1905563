"""The chain-of-thought reward model: a generative judge on our sampler.

Report 2.3.5: on the same inputs as the classic model, it "explicitly
generates a step-by-step reasoning process before providing a final
correctness judgment in JSON format". `CotJudge` prompts the model with the
reward-model template (kimi_jax/reward_models/template.py), lets it write up
to `max_new_tokens` through `Sampler.generate` (continuous batching over
its own engine slots, on the job's mesh) and reads the verdict with
`verdict.parse_verdict` (the last JSON object; malformed or missing counts
as incorrect and is reported).

Seed rationales (`seed_rationale`) are what a model that has never judged
starts from when it cannot follow the instruction zero-shot (a small
policy): the answer the verifier read, the reference, whether they agree,
and the verdict. `launch/train_rm.py` fine-tunes on a few of them, then
rejection-samples rationales on the whole training set and keeps those
whose verdict matches the label (kimi_jax/reward_models/cot_train.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from kimi_jax.reward_models import template as template_lib
from kimi_jax.reward_models.verdict import Verdict, parse_verdict, verdict_text
from kimi_jax.rl import rollout
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.sampling import SamplingParams

# Words of seed rationales and verdicts (for word-level tokenizers).
RATIONALE_WORDS = ("final", "none", "same", "differ")
VERDICT_WORDS = tuple(verdict_text(True).split()) + tuple(
    verdict_text(False).split()[1:])


def seed_rationale(extracted: str | None, reference: str, label: bool
                   ) -> str:
  """A rationale ending in the verdict `label`: the response's final answer
  (as the verifier read it), the reference, agreement, verdict."""
  answer = "none" if extracted is None or not str(extracted).strip() else \
      " ".join(str(extracted).split())
  agree = "same" if label else "differ"
  return (f"final {answer} {template_lib.REFERENCE} "
          f"{' '.join(reference.split())} {agree} {verdict_text(label)}")


@dataclasses.dataclass(frozen=True)
class Judgment:
  """verdict: parsed from `text`; tokens: generated (eos included);
  truncated: the response was cut to fit the input."""

  verdict: Verdict
  text: str
  tokens: int
  truncated: bool


@dataclasses.dataclass(frozen=True)
class JudgeItem:
  question: str
  reference: str
  response: str
  where: str = ""


class CotJudge:
  """`judge(items) -> [Judgment]` with a CoT reward model's params.

  sampler_params: the model's params in `sampler.engine.param_shardings`
  (placed once; frozen). Greedy unless a temperature is given.
  """

  def __init__(self, *, sampler: Sampler, sampler_params: Any,
               tokenizer: Any, template: template_lib.RMTemplate,
               max_new_tokens: int):
    self.sampler, self.params = sampler, sampler_params
    self.tokenizer, self.template = tokenizer, template
    self.max_new_tokens = max_new_tokens
    if template.max_input_len + max_new_tokens > sampler.engine.cache_len:
      raise ValueError(
          f"CoT reward model: max_input_len ({template.max_input_len}) + "
          f"max_new_tokens ({max_new_tokens}) exceed its sampler cache "
          f"({sampler.engine.cache_len})")

  def encode(self, item: JudgeItem) -> template_lib.RMInput:
    return template_lib.encode(self.template, self.tokenizer, item.question,
                               item.reference, item.response, item.where)

  def judge(self, items: Sequence[JudgeItem], *, temperature: float = 0.0,
            samples: int = 1, seed: int = 0
            ) -> tuple[list[list[Judgment]], Any]:
    """`samples` judgments per item (greedy when temperature is 0: then
    use samples=1), and the sampler's stats."""
    if temperature == 0.0 and samples != 1:
      raise ValueError("greedy judging gives one judgment per item")
    stop = rollout.stop_tokens(self.tokenizer)
    inputs = [self.encode(it) for it in items]
    requests = []
    for i, x in enumerate(inputs):
      for j in range(samples):
        sampling = (SamplingParams(greedy=True) if temperature == 0.0 else
                    SamplingParams(temperature=temperature,
                                   seed=rollout.request_seed(seed, i, j)))
        requests.append(SampleRequest(
            id=(i, j), prompt=x.ids, max_new_tokens=self.max_new_tokens,
            stop_tokens=stop, sampling=sampling))
    results, stats = self.sampler.generate(self.params, requests)
    out: list[list[Judgment]] = [[] for _ in items]
    for res in results:
      i, _ = res.id
      text = rollout.response_text(res.tokens, self.tokenizer)
      out[i].append(Judgment(parse_verdict(text), text, len(res.tokens),
                             inputs[i].truncated))
    return out, stats
