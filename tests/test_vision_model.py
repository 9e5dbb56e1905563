"""The vision path through the policy: images in token rows for the
trainer's log-probs, and image prompts through the sampler's prefill,
decode and partial-rollout continuation, against the trainer's forward;
packed rows keep each sequence's images; the sharded forward equals one
device."""

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config
from kimi_jax.model import logprobs, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import (SampleRequest, SampleRequestError,
                                     Sampler, continuation)
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from kimi_jax.token_rows import TokenRows
from kimi_jax.vision.merge import RowImages

IMG = 5  # the placeholder token id
VISION = dict(image_size=16, patch_size=4, d_model=32, n_layers=2, n_heads=2,
              mlp_dim=64, image_token_id=IMG, pool=2, max_images=2)
CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                  max_seq_len=64, vision=VISION)
P = CFG.vision.tokens_per_image  # 4: a 4 x 4 patch grid pooled 2 x 2
NO_REPEAT = RepeatConfig(enabled=False)


def _pixels(seed, n):
  rng = np.random.default_rng(seed)
  return rng.uniform(-1, 1, (n, 16, 16, 3)).astype(np.float32)


def _prompt(n_images):
  out = [3, 7]
  for j in range(n_images):
    out += [IMG] * P + [9 + j]
  return tuple(out + [11])


@pytest.fixture(scope="module")
def params():
  return jax.jit(lambda: transformer.init_params(CFG, jax.random.key(0),
                                                 std=0.2))()


def _rows(seqs, images_per_seq, T):
  """Packed host rows, one row, sequences back to back; each sequence's
  images go to the row's next slots in order."""
  tokens = np.zeros((1, T), np.int32)
  targets = np.zeros((1, T), np.int32)
  positions = np.zeros((1, T), np.int32)
  segments = np.zeros((1, T), np.int32)
  mask = np.zeros((1, T), np.float32)
  pixels = np.zeros((1, 2, 16, 16, 3), np.float32)
  image_mask = np.zeros((1, 2), bool)
  at = slot = 0
  for s, (seq, imgs) in enumerate(zip(seqs, images_per_seq)):
    n = len(seq) - 1
    tokens[0, at:at + n] = seq[:-1]
    targets[0, at:at + n] = seq[1:]
    positions[0, at:at + n] = np.arange(n)
    segments[0, at:at + n] = s + 1
    mask[0, at:at + n] = 1.0
    at += n
    for img in imgs:
      pixels[0, slot] = img
      image_mask[0, slot] = True
      slot += 1
  return TokenRows(tokens, targets, positions, segments, mask,
                   images=RowImages(pixels, image_mask))


_row_logp = jax.jit(lambda p, rows: logprobs.rows_logprobs(p, rows, cfg=CFG))


@pytest.mark.host_inputs
def test_sampled_logprobs_of_an_image_prompt_equal_the_trainers(params):
  images = _pixels(1, 2)
  prompt = _prompt(2)
  engine = Engine(CFG, EngineConfig(max_slots=2, cache_len=64,
                                    prefill_buckets=(16, 32)))
  sampler = Sampler(engine, NO_REPEAT, steps_per_call=4)
  placed, _ = handoff.place_params(params, engine.param_shardings)
  req = SampleRequest("a", prompt, max_new_tokens=12, images=images,
                      sampling=SamplingParams(seed=3))
  (res,), _ = sampler.generate(placed, [req])
  assert len(res.tokens) == 12
  # The trainer's forward over prompt + response, the images in the row.
  seq = prompt + res.tokens
  logp = np.asarray(_row_logp(params, _rows([seq], [images], 48)))[0]
  n = len(prompt)
  np.testing.assert_allclose(logp[n - 1:n - 1 + 12], res.logprobs,
                             atol=2e-5)
  # The images matter: other pixels give other log-probs for that response.
  other = np.asarray(_row_logp(params, _rows([seq], [_pixels(2, 2)], 48)))[0]
  assert np.abs(other[n - 1:n - 1 + 12] - logp[n - 1:n - 1 + 12]).max() > 1e-3


@pytest.mark.host_inputs
def test_a_partial_rollout_of_an_image_prompt_continues_as_if_uninterrupted(
    params):
  images = _pixels(3, 1)
  engine = Engine(CFG, EngineConfig(max_slots=2, cache_len=64,
                                    prefill_buckets=(16, 32)))
  sampler = Sampler(engine, NO_REPEAT, steps_per_call=3)
  placed, _ = handoff.place_params(params, engine.param_shardings)
  req = SampleRequest("a", _prompt(1), max_new_tokens=10, images=images,
                      sampling=SamplingParams(seed=9))
  (whole,), _ = sampler.generate(placed, [req])
  (first,), _ = sampler.generate(placed, [dataclasses.replace(req, budget=4)])
  assert first.finish_reason == "budget"
  (rest,), _ = sampler.generate(placed, [continuation(req, first)])
  assert first.tokens + rest.tokens == whole.tokens
  np.testing.assert_allclose(first.logprobs + rest.logprobs, whole.logprobs,
                             atol=2e-5)


@pytest.mark.host_inputs
def test_packed_rows_keep_each_sequences_images(params):
  a, b = _prompt(1) + (20, 21, 22), _prompt(1) + (30, 31)
  img_a, img_b = _pixels(4, 1), _pixels(5, 1)
  packed = np.asarray(_row_logp(params, _rows([a, b], [img_a, img_b], 32)))
  alone_a = np.asarray(_row_logp(params, _rows([a], [img_a], 32)))
  alone_b = np.asarray(_row_logp(params, _rows([b], [img_b], 32)))
  na, nb = len(a) - 1, len(b) - 1
  np.testing.assert_allclose(packed[0, :na], alone_a[0, :na], atol=1e-5)
  np.testing.assert_allclose(packed[0, na:na + nb], alone_b[0, :nb],
                             atol=1e-5)
  # Swapping the images between the packed sequences changes both.
  swapped = np.asarray(_row_logp(params, _rows([a, b], [img_b, img_a], 32)))
  assert np.abs(swapped[0, :na] - packed[0, :na]).max() > 1e-3


def test_requests_with_images_the_model_cannot_take_are_named(params):
  engine = Engine(CFG, EngineConfig(max_slots=2, cache_len=64))
  sampler = Sampler(engine, NO_REPEAT)
  bad = [
      SampleRequest("one_placeholder_run_short", _prompt(2), max_new_tokens=4,
                    images=_pixels(0, 1)),
      SampleRequest("wrong_size", _prompt(1), max_new_tokens=4,
                    images=np.zeros((1, 8, 8, 3), np.float32)),
      SampleRequest("too_many", _prompt(3), max_new_tokens=4,
                    images=_pixels(0, 3)),
  ]
  with pytest.raises(SampleRequestError) as info:
    sampler.validate(bad)
  named = {(rid, field) for rid, field, _ in info.value.problems}
  assert named == {(r.id, "images") for r in bad}
  text_engine = Engine(dataclasses.replace(CFG, vision=None),
                       EngineConfig(max_slots=2, cache_len=64))
  with pytest.raises(SampleRequestError, match="no vision tower"):
    Sampler(text_engine).validate([SampleRequest(
        "x", (1, 2), max_new_tokens=3, images=_pixels(0, 1))])


def test_vision_forward_on_a_mesh_equals_one_device(params):
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  shardings = transformer.param_shardings(CFG, sharder)
  # Every vision and projector parameter has a sharding from the rules.
  assert set(shardings) >= {"vision", "projector"}
  sharded = transformer.init_sharded(CFG, 0, sharder, std=0.2)
  single = jax.device_get(sharded)
  rows = jax.tree.map(lambda x: np.concatenate([x, x]), _rows(
      [_prompt(2) + (13, 14)], [_pixels(6, 2)], 24))
  host = jax.device_get(jax.jit(
      lambda p, r: logprobs.rows_logprobs(p, r, cfg=CFG))(
          jax.device_put(single, jax.devices()[0]),
          jax.device_put(rows, jax.devices()[0])))
  from kimi_jax.sharding import batch_shardings
  on_mesh = jax.jit(
      lambda p, r: logprobs.rows_logprobs(p, r, cfg=CFG, sharder=sharder))(
          sharded, jax.device_put(rows, batch_shardings(sharder, rows)))
  np.testing.assert_allclose(np.asarray(on_mesh), host, atol=2e-5)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VISION_TINY = os.path.join(ROOT, "experiments", "vision_tiny.py")
TINY = os.path.join(ROOT, "experiments", "tiny.py")


@pytest.mark.parametrize("override,needle", [
    ({"model.vision.patch_size": 8}, "model.vision.tokens_per_image is 4"),
    ({"model.vision.image_token_id": 3}, "model.vision.image_token_id is 3"),
    ({"task.image_size": 64}, "model.vision.image_size is 32"),
])
def test_an_image_task_needs_a_matching_vision_tower(override, needle):
  with pytest.raises(ConfigError, match=re.escape(needle)):
    parse_config(load_config(VISION_TINY + ":micro", override))
  text_model = load_config(TINY + ":micro")
  with text_model.unlocked():
    text_model.task.image_fraction = 0.5
  with pytest.raises(ConfigError, match="config.model.vision"):
    parse_config(text_model)


@pytest.mark.slow
def test_vision_tiny_micro_runs_end_to_end(tmp_path):
  # Warm start and RL with half the problems shown as images: the job
  # trains, samples and evaluates image prompts, and reports pass@1 of the
  # image and the text problems apart.
  config = load_config(VISION_TINY + ":micro")
  job_lib.train_and_evaluate(config, str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  evals = [r for r in rows if r["stage"] == "eval"]
  assert evals and set(evals[-1]["pass_at_1_by_task"]) == {"image", "text"}
  trained = [r for r in rows if r["stage"] == "rl" and "loss" in r]
  assert trained and all(np.isfinite(r["loss"]) for r in trained)
  sft = [r for r in rows if r["stage"] == "sft"]
  assert sft and np.isfinite(sft[-1]["loss"])
  # The export writes the language model and, beside it, the tower as a
  # SigLIP vision model with the trained weights.
  from kimi_jax.job import export
  from kimi_jax.job import workdir as workdir_lib
  from kimi_jax.vision import hf as vision_hf
  out = tmp_path / "hf"
  result = export.export_workdir(str(tmp_path), str(out))
  assert (out / "config.json").exists() and result.model.vision is None
  model = parse_config(config).model
  tower = vision_hf.load_vision_hf(str(out / "vision"), model.vision)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  trained, _ = workdir_lib.restore_params(
      str(tmp_path), parse_config(config),
      jax.tree.map(lambda _: one, transformer.abstract_params(model)))
  np.testing.assert_array_equal(np.asarray(tower["pos_embed"]),
                                np.asarray(trained["vision"]["pos_embed"]))


def test_image_problems_read_the_picture_out_and_drill_every_picture():
  from kimi_jax import sft
  from kimi_jax.data import pointer_chase as pc
  from kimi_jax.data import tasks, visual_tasks
  cfg = pc.PointerChaseConfig(image_fraction=0.5, reading_repeats=3)
  task = tasks.make_task(cfg, seed=0)
  images = [r for r in task.train if "pixels" in r]
  # About half the problems, train and held out, are pictures of "x cN".
  assert 0.4 < len(images) / len(task.train) < 0.6
  assert any("pixels" in r for r in task.eval)
  examples = sft.warmstart_pairs(task.warmstart(0), task.tokenizer,
                                 task.encode_prompt)
  tok = task.tokenizer
  placeholder = tok.encode(pc.IMAGE_WORD)[0]
  drills = [e for e in examples if e[1][-1] != tok.eos_id]
  # Every train picture is drilled 3 times: the reading alone, no eos.
  assert len(drills) == 3 * len(images)
  for prompt, reading, pixels in drills[:20]:
    assert prompt == [tok.bos_id] + [placeholder] * cfg.image_tokens
    words = tok.decode(reading).split()
    assert len(words) == 3 and words[2] == "="
    # The picture shows exactly what the reading says.
    drawn = visual_tasks.render_text(" ".join(words[:2]), 32)
    np.testing.assert_array_equal(pixels[0], drawn / 127.5 - 1.0)
  # A worked solution of a picture starts by reading it out, then solves.
  solved = [e for e in examples if e[2] is not None and
            e[1][-1] == tok.eos_id]
  assert solved
  for prompt, solution, pixels in solved[:20]:
    words = tok.decode(solution).split()
    assert words[2] == "=" and ">" in words[3:]
  # Text problems keep their text prompt and no pixels.
  text = [e for e in examples if e[2] is None]
  assert text and all(placeholder not in e[0] for e in text)


def test_eval_plots_get_a_pass_at_1_line_per_task(tmp_path):
  from kimi_jax.infra import metrics
  rows = [{"stage": "eval", "step": 0, "pass_at_1": 0.3,
           "pass_at_1_by_task": {"image": 0.25, "text": 0.375}},
          {"stage": "rl", "step": 1, "loss": 0.5},
          {"stage": "eval", "step": 10, "pass_at_1": 0.8,
           "pass_at_1_by_task": {"image": 0.75, "text": 0.875}}]
  flat, keys = metrics.with_task_keys(rows)
  assert keys == ("pass_at_1[image]", "pass_at_1[text]")
  assert [r.get("pass_at_1[text]") for r in flat] == [0.375, None, 0.875]
  assert "pass_at_1[image]" not in rows[0]  # the records are not changed
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  written = metrics.plot_run(str(path), str(tmp_path))
  assert str(tmp_path / "eval_curves.png") in written


def test_a_jsonl_image_set_loads_with_pixels_and_placeholder_runs(tmp_path):
  # Generated "count" problems written as JSONL + PNG files, read back as a
  # vision model's jsonl task: each record has its pixels, and its prompt's
  # <image> marker becomes a run of tokens_per_image placeholders, the text
  # around it tokenized as before.
  from kimi_jax.data import tasks, visual_tasks
  from kimi_jax.curation import text_tokenizer
  from kimi_jax.model.tokenizer import load_hf_tokenizer
  from kimi_jax.vision.config import VisionConfig
  records = visual_tasks.make_visual_records(
      visual_tasks.VisualTaskConfig(tasks="count", image_size=32), 6)
  visual_tasks.write_jsonl(records, str(tmp_path / "train.jsonl"),
                           str(tmp_path / "img"))
  visual_tasks.write_jsonl(records[:2], str(tmp_path / "eval.jsonl"))
  pad = "<|image_pad|>"
  tok_dir = str(tmp_path / "tok")
  text_tokenizer.save(text_tokenizer.build(
      [], ("<answer>", "</answer>", pad)), tok_dir)
  tok = load_hf_tokenizer(tok_dir)
  image_id = tok.encode(pad)[0]
  vision = VisionConfig(image_size=32, patch_size=4, d_model=16, n_layers=1,
                        n_heads=2, mlp_dim=32, lm_d_model=16,
                        image_token_id=image_id, max_images=1)
  cfg = tasks.JsonlTaskConfig(
      name="jsonl", train_path=str(tmp_path / "train.jsonl"),
      eval_path=str(tmp_path / "eval.jsonl"), reward="math",
      chat_template=False)
  task = tasks.make_task(cfg, 0, tok, vision=vision)
  assert len(task.train) == 6 and len(task.eval) == 2
  for i, want in enumerate(records):
    record = task.train[i]
    assert record["pixels"].shape == (1, 32, 32, 3)
    np.testing.assert_allclose(record["pixels"][0],
                               want["images"][0] / 127.5 - 1.0, atol=1e-6)
    ids = task.encode_prompt(record)
    run = [j for j, t in enumerate(ids) if t == image_id]
    assert len(run) == vision.tokens_per_image
    assert run == list(range(run[0], run[0] + len(run)))  # one run
    before, after = record["prompt"].split("<image>")
    assert ids[:run[0]] == tok.encode_with_special_tokens(before)
    assert ids[run[-1] + 1:] == tok.encode(after)
  # The same set for a text model: no pixels, the marker stays text.
  text = tasks.make_task(cfg, 0, tok)
  assert "pixels" not in text.train[0]
  assert image_id not in text.encode_prompt(text.train[0])


@pytest.mark.host_inputs
def test_a_vision_model_never_samples_its_placeholder(params):
  # Logits that put almost all mass on the placeholder: the draw (greedy or
  # not) takes another token, and the log-prob is the full distribution's,
  # as the trainer computes it.
  from kimi_jax.sampler.sampling import sample_tokens, stacked_slot_sampling
  logits = np.zeros((2, 8), np.float32)
  logits[:, IMG] = 20.0
  s = stacked_slot_sampling([SamplingParams(seed=1),
                             SamplingParams(greedy=True)], 2)
  tokens, logp = sample_tokens(jax.numpy.asarray(logits), s,
                               np.zeros(2, np.int32), never=IMG)
  assert IMG not in np.asarray(tokens)
  full = jax.nn.log_softmax(logits, axis=-1)
  np.testing.assert_allclose(
      np.asarray(logp), np.asarray(full)[np.arange(2), np.asarray(tokens)],
      rtol=1e-6)
  free, _ = sample_tokens(jax.numpy.asarray(logits), s,
                          np.zeros(2, np.int32))
  assert list(np.asarray(free)) == [IMG, IMG]


def test_sft_packing_keeps_each_examples_images_in_its_row():
  # Examples with 0, 1 and 2 images (pixels filled with the example's
  # number): a row takes an example only with room for its images too, and
  # the row's slots hold its examples' images in packing order.
  from kimi_jax.data import sft_data
  from kimi_jax.token_rows import ImageSlots
  like = (2, 2, 1)
  examples = [sft_data.pair_example(
      [1, 2], [3, 4], where=f"ex{i}",
      pixels=np.full((i % 3, 2, 2, 1), float(i), np.float32)) for i in range(6)]
  rows, placed = sft_data.pack_rows(iter(examples), 4, 12, 0,
                                    ImageSlots(2, like))
  assert placed == 6
  for r in range(4):
    segs = rows["segment_ids"][r]
    # Which example each segment is: examples go in order, first fit.
    want = []
    for s in range(1, segs.max() + 1):
      i = [j for j, e in enumerate(examples)
           if _placed_at(examples, rows, j) == (r, s)][0]
      want += [float(i)] * (i % 3)
    assert len(want) <= 2
    np.testing.assert_array_equal(rows["image_mask"][r],
                                  np.arange(2) < len(want))
    np.testing.assert_array_equal(rows["pixels"][r, :len(want), 0, 0, 0],
                                  want)
  with pytest.raises(Exception, match="image slots"):
    sft_data.pack_rows(iter(examples[2:3]), 4, 12, 0, ImageSlots(1, like))


def _placed_at(examples, rows, j):
  """(row, segment) of example j when examples are packed first fit in
  order (each takes 3 positions of a 12-long row, so rows fill by slots)."""
  used = [0] * 4
  slots = [0] * 4
  seg = [0] * 4
  for i, e in enumerate(examples):
    k = len(e.pixels)
    r = next(r for r in range(4) if used[r] + 3 <= 12 and slots[r] + k <= 2)
    used[r] += 3
    slots[r] += k
    seg[r] += 1
    if i == j:
      return r, seg[r]
