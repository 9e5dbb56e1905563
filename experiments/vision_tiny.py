"""python launch/tpu_run.py --config experiments/vision_tiny.py --workdir /tmp/kimi_vision

The tiny task with pictures (report 2.3.5, text-rendered vision data): half
of the pointer-chasing problems, in training and held out, are shown as a
32 px image of "x cN" drawn in a 3x5 pixel font (kimi_jax/data/
visual_tasks.py) instead of as text, and the same verifier scores both. The
policy is tiny.py's 2-layer model with a 2-layer SigLIP-style vision tower
(4 px patches, an 8 x 8 grid pooled 2 x 2 into 16 image tokens) trained
with it from scratch: a warm start on chains and direct answers for both
kinds, then Kimi k1.5 RL. The held-out evaluation reports pass@1 for the
"image" and "text" problems separately (`pass_at_1_by_task`).

`experiments/vision_tiny.py:micro` is a seconds-scale variant for tests.
"""

import ml_collections

from experiments import tiny
from kimi_jax.data import pointer_chase

IMAGE_SIZE = 32
PATCH = 4
POOL = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH // POOL) ** 2  # 16


def vision_config(d_model: int) -> ml_collections.ConfigDict:
  placeholder = pointer_chase.tokenizer(images=True).encode(
      pointer_chase.IMAGE_WORD)[0]
  return ml_collections.ConfigDict(dict(
      image_size=IMAGE_SIZE, patch_size=PATCH, channels=3, d_model=64,
      n_layers=2, n_heads=4, mlp_dim=256, norm_eps=1e-6, pool=POOL,
      # One image per prompt; a packed training row holds two sequences'
      # images (about two sequences fit a row). The tower encodes every
      # slot, empty or not, so more slots cost compute for nothing.
      max_images=2, projector_dim=256, lm_d_model=d_model,
      image_token_id=placeholder, param_dtype="float32",
      compute_dtype="float32", remat=False))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = tiny.get_config()
  c.model.vision = vision_config(c.model.d_model)
  # Worked solutions for a quarter of the train problems, as tiny.py (RL
  # needs problems whose answer was never shown: with all of them the warm
  # start memorises direct answers and RL only fits those), and reading
  # drills on every train picture (each of the 100 states must be seen
  # drawn). Reading takes steps: in a trial with every problem's solution
  # in the warm start, 600 steps read 13% of its own pictures right, 2000
  # all of them and 77% of the held-out ones.
  c.task.update(dict(image_fraction=0.5, image_size=IMAGE_SIZE,
                     image_tokens=IMAGE_TOKENS, reading_repeats=4))
  # An image prompt is 1 + 16 tokens and its response reads the picture out
  # first (3 tokens): the longest (8 steps) is 17 + 30 = 47 tokens.
  c.sft.update(dict(steps=2000, seq_len=48))
  c.sampler.update(dict(cache_len=64, prefill_buckets=(8, 32, 64)))
  c.rl.update(dict(iterations=60, train_len_buckets=(32, 48, 64)))
  if arg == "micro":
    tiny.shrink_to_micro(c)
    c.sft.steps = 10
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  return c
