"""The detour and recheck styles of the pointer-chasing task (long2short's
long CoT)."""

import numpy as np
import pytest

from kimi_jax.data import pointer_chase as pc
from kimi_jax.data import tasks
from kimi_jax.infra.config import ConfigError


def _style_cfg(style: str, **kw) -> pc.PointerChaseConfig:
  knobs = {"detours": dict(detour_rate=0.75, max_detours=2),
           "rechecks": dict(recheck_rate=0.75, max_rechecks=1)}[style]
  return pc.PointerChaseConfig(**{
      **knobs, "cot_style": style, "direct_fraction": 0.0,
      "warmstart_fraction": 1.0, **kw})


def _detour_cfg(**kw):
  return _style_cfg("detours", **kw)


def test_detour_chain_format_by_hand_and_reward():
  perm = np.arange(100)[::-1]  # f(s) = 99 - s
  rec = {"x": 10, "n": 3, "answer": "89", "prompt": "10 c3 ="}
  text = pc.cot_solution(rec, perm, [[5], [], [7, 8]])
  assert text == "c2 05 ! 89 ; c1 10 ; c0 07 ! 08 ! 89 ; > 89"
  assert pc.PointerChaseReward()(rec, text).correct
  # Without detours it is the plain chain.
  assert pc.cot_solution(rec, perm, [[], [], []]) == pc.cot_solution(rec, perm)
  with pytest.raises(ValueError, match="2 detour lists for 3 steps"):
    pc.cot_solution(rec, perm, [[], []])


def test_detours_are_wrong_states_at_the_configured_rate():
  cfg = _detour_cfg()
  perm = pc.permutation(0)
  rng = np.random.default_rng(0)
  rec = {"x": 3, "n": 8}
  right = pc.chain(perm, 3, 8)
  counts = []
  for _ in range(500):
    tried = pc.draw_detours(rec, perm, cfg, rng)
    assert len(tried) == 8
    for step, wrong in zip(right, tried):
      assert len(wrong) <= 2 and step not in wrong
      assert all(0 <= w < 100 for w in wrong)
      counts.append(len(wrong))
  counts = np.array(counts)
  # P(>= 1) = 0.75 and P(2) = 0.75^2 = 0.5625 (the cap is 2).
  assert abs((counts >= 1).mean() - 0.75) < 0.03
  assert abs((counts == 2).mean() - 0.5625) < 0.03


def test_warmstart_of_the_detour_style_is_longer_and_correct():
  cfg = _detour_cfg()
  train, _ = pc.make_problems(cfg, seed=0)
  tok = pc.tokenizer("detours")
  pairs = pc.warmstart_texts(train, cfg, seed=0, size=1000)
  by_prompt = {r["prompt"]: r for r in train}
  reward = pc.PointerChaseReward()
  lengths, minimal = [], []
  for prompt, text in pairs:
    rec = by_prompt[prompt]
    assert reward(rec, text).correct
    lengths.append(len(tok.encode(text)) + 1)
    minimal.append(pc.minimal_length(rec))
    assert lengths[-1] >= minimal[-1]
  # 2 extra tokens per detour, 0.75 + 0.5625 detours per step on average.
  expected = np.mean(minimal) + 2 * 1.3125 * np.mean(
      [by_prompt[p]["n"] for p, _ in pairs])
  assert abs(np.mean(lengths) - expected) < 1.0


def test_plain_words_keep_their_ids_in_the_detour_tokenizer():
  plain, detours = pc.tokenizer(), pc.tokenizer("detours")
  text = "c2 89 ; c1 10 ; c0 89 ; > 89"
  assert plain.encode(text) == detours.encode(text)
  assert detours.vocab_size == plain.vocab_size + 1
  assert detours.decode(detours.encode("c0 05 ! 07 ;")) == "c0 05 ! 07 ;"
  with pytest.raises(ValueError, match="unknown word '!'"):
    plain.encode("05 !")


def test_minimal_length_counts_three_per_step_answer_and_eos():
  perm = pc.permutation(0)
  tok = pc.tokenizer()
  for n in (1, 4, 8):
    rec = {"x": 5, "n": n}
    assert pc.minimal_length(rec) == len(tok.encode(
        pc.cot_solution(rec, perm))) + 1


@pytest.mark.parametrize("overrides, needle", [
    ({"cot_style": "long"}, "task.cot_style"),
    ({"cot_style": "detours"}, "detour_rate > 0"),
    ({"detour_rate": 0.5}, "need task.cot_style='detours'"),
    ({"cot_style": "detours", "detour_rate": 1.0, "max_detours": 2},
     "task.detour_rate must be in"),
    ({"cot_style": "detours", "detour_rate": 0.5, "max_detours": -1},
     "task.max_detours must be"),
])
def test_bad_detour_config_names_the_key(overrides, needle):
  section = dict(name="pointer_chase", **overrides)
  with pytest.raises(ConfigError, match=needle):
    tasks.task_config(section)


def test_detour_task_uses_the_detour_tokenizer():
  task = tasks.make_task(_detour_cfg(), seed=0)
  assert "!" in task.tokenizer.words
  assert "!" not in tasks.make_task(pc.PointerChaseConfig(), 0).tokenizer.words


# ---- the recheck style: a verification pass after the chain -------------------


def _recheck_cfg(**kw):
  return _style_cfg("rechecks", **kw)


def test_recheck_chain_format_by_hand_and_reward():
  perm = np.arange(100)[::-1]  # f(s) = 99 - s
  rec = {"x": 10, "n": 3, "answer": "89", "prompt": "10 c3 ="}
  plain = "c2 89 ; c1 10 ; c0 89 ;"
  check = f"check 10 c3 = {plain}"
  assert pc.cot_solution(rec, perm, rechecks=1) == f"{plain} {check} > 89"
  assert pc.cot_solution(rec, perm, rechecks=2) == (
      f"{plain} {check} {check} > 89")
  assert pc.cot_solution(rec, perm, rechecks=0) == pc.cot_solution(rec, perm)
  assert pc.PointerChaseReward()(rec, f"{plain} {check} > 89").correct
  # The answer is read after the last '>', not from the restated chain.
  assert not pc.PointerChaseReward()(rec, f"{plain} {check} > 10").correct


def test_rechecks_are_drawn_at_the_configured_rate_up_to_the_cap():
  rng = np.random.default_rng(0)
  counts = np.array([pc.draw_rechecks(_recheck_cfg(max_rechecks=2), rng)
                     for _ in range(4000)])
  assert counts.max() == 2 and counts.min() == 0
  # P(>= 1) = 0.75, P(2) = 0.75^2.
  assert abs((counts >= 1).mean() - 0.75) < 0.03
  assert abs((counts == 2).mean() - 0.5625) < 0.03


def test_warmstart_of_the_recheck_style_adds_one_pass_at_the_rate():
  cfg = _recheck_cfg()
  train, _ = pc.make_problems(cfg, seed=0)
  tok = pc.tokenizer("rechecks")
  by_prompt = {r["prompt"]: r for r in train}
  reward = pc.PointerChaseReward()
  checked = []
  for prompt, text in pc.warmstart_texts(train, cfg, seed=0, size=1000):
    rec = by_prompt[prompt]
    assert reward(rec, text).correct
    extra = len(tok.encode(text)) + 1 - pc.minimal_length(rec)
    # Either the plain chain or one pass of 4 + 3n tokens more.
    assert extra in (0, 4 + 3 * rec["n"])
    checked.append(extra > 0)
  assert abs(np.mean(checked) - 0.75) < 0.04
  assert "check" in tasks.make_task(cfg, seed=0).tokenizer.words
  plain_text = "c2 89 ; c1 10 ; c0 89 ; > 89"
  assert tok.encode(plain_text) == pc.tokenizer().encode(plain_text)


@pytest.mark.parametrize("overrides, needle", [
    ({"cot_style": "rechecks"}, "recheck_rate > 0"),
    ({"recheck_rate": 0.5}, "need task.cot_style='rechecks'"),
    ({"cot_style": "rechecks", "recheck_rate": 1.5, "max_rechecks": 1},
     "task.recheck_rate must be in"),
    ({"cot_style": "rechecks", "recheck_rate": 0.5, "max_rechecks": -1},
     "task.max_rechecks must be"),
    ({"cot_style": "rechecks", "detour_rate": 0.5, "max_detours": 1,
      "recheck_rate": 0.5, "max_rechecks": 1},
     "need task.cot_style='detours'"),
])
def test_bad_recheck_config_names_the_key(overrides, needle):
  section = dict(name="pointer_chase", **overrides)
  with pytest.raises(ConfigError, match=needle):
    tasks.task_config(section)
