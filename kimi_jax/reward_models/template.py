"""A reward model's input: question, reference answer and response as tokens.

Both reward models (report 2.3.5: "takes as input the question, the
reference answer, and the response") read the same text:

    {instruction}            (only when the template has one)
    Question: {question}
    Reference: {reference}
    Response: {response}
    Judge:

The classic model scores the last token (`Judge:`); the chain-of-thought
model continues after it with its reasoning and a JSON verdict. The parts
are tokenized separately and concatenated (a beginning-of-sequence token
first when the tokenizer has one), so the response can be cut to fit:
when the input would exceed `max_input_len` tokens, the response loses
tokens from its FRONT (the final answer sits at its end) and the input is
marked truncated. A question and reference that leave fewer than
`min_response_tokens` for the response are an error naming the example.

Word-level tokenizers (the synthetic tasks) know only their own words:
`rm_tokenizer` appends the template's words (and the reasoning words of a
CoT model) to the task's vocabulary, after the task's own ids, so the
policy's embeddings keep their meaning in a reward model started from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from kimi_jax.data.word_tokenizer import WordTokenizer

QUESTION, REFERENCE, RESPONSE, JUDGE = ("Question:", "Reference:",
                                        "Response:", "Judge:")
TEMPLATE_WORDS = (QUESTION, REFERENCE, RESPONSE, JUDGE)


@dataclasses.dataclass(frozen=True)
class RMTemplate:
  """instruction: an optional first line (e.g. what a CoT model should do
  for a prompted instruct model); max_input_len: tokens of the whole input;
  min_response_tokens: the least room the response must keep."""

  instruction: str = ""
  max_input_len: int = 4096
  min_response_tokens: int = 16

  def __post_init__(self):
    if self.max_input_len < 2 or self.min_response_tokens < 1:
      raise ValueError(f"rm template: max_input_len >= 2 and "
                       f"min_response_tokens >= 1 are required, got "
                       f"{self.max_input_len}, {self.min_response_tokens}")

  @property
  def words(self) -> tuple[str, ...]:
    return TEMPLATE_WORDS + tuple(self.instruction.split())

  def prefix_text(self, question: str, reference: str) -> str:
    head = f"{self.instruction}\n" if self.instruction else ""
    return (f"{head}{QUESTION} {question}\n{REFERENCE} {reference}\n"
            f"{RESPONSE}\n")

  def suffix_text(self) -> str:
    return f"\n{JUDGE}"

  def text(self, question: str, reference: str, response: str) -> str:
    """The whole input as text (for logs and docs; `encode` is the truth)."""
    return self.prefix_text(question, reference) + response + \
        self.suffix_text()


@dataclasses.dataclass(frozen=True)
class RMInput:
  """ids: the input tokens; truncated: the response lost tokens."""

  ids: tuple[int, ...]
  truncated: bool


def encode(template: RMTemplate, tokenizer: Any, question: str,
           reference: str, response: str, where: str = "") -> RMInput:
  """The reward model's input ids (see the module doc)."""
  bos = getattr(tokenizer, "bos_id", None)
  prefix = ([bos] if bos is not None else []) + list(
      tokenizer.encode(template.prefix_text(question, str(reference))))
  suffix = list(tokenizer.encode(template.suffix_text()))
  room = template.max_input_len - len(prefix) - len(suffix)
  if room < template.min_response_tokens:
    raise ValueError(
        f"{where or 'reward model input'}: question and reference take "
        f"{len(prefix) + len(suffix)} of max_input_len="
        f"{template.max_input_len} tokens, leaving {room} for the response "
        f"(min_response_tokens={template.min_response_tokens})")
  body = list(tokenizer.encode(response))
  truncated = len(body) > room
  if truncated:
    body = body[len(body) - room:]
  return RMInput(tuple(prefix + body + suffix), truncated)


def rm_tokenizer(tokenizer: Any, words: Sequence[str]) -> Any:
  """The tokenizer a reward model reads with: a word tokenizer extended by
  `words` it lacks (appended, so existing ids keep their meaning); any other
  tokenizer as is."""
  if not isinstance(tokenizer, WordTokenizer):
    return tokenizer
  extra = []
  for w in words:
    if w not in tokenizer.words and w not in extra:
      extra.append(w)
  return WordTokenizer(tuple(tokenizer.words) + tuple(extra))
