"""The tiny task, its tokenizer, its packed warm-start rows and the data
checks of the config."""

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


def test_task_warmstart_pairs_are_packed_with_loss_on_the_solution():
  """The tiny task's warm-start pairs go through packed rows: several
  examples per row, each one its own segment with positions from 0, and
  the loss mask on exactly its solution and eos targets."""
  task_cfg = pc.PointerChaseConfig(max_steps=4)
  task = tasks.make_task(task_cfg, seed=0, warmstart_size=64)
  cfg = sft.SFTConfig(steps=1, batch_size=4, seq_len=32, learning_rate=1.0)
  data = sft.make_sft_data(cfg, task, task_cfg, seed=0)
  assert data.report is None  # no JSONL file
  rows = next(data.batches)
  pairs = sft.warmstart_pairs(task.warmstart(0), task.tokenizer,
                              task.encode_prompt)
  by_tokens = {tuple(p + s): len(p) for p, s, _ in pairs}
  seen = 0
  for r in range(cfg.batch_size):
    segments = rows["segment_ids"][r]
    assert segments.max() >= 2  # packed: more than one example per row
    for seg in range(1, segments.max() + 1):
      at = segments == seg
      tokens = list(rows["tokens"][r][at]) + [rows["targets"][r][at][-1]]
      n_prompt = by_tokens[tuple(tokens)]
      np.testing.assert_array_equal(rows["positions"][r][at],
                                    np.arange(at.sum()))
      np.testing.assert_array_equal(rows["targets"][r][at], tokens[1:])
      want = (np.arange(1, len(tokens)) >= n_prompt).astype(np.float32)
      np.testing.assert_array_equal(rows["mask"][r][at], want)
      assert tokens[-1] == task.tokenizer.eos_id
      seen += 1
  assert seen == data.batches.position
  assert (rows["mask"][rows["segment_ids"] == 0] == 0).all()


def test_sft_file_needs_the_jsonl_task(tmp_path):
  data = tmp_path / "s.jsonl"
  data.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
  with pytest.raises(ValueError, match=r"config\.sft\.train_path: SFT "
                     r"records are tokenized with the Hugging Face"):
    _check(dict(name="pointer_chase"), 5, str(data))


def _task(section, tok):
  return tasks.make_task(tasks.task_config(section), seed=0, tokenizer=tok)


def _check(section, sft_steps, sft_train_path):
  tasks.check_data_config(tasks.task_config(section), sft_steps,
                          sft_train_path)


def test_jsonl_task_loads_prompt_sets_and_names_bad_rows(tmp_path):
  from kimi_jax.model.tokenizer import load_hf_tokenizer, prompt_ids
  from tests.hf_dirs import make_qwen_style_dir
  tok = load_hf_tokenizer(make_qwen_style_dir(tmp_path / "tok"))
  train, held = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
  train.write_text(json.dumps({"q": "6 x 7?", "a": 42}) + "\n" +
                   "{not json\n")
  held.write_text(json.dumps({"q": "1 + 1?", "a": "2"}) + "\n")
  section = dict(name="jsonl", train_path=str(train), eval_path=str(held),
                 reward="math", prompt_field="q", answer_field="a",
                 chat_template=True, system_prompt="Be brief.")
  with pytest.raises(ValueError, match=r"t\.jsonl:2: not valid JSON"):
    _task(section, tok)
  task = _task(dict(section, on_bad_row="skip"), tok)
  assert {k: r.skipped for k, r in task.reports.items()} == {
      "task_train": 1, "task_eval": 0}
  assert (len(task.train), task.train[0]["answer"]) == (1, "42")
  assert task.encode_prompt(task.eval[0]) == prompt_ids(
      tok, "1 + 1?", chat_template=True, system_prompt="Be brief.")
  base = _task(dict(section, chat_template=False, system_prompt="",
                    on_bad_row="skip"), tok)
  assert base.encode_prompt(base.eval[0]) == tok.encode("1 + 1?")
  held.write_text(json.dumps({"question": "x"}) + "\n")
  with pytest.raises(ValueError, match=r"e\.jsonl:1: field 'q': missing"):
    _task(dict(section, on_bad_row="skip"), tok)


def test_jsonl_prompts_too_long_for_the_sampler_are_bad_rows(tmp_path):
  """A prompt that leaves no room for a response is caught at load time,
  naming its file, line and field, not in the middle of RL."""
  from kimi_jax.model.tokenizer import load_hf_tokenizer, prompt_ids
  from tests.hf_dirs import make_qwen_style_dir
  tok = load_hf_tokenizer(make_qwen_style_dir(tmp_path / "tok"))
  short, long = "What is 6 times 7?", "What is 6 times 7? " * 20
  path = tmp_path / "t.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n"
                          for p in (short, long, short)))
  section = dict(name="jsonl", train_path=str(path), eval_path=str(path))
  limit = len(prompt_ids(tok, short, chat_template=True)) + 5
  make = lambda **kw: tasks.make_task(tasks.task_config(dict(section, **kw)),
                                      seed=0, tokenizer=tok,
                                      max_prompt_tokens=limit)
  with pytest.raises(ValueError, match=rf"t\.jsonl:2: field 'prompt': \d+ "
                     rf"tokens as prompted, more than the {limit} that "
                     rf"leave room"):
    make()
  task = make(on_bad_row="skip")
  assert len(task.train) == 2 and task.reports["task_train"].skipped == 1
  assert all(len(task.encode_prompt(r)) <= limit for r in task.train)


def test_data_config_check_names_the_key(tmp_path):
  data = tmp_path / "t.jsonl"
  data.write_text("{}\n")
  jsonl = dict(name="jsonl", train_path=str(data), eval_path=str(data))
  _check(jsonl, sft_steps=0, sft_train_path="")
  _check(jsonl, sft_steps=5, sft_train_path=str(data))
  _check(dict(name="pointer_chase"), 5, "")
  with pytest.raises(ValueError, match=r"config\.sft\.steps=5 asks for a "
                     r"warm start but config\.sft\.train_path is empty"):
    _check(jsonl, sft_steps=5, sft_train_path="")
  with pytest.raises(ValueError, match=r"config\.sft\.train_path: file not "
                     r"found: .*nope"):
    _check(jsonl, 5, str(tmp_path / "nope.jsonl"))
  with pytest.raises(ValueError, match=r"config\.task\.eval_path: file not "
                     r"found"):
    _check(dict(jsonl, eval_path=str(tmp_path / "x")), 0, "")
  with pytest.raises(ValueError, match=r"config\.task\.train_path must be"):
    _check(dict(jsonl, train_path=""), 0, "")


def test_validation_split_leaves_the_held_out_split_where_it_was():
  base = pc.PointerChaseConfig()
  with_val = pc.PointerChaseConfig(val_fraction=0.125)
  train, held = pc.make_problems(with_val, seed=3)
  assert (train, held) == pc.make_problems(base, seed=3)
  rest, val = pc.split_validation(train, with_val, seed=3)
  ids = lambda rs: {r["id"] for r in rs}
  assert ids(rest) | ids(val) == ids(train)
  assert not ids(rest) & ids(val) and not ids(val) & ids(held)
  assert 0.09 < len(val) / len(train) < 0.16  # 0.125 of 700 pairs
  # Every difficulty is validated; none of it is trained on.
  assert {r["n"] for r in val} == set(range(1, 9))
  assert pc.split_validation(train, base, seed=3) == (train, [])
  with pytest.raises(ValueError, match="task.val_fraction"):
    pc.PointerChaseConfig(val_fraction=1.0)
