"""The tiny task, its tokenizer and the warm-start row encoding."""

import json

import numpy as np
import pytest

from kimi_jax import sft
from kimi_jax.data import pointer_chase as pc
from kimi_jax.data import tasks
from kimi_jax.data.word_tokenizer import WordTokenizer


def test_problems_are_disjoint_complete_and_answers_follow_the_permutation():
  cfg = pc.PointerChaseConfig(max_steps=4)
  train, held = pc.make_problems(cfg, seed=3)
  pairs = [(r["x"], r["n"]) for r in train + held]
  assert len(pairs) == len(set(pairs)) == 100 * 4
  assert not {r["id"] for r in train} & {r["id"] for r in held}
  assert 0.05 < len(held) / len(pairs) < 0.25
  perm = pc.permutation(3)
  for r in held[:20]:
    s = r["x"]
    for _ in range(r["n"]):  # f applied n times, by hand
      s = int(perm[s])
    assert r["answer"] == f"{s:02d}"
    assert r["difficulty"] == r["n"]


def test_chain_of_thought_format_and_reward():
  perm = np.arange(100)[::-1]  # f(s) = 99 - s
  rec = {"x": 10, "n": 3, "answer": "89", "prompt": "10 c3 ="}
  cot = pc.cot_solution(rec, perm)
  assert cot == "c2 89 ; c1 10 ; c0 89 ; > 89"
  reward = pc.PointerChaseReward()
  assert reward(rec, cot).correct and reward(rec, cot).score == 1.0
  assert reward(rec, "> 89").correct
  for wrong in ("> 88", "c2 89 ;", "> 89 > 8", "", "> 89 10"):
    assert not reward(rec, wrong).correct, wrong


def test_word_tokenizer_round_trip_and_errors(tmp_path):
  tok = pc.tokenizer()
  text = "c2 89 ; c1 10 ; c0 89 ; > 89"
  ids = tok.encode(text)
  assert min(ids) >= 3 and tok.decode(ids) == text
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
  assert tok.vocab_size == 3 + 3 + 10 + 100
  tok.save(str(tmp_path))
  assert WordTokenizer.load(str(tmp_path)) == tok
  with pytest.raises(ValueError, match="unknown word 'c99'"):
    tok.encode("c99")
  with pytest.raises(ValueError, match="duplicate"):
    WordTokenizer(("a", "a"))


def test_warmstart_mixes_direct_and_cot_over_a_subset():
  cfg = pc.PointerChaseConfig(direct_fraction=0.5, warmstart_fraction=0.25)
  train, _ = pc.make_problems(cfg, seed=0)
  pairs = pc.warmstart_texts(train, cfg, seed=0, size=2000)
  direct = [s for _, s in pairs if s.startswith(">")]
  assert 0.4 < len(direct) / len(pairs) < 0.6
  assert len({p for p, _ in pairs}) == round(0.25 * len(train))


def test_encode_pair_masks_only_the_solution():
  row = sft.encode_pair([1, 10, 11], [20, 21, 2], seq_len=8, pad_id=0)
  np.testing.assert_array_equal(row["tokens"], [1, 10, 11, 20, 21, 0, 0, 0])
  np.testing.assert_array_equal(row["targets"], [10, 11, 20, 21, 2, 0, 0, 0])
  # Targets 20, 21, 2 (the solution and eos) count; prompt targets do not.
  np.testing.assert_array_equal(row["mask"], [0, 0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 1, 1, 0, 0, 0])
  with pytest.raises(ValueError, match="exceeds sft.seq_len"):
    sft.encode_pair([1] * 6, [2] * 4, seq_len=8, pad_id=0)


def test_jsonl_task_errors_name_file_line_and_field(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" +
                  "{not json\n")
  with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
    tasks.read_jsonl_records(str(path), "prompt")
  path.write_text(json.dumps({"question": "x"}) + "\n")
  with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'prompt'"):
    tasks.read_jsonl_records(str(path), "prompt")
