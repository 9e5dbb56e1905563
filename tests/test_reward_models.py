"""Reward models. Fast: verdict parsing, the input template, labelled rows,
calibration, the verifier-first combination. Slow (each compiles a
transformer): the value head's losses and gradients on hand batches against
step-by-step references, the registry, frozen weights during RL, the HF
export and the rm_tiny study end to end."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.data import pointer_chase
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.reward_models import (labelled, serving, store, value_data,
                                    value_model)
from kimi_jax.reward_models import template as template_lib
from kimi_jax.reward_models.cot_model import seed_rationale
from kimi_jax.reward_models.serving import make_model_reward
from kimi_jax.reward_models.verdict import parse_verdict
from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.registry import make_reward
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=32, qkv_bias=True,
                  max_seq_len=64)


def _host_params(cfg: ModelConfig, seed: int) -> dict:
  """Random value-model params built on the host (norms away from 1)."""
  rng = np.random.RandomState(seed)

  def leaf(path, shape):
    noise = rng.normal(size=shape).astype(np.float32)
    if "norm" in jax.tree_util.keystr(path):
      return 1.0 + 0.3 * noise
    return 0.3 * noise

  model = jax.tree_util.tree_map_with_path(
      leaf, transformer.param_shapes(cfg),
      is_leaf=lambda x: isinstance(x, tuple))
  return {"model": model,
          "head": {"w_D": rng.normal(size=cfg.d_model).astype(np.float32)}}


@jax.jit
def _final_states(model, tokens_BxT):
  positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]),
                               tokens_BxT.shape)
  h, _ = transformer.hidden_states(model, tokens_BxT, positions,
                                   jnp.ones_like(tokens_BxT), cfg=CFG)
  return h


def _last_hidden(params: dict, ids: list[int]) -> np.ndarray:
  """Reference: one sequence alone, unpacked, as the LM head would read
  it: final-norm hidden state of its last token."""
  h = _final_states(params["model"], np.asarray([ids], np.int32))
  return np.asarray(h[0, -1], np.float64)


def _value_and_grad(loss):
  return jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG),
                                    has_aux=True))


BCE = _value_and_grad(value_model.bce_loss)
BT = _value_and_grad(value_model.bradley_terry_loss)


SEQS = [([5, 9, 11, 3], True), ([7, 2, 30, 31, 8, 12], False),
        ([4, 4, 17], True), ([20, 21, 22, 23, 24], False)]


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.slow  # compiles a transformer: > 3 s on 2 cores
@pytest.mark.host_inputs
def test_value_bce_loss_and_gradient_on_a_hand_batch():
  """Packed rows (two sequences share a row) score each sequence at its
  last token: loss = mean(softplus(s) - y s) and d loss / d w =
  mean((sigmoid(s) - y) h), recomputed from each sequence run alone."""
  params = _host_params(CFG, 0)
  units = [(value_data.Scored(tuple(ids), y),) for ids, y in SEQS]
  batch, where, placed = value_data.pack_units(units, n_rows=2, row_len=12,
                                               pad_id=0)
  assert placed == 4
  assert sorted({r for r, _ in where}) == [0, 1]  # two share a row
  h = np.stack([_last_hidden(params, ids) for ids, _ in SEQS])
  y = np.asarray([float(lab) for _, lab in SEQS])
  s = h @ params["head"]["w_D"].astype(np.float64)
  want_loss = np.mean(np.logaddexp(0.0, s) - y * s)
  want_grad_w = ((_sigmoid(s) - y)[:, None] * h).mean(axis=0)

  (loss, metrics), grads = BCE(params, batch)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grads["head"]["w_D"]), want_grad_w,
                             rtol=1e-4, atol=1e-6)
  assert float(metrics["scored"]) == 4
  assert float(metrics["accuracy"]) == np.mean((s > 0) == (y > 0.5))
  # The body gets a gradient through the scored positions only: changing a
  # padding token changes nothing.
  assert np.abs(np.asarray(grads["model"]["embed"])).sum() > 0
  padded = jax.tree.map(np.copy, batch)
  free = np.argwhere(padded.rows.segment_ids_RxT == 0)[0]
  padded.rows.tokens_RxT[tuple(free)] = 33
  np.testing.assert_allclose(float(BCE(params, padded)[0][0]), float(loss),
                             rtol=1e-6)


@pytest.mark.slow  # compiles a transformer: > 3 s on 2 cores
@pytest.mark.host_inputs
def test_bradley_terry_loss_and_gradient_on_a_hand_batch():
  """Pairs (chosen, rejected) give mean softplus(s_r - s_c); its gradient
  in w is mean(sigmoid(s_r - s_c) (h_r - h_c)). A pair's members may sit in
  different rows."""
  params = _host_params(CFG, 1)
  scored = [value_data.Scored(tuple(ids), y) for ids, y in SEQS]
  units = [(scored[0], scored[1]), (scored[2], scored[3])]
  batch, where, placed = value_data.pack_units(units, n_rows=3, row_len=8,
                                               pad_id=0)
  assert placed == 2
  assert where[0][0] != where[1][0]  # pair 1's members in different rows
  h = np.stack([_last_hidden(params, ids) for ids, _ in SEQS])
  s = h @ params["head"]["w_D"].astype(np.float64)
  margin = np.asarray([s[0] - s[1], s[2] - s[3]])
  want_loss = np.mean(np.logaddexp(0.0, -margin))
  d = np.stack([h[1] - h[0], h[3] - h[2]])
  want_grad = (_sigmoid(-margin)[:, None] * d).mean(axis=0)
  (loss, m), grads = BT(params, batch)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grads["head"]["w_D"]), want_grad,
                             rtol=1e-4, atol=1e-6)
  assert float(m["pairs"]) == 2


@pytest.mark.slow  # compiles a transformer: > 3 s on 2 cores
@pytest.mark.host_inputs
def test_bradley_terry_ignores_an_incomplete_pair():
  params = _host_params(CFG, 2)
  scored = [value_data.Scored(tuple(ids), y) for ids, y in SEQS]
  full, _, _ = value_data.pack_units([(scored[0], scored[1])], 2, 10, 0)
  both, _, _ = value_data.pack_units([(scored[0], scored[1]),
                                      (scored[2], scored[3])], 2, 10, 0)
  # Drop the rejected member of pair 2: only pair 1 counts.
  broken = jax.tree.map(np.copy, both)
  last = np.argwhere(broken.pair_RxT == 2)
  r, t = last[np.argmin(broken.label_RxT[tuple(last.T)])]
  broken.pair_RxT[r, t] = 0
  (a, _), _ = BT(params, full)
  (b, m), _ = BT(params, broken)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  assert float(m["pairs"]) == 1


def test_fit_offset_recovers_the_base_rate():
  logits = np.zeros(10)
  labels = np.array([1, 1, 1] + [0] * 7)
  c = value_model.fit_offset(logits, labels)
  np.testing.assert_allclose(_sigmoid(c), 0.3, atol=1e-9)
  with pytest.raises(ValueError, match="both"):
    value_model.fit_offset(logits, np.zeros(10))


# ---- verdicts -------------------------------------------------------------


@pytest.mark.parametrize("text,correct,status", [
    ('final 55 Reference: 55 same {"correct": true}', True, "ok"),
    ('differ {"correct": false}', False, "ok"),
    # Several objects: the last one is the verdict.
    ('it claims {"correct": true} but the final answer differs; '
     '{"correct": false}', False, "ok"),
    ('{"correct": false} on reflection {"correct": true}', True, "ok"),
    # Nested: the top-level object counts, its keys decide.
    ('{"verdict": {"correct": true}}', False, "malformed"),
    # LaTeX braces before the verdict are not objects.
    ('\\frac{1}{2} equals 0.5 {"correct": true}', True, "ok"),
    # Malformed: a broken object, a non-boolean, a missing key.
    ('{"correct": tru}', False, "malformed"),
    ('{"correct": "true"}', False, "malformed"),
    ('{"correct": 1}', False, "malformed"),
    ('{"score": 1}', False, "malformed"),
    # A broken final verdict does not fall back to an earlier object.
    ('{"correct": true} hmm, {"correct": fa', False, "malformed"),
    # Missing: no object at all.
    ("the answers agree", False, "missing"),
    ("", False, "missing"),
    ("{ not json", False, "missing"),
])
def test_parse_verdict(text, correct, status):
  v = parse_verdict(text)
  assert (v.correct, v.status) == (correct, status)


def test_seed_rationale_ends_in_its_label():
  for label in (True, False):
    text = seed_rationale("55", "55" if label else "12", label)
    assert parse_verdict(text).correct is label
  assert seed_rationale(None, "5", False).startswith("final none ")


# ---- the input template ---------------------------------------------------


def test_template_cuts_the_response_from_its_front():
  tok = template_lib.rm_tokenizer(pointer_chase.tokenizer(),
                                  template_lib.TEMPLATE_WORDS)
  t = template_lib.RMTemplate(max_input_len=12, min_response_tokens=2)
  x = template_lib.encode(t, tok, "37 c2 =", "05", "c1 81 ; c0 05 ; > 05")
  assert x.truncated
  assert len(x.ids) == 12
  # bos, the 4 template words, question and reference take 9 of 12.
  assert tok.decode(x.ids) == ("Question: 37 c2 = Reference: 05 Response: "
                               "; > 05 Judge:")
  assert x.ids[0] == tok.bos_id
  full = template_lib.encode(
      template_lib.RMTemplate(max_input_len=40), tok, "37 c2 =", "05",
      "c1 81 ; c0 05 ; > 05")
  assert not full.truncated and len(full.ids) == 17
  with pytest.raises(ValueError, match="pc-1.*leaving 0 for the response"):
    template_lib.encode(t, tok, "37 c2 = 37 c2 =", "05", "> 05", "pc-1")


def test_rm_tokenizer_keeps_the_task_ids():
  task = pointer_chase.tokenizer()
  tok = template_lib.rm_tokenizer(task, ("Judge:", "55", "final"))
  assert tok.words[:len(task.words)] == task.words
  assert tok.encode("37 c2 = > 55") == task.encode("37 c2 = > 55")
  assert tok.vocab_size == task.vocab_size + 2
  serving.check_tokenizer(tok, task, "rm")
  with pytest.raises(ValueError, match="does not extend"):
    serving.check_tokenizer(pointer_chase.tokenizer(),
                            template_lib.rm_tokenizer(task, ("x",)), "rm")


def test_labelled_rows_are_checked_and_hidden_rows_never_train(tmp_path):
  hand = labelled.load_jsonl(os.path.join(ROOT, "tests", "data",
                                          "rm_hand_labelled.jsonl"))
  assert len(hand) >= 30 and all(e.hidden and e.source == "hand"
                                 for e in hand)
  with pytest.raises(ValueError, match="hidden"):
    labelled.training_examples(hand[:2])
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"id": "a", "question": "q", "reference": "r",
                              "response": "x", "label": "yes"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'label'"):
    labelled.load_jsonl(str(path))


# ---- registry -------------------------------------------------------------


def _tiny_rm(kind: str, sharder: Sharder) -> store.RewardModel:
  tok = template_lib.rm_tokenizer(pointer_chase.tokenizer(),
                                  template_lib.TEMPLATE_WORDS)
  cfg = ModelConfig(vocab_size=128, d_model=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64)
  params = transformer.init_sharded(cfg, 0, sharder)
  if kind == "value":
    params = value_model.init_params(params, cfg)
  return store.RewardModel(kind=kind, model=cfg,
                           template=template_lib.RMTemplate(max_input_len=48),
                           tokenizer=tok, params=params, max_new_tokens=12)
@pytest.mark.slow  # compiles a transformer: > 3 s on 2 cores
def test_make_model_reward_returns_the_reward_model_rewards():
  sharder = Sharder(make_mesh(MeshConfig()))
  value, cot = _tiny_rm("value", sharder), _tiny_rm("cot", sharder)
  verifier = pointer_chase.PointerChaseReward()
  kw = dict(sharder=sharder, verifier=verifier)
  assert isinstance(make_model_reward("rm_value", model=value, **kw),
                    serving.ValueRMReward)
  assert isinstance(make_model_reward("rm_cot", model=cot, **kw),
                    serving.CotRMReward)
  both = make_model_reward("verifier_or_rm_cot", model=cot, **kw)
  assert isinstance(both, serving.VerifierFirst)
  assert isinstance(both.model, serving.CotRMReward)
  assert isinstance(make_model_reward("verifier_or_rm_value", model=value,
                                **kw).model, serving.ValueRMReward)
  with pytest.raises(ValueError, match="needs a cot reward model"):
    make_model_reward("rm_cot", model=value, **kw)
  with pytest.raises(ValueError, match="needs a reward model"):
    make_model_reward("rm_value", **kw)
  with pytest.raises(TypeError):
    make_model_reward("rm_value", model=value, temperature=2.0, **kw)
  # The verifier registry knows the names but builds no model.
  with pytest.raises(ValueError, match="make_model_reward"):
    make_reward("rm_value")


class _CountingModel:
  """A stand-in reward model: says correct, records what it was asked."""

  def __init__(self):
    self.asked: list[str] = []
    self.stats = serving._Stats("rm")

  def batch(self, records, responses):
    self.asked += list(responses)
    return [RewardResult(1.0, True) for _ in responses]

  def take_stats(self):
    return self.stats.take()


def test_verifier_first_asks_the_model_only_where_the_verifier_read_no_answer():
  model = _CountingModel()
  reward = serving.VerifierFirst(pointer_chase.PointerChaseReward(), model)
  record = {"id": "pc", "prompt": "37 c1 =", "answer": "55"}
  out = reward.batch([record] * 3, ["> 55", "> 12", "c0 55 ;"])
  assert [r.correct for r in out] == [True, False, True]
  assert model.asked == ["c0 55 ;"]  # no final answer: the model decides
  assert out[2].info["by"] == "model"
  stats = reward.take_stats()
  assert stats["rm_verifier_decided"] == 2 and stats["rm_model_decided"] == 1


def test_math_verdicts_that_did_not_parse_go_to_the_model():
  from kimi_jax.rewards.math_policy import UNPARSED
  assert serving.verifier_decided(RewardResult(0.0, False, info={
      "answer": "5"}))
  assert not serving.verifier_decided(RewardResult(0.0, False, info={
      "answer": "\\text{five}", "reason": UNPARSED}))
  assert not serving.verifier_decided(RewardResult(
      0.0, False, error="no answer found", info={"answer": None}))


# ---- slow: serving, frozen weights, export, the study -----------------------


@pytest.mark.slow
def test_cot_reward_counts_missing_verdicts_and_times_calls():
  """An untrained model writes no verdict: every response scores incorrect
  and is counted missing; the calls are counted and timed."""
  sharder = Sharder(make_mesh(MeshConfig()))
  reward = make_model_reward("rm_cot", model=_tiny_rm("cot", sharder),
                             sharder=sharder, max_slots=8,
                             verifier=pointer_chase.PointerChaseReward(),
                             audit=True)
  record = {"id": "pc", "prompt": "37 c1 =", "answer": "55"}
  out = reward.batch([record] * 3, ["> 55", "> 12", "c0 55 ; > 55"])
  assert [r.correct for r in out] == [False] * 3
  assert all(r.error in ("verdict missing", "verdict malformed")
             for r in out)
  stats = reward.take_stats()
  assert stats["rm_calls"] == 1 and stats["rm_items"] == 3
  assert stats["rm_missing"] + stats["rm_malformed"] == 3
  assert stats["rm_seconds"] > 0 and stats["rm_tokens"] >= 3
  # Audited against the exact verifier: it says 2 of 3 are right.
  np.testing.assert_allclose(stats["rm_verifier_accuracy"], 2 / 3)
  np.testing.assert_allclose(stats["rm_agreement"], 1 / 3)
  assert reward.take_stats() == {}


def _micro(**overrides):
  from kimi_jax.infra.config import load_config
  return load_config(os.path.join(ROOT, "experiments", "tiny.py:micro"),
                     overrides)


@pytest.mark.slow
def test_reward_model_weights_are_frozen_during_rl(tmp_path):
  """An RL iteration that trains the policy on a value reward model's
  verdicts leaves the reward model's params bit for bit unchanged."""
  from kimi_jax.job import run as job_lib
  from kimi_jax.job.experiment import parse_config
  cfg = parse_config(_micro(), jax.device_count())
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  policy = transformer.init_sharded(cfg.model, 0, sharder)
  rm_params = value_model.init_params(policy, cfg.model)
  # A head that splits responses both ways, so groups are informative.
  w = np.random.RandomState(0).normal(size=cfg.model.d_model) * 30
  rm_params["head"]["w_D"] = jax.device_put(
      w.astype(np.float32), rm_params["head"]["w_D"].sharding)
  tok = template_lib.rm_tokenizer(pointer_chase.tokenizer(),
                                  template_lib.TEMPLATE_WORDS)
  store.save(str(tmp_path / "rm"), store.RewardModel(
      kind="value", model=cfg.model,
      template=template_lib.RMTemplate(max_input_len=48), tokenizer=tok,
      params=rm_params))
  config = _micro(**{"task.reward": "rm_value",
                     "reward_model.path": str(tmp_path / "rm"),
                     "reward_model.audit": True})
  job = job_lib.build(parse_config(config, jax.device_count()),
                      str(tmp_path / "run"))
  reward = job.task.reward
  assert isinstance(reward, serving.ValueRMReward)
  assert job.evaluator.task.reward.__class__ is \
      pointer_chase.PointerChaseReward  # held-out: the exact verifier
  before = jax.device_get(reward.scorer.params)
  loop = job.rl_loop()
  state = job.initial_loop_state()
  train = job.learner.init_state(job_lib.initial_params(job))
  start = jax.device_get(train.params)
  trained = False
  for _ in range(3):
    state, train, row = loop.iteration(state, train)
    trained = trained or "loss" in row
    if trained:
      break
  assert trained, "no informative group in 3 iterations"
  assert row["rm_calls"] >= 1 and row["rm_items"] > 0 and "rm_seconds" in row
  assert "rm_agreement" in row
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), start,
                       jax.device_get(train.params))
  assert max(jax.tree.leaves(moved)) > 0  # the policy did train
  after = jax.device_get(reward.scorer.params)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.host_inputs
def test_value_model_export_loads_in_transformers(tmp_path):
  """The exported value model, loaded by transformers as a sequence
  classifier, gives our logit for the last token."""
  torch = pytest.importorskip("torch")
  import transformers
  sharder = Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))
  cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=8, mlp_dim=32, qkv_bias=True,
                    tie_embeddings=True, max_seq_len=64, rope_theta=10000.0)
  host = _host_params(cfg, 3)
  params = jax.device_put(host, jax.devices()[0])
  rm = store.RewardModel(kind="value", model=cfg,
                         template=template_lib.RMTemplate(), tokenizer=None,
                         params=params, logit_offset=0.25)
  store.export_value_hf(rm, str(tmp_path / "hf"))
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path / "hf")).eval()
  ids = np.asarray([[5, 9, 11, 3, 17, 2]], np.int32)
  with torch.no_grad():
    theirs = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  ours = value_model.score_logits(
      params, ids, np.arange(6, dtype=np.int32)[None], np.ones_like(ids),
      cfg=cfg)
  np.testing.assert_allclose(theirs[0, 0], np.asarray(ours)[0, -1],
                             rtol=1e-4, atol=1e-5)
  meta = json.load(open(tmp_path / "hf" / "config.json"))
  assert meta["architectures"] == ["Qwen2ForSequenceClassification"]
  assert meta["kimi_jax_reward_model"]["logit_offset"] == 0.25
  del sharder


@pytest.mark.slow
def test_rm_tiny_micro_study_end_to_end(tmp_path, monkeypatch, capsys):
  """experiments/rm_tiny.py:micro: warm start, both reward models trained
  and measured, one RL iteration per arm, the comparison written."""
  from kimi_jax.infra.config import load_config
  from kimi_jax.reward_models import study
  config = load_config(os.path.join(ROOT, "experiments",
                                    "rm_tiny.py:micro"))
  summary = study.run_study(config, str(tmp_path))
  rm_eval = json.load(open(tmp_path / "rm" / "rm_eval.json"))
  for kind in ("value", "cot"):
    for key in ("accuracy", "precision", "recall", "n"):
      assert key in rm_eval[kind]
    assert rm_eval[kind]["n"] == rm_eval["data"]["eval"] > 0
    assert (tmp_path / "rm" / kind / "rm.json").exists()
  assert {"malformed", "missing"} <= set(rm_eval["cot"])
  assert set(summary["arms"]) == {"pointer_chase", "rm_cot", "rm_value"}
  assert "rm_cot_within_tolerance" in summary
  for arm in ("rm_cot", "rm_value"):
    rows = [json.loads(l) for l in open(tmp_path / f"rl_{arm}" /
                                         "metrics.jsonl")]
    rl = [r for r in rows if r["stage"] == "rl"]
    assert rl and all(r["rm_calls"] >= 1 and "rm_seconds" in r for r in rl)
    assert summary["arms"][arm]["warm_pass_at_1"] == \
        summary["arms"]["pointer_chase"]["warm_pass_at_1"]
  assert json.load(open(tmp_path / "rm_study.json"))["arms"]
  assert not rm_eval["value"]["reused"] and not rm_eval["cot"]["reused"]

  # A rerun of train_rm reads both finished models back and judges alike;
  # a changed rm_value section trains the value model again, not the CoT.
  from kimi_jax.job.run import rl_step
  from kimi_jax.job.experiment import parse_config
  from kimi_jax.reward_models import train as train_lib
  step = rl_step(parse_config(study.job_config(config)), 0)
  rerun = lambda cfg: train_lib.train_reward_models(
      cfg, str(tmp_path / "rm"), policy_workdir=str(tmp_path / "warm"),
      policy_step=step)
  again = rerun(config)
  for kind in ("value", "cot"):
    assert again[kind]["reused"]
    for key in ("accuracy", "precision", "recall", "n"):
      assert again[kind][key] == rm_eval[kind][key]
  changed = config.copy_and_resolve_references()
  changed.rm_value.steps += 1
  third = rerun(changed)
  assert not third["value"]["reused"] and third["cot"]["reused"]
  assert third["value"]["train"]["steps"] == config.rm_value.steps + 1

  # A crash in the CoT model's final SFT: the rerun reads rejection
  # sampling back and continues the SFT from its last checkpoint.
  changed.rm_cot.steps += 2
  changed.rm_cot.checkpoint_every = 4
  from tests.kill import kill_at_placement
  with monkeypatch.context() as m:
    # The final SFT's 7th step.
    kill_at_placement(m, changed.rm_cot.seed_steps + 7)
    with pytest.raises(KeyboardInterrupt):
      rerun(changed)
  capsys.readouterr()
  fourth = rerun(changed)
  out = capsys.readouterr().out
  assert "CoT RM rejection sampling: read back" in out
  assert "CoT RM SFT: resumed at step 4" in out
  assert fourth["value"]["reused"] and not fourth["cot"]["reused"]
  assert fourth["cot"]["train"]["sft"]["final_loss"] is not None
  assert not (tmp_path / "rm" / "cot.progress").exists()


@pytest.mark.slow  # samples a policy in chunks
def test_labelling_in_journaled_chunks_equals_one_call(tmp_path):
  """sample_and_label on the real sampler: chunks of 3 records give the
  one-call examples, and a rerun with the journal samples nothing."""
  from kimi_jax.data.journal import Journal, ModelCalls
  from tests.tiny_sampler import CountingSampler, tiny_micro_sampler
  cfg, sampler, params = tiny_micro_sampler(5)
  train, _ = pointer_chase.make_problems(cfg.task, cfg.seed)
  records = train[:8]
  tok = pointer_chase.tokenizer()
  counting = CountingSampler(sampler)
  calls = counting.calls

  def label(calls_cfg=ModelCalls()):
    return labelled.sample_and_label(
        sampler=counting, sampler_params=params, records=records,
        encode_prompt=lambda r: [tok.bos_id] + tok.encode(r["prompt"]),
        tokenizer=tok, verifier=make_reward("pointer_chase"), samples=3,
        max_response_len=cfg.rl.max_response_len,
        settings=cfg.sampler.sampling, seed=7, calls=calls_cfg)

  whole = label()
  assert calls == [24]
  path = str(tmp_path / "journal.jsonl")
  chunked = label(ModelCalls(3, Journal(path, context="p")))
  assert calls[1:] == [9, 9, 6]
  assert chunked == whole
  verifier = make_reward("pointer_chase")
  by_id = {r["id"]: r for r in records}
  assert [e.id for e in whole] == [f"{r['id']}/{j}" for r in records
                                   for j in range(3)]
  assert [e.label for e in whole] == [
      verifier(by_id[e.record_id], e.response).correct for e in whole]
  journal = Journal(path, context="p")
  assert label(ModelCalls(3, journal)) == whole
  assert calls[4:] == [] and journal.reused == 3
  # Another policy (context) samples again.
  label(ModelCalls(3, Journal(path, context="other")))
  assert calls[4:] == [9, 9, 6]
