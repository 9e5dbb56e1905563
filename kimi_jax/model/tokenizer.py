"""Tokenizers: the small protocol the sampler and RL code use, and HF loading.

Any object with `encode`, `decode`, `eos_id`, `pad_id` and `vocab_size`
satisfies `Tokenizer` (e.g. a character-level tokenizer for synthetic tasks).
`load_hf_tokenizer` wraps a `tokenizers` `tokenizer.json` from an HF model
directory, taking special ids, extra stop ids and the chat template from the
JSON configs next to it; `prompt_ids` turns a task prompt into the ids the
sampler starts from (through the chat template for instruct models).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Protocol, Sequence, runtime_checkable

import tokenizers

from kimi_jax.model.chat_template import ChatTemplate, load_chat_template

TOKENIZER_FILE = "tokenizer.json"
# Where the special ids may be named, in order of precedence. The
# tokenizer_config names the token the chat template ends a turn with, which is
# what generation should stop on; generation_config / config give ids.
_TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
_ID_FILES = (GENERATION_CONFIG, "config.json")


@runtime_checkable
class Tokenizer(Protocol):
  """Text <-> token ids."""

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
  """A `tokenizers.Tokenizer` with its special ids and chat template.

  `encode` adds no special tokens (a chat template or the caller adds BOS and
  turn markers explicitly; `bos_id` is given for that). `decode` drops special
  tokens, so a response ending in EOS decodes to its text alone.
  `extra_stop_ids`: other ids that end a response (generation_config.json
  may list several eos ids, e.g. Llama 3's <|eot_id|> and <|eom_id|>).
  """

  tokenizer: tokenizers.Tokenizer
  eos_id: int
  pad_id: int
  bos_id: int | None = None
  extra_stop_ids: tuple[int, ...] = ()
  chat_template: ChatTemplate | None = None
  path: str = ""

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """eos_id first, then the extra stop ids (the sampler's stop_tokens)."""
    return tuple(dict.fromkeys((self.eos_id,) + self.extra_stop_ids))

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_with_special_tokens(self, text: str) -> list[int]:
    """As `transformers`' `tokenizer(text)`: the tokenizer's post-processor
    adds its special tokens (e.g. Llama's BOS; Qwen adds none)."""
    return self.tokenizer.encode(text, add_special_tokens=True).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)

  def render_chat(self, messages: Sequence[dict[str, Any]], *,
                  add_generation_prompt: bool = False,
                  **template_vars: Any) -> str:
    """The conversation through the checkpoint's chat template; extra
    variables (e.g. `enable_thinking`) as `apply_chat_template`'s kwargs."""
    if self.chat_template is None:
      raise ValueError(
          f"{self.path or 'tokenizer'}: no chat template (neither "
          f"chat_template.jinja nor tokenizer_config.json chat_template); "
          f"set task.chat_template=False for a base model")
    return self.chat_template.render(
        messages, add_generation_prompt=add_generation_prompt,
        **template_vars)

  def encode_chat(self, messages: Sequence[dict[str, Any]], *,
                  add_generation_prompt: bool = False,
                  **template_vars: Any) -> list[int]:
    """Ids of the rendered conversation, as `apply_chat_template` gives."""
    return self.encode(self.render_chat(
        messages, add_generation_prompt=add_generation_prompt,
        **template_vars))


# `task.thinking`: how a reasoning model's template is asked to think.
# "template" passes nothing (the template's own default); "on" / "off" pass
# enable_thinking=True / False, the switch Qwen3's template reads (off: the
# generation prompt holds an empty <think></think> block).
THINKING = {"template": {}, "on": {"enable_thinking": True},
            "off": {"enable_thinking": False}}


def thinking_vars(thinking: str) -> dict[str, bool]:
  """The chat-template variables of a `task.thinking` setting."""
  try:
    return dict(THINKING[thinking])
  except KeyError:
    raise ValueError(f"thinking must be one of {sorted(THINKING)}, got "
                     f"{thinking!r}") from None


def chat_messages(prompt: str, system_prompt: str = "") -> list[dict[str, str]]:
  """[system (when set), user] for one prompt."""
  system = [{"role": "system", "content": system_prompt}] if system_prompt \
      else []
  return system + [{"role": "user", "content": prompt}]


def prompt_ids(tokenizer: HFTokenizer, prompt: str, *, chat_template: bool,
               system_prompt: str = "", thinking: str = "template"
               ) -> list[int]:
  """The ids the sampler starts from for one task prompt.

  chat_template=True (instruct models): [system, user] through the chat
  template, ending with the assistant turn's header (generation prompt),
  rendered with `thinking`'s variables (THINKING).
  chat_template=False (base models): the text as the tokenizer encodes a
  document (with its own BOS, if any); a system prompt is put before the
  prompt, separated by a blank line.
  """
  if chat_template:
    return tokenizer.encode_chat(chat_messages(prompt, system_prompt),
                                 add_generation_prompt=True,
                                 **thinking_vars(thinking))
  text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
  return tokenizer.encode_with_special_tokens(text)


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _token_id(tok: tokenizers.Tokenizer, token: Any, source: str
              ) -> int | None:
  """Id of a token given as a string or an AddedToken dict ({content})."""
  if token is None:
    return None
  content = token["content"] if isinstance(token, dict) else token
  token_id = tok.token_to_id(content)
  if token_id is None:
    raise ValueError(f"{source}: special token {content!r} is not in the "
                     f"vocabulary")
  return token_id


def _first_id(value: Any) -> int | None:
  """generation_config may list several eos ids; the first is the main one."""
  if isinstance(value, list):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def _special_id(tok: tokenizers.Tokenizer, path: str, token_key: str,
                id_key: str) -> int | None:
  tok_cfg_path = os.path.join(path, _TOKENIZER_CONFIG)
  found = _token_id(tok, _read_json(tok_cfg_path).get(token_key), tok_cfg_path)
  for name in _ID_FILES:
    if found is not None:
      break
    found = _first_id(_read_json(os.path.join(path, name)).get(id_key))
  return found


def _generation_stop_ids(tok: tokenizers.Tokenizer, path: str
                         ) -> tuple[int, ...]:
  """All of generation_config.json's eos_token_id (an int or a list)."""
  config_path = os.path.join(path, GENERATION_CONFIG)
  value = _read_json(config_path).get("eos_token_id")
  if value is None:
    return ()
  values = value if isinstance(value, list) else [value]
  vocab = tok.get_vocab_size(with_added_tokens=True)
  for v in values:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
      raise ValueError(f"{config_path}: eos_token_id must be token ids in "
                       f"[0, {vocab}), got {value!r}")
  return tuple(values)


def load_hf_tokenizer(path: str) -> HFTokenizer:
  """Loads `path/tokenizer.json`, its special ids and its chat template.

  Each id comes from the first of tokenizer_config.json (token strings),
  generation_config.json, config.json (ids) that names it. Without any pad
  token the eos id pads (as HF generation does); pad positions are masked.
  Every eos id of generation_config.json also stops generation
  (`stop_ids`). Raises ValueError when no eos id is named anywhere.
  """
  tok_path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.exists(tok_path):
    raise FileNotFoundError(f"{tok_path} not found (only the `tokenizers` "
                            f"JSON format is supported)")
  tok = tokenizers.Tokenizer.from_file(tok_path)
  eos_id = _special_id(tok, path, "eos_token", "eos_token_id")
  if eos_id is None:
    raise ValueError(f"{path}: no eos token in {_TOKENIZER_CONFIG} or eos id "
                     f"in {' / '.join(_ID_FILES)}")
  pad_id = _special_id(tok, path, "pad_token", "pad_token_id")
  if pad_id is None:
    logging.warning("%s: no pad token named; padding with eos id %d", path,
                    eos_id)
    pad_id = eos_id
  bos_id = _special_id(tok, path, "bos_token", "bos_token_id")
  extra = tuple(i for i in _generation_stop_ids(tok, path) if i != eos_id)
  return HFTokenizer(tokenizer=tok, eos_id=eos_id, pad_id=pad_id,
                     bos_id=bos_id, extra_stop_ids=extra,
                     chat_template=load_chat_template(path), path=path)
