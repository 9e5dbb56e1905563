"""Hugging Face tokenizer directories built at test time (no downloads): a
byte-level BPE trained with the `tokenizers` library, special tokens and a
chat template in the styles of Qwen2 (ChatML), Qwen3 (ChatML with a
thinking switch), Llama 3 and Gemma 3, and tiny random checkpoints of every
supported family. Shared by the chat-template, SFT-data, export and parity
tests (and the end-to-end tests)."""

from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

QWEN_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools:\\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role in ('user', 'assistant') %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role != 'system' %}
{{- raise_exception('unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA_TEMPLATE = """\
{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] | trim %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = 'Reason step by step.' %}
    {% set rest = messages %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

Year: {{ strftime_now('%Y') }}
{{ system }}<|eot_id|>
{% for message in rest %}
    {% if message['role'] == 'note' %}
        {% continue %}
    {% endif %}
    {% if (loop.index0 % 2 == 0) != (message['role'] == 'user') %}
        {{ raise_exception('roles must alternate user/assistant') }}
    {% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

# ChatML with a thinking block, as Qwen3's template writes it: an assistant
# turn's text up to `</think>` is its reasoning; the last assistant turn is
# written `<think>\nREASONING\n</think>\n\nANSWER` (an empty block when it
# has none); enable_thinking=false closes an empty block in the generation
# prompt, so the model answers at once.
QWEN3_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role in ('system', 'user') %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set answer = message.content %}
{%- set reasoning = '' %}
{%- if '</think>' in answer %}
{%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.last %}
{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
{%- endif %}
{{- answer + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# Gemma 3's turns: BOS from the template, `model` for the assistant, a system
# message folded into the first user turn.
GEMMA_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set prefix = messages[0].content + '\\n\\n' %}
{%- set rest = messages[1:] %}
{%- else %}
{%- set prefix = '' %}
{%- set rest = messages %}
{%- endif %}
{%- for message in rest %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}
{{- message.content | trim }}{{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

CORPUS = [
    "You are a helpful assistant.", "What is 6 times 7?",
    "Think step by step, then answer: the answer is 42.",
    "system user assistant tools", "Reason step by step.",
    "Compute 12 + 30 and explain the result in one sentence.",
    "Year: 2025", "<b>bold</b> & ampersands",
] * 20

def _train_bpe(specials: list[str]) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=500, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def write_file(path, name: str, value) -> None:
  with open(os.path.join(path, name), "w") as f:
    if isinstance(value, str):
      f.write(value)
    else:
      json.dump(value, f)


def make_qwen_style_dir(path) -> str:
  """ChatML tokenizer: eos <|im_end|>, pad <|endoftext|>, no BOS; the
  generation config stops on both."""
  os.makedirs(path, exist_ok=True)
  tok = _train_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  tok.save(os.path.join(path, "tokenizer.json"))
  write_file(path, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "bos_token": None, "chat_template": QWEN_TEMPLATE})
  write_file(path, "generation_config.json", {
      "eos_token_id": [tok.token_to_id("<|im_end|>"),
                       tok.token_to_id("<|endoftext|>")]})
  return str(path)


def make_llama_style_dir(path) -> str:
  """Llama-3-like: BOS added by the post-processor, eos <|eot_id|>, the
  template in chat_template.jinja (as newer checkpoints save it)."""
  os.makedirs(path, exist_ok=True)
  tok = _train_bpe(["<|begin_of_text|>", "<|end_of_text|>",
                    "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>"])
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>",
                                                      bos)])
  tok.save(os.path.join(path, "tokenizer.json"))
  write_file(path, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>",
                    "special": True},
      "eos_token": "<|eot_id|>"})
  write_file(path, "chat_template.jinja", LLAMA_TEMPLATE)
  write_file(path, "generation_config.json", {
      "eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                       tok.token_to_id("<|eot_id|>")]})
  return str(path)


def make_qwen3_style_dir(path) -> str:
  """`make_qwen_style_dir` with <think> and </think> as added, non-special
  tokens (decoding keeps them, as Qwen3's does) and QWEN3_TEMPLATE."""
  make_qwen_style_dir(path)
  tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  tok.add_tokens([tokenizers.AddedToken("<think>", special=False),
                  tokenizers.AddedToken("</think>", special=False)])
  tok.save(os.path.join(path, "tokenizer.json"))
  write_file(path, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "bos_token": None, "chat_template": QWEN3_TEMPLATE})
  return str(path)


def make_gemma_style_dir(path) -> str:
  """Gemma-3-like: BOS added by the post-processor and written by the
  template, eos <eos>; the generation config stops on <end_of_turn> too."""
  os.makedirs(path, exist_ok=True)
  tok = _train_bpe(["<pad>", "<eos>", "<bos>", "<start_of_turn>",
                    "<end_of_turn>"])
  bos = tok.token_to_id("<bos>")
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", special_tokens=[("<bos>", bos)])
  tok.save(os.path.join(path, "tokenizer.json"))
  write_file(path, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
      "eos_token": "<eos>", "pad_token": "<pad>",
      "chat_template": GEMMA_TEMPLATE})
  write_file(path, "generation_config.json", {
      "eos_token_id": [tok.token_to_id("<eos>"),
                       tok.token_to_id("<end_of_turn>")]})
  return str(path)


# ---------------------------------------------------------------------------
# A tiny Qwen2 checkpoint that answers math prompts (the end-to-end test)


def _chain_tokens(tok: tokenizers.Tokenizer, prefix: str,
                  branches: list[str], suffix: str) -> tuple[list[int],
                                                             list[int],
                                                             list[int]]:
  """Ids of prefix, of each one-token branch, and of suffix; checks that
  `prefix + branch + suffix` tokenizes as their concatenation and that no
  id repeats (each id gets one successor)."""
  pre = tok.encode(prefix, add_special_tokens=False).ids
  suf = tok.encode(suffix, add_special_tokens=False).ids
  mid = []
  for b in branches:
    ids = tok.encode(prefix + b + suffix, add_special_tokens=False).ids
    [one] = tok.encode(b, add_special_tokens=False).ids
    assert ids == pre + [one] + suf, (b, ids)
    mid.append(one)
  chain = pre + mid + suf
  assert len(set(chain)) == len(chain), chain
  return pre, mid, suf


def make_answering_qwen2_dir(path, *, answers: tuple[str, ...] = ("4", "7"),
                             vocab_size: int = 512, seed: int = 0) -> str:
  """A random tiny Qwen2 (built with transformers) with the Qwen-style
  tokenizer of `make_qwen_style_dir`, whose embedding and output rows of a
  few tokens make it answer every chat prompt with `\\boxed{a}<|im_end|>`,
  `a` drawn evenly from `answers` (when sampled at temperature 1).

  The rows: the generation prompt's last token and each answer token get
  large orthogonal embeddings (the random layers barely move them), and the
  output row of the token that should follow gets a large logit on it. Every
  other weight stays random, so training changes the logits everywhere.
  """
  import numpy as np
  import torch
  import transformers
  make_qwen_style_dir(path)
  tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  pre, mid, suf = _chain_tokens(tok, "\\boxed{", list(answers), "}")
  eos = tok.token_to_id("<|im_end|>")
  start = tok.encode("<|im_start|>assistant\n",
                     add_special_tokens=False).ids[-1]
  # (token, its successors): prompt end -> \boxed{ -> answers -> } -> eos.
  edges = [(start, [pre[0]])] + [(a, [b]) for a, b in zip(pre, pre[1:])]
  edges += [(pre[-1], mid)] + [(m, [suf[0]]) for m in mid]
  edges += [(a, [b]) for a, b in zip(suf, suf[1:])] + [(suf[-1], [eos])]
  torch.manual_seed(seed)
  d = 64
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=vocab_size, hidden_size=d, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
      tie_word_embeddings=False))
  rng = np.random.default_rng(seed)
  basis, _ = np.linalg.qr(rng.normal(size=(d, len(edges))))
  with torch.no_grad():
    embed = model.model.embed_tokens.weight
    head = model.lm_head.weight
    for (src, nexts), direction in zip(edges, basis.T):
      # RMS 1: the final norm maps it to sqrt(d) * direction.
      row = torch.tensor(direction * np.sqrt(d), dtype=torch.float32)
      embed[src] = row
      for nxt in nexts:
        head[nxt] += 20.0 * row / d
  save_keeping_generation_config(model, path)
  return str(path)


def save_keeping_generation_config(model, path) -> None:
  """`model.save_pretrained(path)`, keeping the generation_config.json the
  tokenizer style wrote there (transformers writes its own)."""
  generation = os.path.join(path, "generation_config.json")
  with open(generation) as f:
    ours = f.read()
  model.save_pretrained(path)
  with open(generation, "w") as f:
    f.write(ours)


def make_unsupported_dir(path) -> str:
  """A checkpoint directory of an architecture we do not implement."""
  make_qwen_style_dir(path)
  write_file(path, "config.json", {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4})
  return str(path)


# ---------------------------------------------------------------------------
# Tiny random models of every supported family (the parity tests)

# Window of the tiny Gemma 3: shorter than the test sequences, so sliding
# layers see fewer keys than full ones in every path.
TINY_WINDOW = 4
_SIZES = dict(vocab_size=96, hidden_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, rms_norm_eps=1e-5)

# name -> (transformers config class, causal-LM class, config keys).
TINY_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=24, rope_parameters={"rope_type": "default",
                                      "rope_theta": 5000.0},
        max_position_embeddings=128)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=24, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0,
                         "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                         "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                         "factor": 4.0, "beta_fast": 8.0, "beta_slow": 2.0,
                         "original_max_position_embeddings": 64})),
    # Mixture of experts: every layer sparse, top-2 of 8 renormalised; and
    # a mix (layer 0 dense by mlp_only_layers, top-3 of 6 unnormalised).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=24, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "qwen3_moe_mixed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
        norm_topk_prob=False, mlp_only_layers=[0],
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention",
                     "sliding_attention"],
        max_position_embeddings=128,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0,
                               "rope_theta": 20000.0},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": 300.0}})),
    "gemma3_softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
        sliding_window_pattern=3, final_logit_softcapping=3.0,
        tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={
            "full_attention": {"rope_type": "default",
                               "rope_theta": 20000.0},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": 300.0}})),
}


def tiny_hf_model(name: str, seed: int = 0, **changes):
  """A random tiny `transformers` model of family `name` (TINY_FAMILIES),
  float32, eval mode; norms and biases moved off their init so that their
  placement matters (Gemma norms, scale 1 + weight, around 0)."""
  import torch
  import transformers
  config_cls, model_cls, keys = TINY_FAMILIES[name]
  config = getattr(transformers, config_cls)(**{**_SIZES, **keys, **changes})
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config)
  zero_centred = name.startswith("gemma")
  with torch.no_grad():
    for param_name, p in model.named_parameters():
      if "norm" in param_name:
        p.copy_((0.0 if zero_centred else 1.0) + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  return model.eval()


# The tokenizer style of each family (by TINY_FAMILIES name prefix).
_STYLES = {"qwen2": make_qwen_style_dir, "qwen3": make_qwen3_style_dir,
           "llama3": make_llama_style_dir, "gemma3": make_gemma_style_dir}


def make_family_dir(path, name: str, seed: int = 0, **changes) -> str:
  """A checkpoint directory of family `name` (TINY_FAMILIES): its random
  tiny model (`tiny_hf_model`, with `changes`; the vocabulary covers the
  test tokenizer) and the tokenizer, chat template and generation config
  of the family's style."""
  _STYLES[name.split("_")[0]](path)
  model = tiny_hf_model(name, seed, **{"vocab_size": 512, **changes})
  save_keeping_generation_config(model, path)
  return str(path)
