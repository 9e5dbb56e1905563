"""Reasoning models' prompt formats: `task.thinking` through a chat template
with Qwen3's switch (`enable_thinking`), rendered as `transformers` renders
it, in RL prompts, SFT rows that hold thinking, and the prompts that
`launch/sample.py` feeds a run's policy."""

from __future__ import annotations

import ml_collections
import pytest
import transformers

from kimi_jax.data import sft_data, tasks
from kimi_jax.data.records import DataError
from kimi_jax.job.workdir import prompt_encoder
from kimi_jax.model.tokenizer import load_hf_tokenizer, prompt_ids
from tests.hf_dirs import make_qwen3_style_dir

QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
  """A ChatML tokenizer with <think> and </think> and Qwen3's thinking
  switch (tests/hf_dirs.py: QWEN3_TEMPLATE)."""
  return make_qwen3_style_dir(tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("messages", [
    QUESTION,
    QUESTION + [{"role": "assistant",
                 "content": "<think>\n6 sevens\n</think>\n\n42"}],
    QUESTION + [{"role": "assistant", "content": "42"},
                {"role": "user", "content": "And 6 times 8?"}],
])
def test_rendering_with_the_switch_equals_transformers(thinking_dir, thinking,
                                                       messages):
  ref = transformers.AutoTokenizer.from_pretrained(thinking_dir)
  ours = load_hf_tokenizer(thinking_dir)
  extra = {} if thinking is None else {"enable_thinking": thinking}
  gen = messages[-1]["role"] == "user"
  want = ref.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=gen, **extra)
  assert ours.render_chat(messages, add_generation_prompt=gen,
                          **extra) == want
  assert ours.encode_chat(messages, add_generation_prompt=gen,
                          **extra) == ref.apply_chat_template(
                              messages, add_generation_prompt=gen,
                              return_dict=False, **extra)


def test_prompt_ids_follow_task_thinking(thinking_dir):
  tok = load_hf_tokenizer(thinking_dir)
  ids = {t: prompt_ids(tok, "What is 6 times 7?", chat_template=True,
                       thinking=t) for t in ("template", "on", "off")}
  assert ids["template"] == ids["on"]
  assert tok.tokenizer.decode(ids["off"], skip_special_tokens=False
                              ).endswith("assistant\n<think>\n\n</think>\n\n")
  assert ids["off"][:len(ids["on"])] == ids["on"]
  with pytest.raises(ValueError, match="thinking must be one of"):
    prompt_ids(tok, "x", chat_template=True, thinking="maybe")


def _trained_text(tok, example) -> str:
  """The text of the tokens an SFT example puts loss on."""
  return tok.tokenizer.decode(
      [int(t) for t, on in zip(example.tokens_N, example.loss_N) if on],
      skip_special_tokens=False)


def test_sft_rows_train_on_the_thinking_and_the_answer(thinking_dir):
  tok = load_hf_tokenizer(thinking_dir)
  record = {"id": "r1", "prompt": "What is 6 times 7?",
            "response": "<think>\n6 sevens make 42\n</think>\n\n42"}
  on = sft_data.tokenize_record(record, tok, sft_data.SFTTokenizeConfig(
      thinking="on"))
  assert _trained_text(tok, on) == (
      "<think>\n6 sevens make 42\n</think>\n\n42<|im_end|>\n")
  # Thinking off: the prompt already closes an empty block; the model
  # learns the answer alone.
  plain = dict(record, response="42")
  off = sft_data.tokenize_record(plain, tok, sft_data.SFTTokenizeConfig(
      thinking="off"))
  assert _trained_text(tok, off) == "42<|im_end|>\n"
  assert tok.tokenizer.decode(list(off.tokens_N), skip_special_tokens=False
                              ).count("<think>") == 1
  # Reasoning in a row while thinking is off cannot be placed: named.
  with pytest.raises(DataError, match="r1: the chat template renders"):
    sft_data.tokenize_record(record, tok, sft_data.SFTTokenizeConfig(
        thinking="off"))


def test_task_thinking_is_checked_by_key():
  with pytest.raises(ValueError, match="config.task.thinking"):
    tasks.JsonlTaskConfig(train_path="a", eval_path="b", thinking="yes")


def test_sampling_prompts_are_formatted_as_the_run_formatted_them(
    thinking_dir):
  tok = load_hf_tokenizer(thinking_dir)
  typed = tasks.JsonlTaskConfig(train_path="a", eval_path="b",
                                system_prompt="Be brief.", thinking="off")
  loaded = ml_collections.ConfigDict(
      {"chat_template": True, "system_prompt": "Be brief.",
       "thinking": "off"})
  want = prompt_ids(tok, "What is 6 times 7?", chat_template=True,
                    system_prompt="Be brief.", thinking="off")
  assert prompt_encoder(typed, tok)("What is 6 times 7?") == want
  assert prompt_encoder(loaded, tok)("What is 6 times 7?") == want
  # --raw: the text alone (this tokenizer has no BOS).
  assert prompt_encoder(typed, tok, raw=True)("What is 6 times 7?") == (
      tok.encode("What is 6 times 7?"))
  # A config written before `thinking` existed reads as the default.
  old = ml_collections.ConfigDict({"chat_template": True})
  assert prompt_encoder(old, tok)("What is 6 times 7?") == prompt_ids(
      tok, "What is 6 times 7?", chat_template=True)
