"""Chat templates of Hugging Face checkpoints, rendered as `transformers` does.

A template is Jinja code shipped with the checkpoint. `transformers` renders
it in an immutable sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag, a
`tojson` filter that does not escape HTML, and the globals `raise_exception`
and `strftime_now`; the variables are `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...). The rendered text is then tokenized without
adding special tokens. This module does the same with jinja2 directly, so the
prompts the policy sees in RL are the ones it saw in its own instruction
tuning (tests/test_chat_template.py compares with `transformers`).

Where a template comes from, highest precedence first (as `transformers`):
`chat_template.jinja`, then `additional_chat_templates/<name>.jinja` (named
templates), then `tokenizer_config.json`'s `chat_template` (a string, or a
list of `{"name", "template"}`). With several named templates the one named
"default" is used.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The tokenizer attributes `transformers` passes to a template by name.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token",
                      "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
  """A chat template is missing, ambiguous, or failed to render."""


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
  # Jinja's own tojson escapes <, >, & for HTML; chat text must stay as is.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}body{% endgeneration %}` renders as `body`.

  transformers uses the tag to find assistant text for its assistant masks;
  we find assistant turns by rendering prefixes instead (sft_data), so the
  tag only has to parse.
  """

  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A checkpoint's chat template and the special tokens it may refer to.

  source: the Jinja text; where: the file it came from (for errors);
  special_tokens: {"bos_token": "<s>", ...} as the tokenizer names them.
  """

  source: str
  where: str
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    try:
      _compile(self.source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
      raise ChatTemplateError(f"{self.where}: chat template does not parse "
                              f"(line {exc.lineno}: {exc.message})") from None

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None,
             **extra: Any) -> str:
    """The conversation as text, exactly as `apply_chat_template(...,
    tokenize=False)` renders it.

    Keys whose value is None are dropped from each message first, as
    transformers does (many templates test for a key's presence). `extra`
    variables override the special tokens of the same name.
    """
    if not messages:
      raise ChatTemplateError(f"{self.where}: cannot render an empty "
                              f"conversation")
    clean = []
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{i}] must be a mapping with "
                                f"'role' and 'content', got {message!r}")
      clean.append({k: v for k, v in message.items() if v is not None})
    variables = {**self.special_tokens, **extra}
    try:
      return _compile(self.source).render(
          messages=clean, tools=None if tools is None else list(tools),
          documents=None, add_generation_prompt=add_generation_prompt,
          **variables)
    except jinja2.exceptions.TemplateError as exc:
      raise ChatTemplateError(f"{self.where}: chat template failed: {exc}"
                              ) from None


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    try:
      out = json.load(f)
    except json.JSONDecodeError as exc:
      raise ChatTemplateError(f"{path}: not valid JSON ({exc})") from None
  if not isinstance(out, dict):
    raise ChatTemplateError(f"{path}: expected a JSON object")
  return out


def _token_text(value: Any) -> str | None:
  """A special token given as a string or an AddedToken dict ({content})."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def special_tokens(path: str) -> dict[str, str]:
  """The named special tokens of an HF directory, as strings.

  From tokenizer_config.json, and for keys it lacks, special_tokens_map.json
  (older checkpoints keep them there).
  """
  out: dict[str, str] = {}
  for name in ("special_tokens_map.json", TOKENIZER_CONFIG):
    config = _read_json(os.path.join(path, name))
    for key in SPECIAL_TOKEN_KEYS:
      text = _token_text(config.get(key))
      if text is not None:
        out[key] = text
  return out


def _named_templates(path: str) -> tuple[dict[str, str], str]:
  """{name: template text} and the file(s) they came from."""
  single = os.path.join(path, TEMPLATE_FILE)
  extra_dir = os.path.join(path, TEMPLATE_DIR)
  found: dict[str, str] = {}
  if os.path.isfile(single):
    with open(single) as f:
      found["default"] = f.read()
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        with open(os.path.join(extra_dir, name)) as f:
          found[name[:-len(".jinja")]] = f.read()
  if found:
    return found, single if os.path.isfile(single) else extra_dir
  config_path = os.path.join(path, TOKENIZER_CONFIG)
  value = _read_json(config_path).get("chat_template")
  where = f"{config_path} (chat_template)"
  if value is None:
    return {}, where
  if isinstance(value, str):
    return {"default": value}, where
  if isinstance(value, list) and all(
      isinstance(t, dict) and isinstance(t.get("name"), str) and
      isinstance(t.get("template"), str) for t in value):
    return {t["name"]: t["template"] for t in value}, where
  raise ChatTemplateError(f"{where}: expected a string or a list of "
                          f"{{'name', 'template'}} objects")


def load_chat_template(path: str) -> ChatTemplate | None:
  """The default chat template of the HF directory `path`, or None if it has
  none (a base model). Raises ChatTemplateError when there are named
  templates and none is called "default" (transformers refuses those too)."""
  found, where = _named_templates(path)
  if not found:
    return None
  if "default" not in found:
    raise ChatTemplateError(f"{where}: named chat templates {sorted(found)} "
                            f"and none named 'default'")
  return ChatTemplate(source=found["default"], where=where,
                      special_tokens=special_tokens(path))
