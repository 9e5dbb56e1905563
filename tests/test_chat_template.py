"""Chat templates and HF tokenizer directories: our rendering (text and ids)
equals `transformers`' `apply_chat_template`. The directories come from
tests/hf_dirs.py (BPE trained at test time; templates in the styles of Qwen2
— ChatML, `-` whitespace control — and Llama 3 — plain block tags relying on
trim_blocks / lstrip_blocks, strftime_now, raise_exception, loop controls)."""

from __future__ import annotations

import pytest
import transformers

from kimi_jax.model import chat_template as ct
from kimi_jax.model.tokenizer import load_hf_tokenizer, prompt_ids
from tests.hf_dirs import (QWEN_TEMPLATE, make_llama_style_dir,
                           make_qwen_style_dir, write_file)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 6 times 7?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What is 6 times 7?"}],
    [{"role": "system", "content": "  Answer briefly.  "},
     {"role": "user", "content": "Compute 12 + 30."},
     {"role": "assistant", "content": "12 + 30 = 42."},
     {"role": "user", "content": "And 6 × 7, in <b>bold</b> & more?"}],
    [{"role": "user", "content": "Compute 12 + 30."},
     {"role": "assistant", "content": "The answer is 42.", "extra": None}],
]
TOOLS = [{"name": "calc", "description": "evaluates <expr> & returns é",
          "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  return {"qwen": make_qwen_style_dir(tmp_path_factory.mktemp("qwen")),
          "llama": make_llama_style_dir(tmp_path_factory.mktemp("llama"))}


@pytest.mark.parametrize("style", ["qwen", "llama"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_equals_transformers(hf_dirs, style, conv, gen):
  path = hf_dirs[style]
  ref = transformers.AutoTokenizer.from_pretrained(path)
  ours = load_hf_tokenizer(path)
  messages = CONVERSATIONS[conv]
  want_text = ref.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=gen)
  want_ids = ref.apply_chat_template(messages, add_generation_prompt=gen,
                                     return_dict=False)
  assert ours.render_chat(messages, add_generation_prompt=gen) == want_text
  assert ours.encode_chat(messages, add_generation_prompt=gen) == want_ids
  # Special tokens became single ids, not their characters.
  assert len(want_ids) < len(want_text) / 2


def test_tools_render_as_transformers_with_unescaped_json(hf_dirs):
  path = hf_dirs["qwen"]
  ref = transformers.AutoTokenizer.from_pretrained(path)
  ours = load_hf_tokenizer(path)
  want = ref.apply_chat_template(CONVERSATIONS[1], tools=TOOLS,
                                 tokenize=False, add_generation_prompt=True)
  got = ours.chat_template.render(CONVERSATIONS[1], tools=TOOLS,
                                  add_generation_prompt=True)
  assert got == want
  assert "<expr> & returns é" in got  # tojson escapes neither HTML nor é


def test_prompt_ids_chat_and_plain(hf_dirs):
  for style, path in hf_dirs.items():
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ours = load_hf_tokenizer(path)
    chat = prompt_ids(ours, "What is 6 times 7?", chat_template=True,
                      system_prompt="Answer briefly.")
    assert chat == ref.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, return_dict=False)
    plain = prompt_ids(ours, "What is 6 times 7?", chat_template=False)
    assert plain == ref("What is 6 times 7?")["input_ids"], style
  llama = load_hf_tokenizer(hf_dirs["llama"])
  assert plain[0] == llama.bos_id  # the post-processor's BOS
  with_system = prompt_ids(llama, "What is 6 times 7?", chat_template=False,
                           system_prompt="Answer briefly.")
  assert llama.decode(with_system) == "Answer briefly.\n\nWhat is 6 times 7?"


def test_special_and_stop_ids(hf_dirs):
  qwen = load_hf_tokenizer(hf_dirs["qwen"])
  t = qwen.tokenizer
  assert (qwen.eos_id, qwen.pad_id) == (t.token_to_id("<|im_end|>"),
                                        t.token_to_id("<|endoftext|>"))
  assert qwen.stop_ids == (qwen.eos_id, t.token_to_id("<|endoftext|>"))
  llama = load_hf_tokenizer(hf_dirs["llama"])
  t = llama.tokenizer
  assert llama.eos_id == llama.pad_id == t.token_to_id("<|eot_id|>")
  assert llama.bos_id == t.token_to_id("<|begin_of_text|>")
  # eos first, then generation_config's other eos ids, without repeats.
  assert llama.stop_ids == (t.token_to_id("<|eot_id|>"),
                            t.token_to_id("<|end_of_text|>"))
  assert llama.chat_template.special_tokens == {
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_named_templates_use_default(hf_dirs, tmp_path):
  path = make_qwen_style_dir(tmp_path)
  write_file(path, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                        {"name": "default", "template": QWEN_TEMPLATE}]})
  ref = transformers.AutoTokenizer.from_pretrained(path)
  ours = load_hf_tokenizer(path)
  assert ours.render_chat(CONVERSATIONS[0]) == ref.apply_chat_template(
      CONVERSATIONS[0], tokenize=False)


def test_template_errors_name_the_file(hf_dirs, tmp_path):
  ours = load_hf_tokenizer(hf_dirs["llama"])
  bad_roles = [{"role": "assistant", "content": "hi"}]
  with pytest.raises(ct.ChatTemplateError,
                     match=r"chat_template\.jinja.*alternate"):
    ours.render_chat(bad_roles)
  qwen = load_hf_tokenizer(hf_dirs["qwen"])
  with pytest.raises(ct.ChatTemplateError,
                     match=r"tokenizer_config\.json \(chat_template\).*"
                     r"unknown role: robot"):
    qwen.render_chat([{"role": "robot", "content": "beep"}])
  path = make_qwen_style_dir(tmp_path)
  write_file(path, "tokenizer_config.json", {
      "eos_token": "<|im_end|>",
      "chat_template": [{"name": "tool_use", "template": "x"},
                        {"name": "rag", "template": "y"}]})
  with pytest.raises(ct.ChatTemplateError, match=r"none named 'default'"):
    load_hf_tokenizer(path)
  write_file(path, "tokenizer_config.json", {"eos_token": "<|im_end|>",
                                         "chat_template": "{% if %}"})
  with pytest.raises(ct.ChatTemplateError, match="does not parse"):
    load_hf_tokenizer(path)


def test_base_model_without_template(hf_dirs, tmp_path):
  path = make_qwen_style_dir(tmp_path)
  write_file(path, "tokenizer_config.json", {"eos_token": "<|im_end|>"})
  tok = load_hf_tokenizer(path)
  assert tok.chat_template is None
  with pytest.raises(ValueError, match=r"no chat template.*"
                     r"task\.chat_template=False"):
    prompt_ids(tok, "hi", chat_template=True)
  assert prompt_ids(tok, "hi", chat_template=False) == tok.encode("hi")


def test_bad_generation_config_eos_is_named(tmp_path):
  path = make_qwen_style_dir(tmp_path)
  write_file(path, "generation_config.json", {"eos_token_id": [1, "two"]})
  with pytest.raises(ValueError, match=r"generation_config\.json: "
                     r"eos_token_id"):
    load_hf_tokenizer(path)
