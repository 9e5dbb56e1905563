"""Long2short: merging, shortest rejection sampling, DPO pairs and loss, the
long2short RL config, the report's targets, and the pipeline end to end."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config
from kimi_jax.long2short import config as l2s_config
from kimi_jax.long2short import dpo, merge, pipeline, report, shortest
from kimi_jax.long2short.samples import Samples
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import length_reward, replay_buffer
from kimi_jax.rl.evaluation import EvalSamples
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh, place_batch

EXPERIMENT = "experiments/long2short_tiny.py"
MODEL = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=32,
                    tie_embeddings=True)


def _sharder():
  from experiments import tiny
  from kimi_jax.sharding import rules_from_config
  return Sharder(make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)),
                 rules_from_config(tiny.sharding_config().rules))


# ---- merging ------------------------------------------------------------------


def test_merge_is_exact_weight_averaging_and_alpha_gives_the_endpoints():
  sharder = _sharder()
  a = transformer.init_sharded(MODEL, 1, sharder)
  b = transformer.init_sharded(MODEL, 2, sharder)
  host_a, host_b = jax.device_get(a), jax.device_get(b)
  for alpha in (0.0, 1.0, 0.5, 0.25):
    merged = jax.device_get(merge.interpolate(a, b, alpha))
    for x, y, m in zip(jax.tree.leaves(host_a), jax.tree.leaves(host_b),
                       jax.tree.leaves(merged)):
      want = (np.float32(alpha) * x.astype(np.float32) +
              np.float32(1 - alpha) * y.astype(np.float32))
      np.testing.assert_array_equal(m, want)
      if alpha == 1.0:
        np.testing.assert_array_equal(m, x)
      if alpha == 0.0:
        np.testing.assert_array_equal(m, y)
      if alpha == 0.5:  # the report's simple average
        np.testing.assert_array_equal(m, (x + y) / np.float32(2))
  # The merged params keep the long model's shardings.
  assert jax.tree.map(lambda x: x.sharding, merge.interpolate(a, b, 0.5)) \
      == jax.tree.map(lambda x: x.sharding, a)


def test_merge_rejects_mismatched_models_and_bad_alpha():
  sharder = _sharder()
  a = transformer.init_sharded(MODEL, 1, sharder)
  wider = ModelConfig(**{**MODEL.__dict__, "mlp_dim": 64})
  b = transformer.init_sharded(wider, 1, sharder)
  with pytest.raises(merge.MergeError, match="shape"):
    merge.interpolate(a, b, 0.5)
  with pytest.raises(merge.MergeError, match="alpha"):
    merge.interpolate(a, a, 1.5)


# ---- shortest rejection sampling ----------------------------------------------


def _samples(lengths, correct):
  P, N = np.shape(lengths)
  return Samples(
      records=[{"prompt": f"p{p}"} for p in range(P)],
      prompts=[[1, 10 + p] for p in range(P)],
      tokens=[[[5] * (int(n) - 1) + [2] for n in row] for row in lengths],
      lengths_PxN=np.asarray(lengths, np.int32),
      correct_PxN=np.asarray(correct, bool))


def test_shortest_rejection_picks_the_shortest_correct_and_skips_none():
  lengths = [[20, 12, 9, 12],   # 9 is incorrect: 12 (first of two) wins
             [30, 25, 40, 18],  # nothing correct: skipped
             [7, 7, 7, 7]]
  correct = [[True, True, False, True],
             [False, False, False, False],
             [False, True, True, False]]
  assert shortest.shortest_correct(np.array(lengths[0]),
                                   np.array(correct[0])) == 1
  assert shortest.shortest_correct(np.array(lengths[1]),
                                   np.array(correct[1])) is None
  assert shortest.select(_samples(lengths, correct)) == [(0, 1), (2, 1)]


# ---- DPO ------------------------------------------------------------------------


def test_dpo_pairs_follow_the_one_and_a_half_rule():
  lengths = np.array([14, 10, 16, 15, 20, 9, 30])
  correct = np.array([True, True, False, True, True, False, True])
  # Shortest correct: index 1 (10 tokens). Negatives: the incorrect 2 and
  # 5 (even the shorter 5), and correct ones longer than 15: 4 and 6. The
  # correct 0 (14) and 3 (exactly 15) are not negatives.
  assert dpo.preference_pairs(lengths, correct, long_ratio=1.5) == [
      (1, 2), (1, 4), (1, 5), (1, 6)]
  assert dpo.preference_pairs(lengths, np.zeros(7, bool)) == []
  # All correct and within 1.5x: no pair.
  assert dpo.preference_pairs(np.array([10, 12, 15]), np.ones(3, bool)) == []
  pairs = dpo.all_pairs(_samples([[10, 16, 12]], [[True, True, False]]),
                        long_ratio=1.5)
  assert [(len(p.chosen), len(p.rejected)) for p in pairs] == [(10, 16),
                                                               (10, 12)]


@pytest.mark.host_inputs
def test_dpo_loss_and_gradient_match_the_formula():
  beta = 0.3
  logp = np.array([[-3.0, -5.0], [-2.0, -1.0], [-4.0, -4.5]], np.float32)
  ref = np.array([[-3.5, -4.0], [-2.5, -2.0], [9.0, 9.0]], np.float32)
  valid = np.array([1.0, 1.0, 0.0], np.float32)  # the last is padding
  # By hand: z = beta * ((lc - rc) - (lr - rr)).
  z = beta * np.array([(-3.0 + 3.5) - (-5.0 + 4.0),
                       (-2.0 + 2.5) - (-1.0 + 2.0)])
  want = np.mean(np.log1p(np.exp(-z)))
  loss, metrics = dpo.dpo_loss(jnp.asarray(logp), jnp.asarray(ref),
                               jnp.asarray(valid), beta=beta)
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  assert float(metrics["accuracy"]) == 0.5  # z = +0.45, -0.15
  grad = jax.grad(lambda x: dpo.dpo_loss(x, jnp.asarray(ref),
                                         jnp.asarray(valid), beta=beta)[0])(
                                             jnp.asarray(logp))
  sig = 1.0 / (1.0 + np.exp(z))  # sigmoid(-z)
  want_grad = np.zeros_like(logp)
  want_grad[:2, 0] = -beta * sig / 2
  want_grad[:2, 1] = beta * sig / 2
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5,
                             atol=1e-7)


@pytest.mark.host_inputs
def test_dpo_nll_term_adds_the_chosen_per_token_nll_by_hand():
  beta, w = 0.3, 0.5
  logp = np.array([[-3.0, -5.0], [-2.0, -1.0], [-4.0, -4.5]], np.float32)
  ref = np.array([[-3.5, -4.0], [-2.5, -2.0], [9.0, 9.0]], np.float32)
  lens = np.array([[6.0, 9.0], [4.0, 12.0], [0.0, 0.0]], np.float32)
  valid = np.array([1.0, 1.0, 0.0], np.float32)
  args = [jnp.asarray(x) for x in (logp, ref, valid)]
  plain, _ = dpo.dpo_loss(*args, beta=beta)
  loss, metrics = dpo.dpo_loss(*args, beta=beta, nll_weight=w,
                               len_Px2=jnp.asarray(lens))
  nll = np.mean([3.0 / 6.0, 2.0 / 4.0])
  np.testing.assert_allclose(float(metrics["chosen_nll"]), nll, rtol=1e-6)
  np.testing.assert_allclose(float(loss), float(plain) + w * nll, rtol=1e-6)
  # Its gradient: -w / (len x pairs) on each real chosen log-prob.
  g = lambda **kw: np.asarray(jax.grad(lambda x: dpo.dpo_loss(
      x, args[1], args[2], beta=beta, **kw)[0])(args[0]))
  extra = g(nll_weight=w, len_Px2=jnp.asarray(lens)) - g()
  want = np.zeros_like(logp)
  want[:2, 0] = -w / (lens[:2, 0] * 2)
  np.testing.assert_allclose(extra, want, atol=1e-7)
  with pytest.raises(ValueError, match="len_Px2"):
    dpo.dpo_loss(*args, beta=beta, nll_weight=w)


def _pairs():
  rng = np.random.default_rng(0)
  out = []
  for i in range(5):
    prompt = tuple(int(t) for t in rng.integers(3, 30, 3))
    out.append(dpo.Pair(prompt,
                        tuple(int(t) for t in rng.integers(3, 30, 2 + i)),
                        tuple(int(t) for t in rng.integers(3, 30, 6 - i))))
  return out


def test_packed_pairs_give_each_sequences_own_log_prob():
  sharder = _sharder()
  params = transformer.init_sharded(MODEL, 0, sharder)
  pairs = _pairs()
  batch, placed = dpo.pack_pairs(pairs, n_pairs=8, n_rows=8, row_len=16,
                                 pad_id=0)
  assert placed == 5 and batch.valid_P.tolist() == [1.0] * 5 + [0.0] * 3
  fn = jax.jit(functools.partial(dpo.pair_logp, cfg=MODEL, sharder=sharder))
  got = np.asarray(fn(params, place_batch(sharder, batch)))
  # Reference: each sequence alone, unpacked, log-probs of its response.
  for p, pair in enumerate(pairs):
    for side, resp in enumerate((pair.chosen, pair.rejected)):
      seq = np.array([list(pair.prompt) + list(resp)], np.int32)
      T = seq.shape[1] - 1
      args = [jax.device_put(x, sharder.replicated()) for x in (
          seq[:, :-1], np.arange(T, dtype=np.int32)[None],
          np.ones((1, T), np.int32))]
      logits, _ = jax.jit(functools.partial(transformer.forward, cfg=MODEL))(
          params, *args)
      z = np.asarray(jax.device_get(logits), np.float64)
      z = z - z.max(-1, keepdims=True)
      logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
      targets = seq[0, 1:]
      want = sum(float(logp[0, t, targets[t]])
                 for t in range(len(pair.prompt) - 1, T))
      np.testing.assert_allclose(got[p, side], want, rtol=2e-5, atol=2e-5)
  assert np.all(got[5:] == 0.0)


def test_pairs_are_packed_first_fit_and_never_split():
  pairs = _pairs()
  batches = dpo.make_batches(pairs, n_pairs=2, n_rows=2, row_len=16, pad_id=0)
  assert sum(int(b.valid_P.sum()) for b in batches) == len(pairs)
  i = 0
  for b in batches:
    for p in range(b.n_pairs):
      has = [(b.seq_RxT == 2 * p + s).any() for s in (0, 1)]
      assert has == [bool(b.valid_P[p])] * 2
      if b.valid_P[p]:
        # Response lengths: the pair's own, and the loss mask's count.
        want = [len(pairs[i].chosen), len(pairs[i].rejected)]
        assert b.len_Px2[p].tolist() == want
        assert [b.rows.mask_RxT[b.seq_RxT == 2 * p + s].sum()
                for s in (0, 1)] == want
        i += 1
      else:
        assert b.len_Px2[p].tolist() == [0, 0]
  with pytest.raises(ValueError, match="does not fit a row"):
    dpo.pack_pairs(pairs, n_pairs=2, n_rows=2, row_len=6, pad_id=0)


@pytest.mark.slow
def test_dpo_train_step_lowers_the_loss_on_its_pairs():
  from kimi_jax import train_step as ts
  from kimi_jax.sharding import batch_shardings
  sharder = _sharder()
  ref = transformer.init_sharded(MODEL, 0, sharder)
  batch, _ = dpo.pack_pairs(_pairs(), n_pairs=8, n_rows=8, row_len=16,
                            pad_id=0)
  ref_fn = jax.jit(functools.partial(dpo.pair_logp, cfg=MODEL,
                                     sharder=sharder),
                   out_shardings=sharder.replicated())
  batch = batch.replace(ref_logp_Px2=np.asarray(jax.device_get(
      ref_fn(ref, place_batch(sharder, batch)))))
  optimizer = ts.make_optimizer(ts.OptimizerConfig(learning_rate=1e-2))
  shardings = ts.state_shardings(optimizer, MODEL, sharder)
  step, _ = ts.jit_train_step(
      functools.partial(dpo.batch_loss, cfg=MODEL, sharder=sharder, beta=0.5),
      optimizer, shardings, batch_shardings(sharder, batch))
  state = ts.create_state(transformer.init_sharded(MODEL, 0, sharder),
                          optimizer, shardings)
  placed = place_batch(sharder, batch)
  losses = []
  for _ in range(10):
    state, m = step(state, placed)
    losses.append(float(m["loss"]))
  # At the reference the loss is log 2; DPO then pulls the margin up.
  np.testing.assert_allclose(losses[0], np.log(2.0), rtol=1e-5)
  assert losses[-1] < losses[0] - 0.1


# ---- long2short RL config -------------------------------------------------------


def test_l2s_rl_config_raises_the_penalty_and_cuts_the_rollout_cap():
  config = load_config(EXPERIMENT + ":micro")
  l2s = l2s_config.l2s_config(config)
  long_cfg = parse_config(pipeline.job_sections(config), 8)
  cfg = parse_config(pipeline.l2s_rl_config(pipeline.job_sections(config),
                                            l2s), 8)
  assert cfg.sft.steps == 0
  assert cfg.rl.length_reward_weight == l2s.l2s_rl.length_reward_weight
  assert cfg.rl.length_reward_weight > long_cfg.rl.length_reward_weight
  assert cfg.rl.max_response_len == l2s.l2s_rl.max_response_len
  assert cfg.rl.max_response_len < long_cfg.rl.max_response_len
  # The RL loop built from it rolls out under the cut cap and scores with
  # the raised weight from its first iteration.
  job = job_lib.build(cfg, "/tmp/unused_l2s_rl_test")
  loop = job.rl_loop()
  assert loop.max_response_len(0, 0) == l2s.l2s_rl.max_response_len
  K = cfg.rl.samples_per_prompt
  buffer = replay_buffer.RolloutBuffer(group_size=K, max_wait_iterations=0)
  gid = buffer.new_group(0)
  right = job.task.train[0]
  tok = job.task.tokenizer
  answer = tok.encode(f"> {right['answer']}") + [tok.eos_id]
  long_answer = tok.encode(f"c0 {right['answer']} ; > {right['answer']}") + [
      tok.eos_id]
  group = [answer] + [long_answer] * (K - 1)
  for j, tokens in enumerate(group):
    buffer.add_segment(gid, j, tokens, [0.0] * len(tokens), version=0,
                       finish_reason="stop")
  scores, stats = loop.score(0, buffer.complete_groups())
  lengths = np.array([[len(t) for t in group]])
  want = 1.0 + cfg.rl.length_reward_weight * np.asarray(
      length_reward.length_reward(lengths, np.ones((1, K), bool)))
  # By hand: +0.5 for the shortest correct, -0.5 for the longest.
  np.testing.assert_allclose(want, [[1.0 + 0.5 * cfg.rl.length_reward_weight]
                                    + [1.0 - 0.5 *
                                       cfg.rl.length_reward_weight] * (K - 1)])
  np.testing.assert_allclose(scores.reward_PxK, want)
  assert stats["length_reward_weight"] == l2s.l2s_rl.length_reward_weight


def _warmstart_of(config) -> list[tuple[str, str]]:
  from kimi_jax.data import tasks
  cfg = parse_config(config, 8)
  return tasks.make_task(cfg.task, cfg.seed).warmstart(cfg.seed)


@pytest.mark.parametrize("short_style", ["direct", "plain"])
def test_stage_configs_give_each_model_its_warm_start(short_style):
  from kimi_jax.data import pointer_chase as pc
  config = load_config(EXPERIMENT, {"l2s.short_cot_style": short_style})
  l2s = l2s_config.l2s_config(config)
  job_config = pipeline.job_sections(config)
  train = {r["prompt"]: r for r in pc.make_problems(
      parse_config(job_config, 8).task, 0)[0]}
  perm = pc.permutation(0)
  plain = {p: pc.cot_solution(r, perm) for p, r in train.items()}
  # The base (common ancestor) learns from plain chains only.
  base = _warmstart_of(pipeline.base_config(job_config, l2s))
  assert all(text == plain[p] for p, text in base)
  # The short-only model: the answer alone, or the plain chain.
  short = _warmstart_of(pipeline.short_config(job_config, l2s))
  want = ((lambda p: f"> {train[p]['answer']}") if short_style == "direct"
          else plain.get)
  assert all(text == want(p) for p, text in short)
  # The long model: the plain chain, and a verification pass on most.
  long = _warmstart_of(job_config)
  checked = [text != plain[p] for p, text in long]
  assert all(text.startswith(plain[p][:-5]) for p, text in long)
  assert 0.6 < np.mean(checked) < 0.9
  assert all(" check " in text for (_, text), c in zip(long, checked) if c)


@pytest.mark.parametrize("override, needle", [
    ({"l2s_rl.max_response_len": 64}, "config.l2s_rl.max_response_len"),
    ({"l2s_rl.length_reward_weight": 0.0},
     "config.l2s_rl.length_reward_weight"),
    ({"l2s.short_cot_style": "detours"}, "config.l2s.short_cot_style"),
    ({"merge.alpha": 2.0}, "config.merge.alpha"),
    ({"dpo.long_ratio": 0.5}, "config.dpo.long_ratio"),
    ({"l2s.samples_per_prompt": 0}, "config.l2s.samples_per_prompt"),
])
def test_bad_long2short_config_names_the_key(override, needle):
  config = load_config(EXPERIMENT, override)
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
    l2s = l2s_config.l2s_config(config)
    l2s_config.check_long2short(l2s, parse_config(
        pipeline.job_sections(config)))


# ---- evaluation and targets -------------------------------------------------------


def test_eval_summary_and_method_record_by_hand():
  # 2 problems x (3 draws + greedy).
  s = EvalSamples(problem_N=np.array([0, 0, 0, 0, 1, 1, 1, 1]),
                  draw_N=np.array([0, 1, 2, -1, 0, 1, 2, -1]),
                  length_N=np.array([10, 20, 30, 12, 5, 6, 100, 5]),
                  correct_N=np.array([1, 1, 0, 1, 0, 0, 0, 1], bool),
                  task_N=np.array(["a"] * 4 + ["b"] * 4, dtype=object),
                  n_problems=2)
  r = s.summary()
  assert r.pass_at_1 == pytest.approx(2 / 6)
  assert r.pass_at_1_by_task == {"a": pytest.approx(2 / 3), "b": 0.0}
  assert r.greedy_accuracy == 1.0
  assert r.mean_length == pytest.approx(171 / 6)
  assert r.p90_length == pytest.approx(np.percentile([10, 20, 30, 5, 6, 100],
                                                     90))
  rec = report.method_record(s, [{"difficulty": 1.0}, {"difficulty": 3.0}])
  assert rec["shortest_correct_tokens"] == 10 and rec["problems_solved"] == 1
  assert rec["by_difficulty"]["1"] == {"pass_at_1": pytest.approx(2 / 3),
                                       "mean_tokens": 20.0}
  assert rec["by_difficulty"]["3"]["pass_at_1"] == 0.0


def test_targets_pick_the_best_method_and_check_point_six():
  def rec(p, t):
    return {"pass_at_1": p, "mean_tokens": t}
  methods = {"long": rec(0.95, 30.0), "short_baseline": rec(0.90, 16.0),
             "merge": rec(0.50, 20.0), "shortest_rs": rec(0.94, 25.0),
             "dpo": rec(0.935, 17.0), "l2s_rl": rec(0.945, 18.0)}
  t = report.targets(methods, shortest_solution_tokens=16.0)
  assert t["long_over_shortest_solution"] == pytest.approx(30 / 16)
  assert t["methods_meeting"] == ["dpo", "l2s_rl"]
  assert t["best_method"] == "l2s_rl" and t["met"]
  assert t["best_token_ratio"] == pytest.approx(0.6)
  methods["l2s_rl"] = rec(0.89, 18.0)  # below the short baseline now
  t = report.targets(methods, shortest_solution_tokens=16.0)
  assert t["methods_meeting"] == ["dpo"]
  methods["dpo"] = rec(0.92, 17.0)  # more than 0.02 below the long model
  t = report.targets(methods, shortest_solution_tokens=16.0)
  assert not t["met"] and t["methods_meeting"] == []


def test_labels_of_close_methods_do_not_overlap():
  points = {"a": (17.0, 0.99), "b": (17.4, 0.96), "c": (19.5, 0.99),
            "far": (3.0, 0.40)}
  offsets = report.label_offsets(points, (0.0, 35.0), (0.0, 1.05))
  assert offsets["far"] == (6.0, 4.0)  # alone: beside the point
  # The three close ones: each label somewhere else.
  boxes = {(points[k][0] / 35 + (0.0 if o[0] > 0 else -0.22),
            points[k][1] / 1.05 + o[1] / 250) for k, o in offsets.items()
           if k != "far"}
  assert len(boxes) == 3
  ordered = sorted(boxes)
  for (x0, y0), (x1, y1) in zip(ordered, ordered[1:]):
    assert abs(x1 - x0) > 0.05 or abs(y1 - y0) > 0.04


def test_two_hf_directories_merge_into_a_hf_directory(tmp_path):
  from kimi_jax.model import hf
  sharder = _sharder()
  a = transformer.init_sharded(MODEL, 1, sharder)
  b = transformer.init_sharded(MODEL, 2, sharder)
  for name, params in (("long", a), ("short", b)):
    hf.export_hf_directory(params, MODEL, str(tmp_path / name))
  kind = merge.merge_sources(str(tmp_path / "long"), str(tmp_path / "short"),
                             str(tmp_path / "merged"), alpha=0.25)
  assert kind == "hf"
  cfg, merged = hf.load_hf_checkpoint(str(tmp_path / "merged"))
  assert cfg == hf.load_hf_checkpoint(str(tmp_path / "long"))[0]
  for x, y, m in zip(jax.tree.leaves(jax.device_get(a)),
                     jax.tree.leaves(jax.device_get(b)),
                     jax.tree.leaves(jax.device_get(merged))):
    np.testing.assert_array_equal(m, np.float32(0.25) * x +
                                  np.float32(0.75) * y)
  with pytest.raises(merge.MergeError, match="no config.json"):
    merge.merge_sources(str(tmp_path), str(tmp_path / "short"),
                        str(tmp_path / "x"), alpha=0.5)


# ---- end to end -----------------------------------------------------------------


def _micro_context(tmp_path, dpo_checkpoint_every: int = 100):
  config = load_config(EXPERIMENT + ":micro")
  config.dpo.checkpoint_every = dpo_checkpoint_every
  job_config = pipeline.job_sections(config)
  cfg = parse_config(job_config, jax.device_count())
  return pipeline.Context(job_config, cfg, l2s_config.l2s_config(config),
                          str(tmp_path))


def _random_long_model(ctx) -> str:
  long = os.path.join(ctx.workdir, "long")
  pipeline.policies.write_policy(
      long, ctx.config, transformer.init_sharded(ctx.cfg.model, 0,
                                                 ctx.tools.sharder))
  return long


@pytest.mark.slow
def test_shortest_rs_and_dpo_stages_train_on_hand_made_samples(
    tmp_path, monkeypatch, capsys):
  """The two sampling-based stages on a group with known lengths: a random
  policy stands in for the long model (the micro pipeline's long model
  solves nothing, so there the stages keep it untrained). DPO killed in
  its second step and rerun ends at the uninterrupted parameters."""
  from tests.kill import kill_at_placement
  from kimi_jax.data import pointer_chase as pc
  ctx = _micro_context(tmp_path / "a")
  long = _random_long_model(ctx)
  task, tok = ctx.tools.task, ctx.tools.task.tokenizer
  perm = pc.permutation(ctx.cfg.seed)
  records = list(task.train[:4])
  tokens = []
  for r in records:  # 0, 1, 2 verification passes, then a wrong answer
    row = [pc.cot_solution(r, perm, rechecks=k) for k in range(3)]
    row.append("> " + pc.state((int(r["answer"]) + 1) % 100))
    tokens.append([tok.encode(t) + [tok.eos_id] for t in row])
  drawn = Samples(records, [task.encode_prompt(r) for r in records], tokens,
                  np.array([[len(t) for t in row] for row in tokens]),
                  np.array([[True, True, True, False]] * 4))
  rs = pipeline.stage_shortest_rs(ctx, long, drawn)
  assert pipeline.policies.stage_done(rs)["examples"] == 4
  done = pipeline.stage_dpo(ctx, long, drawn)
  # Per prompt: the wrong answer, plus each checked chain more than 1.5x
  # the plain one (a pass adds 3n + 4 tokens to a chain of 3n + 3).
  want = sum(1 + sum(len(t) > 1.5 * len(row[0]) for t in row[1:3])
             for row in tokens)
  assert pipeline.policies.stage_done(done)["pairs"] == want
  trained = ctx.params(done)
  start = ctx.params(long)
  assert any(not np.array_equal(x, y) for x, y in zip(
      jax.tree.leaves(jax.device_get(trained)),
      jax.tree.leaves(jax.device_get(start))))

  assert ctx.l2s.dpo.steps >= 2
  killed = _micro_context(tmp_path / "b", dpo_checkpoint_every=1)
  long_b = _random_long_model(killed)
  with monkeypatch.context() as m:
    kill_at_placement(m, 2)  # in DPO's second step
    with pytest.raises(KeyboardInterrupt):
      pipeline.stage_dpo(killed, long_b, drawn)
  assert pipeline.policies.stage_done(killed.path("dpo")) is None
  capsys.readouterr()
  resumed = killed.params(pipeline.stage_dpo(killed, long_b, drawn))
  assert "DPO: resumed at step 1" in capsys.readouterr().out
  # The killed run's row of step 1 is kept, step 2 is the resumed run's.
  rows = [json.loads(line) for line in open(os.path.join(
      killed.path("dpo"), "metrics.jsonl"))]
  assert [r["step"] for r in rows if r["stage"] == "dpo"] == [1, 2]
  assert not os.path.exists(killed.path("dpo") + ".progress")
  for x, y in zip(jax.tree.leaves(jax.device_get(resumed)),
                  jax.tree.leaves(jax.device_get(trained))):
    np.testing.assert_array_equal(x, y)


@pytest.fixture
def compile_cache(tmp_path):
  """The launcher's compilation cache, for one test; the process's settings
  come back afterwards."""
  from jax.experimental.compilation_cache import compilation_cache
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  pipeline.use_compile_cache(str(tmp_path / "compile_cache"))
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  compilation_cache.reset_cache()


@pytest.mark.slow
def test_micro_pipeline_writes_every_method_and_the_figure(tmp_path,
                                                           compile_cache):
  from kimi_jax.job.export import export_workdir
  config = load_config(EXPERIMENT + ":micro")
  workdir = str(tmp_path / "l2s")
  result = pipeline.run(config, workdir)
  with open(os.path.join(workdir, "long2short.json")) as f:
    saved = json.load(f)
  assert set(saved["methods"]) == set(l2s_config.METHODS)
  for name in l2s_config.METHODS:
    m = saved["methods"][name]
    assert 0.0 <= m["pass_at_1"] <= 1.0 and m["mean_tokens"] > 0
  assert saved["targets"] == result["targets"]
  assert os.path.getsize(os.path.join(workdir, "token_efficiency.png")) > 0
  # Every method's directory is a run: export_hf accepts it.
  out = export_workdir(os.path.join(workdir, "merge"), str(tmp_path / "hf"))
  assert os.path.isfile(os.path.join(out.out, "config.json"))
  # A second run skips the finished stages and gives the same comparison.
  again = pipeline.run(config, workdir)
  assert again["methods"] == result["methods"]


@pytest.mark.slow  # samples a policy in chunks
def test_samples_in_journaled_chunks_equal_one_call(tmp_path):
  """long2short's samples on the real sampler: chunks of 3 prompts give
  the one-call tokens and verdicts, and a rerun with the journal samples
  nothing."""
  from kimi_jax.data import pointer_chase
  from kimi_jax.data.journal import Journal, ModelCalls
  from kimi_jax.data.tasks import Task
  from kimi_jax.long2short import samples
  from kimi_jax.rewards.registry import make_reward
  from tests.tiny_sampler import CountingSampler, tiny_micro_sampler
  cfg, sampler, params = tiny_micro_sampler(4)
  train, _ = pointer_chase.make_problems(cfg.task, cfg.seed)
  tok = pointer_chase.tokenizer()
  task = Task("pc", train=train[:7], eval=train[:1],
              reward=make_reward("pointer_chase"), tokenizer=tok,
              encode_prompt=lambda r: [tok.bos_id] + tok.encode(r["prompt"]))
  counting = CountingSampler(sampler)
  calls = counting.calls

  def draw(calls_cfg=ModelCalls()):
    return samples.sample(counting, params, task, task.train, n=2,
                          max_response_len=cfg.rl.max_response_len,
                          settings=cfg.sampler.sampling, seed=9,
                          calls=calls_cfg)

  whole = draw()
  path = str(tmp_path / "journal.jsonl")
  chunked = draw(ModelCalls(3, Journal(path)))
  assert calls == [14, 6, 6, 2]
  assert chunked.tokens == whole.tokens
  np.testing.assert_array_equal(chunked.correct_PxN, whole.correct_PxN)
  np.testing.assert_array_equal(chunked.lengths_PxN, whole.lengths_PxN)
  reward = make_reward("pointer_chase")
  assert [[reward(r, whole.text(p, j, tok)).correct for j in range(2)]
          for p, r in enumerate(task.train)] == whole.correct_PxN.tolist()
  again = draw(ModelCalls(3, Journal(path)))
  assert calls[4:] == [] and again.tokens == whole.tokens
