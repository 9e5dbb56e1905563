"""SFT data: first-fit packing checked by hand, loss on response / assistant
tokens only (against transformers' assistant mask), packed rows give the
same per-token log-probs as one example per row, and resumable batches."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import transformers

from kimi_jax.data import records as rec
from kimi_jax.data import sft_data
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.tokenizer import load_hf_tokenizer, prompt_ids
from tests.hf_dirs import make_qwen_style_dir

# QWEN_TEMPLATE of test_chat_template with the assistant text (and its
# end-of-turn marker) in a {% generation %} block, so that transformers'
# return_assistant_tokens_mask gives an independent reference.
GEN_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{{- message.content + '<|im_end|>\\n' }}
{%- endgeneration %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _ex(tokens, loss, where="x"):
  return sft_data.SFTExample(np.asarray(tokens, np.int32),
                             np.asarray(loss, bool), where)


def test_first_fit_packing_by_hand():
  examples = [
      _ex([11, 12, 13, 14], [0, 0, 1, 1], "a"),  # 3 positions
      _ex([21, 22, 23], [0, 1, 1], "b"),         # 2
      _ex([31, 32, 33, 34, 35], [0, 1, 0, 1, 1], "c"),  # 4
      _ex([41, 42], [0, 1], "d"),                # 1
      _ex([51, 52, 53], [0, 1, 1], "e"),         # 2: fits no row -> stop
      _ex([61, 62], [0, 1], "f"),
  ]
  rows, placed = sft_data.pack_rows(examples, n_rows=2, row_len=5, pad_id=0)
  assert placed == 4
  np.testing.assert_array_equal(rows["tokens"], [[11, 12, 13, 21, 22],
                                                 [31, 32, 33, 34, 41]])
  np.testing.assert_array_equal(rows["targets"], [[12, 13, 14, 22, 23],
                                                  [32, 33, 34, 35, 42]])
  np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 0, 1],
                                                    [0, 1, 2, 3, 0]])
  np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 2, 2],
                                                      [1, 1, 1, 1, 2]])
  np.testing.assert_array_equal(rows["mask"], [[0, 1, 1, 1, 1],
                                               [1, 0, 1, 1, 1]])
  assert rows["mask"].dtype == np.float32
  # Room left in an earlier row is used first; padding is segment 0.
  rows, placed = sft_data.pack_rows(
      [examples[2], examples[1], examples[3]], n_rows=2, row_len=5,
      pad_id=-1)
  assert placed == 3
  np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 2],
                                                      [1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(rows["tokens"][1], [21, 22, -1, -1, -1])
  np.testing.assert_array_equal(rows["mask"][1], [1, 1, 0, 0, 0])


def test_too_long_example_is_named_or_truncated():
  long = _ex(range(1, 9), [0] * 3 + [1] * 5, "sft.jsonl:7")
  with pytest.raises(rec.DataError, match=r"sft\.jsonl:7: example of 8 tokens"
                     r" needs 7 positions, more than a row's 5.*truncate"):
    sft_data.fit_to_row(long, 5, truncate=False)
  cut = sft_data.fit_to_row(long, 5, truncate=True)
  np.testing.assert_array_equal(cut.tokens_N, [1, 2, 3, 4, 5, 6])
  with pytest.raises(rec.DataError, match=r"sft\.jsonl:7"):
    sft_data.pack_rows([long], 2, 5, 0)


@pytest.fixture(scope="module")
def qwen_tok_dir(tmp_path_factory):
  path = make_qwen_style_dir(tmp_path_factory.mktemp("qwen_gen"))
  with open(os.path.join(path, "tokenizer_config.json")) as f:
    config = json.load(f)
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(dict(config, chat_template=GEN_TEMPLATE), f)
  return path


CHAT = [{"role": "user", "content": "Compute 12 + 30."},
        {"role": "assistant", "content": "12 + 30 = 42."},
        {"role": "user", "content": "And 6 times 7?"},
        {"role": "assistant", "content": "The answer is 42."}]


def test_loss_on_assistant_turns_matches_transformers(qwen_tok_dir):
  tok = load_hf_tokenizer(qwen_tok_dir)
  ref = transformers.AutoTokenizer.from_pretrained(qwen_tok_dir)
  cfg = sft_data.SFTTokenizeConfig(chat_template=True)
  for messages in (CHAT, [{"role": "system", "content": "Be brief."}] + CHAT,
                   CHAT[:2]):
    ex = sft_data.tokenize_record({"messages": messages, "id": "r"}, tok, cfg)
    want = ref.apply_chat_template(messages, return_dict=True,
                                   return_assistant_tokens_mask=True)
    np.testing.assert_array_equal(ex.tokens_N, want["input_ids"])
    np.testing.assert_array_equal(ex.loss_N, np.asarray(
        want["assistant_masks"], bool))
  trained = tok.decode(ex.tokens_N[ex.loss_N])
  assert trained == "12 + 30 = 42.\n"  # <|im_end|> is trained, not decoded
  assert tok.eos_id in ex.tokens_N[ex.loss_N]


def test_prompt_response_with_and_without_template(qwen_tok_dir):
  tok = load_hf_tokenizer(qwen_tok_dir)
  row = {"prompt": "Compute 12 + 30.", "response": "12 + 30 = 42.",
         "id": "s:1"}
  chat = sft_data.tokenize_record(row, tok, sft_data.SFTTokenizeConfig(
      chat_template=True, system_prompt="Be brief."))
  prompt = prompt_ids(tok, row["prompt"], chat_template=True,
                      system_prompt="Be brief.")
  # The SFT prompt is exactly what RL will prompt with.
  np.testing.assert_array_equal(chat.tokens_N[:len(prompt)], prompt)
  assert not chat.loss_N[:len(prompt)].any()
  assert chat.loss_N[len(prompt):].all()
  plain = sft_data.tokenize_record(row, tok, sft_data.SFTTokenizeConfig(
      chat_template=False))
  want = tok.encode(row["prompt"]) + tok.encode(row["response"]) + [
      tok.eos_id]
  np.testing.assert_array_equal(plain.tokens_N, want)
  n_prompt = len(tok.encode(row["prompt"]))
  np.testing.assert_array_equal(plain.loss_N,
                                np.arange(len(want)) >= n_prompt)
  with pytest.raises(rec.DataError, match=r"s:2: chat messages need"):
    sft_data.tokenize_record({"messages": CHAT, "id": "s:2"}, tok,
                             sft_data.SFTTokenizeConfig(chat_template=False))


@pytest.mark.slow
def test_packed_rows_score_like_one_example_per_row():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64)
  rng = np.random.RandomState(0)
  params = jax.device_put(jax.tree.map(
      lambda shape: (0.3 * rng.normal(size=shape)).astype(np.float32),
      transformer.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
  examples = [_ex(rng.randint(1, 64, n), rng.rand(n) < 0.7, str(i))
              for i, n in enumerate([5, 9, 4, 7, 3, 6])]
  rows, placed = sft_data.pack_rows(examples, n_rows=2, row_len=16, pad_id=0)
  assert placed == 6 and rows["segment_ids"].max() > 2

  @jax.jit
  def token_logp(params, batch):
    logits, _ = transformer.forward(params, batch["tokens"],
                                    batch["positions"], batch["segment_ids"],
                                    cfg=cfg)
    return transformer.token_logprobs(logits, batch["targets"])

  def logp(batch):
    return np.asarray(token_logp(params, jax.device_put(batch)))

  packed = logp(rows) * rows["mask"]
  # Alone: the example in row 0, row 1 empty (one compiled shape).
  singles = [sft_data.pack_rows([e], 2, 16, 0)[0] for e in examples]
  alone = [logp(s)[0] * s["mask"][0] for s in singles]
  # Each segment of the packed rows scores as its example does alone.
  for r in range(2):
    for seg in range(1, rows["segment_ids"][r].max() + 1):
      at = rows["segment_ids"][r] == seg
      i = next(k for k, s in enumerate(singles)
               if np.array_equal(s["tokens"][0][:at.sum()],
                                 rows["tokens"][r][at]))
      np.testing.assert_allclose(packed[r][at], alone[i][:at.sum()],
                                 rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.sum(), sum(a.sum() for a in alone),
                             rtol=1e-5)


def test_packed_batches_resume_exactly(qwen_tok_dir, tmp_path):
  tok = load_hf_tokenizer(qwen_tok_dir)
  path = tmp_path / "sft.jsonl"
  with open(path, "w") as f:
    for i in range(9):
      f.write(json.dumps({"prompt": f"Compute {i} + {i}.",
                          "response": f"{i} + {i} = {2 * i}." * (1 + i % 3)})
              + "\n")
  src = rec.load_sft_source(str(path))
  cfg = sft_data.SFTTokenizeConfig(chat_template=True)

  def batches(seed=3):
    return sft_data.PackedBatches(src, sft_data.hf_example_fn(tok, cfg),
                                  n_rows=2, row_len=96, pad_id=tok.pad_id,
                                  seed=seed)

  it = batches()
  first = [next(it) for _ in range(3)]
  state = json.loads(json.dumps(it.get_state()))
  assert state["position"] == sum(int(b["segment_ids"].max(axis=1).sum())
                                  for b in first)
  rest = [next(it) for _ in range(2)]
  resumed = batches()
  resumed.set_state(state)
  for want in rest:
    got = next(resumed)
    for key in sft_data.ROW_KEYS:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # Several examples per row, and a new seed gives a new order.
  assert max(int(b["segment_ids"].max()) for b in first) >= 2
  assert not np.array_equal(next(batches(seed=4))["tokens"],
                            first[0]["tokens"])
  with pytest.raises(rec.DataError, match=r"too\.jsonl:1: example of"):
    tiny = tmp_path / "too.jsonl"
    tiny.write_text(json.dumps({"prompt": "p" * 50, "response": "r"}) + "\n")
    next(sft_data.PackedBatches(rec.load_sft_source(str(tiny)),
                                sft_data.hf_example_fn(tok, cfg), n_rows=1,
                                row_len=8, pad_id=0, seed=0))


def test_packed_batches_of_pretokenized_pairs():
  pairs = [([1, 2], [3, 4, 9]), ([5], [6, 9]), ([7, 8, 7], [9])]
  it = sft_data.PackedBatches(pairs, lambda p: sft_data.pair_example(*p),
                              n_rows=1, row_len=9, pad_id=0, seed=0)
  rows = next(it)
  # 4 + 2 + 3 positions: one epoch fills the row exactly, every pair once,
  # losses on responses only.
  assert it.position == 3 and rows["segment_ids"].max() == 3
  assert rows["mask"].sum() == 3 + 2 + 1
  np.testing.assert_array_equal(np.sort(rows["targets"][rows["mask"] > 0]),
                                [3, 4, 6, 9, 9, 9])
