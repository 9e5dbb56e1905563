"""Prompt-set curation and rejection sampling (report 2.1, 2.2) on
hand-made rows and reasoning-gym problems scored by reasoning-gym's own
verifier; the model is a table of known answers (the sampler-backed policy
runs in tests/test_curate_e2e.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kimi_jax.curation import curate as C
from kimi_jax.curation import dedup
from kimi_jax.curation import question_format
from kimi_jax.curation import warmup
from kimi_jax.data import tagging
from kimi_jax.data.records import DataError
from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.reasoning_gym import ReasoningGymReward, make_records



class TablePolicy:
  """Answers prompt i's sample j with `answer_for(prompt, j)`; records every
  call."""

  def __init__(self, answer_for, too_long: int = 10_000):
    self.answer_for = answer_for
    self.too_long = too_long
    self.calls = []

  def prompt_problem(self, prompt):
    return "too long" if len(prompt) > self.too_long else None

  def sample(self, prompts, n, *, temperature, max_new_tokens, seed,
             response_prefix="", first_index=0):
    self.calls.append(dict(prompts=list(prompts), n=n,
                           temperature=temperature, prefix=response_prefix,
                           first_index=first_index))
    return [[response_prefix + self.answer_for(p, j) for j in range(n)]
            for p in prompts]


def exact_answer(record, response):
  """A reward: the text between <answer> and </answer> equals the answer."""
  got = response.removeprefix("<answer>").split("</answer>")[0].strip()
  return RewardResult(float(got == record["answer"]), got == record["answer"])


def _write(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _no_model(**changes):
  return C.CurateConfig(easy_to_hack=False, pass_rate=False, **changes)


# ---------------------------------------------------------------------------
# The format detector on a labelled list

LABELLED = [
    # multiple choice
    ("Which of the following is prime? A) 4 B) 6 C) 7 D) 9", "C",
     "multiple_choice"),
    ("What is 2+2?\n(A) 3\n(B) 4\n(C) 5", "B", "multiple_choice"),
    ("Pick the capital of France.\nA. Paris\nB. Rome\nC. Madrid", "A",
     "multiple_choice"),
    ("Choose the correct answer: the sky is (a) blue (b) green", "a",
     "multiple_choice"),
    ("Which of the following numbers is even: 3, 5, 8?", "8",
     "multiple_choice"),
    ("Select the correct option for x if 2x = 6.", "3", "multiple_choice"),
    ("Solve 3x = 9. Answer choices: 1, 2, 3", "3", "multiple_choice"),
    ("The derivative of x^2 is\nA: x\nB: 2x\nC: x^2", "B",
     "multiple_choice"),
    ("[A] 10 [B] 20 [C] 30 -- how many sides does a decagon have?", "A",
     "multiple_choice"),
    ("Options:\n1, 2, 3\nHow many primes are below 5? Reply with B for 2.",
     "B", "multiple_choice"),
    # true / false
    ("True or false: every even number greater than 2 is composite.",
     "False", "true_false"),
    ("Is 17 a prime number?", "yes", "true_false"),
    ("Does it logically follow that no cats are dogs? (Answer Yes or No)",
     "No", "true_false"),
    ("Answer true/false: 0 is a natural number.", "depends", "true_false"),
    ("(T/F) The square root of 2 is rational.", "F", "true_false"),
    ("Is the following statement true: 5 > 3?", "True", "true_false"),
    ("Can a triangle have two right angles?", "no", "true_false"),
    ("Is it true that 91 is prime?", "no", "true_false"),
    ("Determine whether 2^10 > 1000.", "true", "true_false"),
    ("Yes or no: is 1 a prime?", "No", "true_false"),
    # proof
    ("Prove that there are infinitely many primes.", "", "proof"),
    ("Show that the sum of two odd numbers is even.", "", "proof"),
    ("Let n be an integer. Prove: n^2 - n is even.", "n/a", "proof"),
    ("Give a proof that sqrt(2) is irrational.", "", "proof"),
    ("Demonstrate that the function f(x) = x^3 is injective.", "", "proof"),
    ("Justify why every bounded monotone sequence converges.", "", "proof"),
    ("Show that 3 divides n^3 - n for every integer n.", "", "proof"),
    ("For a triangle with sides a, b, c prove the triangle inequality.",
     "", "proof"),
    ("Using induction, prove 1 + 2 + ... + n = n(n+1)/2.", "", "proof"),
    ("State and prove the AM-GM inequality for two numbers.", "QED",
     "proof"),
    # verifiable, nothing to flag
    ("What is 17 * 23?", "391", None),
    ("Solve for x: 3x + 5 = 20.", "5", None),
    ("How many times does the letter 'a' appear in 'banana'?", "3", None),
    ("Spell this word backward: stone", "enots", None),
    ("State the final answer: 15 - 43 - 75 =", "-103", None),
    ("Find the greatest common divisor of 84 and 36.", "12", None),
    ("A train travels 60 km in 1.5 hours. What is its speed in km/h?",
     "40", None),
    ("Sort these numbers in ascending order: 5, 2, 9.", "2, 5, 9", None),
    ("Compute the area of a circle of radius 2, in terms of pi.", "4\\pi",
     None),
    ("Write the binary representation of 10.", "1010", None),
]


def test_detector_labels_forty_examples():
  assert len(LABELLED) == 40
  wrong = [(q, want, question_format.detect(q, a))
           for q, a, want in LABELLED if question_format.detect(q, a) != want]
  assert not wrong, wrong


# ---------------------------------------------------------------------------
# Duplicates


SEARCHES = ("pairwise", "minhash")


@pytest.mark.parametrize("search", SEARCHES)
def test_exact_and_near_duplicates(search):
  texts = [
      "What is the sum of 12 and 30?",               # 0 kept
      "what is the SUM of 12 and 30 ?!",             # 1 exact dup of 0
      "What is the sum of 12 and 31?",               # 2 other numbers: kept
      ("In a small village there are 12 houses and every house has 30 "
       "windows; how many windows are there in the village altogether?"),
      ("In a small village there are 12 houses and every house has 30 "
       "windows; how many windows are there in this village altogether?"),
      "Spell this word backward: stone",             # 5 kept
  ]
  dups = dedup.find_duplicates(texts, dedup.DedupConfig(search=search))
  assert [(d.index, d.of, d.kind) for d in dups] == [
      (1, 0, "exact_duplicate"), (4, 3, "near_duplicate")]
  # An independent recomputation: lower-case words joined by one space,
  # character 5-grams, Jaccard.
  def grams(text):
    words = "".join(c if c.isalnum() else " " for c in text.lower()).split()
    joined = " ".join(words)
    return {joined[i:i + 5] for i in range(len(joined) - 4)}
  a, b = grams(texts[3]), grams(texts[4])
  assert dups[1].similarity == pytest.approx(len(a & b) / len(a | b))
  assert dups[1].similarity > 0.8
  # Without the numbers guard the templated pair 0/2 is a near duplicate
  # (one character of 29 differs).
  loose = dedup.find_duplicates(texts, dedup.DedupConfig(same_numbers=False,
                                                         search=search))
  assert (2, 0, "near_duplicate") in [(d.index, d.of, d.kind) for d in loose]


@pytest.mark.parametrize("search", SEARCHES)
def test_template_guard_keeps_different_problems_of_one_template(search):
  # reasoning-gym's own generator: prompts share a long template and differ
  # in one short word. On shingles alone every one of them is a near
  # duplicate of another; the template guard compares the words.
  from kimi_jax.rewards.reasoning_gym import make_records
  questions = [r["question"] for r in make_records(
      "spell_backward", size=60, seed=0, min_word_len=3, max_word_len=5)]
  words = [q.rsplit(": ", 1)[1] for q in questions]
  repeats = {i for i, w in enumerate(words) if w in words[:i]}
  off = dedup.find_duplicates(questions, dedup.DedupConfig(ignore_common=1.0,
                                                          search=search))
  assert len(off) >= 40  # of 60
  guarded = dedup.find_duplicates(questions, dedup.DedupConfig(search=search))
  # Exactly the repeated words are duplicates, plus near ones that share
  # most of their letters (none in this draw of 3-5 letter words).
  assert {d.index for d in guarded} == repeats
  assert all(d.kind == "exact_duplicate" for d in guarded)
  # A rewording of one problem is still found among the templated ones.
  reworded = questions + [questions[3].replace("Spell", "spell") + " "]
  assert dedup.find_duplicates(reworded, dedup.DedupConfig(
      search=search))[-1].of == 3


def _number_free_prompts(n: int, seed: int = 0) -> list[str]:
  """Made-up-word prompts (one block: no numbers), every seventh a copy of
  an earlier one with one word replaced or inserted (a near duplicate)."""
  rng = np.random.default_rng(seed)
  vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"),
                              rng.integers(3, 9))) for _ in range(400)]
  texts: list[str] = []
  for i in range(n):
    if i % 7 == 6:
      words = texts[rng.integers(0, i)].split()
      where = int(rng.integers(0, len(words)))
      if i % 2:
        words[where] = vocab[rng.integers(0, 400)]
      else:
        words.insert(where, vocab[rng.integers(0, 400)])
      texts.append(" ".join(words))
    else:
      texts.append(" ".join(vocab[j] for j in rng.integers(0, 400, 20)))
  return texts


def test_minhash_search_finds_what_the_pairwise_search_finds():
  texts = _number_free_prompts(400)
  pairwise = dedup.find_duplicates(texts, dedup.DedupConfig(search="pairwise"))
  minhash = dedup.find_duplicates(texts, dedup.DedupConfig(search="minhash"))
  # "auto" above its size limit is the MinHash search.
  auto = dedup.find_duplicates(texts, dedup.DedupConfig(pairwise_max=100))
  assert len(pairwise) >= 40  # most planted copies pass 0.8
  assert minhash == pairwise == auto
  # A stricter LSH (few bands of many rows) misses some: the search is
  # what finds them, and what it reports is still exact.
  strict = dedup.find_duplicates(texts, dedup.DedupConfig(
      search="minhash", minhash_bands=2, minhash_rows=12))
  assert 0 < len(strict) < len(pairwise)
  assert set(strict) <= set(pairwise)


def test_minhash_signature_agreement_estimates_jaccard():
  a = frozenset(f"s{i}" for i in range(300))
  b = frozenset(f"s{i}" for i in range(100, 400))  # Jaccard 200 / 400
  sig_a = dedup.minhash_signature(a, 1000)
  sig_b = dedup.minhash_signature(b, 1000)
  # Each row agrees with probability 0.5: 1000 rows give 0.5 +- 0.016 (sd).
  assert abs(np.mean(sig_a == sig_b) - 0.5) < 0.06
  assert np.array_equal(dedup.minhash_signature(a, 1000), sig_a)
  # By hand: 1 - (1 - 0.8^5)^25.
  assert dedup.candidate_probability(0.8, 25, 5) == pytest.approx(
      1 - (1 - 0.32768) ** 25)


def test_dedup_search_settings_are_checked():
  with pytest.raises(ValueError, match="search"):
    dedup.DedupConfig(search="lsh")
  with pytest.raises(ValueError, match="minhash_bands"):
    dedup.DedupConfig(minhash_bands=0)
  with pytest.raises(ValueError, match="search"):
    C.CurateConfig(dedup_search="lsh")


def test_near_threshold_is_inclusive_and_configurable():
  texts = ["abcdefgh", "abcdefgx"]
  # By hand: 4 five-grams each, abcde bcdef cdefg shared: 3 / 5.
  assert dedup.jaccard(dedup.shingles(texts[0], 5),
                       dedup.shingles(texts[1], 5)) == pytest.approx(0.6)
  assert dedup.find_duplicates(texts, dedup.DedupConfig(threshold=0.6))
  assert not dedup.find_duplicates(texts, dedup.DedupConfig(threshold=0.61))
  assert dedup.find_duplicates(texts, dedup.DedupConfig(ngram=3,
                                                        threshold=0.7))


# ---------------------------------------------------------------------------
# The pipeline without a model


def _rows():
  return [
      {"prompt": "What is 6 times 7?", "answer": "42", "tags": ["math"]},
      {"prompt": "what is 6 TIMES 7", "answer": "42", "tags": ["math"]},
      {"prompt": "True or false: 7 is prime.", "answer": "True"},
      {"prompt": "Prove that 2 is even.", "answer": "proof"},
      {"prompt": "Write a python program that prints 3.", "answer": "3"},
      {"prompt": "What is 5 + 9?", "answer": "14"},
  ]


def test_side_file_and_kept_rows_add_up_to_the_input(tmp_path):
  rows = _rows() + ["not json", '{"answer": "1"}', "[1, 2]"]
  path = _write(tmp_path / "raw.jsonl", rows)
  result = C.curate(path, _no_model(on_bad_row="reject", kind="math"))
  report = C.write_outputs(result, str(tmp_path / "out.jsonl"),
                           str(tmp_path / "rej.jsonl"),
                           str(tmp_path / "rep.json"))
  kept, rejected = _read(tmp_path / "out.jsonl"), _read(tmp_path / "rej.jsonl")
  assert len(kept) + len(rejected) == len(rows) == report["rows"] == 9
  assert report["accounted"]
  reasons = {r["line"]: r["reason"] for r in rejected}
  assert reasons == {2: "exact_duplicate", 3: "true_false", 4: "proof",
                     7: "bad_row", 8: "bad_row", 9: "bad_row"}
  assert "prompt" in [r for r in rejected if r["line"] == 8][0]["detail"]
  assert [r for r in rejected if r["line"] == 7][0]["row_text"] == "not json"
  assert report["dropped_by_reason"] == {"bad_row": 3, "exact_duplicate": 1,
                                         "proof": 1, "true_false": 1}
  # Tags: the record's own, else the keyword tagger.
  assert [r["tags"] for r in kept] == [["math"], ["code"], ["math"]]


def test_bad_row_is_an_error_naming_file_line_and_field(tmp_path):
  path = _write(tmp_path / "raw.jsonl", _rows()[:2] + [{"prompt": 3}])
  with pytest.raises(DataError, match=r"raw.jsonl:3: field 'prompt'"):
    C.curate(path, _no_model())


def test_every_step_can_be_switched_off(tmp_path):
  path = _write(tmp_path / "raw.jsonl", _rows())
  result = C.curate(path, _no_model(format_filter=False, dedup=False,
                                    tags=False))
  assert len(result.kept) == 6 and not result.dropped
  assert [s.name for s in result.steps if s.enabled] == ["read"]


def test_tag_cap_keeps_at_most_cap_per_primary_tag(tmp_path):
  rows = [{"prompt": f"Compute {i} + {i + 1} please", "tags": [t]}
          for i, t in enumerate("aaaaabbbc")]
  path = _write(tmp_path / "raw.jsonl", rows)
  result = C.curate(path, _no_model(max_per_tag=2))
  assert tagging.balance(r.record["tags"] for r in result.kept) == {
      "a": 2, "b": 2, "c": 1}
  assert {d.reason for d in result.dropped} == {"tag_cap"}
  assert result.steps[-1].info["balance_after"] == {"a": 2, "b": 2, "c": 1}


def test_naive_bayes_posterior_by_hand():
  # Features of the training texts (alpha 1, 11 distinct features, so each
  # tag's denominator is its feature count + 12):
  #   math: add x2, two, numbers x2, "add two", "two numbers",
  #         "add numbers" -> 8 features, denominator 20, prior 2/3;
  #   spell: reverse, the, word, "reverse the", "the word" -> 5, 17, 1/3.
  # "add word" = [add, word, "add word"]:
  #   math  2/3 * 3/20 * 1/20 * 1/20 = 1/4000,
  #   spell 1/3 * 1/17 * 2/17 * 1/17 = 2/14739.
  tagger = tagging.fit_naive_bayes(
      ["add two numbers", "add numbers", "reverse the word"],
      ["math", "math", "spell"])
  assert tagger.tags == ("math", "spell")
  assert tagger.posterior("Add word") == pytest.approx(
      [14739 / 22739, 8000 / 22739])
  assert tagging.features("Add 12 + 3.5") == [
      "add", "<num>", "+", "<num>", "add <num>", "<num> +", "+ <num>"]
  record = {"prompt": "add word"}
  assert tagger(record) == ["math"]
  strict = dataclasses.replace(tagger, min_confidence=0.7)
  assert strict(record) == []  # 0.648 < 0.7: untagged
  assert strict({"prompt": "add word", "tags": ["own"]}) == ["own"]
  with pytest.raises(ValueError, match="at least 2 tags"):
    tagging.fit_naive_bayes(["a", "b"], ["x", "x"])


GYM_KINDS = ("basic_arithmetic", "chain_sum", "spell_backward",
             "letter_counting", "word_sorting", "syllogism",
             "simple_equations")


def test_learned_tagger_tags_unseen_reasoning_gym_problems():
  # Fitted on 20 problems per generator, it names the generator of 40 new
  # problems each (other seeds), from the prompt text alone.
  train = [{"prompt": r["prompt"], "tags": [f"rg/{d}"]}
           for d in GYM_KINDS for r in make_records(d, size=20, seed=1)]
  tagger = tagging.make_tagger("learned", train, min_confidence=0.5)
  test = [(r["prompt"], f"rg/{d}")
          for d in GYM_KINDS for r in make_records(d, size=40, seed=2)]
  right = sum(tagger({"prompt": p}) == [tag] for p, tag in test)
  assert right / len(test) >= 0.95
  # The keyword rules cannot tell these kinds apart (one label for all the
  # arithmetic ones), which is what a learned tagger is for.
  keyword = {tuple(tagging.keyword_tags({"prompt": p})) for p, _ in test}
  assert len(keyword) < len(GYM_KINDS)


def test_curate_with_the_learned_tagger(tmp_path):
  # Half the input carries its generator as a tag, half has none: the
  # learned tagger is fitted on the tagged half and tags the rest.
  rows = []
  for d in ("chain_sum", "spell_backward", "letter_counting"):
    for i, r in enumerate(make_records(d, size=20, seed=5)):
      r = {"prompt": r["prompt"], "answer": r["answer"]}
      rows.append(dict(r, tags=[f"rg/{d}"]) if i % 2 else
                  dict(r, truth=f"rg/{d}"))
  path = _write(tmp_path / "raw.jsonl", rows)
  cfg = _no_model(tagger="learned", dedup=False)
  result = C.curate(path, cfg)
  untagged = [r for r in result.kept if "truth" in r.raw]
  assert len(untagged) == 30
  assert sum(r.record["tags"] == [r.raw["truth"]] for r in untagged) >= 28
  info = {st.name: st for st in result.steps}["tags"].info
  assert info["tagger"] == "learned"
  assert info["learned"]["fitted_rows"] == 30
  assert info["learned"]["rows_with_own_tags"] == 30
  assert info["learned"]["fitted_on"] == "the input's tagged rows"
  # Or fitted on a labelled file of its own.
  labelled = _write(tmp_path / "labelled.jsonl",
                    [{"prompt": r["prompt"], "tags": r["tags"]}
                     for r in rows if "tags" in r])
  bare = [r for r in rows if "truth" in r]
  result = C.curate(_write(tmp_path / "bare.jsonl", bare),
                    _no_model(tagger="learned", dedup=False,
                              tagger_train=labelled))
  assert sum(r.record["tags"] == [r.raw["truth"]]
             for r in result.kept) >= 28
  info = {st.name: st for st in result.steps}["tags"].info
  assert info["learned"]["fitted_on"] == labelled
  # Bad labelled rows and label sets name the file, line and field.
  bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "tags": ["x"]},
                                        {"prompt": "b", "tags": []}])
  with pytest.raises(DataError, match=r"bad.jsonl:2: field 'tags'"):
    C.curate(path, _no_model(tagger="learned", tagger_train=bad))
  one = _write(tmp_path / "one.jsonl", [{"prompt": "a", "tags": ["x"]}])
  with pytest.raises(DataError, match=r"at least 2 tags.*one.jsonl"):
    C.curate(path, _no_model(tagger="learned", tagger_train=one))
  with pytest.raises(ValueError, match="tagger_train fits the 'learned'"):
    _no_model(tagger_train=labelled)
  with pytest.raises(ValueError, match="unknown tagger 'nope'"):
    _no_model(tagger="nope")


# ---------------------------------------------------------------------------
# Model steps with a policy whose answers are known


def _gym(tmp_path, size=6):
  rows = make_records("chain_sum", size=size, seed=3, min_terms=2,
                      max_terms=2, min_digits=2, max_digits=2)
  return rows, _write(tmp_path / "raw.jsonl", rows)


def test_pass_rate_and_bucket_from_known_answers(tmp_path):
  rows, path = _gym(tmp_path)
  answers = {r["prompt"]: r["answer"] for r in rows}
  # Prompt i is answered correctly in its first `right[i]` samples of 10.
  right = {r["prompt"]: k for r, k in zip(rows, [0, 1, 3, 5, 8, 10])}

  def answer_for(prompt, j):
    good = j < right[prompt]
    return f"<answer>{answers[prompt] if good else 'x'}</answer>"

  policy = TablePolicy(answer_for)
  cfg = C.CurateConfig(easy_to_hack=False, max_pass_rate=0.9)
  result = C.curate(path, cfg, policy=policy, reward=ReasoningGymReward())
  assert policy.calls[0]["n"] == 10 and policy.calls[0]["temperature"] == 1.0
  kept = {r.record["prompt"]: r.added for r in result.kept}
  expected = {0: ("hard", 2.0), 0.1: ("hard", 2.0), 0.3: ("medium", 1.0),
              0.5: ("medium", 1.0), 0.8: ("easy", 0.0)}
  for prompt, k in right.items():
    if k == 10:
      assert prompt not in kept
      continue
    rate = k / 10
    assert kept[prompt]["pass_rate"] == pytest.approx(rate)
    assert (kept[prompt]["difficulty_bucket"],
            kept[prompt]["difficulty"]) == expected[rate]
  [trivial] = result.dropped
  assert trivial.reason == "trivial" and trivial.row.added["pass_rate"] == 1
  # The side file keeps the row as read and, apart, what was measured.
  entry = trivial.to_json(path)
  assert entry["row"] == [r for r in rows if right[r["prompt"]] == 10][0]
  assert entry["added"]["pass_rate"] == 1
  assert entry["added"]["tags"] == ["rg/chain_sum"]
  # The curated rows feed the curriculum: `difficulty` is what it reads.
  from kimi_jax.rl.prompt_sampling import PromptSampler, PromptSamplingConfig
  sampler = PromptSampler(
      [dict(r.record, **r.added) for r in result.kept],
      PromptSamplingConfig(curriculum="warmup_then_hard", hard_threshold=2))
  assert len(sampler.eligible(1)) == 2


@pytest.mark.parametrize("counts, shares, quota", [
    ((10, 4, 7), (1, 1, 1), [4, 4, 4]),
    ((10, 4, 7), (2, 1, 1), [8, 4, 4]),
    ((10, 4, 7), (1, 2, 1), [2, 4, 2]),
    ((10, 0, 7), (1, 1, 1), [7, 0, 7]),  # an empty bucket is left out
    ((10, 4, 7), (1, 0, 1), [7, 0, 7]),  # a share of 0 drops its bucket
    ((10, 10, 10), (1, 1, 1), [10, 10, 10]),
    ((3, 9, 9), (0.7, 2.1, 2.1), [3, 9, 9]),  # 3 / 0.7 * 0.7 < 3 in floats
    ((0, 0, 0), (1, 1, 1), [0, 0, 0]),
])
def test_bucket_quota_by_hand(counts, shares, quota):
  assert C.bucket_quota(counts, shares) == quota


@pytest.mark.parametrize("counts, shares, quota", [
    # A bucket under 20 rows is kept whole and does not limit the others:
    # 1:1:1 over 0 / 1 / 970 rows (measured) would otherwise keep 2.
    ((0, 1, 970), (1, 1, 1), [0, 1, 970]),
    ((1, 1, 967), (1, 1, 1), [1, 1, 967]),
    ((30, 5, 60), (1, 1, 1), [30, 5, 30]),
    ((30, 5, 60), (1, 0, 1), [30, 0, 30]),  # a 0 share still drops it
    ((25, 20, 60), (1, 1, 1), [20, 20, 20]),  # 20 rows: in the proportion
])
def test_bucket_quota_keeps_small_buckets_whole(counts, shares, quota):
  assert C.bucket_quota(counts, shares, min_rows=20) == quota


def test_difficulty_balance_keeps_buckets_in_their_shares(tmp_path):
  rows, path = _gym(tmp_path, size=12)
  answers = {r["prompt"]: r["answer"] for r in rows}
  # Pass rates 1.0 (easy) for 6 prompts, 0.5 (medium) for 4, 0 (hard) for 2.
  right = dict(zip(answers, [10] * 6 + [5] * 4 + [0] * 2))

  def answer_for(prompt, j):
    good = j < right[prompt]
    return f"<answer>{answers[prompt] if good else 'x'}</answer>"

  def run(**changes):
    cfg = C.CurateConfig(easy_to_hack=False, bucket_min_rows=1, **changes)
    return C.curate(path, cfg, policy=TablePolicy(answer_for),
                    reward=ReasoningGymReward())

  result = run(bucket_shares=(1, 1, 1))
  kept = [r.added["difficulty_bucket"] for r in result.kept]
  assert sorted(kept) == ["easy", "easy", "hard", "hard", "medium", "medium"]
  assert {d.reason for d in result.dropped} == {"difficulty_balance"}
  assert len(result.kept) + len(result.dropped) == 12
  step = result.steps[-1]
  assert step.name == "difficulty_balance"
  assert step.info["by_bucket_before"] == {"easy": 6, "medium": 4, "hard": 2}
  assert step.info["quota"] == {"easy": 2, "medium": 2, "hard": 2}
  assert "'easy' bucket over its quota of 2 (shares 1:1:1)" in [
      d.detail for d in result.dropped][0]
  # Shares 2:1:0 keep twice as many easy as medium prompts and no hard one.
  result = run(bucket_shares=(2, 1, 0))
  assert sorted(r.added["difficulty_bucket"] for r in result.kept) == (
      ["easy"] * 6 + ["medium"] * 3)
  # Which rows go is a seeded choice, not file order.
  picks = {seed: sorted(r.line for r in run(bucket_shares=(1, 1, 1),
                                            seed=seed).kept)
           for seed in range(4)}
  assert len(set(map(tuple, picks.values()))) > 1
  # Off by default: all 12 kept.
  assert len(run().kept) == 12
  # With the default bucket_min_rows (10) every bucket here is too small
  # to balance: all kept whole.
  whole = C.curate(path, C.CurateConfig(easy_to_hack=False,
                                        bucket_shares=(1, 1, 1)),
                   policy=TablePolicy(answer_for),
                   reward=ReasoningGymReward())
  assert len(whole.kept) == 12
  assert whole.steps[-1].info["kept_whole"] == ["easy", "medium", "hard"]


def test_bucket_shares_are_checked():
  with pytest.raises(ValueError, match=r"bucket_shares needs 3 shares"):
    C.CurateConfig(bucket_shares=(1, 1))
  with pytest.raises(ValueError, match=r"bucket_shares needs 3 shares"):
    C.CurateConfig(bucket_shares=(1, -1, 1))
  with pytest.raises(ValueError, match=r"bucket_shares needs 3 shares"):
    C.CurateConfig(bucket_shares=(0, 0, 0))
  with pytest.raises(ValueError, match=r"bucket_min_rows must be >= 1"):
    C.CurateConfig(bucket_shares=(1, 1, 1), bucket_min_rows=0)
  with pytest.raises(ValueError, match=r"turn curate.pass_rate on"):
    C.CurateConfig(bucket_shares=(1, 1, 1), pass_rate=False)


def test_pass_rate_asks_through_the_pass_template(tmp_path):
  # A model that is right only when asked for steps: its pass rate is 0 on
  # the plain prompt and 1 through a template with the cue.
  rows, path = _gym(tmp_path)
  answers = {r["prompt"]: r["answer"] for r in rows}

  def answer_for(prompt, j):
    plain = prompt.removesuffix(" STEPS")
    return f"<answer>{answers[plain] if prompt != plain else 'x'}</answer>"

  for template, rate in (("{prompt}", 0.0), ("{prompt} STEPS", 1.0)):
    policy = TablePolicy(answer_for)
    cfg = C.CurateConfig(easy_to_hack=False, pass_template=template)
    result = C.curate(path, cfg, policy=policy, reward=ReasoningGymReward())
    assert [r.added["pass_rate"] for r in result.kept] == [rate] * len(rows)
    assert policy.calls[0]["prompts"] == [template.format(prompt=r["prompt"])
                                          for r in rows]
  with pytest.raises(ValueError, match="pass_template"):
    C.CurateConfig(pass_template="no placeholder")


class Killed(Exception):
  pass


def test_a_killed_curation_resumes_from_its_journal(tmp_path):
  from kimi_jax.data.journal import Journal
  # 12 prompts in chunks of 5: the easy-to-hack step asks 5 + 5 + 2 and
  # drops 3, the pass-rate step asks 5 + 4. The first run is killed in its
  # fourth model call (the pass-rate step's first chunk); the rerun asks
  # only for the pass-rate chunks, and its output equals an uninterrupted
  # run's.
  rows, path = _gym(tmp_path, size=12)
  answers = {r["prompt"]: r["answer"] for r in rows}
  good = {r["prompt"]: i % 4 for i, r in enumerate(rows)}

  def answer_for(prompt, j):
    plain = prompt.split("\n\nGive only")[0]
    if plain != prompt:  # a no-CoT guess (after the "<answer>" prefix)
      key = [r["prompt"] for r in rows if r["question"] == plain][0]
      ok = good[key] == 0 and j == 0
      return f"{answers[key] if ok else 'x'}</answer>"
    return f"<answer>{answers[prompt] if j < good[prompt] else 'x'}</answer>"

  class Dies(TablePolicy):
    def __init__(self, answer_for, calls_before_kill):
      super().__init__(answer_for)
      self.left = calls_before_kill

    def sample(self, prompts, n, **kw):
      if self.left == 0:
        raise Killed()
      self.left -= 1
      return super().sample(prompts, n, **kw)

  cfg = C.CurateConfig(chunk_prompts=5, hack_template="{question}\n\n"
                       "Give only the answer.", pass_samples=4)
  journal = str(tmp_path / "journal.jsonl")
  with pytest.raises(Killed):
    C.curate(path, cfg, policy=Dies(answer_for, 3), reward=exact_answer,
             journal=Journal(journal))
  with open(journal, "a") as f:
    f.write('{"digest": "torn')  # a write cut short by the kill
  again = TablePolicy(answer_for)
  resumed = C.curate(path, cfg, policy=again, reward=exact_answer,
                     journal=Journal(journal))
  assert [c["first_index"] for c in again.calls] == [0, 5]
  assert [len(c["prompts"]) for c in again.calls] == [5, 4]
  assert [c["n"] for c in again.calls] == [4, 4]
  whole = TablePolicy(answer_for)
  plain = C.curate(path, cfg, policy=whole, reward=exact_answer)
  assert len(whole.calls) == 5
  assert [(r.line, r.added) for r in resumed.kept] == [
      (r.line, r.added) for r in plain.kept]
  assert [(d.row.line, d.reason) for d in resumed.dropped] == [
      (d.row.line, d.reason) for d in plain.dropped]
  assert len(plain.kept) == 9 and len(plain.dropped) == 3
  # A third run finds every chunk; other settings find none.
  third = TablePolicy(answer_for)
  C.curate(path, cfg, policy=third, reward=exact_answer,
           journal=Journal(journal))
  assert third.calls == []
  fresh = TablePolicy(answer_for)
  C.curate(path, dataclasses.replace(cfg, pass_samples=3), policy=fresh,
           reward=exact_answer, journal=Journal(journal))
  assert [c["n"] for c in fresh.calls] == [3, 3]


def test_map_chunks_journal_by_hand(tmp_path):
  from kimi_jax.data.journal import Journal, map_chunks
  seen = []

  def double(chunk, start):
    seen.append((start, list(chunk)))
    return [2 * x for x in chunk]

  path = str(tmp_path / "j.jsonl")
  items = [1, 2, 3, 4, 5]
  out = map_chunks(items, items, double, chunk=2, journal=Journal(path),
                   key="k")
  assert out == [2, 4, 6, 8, 10]
  assert seen == [(0, [1, 2]), (2, [3, 4]), (4, [5])]
  assert len(open(path).read().splitlines()) == 3
  seen.clear()
  journal = Journal(path)
  assert map_chunks(items, items, double, chunk=2, journal=journal,
                    key="k") == out
  assert seen == [] and journal.reused == 3
  # Another key, chunking or item is another digest.
  map_chunks(items, items, double, chunk=2, journal=Journal(path), key="x")
  map_chunks([1, 2, 9], [1, 2, 9], double, chunk=2, journal=Journal(path),
             key="k")
  assert [s for s, _ in seen] == [0, 2, 4, 2]
  with pytest.raises(ValueError, match="returned 1 results for 2 items"):
    map_chunks(items, items, lambda c, s: [0], chunk=2)


def test_easy_to_hack_drops_what_a_constant_guesser_solves(tmp_path):
  rows = [{"prompt": "What is 6 times 7?", "answer": "42"},
          {"prompt": "What is 40 plus 2?", "answer": "42"},
          {"prompt": "What is 6 times 8?", "answer": "48"}]
  path = _write(tmp_path / "raw.jsonl", rows)

  policy = TablePolicy(lambda p, j: "42</answer>")
  result = C.curate(path, C.CurateConfig(kind="math", pass_rate=False),
                    policy=policy, reward=exact_answer)
  assert [r.record["answer"] for r in result.kept] == ["48"]
  assert [d.reason for d in result.dropped] == ["easy_to_hack"] * 2
  call = policy.calls[0]
  assert call["n"] == 8 and call["prefix"] == "<answer>"
  assert call["prompts"][0].startswith("What is 6 times 7?\n\nGive only")


def test_too_long_prompts_are_rejected_not_fatal(tmp_path):
  rows, path = _gym(tmp_path, size=3)
  long_one = dict(rows[0], id="long", question="Q " * 400,
                  prompt="Q " * 400)
  path = _write(tmp_path / "raw2.jsonl", rows + [long_one])
  policy = TablePolicy(lambda p, j: "<answer>x</answer>", too_long=500)
  result = C.curate(path, C.CurateConfig(dedup=False), policy=policy,
                    reward=ReasoningGymReward())
  assert [d.reason for d in result.dropped] == ["prompt_unusable"]
  assert len(result.kept) == 3


# ---------------------------------------------------------------------------
# Rejection sampling


def test_rejection_sampling_keeps_exactly_the_verified_responses():
  records = make_records("chain_sum", size=3, seed=5, min_terms=2,
                         max_terms=2, min_digits=1, max_digits=1)
  by_prompt = {}
  for r in records:
    by_prompt[r["prompt"]] = [
        f"Plan: add. Check. <answer>{r['answer']}</answer>",
        "<answer>wrong</answer>",
        f"<answer>{r['answer']}</answer>", "no tags at all"]
  by_prompt[records[2]["prompt"]] = ["<answer>nope</answer>"] * 4

  def answer_for(prompt, j):
    plain = prompt.split("\n\nSolve this carefully")[0]
    return by_prompt[plain][j]

  cfg = warmup.WarmupConfig(samples=4, max_per_prompt=4)
  result = warmup.rejection_sample(
      records, cfg, policy=TablePolicy(answer_for),
      reward=ReasoningGymReward())
  want = [(records[i]["prompt"], by_prompt[records[i]["prompt"]][j])
          for i in (0, 1) for j in (0, 2)]
  assert [(r["prompt"], r["response"]) for r in result.rows] == want
  report = result.report()
  assert report["acceptance_rate"] == pytest.approx(4 / 12)
  assert report["prompts_with_a_correct_response"] == 2
  shortest = warmup.rejection_sample(
      records, warmup.WarmupConfig(samples=4, keep="shortest"),
      policy=TablePolicy(answer_for), reward=ReasoningGymReward())
  assert [r["response"] for r in shortest.rows] == [
      f"<answer>{records[i]['answer']}</answer>" for i in (0, 1)]


def test_warmup_accept_score_drops_right_answers_after_a_wrong_step():
  from kimi_jax.rewards.registry import make_reward
  from tests.worked import good_and_lucky
  records = make_records("chain_sum", size=2, seed=0, min_terms=3,
                         max_terms=3, min_digits=1, max_digits=1)
  by_prompt = {r["prompt"]: good_and_lucky(r)[::-1] for r in records}

  def answer_for(prompt, j):
    return by_prompt[prompt.split("\n\nSolve this carefully")[0]][j]

  def rows(accept):
    result = warmup.rejection_sample(
        records, warmup.WarmupConfig(samples=2, max_per_prompt=2,
                                     accept=accept),
        policy=TablePolicy(answer_for),
        reward=make_reward("reasoning_gym_steps"))
    return [row["response"] for row in result.rows], result.report()

  answers, report = rows("answer")
  assert answers == [x for r in records for x in by_prompt[r["prompt"]]]
  assert report["acceptance_rate"] == 1.0
  paths, report = rows("score")
  assert paths == [by_prompt[r["prompt"]][1] for r in records]
  assert report["acceptance_rate"] == 0.5
  with pytest.raises(ValueError, match="warmup.accept"):
    warmup.WarmupConfig(accept="steps")


def test_warmup_rows_are_what_the_sft_stage_reads(tmp_path):
  from kimi_jax.data import records as records_lib
  rows = [{"id": "a#warmup0", "prompt": "p", "response": "r", "tags": []}]
  path = _write(tmp_path / "warmup.jsonl", rows)
  [record] = list(records_lib.load_sft_source(path))
  assert (record["prompt"], record["response"]) == ("p", "r")


def test_prioritized_sampling_starts_from_the_curated_pass_rate():
  from kimi_jax.rl.prompt_sampling import PromptSampler, PromptSamplingConfig
  records = [{"id": "a", "pass_rate": 0.2}, {"id": "b", "pass_rate": 0.9},
             {"id": "c"}]
  cfg = PromptSamplingConfig(prioritized=True, initial_success=0.5,
                             initial_success_field="pass_rate")
  sampler = PromptSampler(records, cfg)
  _, p = sampler.probabilities(0)
  # Weights 1 - s: 0.8, 0.1 and 0.5 for the record without a pass rate.
  assert p == pytest.approx([0.8 / 1.4, 0.1 / 1.4, 0.5 / 1.4])
  sampler.load_state_dict({"version": 1, "stats": [["a", 1.0, 3]]})
  assert sampler.success_rates() == pytest.approx([1.0, 0.9, 0.5])
  with pytest.raises(ValueError, match=r"records\[0\].*'pass_rate'"):
    PromptSampler([{"id": "a", "pass_rate": 2.0}], cfg)


def test_train_prompts_repeating_held_out_problems_are_dropped(tmp_path):
  held = [{"id": "e1", "prompt": "What is 6 times 7?", "answer": "42"},
          {"id": "e2", "prompt": ("A farmer has 12 cows and buys 30 more "
                                  "cows at the market; how many now?"),
           "answer": "42"}]
  rows = [{"prompt": "what is 6 TIMES 7", "answer": "42"},
          {"prompt": ("A farmer has 12 cows and then buys 30 more cows at "
                      "the market. How many now?"), "answer": "42"},
          {"prompt": "What is 6 times 8?", "answer": "48"}]
  path = _write(tmp_path / "raw.jsonl", rows)
  result = C.curate(path, _no_model(kind="math"), held_out=held)
  assert [r.record["answer"] for r in result.kept] == ["48"]
  assert [(d.reason, d.detail.split(" (")[0]) for d in result.dropped] == [
      ("held_out_exact_duplicate", "of held-out record 'e1'"),
      ("held_out_near_duplicate", "of held-out record 'e2'")]
  # Without the held-out set they are all distinct.
  assert len(C.curate(path, _no_model(kind="math")).kept) == 3


@pytest.mark.parametrize("variant", ["", ":cpu_test"])
def test_the_data_tools_config_types_every_section(variant):
  from kimi_jax.infra.config import ConfigError, load_config, to_dataclass
  from kimi_jax.curation import config as tools_config
  from kimi_jax.curation.gym_problems import GymConfig
  config = load_config("experiments/data/gym_curate.py" + variant)
  cfg = tools_config.curate_config(config)
  assert (cfg.pass_samples, cfg.hack_guesses) == (10, 8)  # report 2.1
  tools_config.warmup_config(config)
  tools_config.policy_config(config)
  assert "syllogism" in to_dataclass(GymConfig, config.gym, "gym").names()
  bad = load_config("experiments/data/gym_curate.py" + variant,
                    {"curate.difficulty_edges": (0.2, 0.8)})
  with pytest.raises(ConfigError, match="curate.difficulty_edges"):
    tools_config.curate_config(bad)


# ---------------------------------------------------------------------------
# Answer shift: what the easy-to-hack step does to small answer sets


def test_answer_shift_shares_and_warning_by_hand():
  from kimi_jax.curation import answer_shift as S
  # Tag "count": 16 of 20 input answers are "1", none kept; "2" goes from
  # 4/20 to 4/4. Tag "sum": 10 input rows, below min_rows: not judged.
  before = ([("count", "1")] * 16 + [("count", " 2 ")] * 4 +
            [("sum", "7")] * 10 + [("code", None)] * 3)
  after = [("count", "2")] * 4 + [("sum", "9")] * 2
  out = S.answer_shift(before, after, S.ShiftRule(min_rows=20))
  assert out["by_tag"]["count"] == {
      "rows_in": 20, "kept": 4, "top_in": {"1": 0.8, "2": 0.2},
      "top_kept": {"2": 1.0}}
  assert out["by_tag"]["sum"]["top_kept"] == {"9": 1.0}
  assert "code" not in out["by_tag"]  # no answers: not compared
  assert len(out["warnings"]) == 1
  assert out["warnings"][0].startswith(
      "count: answer '1' is 80% of the 20 input rows but 0% of the 4 kept")
  # The same tag judged at min_rows 10 flags "7" too (100% in, 0% kept).
  out10 = S.answer_shift(before, after, S.ShiftRule(min_rows=10))
  assert [w.split(":")[0] for w in out10["warnings"]] == ["count", "sum"]


def test_answer_shift_keep_ratio_is_the_boundary():
  from kimi_jax.curation import answer_shift as S
  before = [("t", "a")] * 50 + [("t", "b")] * 50  # "a": 0.5 of the input
  # Kept share of "a" 0.125 = 0.25 * 0.5: on the boundary, not flagged;
  # 0.1 is below it.
  at = [("t", "a")] * 1 + [("t", "b")] * 7
  below = [("t", "a")] * 1 + [("t", "b")] * 9
  assert S.answer_shift(before, at)["warnings"] == []
  assert len(S.answer_shift(before, below)["warnings"]) == 1
  with pytest.raises(ValueError, match="curate.answer_shift_keep_ratio"):
    C.CurateConfig(answer_shift_keep_ratio=0.0)


def test_curation_report_flags_the_answer_a_constant_guesser_removes(
    tmp_path):
  # 24 counting prompts answered "1" and 6 answered "2"; the no-CoT
  # guesser always says 1, so easy_to_hack drops every "1".
  rows = [{"prompt": f"How many times does x appear in row {i}?",
           "answer": "1" if i < 24 else "2", "tags": ["count"]}
          for i in range(30)]
  path = _write(tmp_path / "raw.jsonl", rows)

  cfg = C.CurateConfig(pass_rate=False, dedup=False)
  result = C.curate(path, cfg, policy=TablePolicy(lambda p, j: "1</answer>"),
                    reward=exact_answer)
  report = C.write_outputs(result, str(tmp_path / "out.jsonl"),
                           str(tmp_path / "rej.jsonl"),
                           str(tmp_path / "report.json"))
  assert report["kept"] == 6
  with open(tmp_path / "report.json") as f:
    shift = json.load(f)["answer_shift"]
  assert shift["by_tag"]["count"]["top_in"] == {"1": 0.8, "2": 0.2}
  assert shift["by_tag"]["count"]["top_kept"] == {"2": 1.0}
  assert len(shift["warnings"]) == 1 and "answer '1'" in shift["warnings"][0]
  assert C.shift_warnings(report) == shift["warnings"]
  # Switched off: no check, no warnings.
  off = C.curate(path, dataclasses.replace(cfg, answer_shift=False),
                 policy=TablePolicy(lambda p, j: "1</answer>"),
                 reward=exact_answer)
  assert off.report()["answer_shift"] == {}
  assert C.shift_warnings(off.report()) == []
  assert C.shift_warnings({"rows": 30}) == []  # a report from before the check
