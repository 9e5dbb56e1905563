"""SFT examples: tokenized with a loss mask, packed first-fit into rows.

Report 2.2 primes the model with a lightweight SFT on long-CoT data; 2.5.2
packs several examples into each training sequence. Here:

1. `tokenize_record` turns an SFT record into one token sequence and a loss
   mask that is true only on response tokens: for chat `messages`, the
   assistant turns as the chat template renders them (including the
   end-of-turn token, so the model learns to stop); for prompt + response,
   the response (through the chat template as a one-turn conversation, or
   as plain text followed by EOS for base models).
2. `pack_rows` places examples first-fit into R rows of T positions: each
   example of n tokens takes n - 1 positions (inputs tokens[:-1], targets
   tokens[1:]), gets its own segment id (1, 2, ... within the row; 0 is
   padding) and positions restarting at 0, so packed examples never attend
   to each other (`transformer.forward` masks across segments).
3. `PackedBatches` streams batches from a shuffled, repeated Grain source;
   its state is one position in that stream, saved as JSON in checkpoints.

An example longer than a row is an error naming its record (file:line),
unless truncation is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Mapping, Sequence

import grain
import numpy as np

from kimi_jax.data.records import DataError
from kimi_jax.token_rows import ImageSlots, put_images
from kimi_jax.data.sources import check_state, shuffled
from kimi_jax.model.tokenizer import (HFTokenizer, chat_messages, prompt_ids,
                                      thinking_vars)

ROW_KEYS = ("tokens", "targets", "positions", "segment_ids", "mask")


@dataclasses.dataclass(frozen=True)
class SFTExample:
  """tokens_N (int32) and loss_N (bool: token t is a training target)."""

  tokens_N: np.ndarray
  loss_N: np.ndarray
  where: str = ""
  # A vision model's prompt images (n x H x W x C pixels), in the order of
  # the tokens' placeholder runs; None for text.
  pixels: np.ndarray | None = None

  def __post_init__(self):
    if self.tokens_N.shape != self.loss_N.shape or self.tokens_N.ndim != 1:
      raise ValueError(f"{self.where}: tokens {self.tokens_N.shape} and loss "
                       f"mask {self.loss_N.shape} must be equal 1-d shapes")

  @property
  def n_positions(self) -> int:
    """Row positions the example takes: one per (input, target) pair."""
    return len(self.tokens_N) - 1


@dataclasses.dataclass(frozen=True)
class SFTTokenizeConfig:
  """How SFT records become tokens (the same choices as the RL prompts)."""

  chat_template: bool = True
  system_prompt: str = ""
  thinking: str = "template"  # tokenizer.THINKING


def _assistant_spans(tokenizer: HFTokenizer, messages: Sequence[Mapping],
                     where: str, thinking: str = "template"
                     ) -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation and the character span of each assistant
  turn: from the end of the generation prompt before it to the end of the
  conversation rendered up to and including it. A response may hold its
  reasoning (`<think>...</think>` before the answer): the template decides
  how a turn's reasoning is written, and the span covers what it writes."""
  template_vars = thinking_vars(thinking)
  full = tokenizer.render_chat(messages, **template_vars)
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = tokenizer.render_chat(messages[:i], add_generation_prompt=True,
                                   **template_vars) if i else ""
    upto = tokenizer.render_chat(messages[:i + 1], **template_vars)
    if not (upto.startswith(before) and full.startswith(upto)):
      raise DataError(
          f"{where}: the chat template renders turn {i} differently once "
          f"later turns follow (or its generation prompt is not a prefix of "
          f"the turn), so assistant tokens cannot be located; split the "
          f"conversation into single-turn rows")
    spans.append((len(before), len(upto)))
  return full, spans


def _tokens_in_spans(tokenizer: HFTokenizer, text: str,
                     spans: Sequence[tuple[int, int]]
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Ids of `text` (as `encode`) and which tokens start inside a span."""
  encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
  starts = np.asarray([s for s, _ in encoding.offsets], np.int64)
  loss = np.zeros(len(starts), bool)
  for begin, end in spans:
    loss |= (starts >= begin) & (starts < end)
  return np.asarray(encoding.ids, np.int32), loss


def tokenize_record(record: Mapping[str, Any], tokenizer: HFTokenizer,
                    cfg: SFTTokenizeConfig) -> SFTExample:
  """One SFT record (canonical keys, see records.SFTFields) as an example."""
  where = str(record.get("id", "?"))
  if "messages" in record:
    if not cfg.chat_template:
      raise DataError(f"{where}: chat messages need task.chat_template="
                      f"True (a tokenizer with a chat template)")
    messages = list(record["messages"])
    if cfg.system_prompt and messages[0]["role"] != "system":
      messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    text, spans = _assistant_spans(tokenizer, messages, where, cfg.thinking)
    tokens, loss = _tokens_in_spans(tokenizer, text, spans)
  elif cfg.chat_template:
    messages = chat_messages(record["prompt"], cfg.system_prompt) + [
        {"role": "assistant", "content": record["response"]}]
    text, spans = _assistant_spans(tokenizer, messages, where, cfg.thinking)
    tokens, loss = _tokens_in_spans(tokenizer, text, spans)
  else:
    prompt = prompt_ids(tokenizer, record["prompt"], chat_template=False,
                        system_prompt=cfg.system_prompt)
    response = tokenizer.encode(record["response"]) + [tokenizer.eos_id]
    tokens = np.asarray(prompt + response, np.int32)
    loss = np.arange(len(tokens)) >= len(prompt)
  if len(tokens) < 2 or not loss[1:].any():
    raise DataError(f"{where}: no response tokens to train on")
  return SFTExample(tokens, loss, where)


def pair_example(prompt_ids: Sequence[int], response_ids: Sequence[int],
                 where: str = "", pixels: np.ndarray | None = None
                 ) -> SFTExample:
  """An already tokenized (prompt, response) pair; loss on the response
  (which should end with the stop token the model is to learn)."""
  tokens = np.asarray(list(prompt_ids) + list(response_ids), np.int32)
  loss = np.arange(len(tokens)) >= len(prompt_ids)
  return SFTExample(tokens, loss, where, pixels)


def hf_example_fn(tokenizer: HFTokenizer, cfg: SFTTokenizeConfig
                  ) -> Callable[[Mapping[str, Any]], SFTExample]:
  """record -> SFTExample with an HF tokenizer (for PackedBatches)."""
  return functools.partial(tokenize_record, tokenizer=tokenizer, cfg=cfg)


def fit_to_row(example: SFTExample, row_len: int, truncate: bool
               ) -> SFTExample:
  """The example if it fits a row of `row_len` positions; else truncated
  (keeping its first row_len + 1 tokens) when `truncate`, or an error."""
  if example.n_positions <= row_len:
    return example
  if not truncate:
    raise DataError(
        f"{example.where}: example of {len(example.tokens_N)} tokens needs "
        f"{example.n_positions} positions, more than a row's {row_len} "
        f"(sft.seq_len); raise sft.seq_len, shorten the example, or set "
        f"sft.truncate=True")
  # Images stay: placeholders past the cut only leave an image unused.
  return dataclasses.replace(example, tokens_N=example.tokens_N[:row_len + 1],
                             loss_N=example.loss_N[:row_len + 1])


def pack_rows(examples: Iterable[SFTExample], n_rows: int, row_len: int,
              pad_id: int, images: ImageSlots | None = None
              ) -> tuple[dict[str, np.ndarray], int]:
  """First-fit packing of examples, in order, into `n_rows` rows.

  Each example goes into the first row with room for it; packing stops at
  the first example that fits no row (it starts the next batch). Returns
  the rows {tokens, targets, positions, segment_ids, mask}, each [R, T]
  (mask float32: 1 on targets that count), and how many examples were used.
  Every example must already fit a row (`fit_to_row`). With `images` a row
  also has image slots, filled in packing order ("pixels" R x I x H x W x
  C, "image_mask" R x I), and an example needs room there too.
  """
  slots = 0 if images is None else images.slots
  row_images = None if images is None else images.empty(n_rows)
  slots_R = np.zeros(n_rows, np.int64)
  tokens = np.full((n_rows, row_len), pad_id, np.int32)
  targets = np.full((n_rows, row_len), pad_id, np.int32)
  positions = np.zeros((n_rows, row_len), np.int32)
  segment_ids = np.zeros((n_rows, row_len), np.int32)
  mask = np.zeros((n_rows, row_len), np.float32)
  used_R = np.zeros(n_rows, np.int64)
  segments_R = np.zeros(n_rows, np.int32)
  placed = 0
  for example in examples:
    n = example.n_positions
    if n > row_len:
      raise DataError(f"{example.where}: {n} positions exceed the row length "
                      f"{row_len}; pass it through fit_to_row first")
    k = 0 if example.pixels is None else len(example.pixels)
    if k > slots:
      raise DataError(f"{example.where}: {k} images, more than a row's "
                      f"{slots} image slots (model.vision.max_images)")
    room = np.flatnonzero((used_R + n <= row_len) & (slots_R + k <= slots))
    if not len(room):
      break
    r, start = room[0], used_R[room[0]]
    if k:
      slots_R[r] = put_images(row_images, r, slots_R[r], example.pixels)
    span = slice(start, start + n)
    segments_R[r] += 1
    tokens[r, span] = example.tokens_N[:-1]
    targets[r, span] = example.tokens_N[1:]
    positions[r, span] = np.arange(n)
    segment_ids[r, span] = segments_R[r]
    mask[r, span] = example.loss_N[1:]
    used_R[r] += n
    placed += 1
  rows = dict(tokens=tokens, targets=targets, positions=positions,
              segment_ids=segment_ids, mask=mask)
  if images is not None:
    rows.update(pixels=row_images.pixels_BxIxHxWxC,
                image_mask=row_images.mask_BxI)
  return rows, placed


class PackedBatches:
  """Batches of packed SFT rows from a shuffled, repeated Grain source.

  `to_example` turns one record of `source` into an SFTExample
  (`hf_example_fn(tokenizer, cfg)` for SFT records with an HF tokenizer, or
  e.g. `lambda p: pair_example(*p)` for pre-tokenized pairs). `next(it)`
  returns the rows of one global batch (every process can build it and keep
  its own rows). The batch starting at stream position p packs examples
  p, p+1, ... first-fit into `n_rows` rows and ends before the first example
  that fits no row; the next batch starts there. The state is that position
  (plus seed and source size, checked on restore).
  """

  def __init__(self, source: Any,
               to_example: Callable[[Any], SFTExample], *, n_rows: int,
               row_len: int, pad_id: int, seed: int, truncate: bool = False,
               images: ImageSlots | None = None):
    if n_rows <= 0 or row_len <= 0:
      raise ValueError(f"n_rows and row_len must be positive, got {n_rows}, "
                       f"{row_len}")
    self.source, self.seed, self.size = source, int(seed), len(source)
    self.n_rows, self.row_len, self.pad_id = n_rows, row_len, pad_id
    self.images = images
    self._examples = shuffled(source, self.seed).map(
        lambda r: fit_to_row(to_example(r), row_len, truncate))
    self.position = 0

  def __iter__(self) -> "PackedBatches":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    # A batch holds at most n_rows * row_len examples (each takes >= 1
    # position); read them lazily, one at a time, until one does not fit.
    examples = _LazyStream(self._examples, self.position)
    rows, placed = pack_rows(examples, self.n_rows, self.row_len,
                             self.pad_id, self.images)
    self.position += placed
    return rows

  def get_state(self) -> dict[str, int]:
    return {"position": self.position, "seed": self.seed, "size": self.size}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(state, self.seed, self.size, what=repr(self.source))
    self.position = int(state["position"])


class _LazyStream:
  """Items start, start+1, ... of an infinite MapDataset, read on demand."""

  def __init__(self, dataset: grain.MapDataset, start: int):
    self._dataset, self._start = dataset, start

  def __iter__(self):
    i = self._start
    while True:
      yield self._dataset[i]
      i += 1
