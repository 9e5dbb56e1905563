"""Tokenizers: the small protocol the sampler and RL code use, and HF loading.

Any object with `encode`, `decode`, `eos_id`, `pad_id` and `vocab_size`
satisfies `Tokenizer` (e.g. a character-level tokenizer for synthetic tasks).
`load_hf_tokenizer` wraps a `tokenizers` `tokenizer.json` from an HF model
directory, taking special ids from the JSON configs next to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Protocol, Sequence, runtime_checkable

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
# Where the special ids may be named, in order of precedence. The
# tokenizer_config names the token the chat template ends a turn with, which is
# what generation should stop on; generation_config / config give ids.
_TOKENIZER_CONFIG = "tokenizer_config.json"
_ID_FILES = ("generation_config.json", "config.json")


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
  """A `tokenizers.Tokenizer` with its special ids resolved.

  `encode` adds no special tokens (a chat template or the caller adds BOS and
  turn markers explicitly; `bos_id` is given for that). `decode` drops special
  tokens, so a response ending in EOS decodes to its text alone.
  """

  tokenizer: tokenizers.Tokenizer
  eos_id: int
  pad_id: int
  bos_id: int | None = None

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)


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


def load_hf_tokenizer(path: str) -> HFTokenizer:
  """Loads `path/tokenizer.json` and its eos/pad/bos ids.

  Each id comes from the first of tokenizer_config.json (token strings),
  generation_config.json, config.json (ids) that names it. Without any pad
  token the eos id pads (as HF generation does); pad positions are masked.
  Raises ValueError when no eos id is named anywhere.
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
  return HFTokenizer(tokenizer=tok, eos_id=eos_id, pad_id=pad_id,
                     bos_id=bos_id)
