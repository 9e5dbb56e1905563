"""The tiny verifiable task: follow a hidden permutation n steps.

A fixed random permutation f of the 100 states 00..99 (drawn from the task
seed) is never shown; it is learned from the data. A problem gives a start
state x and a step count n (prompt `37 c5 =`); the answer is f^n(x).

A chain-of-thought answer counts down and writes every intermediate state
(`c4 81 ; c3 12 ; c2 40 ; c1 07 ; c0 55 ; > 55`): each step is one lookup of
f, so a small model learns it and it generalises to unseen (x, n) pairs. A
direct answer (`> 55`) must compose n lookups in one forward pass, which a
small model can only memorise for the pairs it trained on. So writing the
steps out helps, and response length means something: the report's long-CoT
story in miniature. Difficulty is n. Train and held-out problems are disjoint
(x, n) pairs.

Two long-CoT variants give a chain removable redundancy (long2short,
docs/long2short.md). `cot_style="rechecks"` (the long2short experiment's):
after the chain a solution may verify it, restating the problem and
re-deriving every step (`... c0 55 ; check 37 c5 = c4 81 ; ... c0 55 ; >
55`): a verification pass that a correct chain never needs.
`cot_style="detours"`: before each right state a step may try wrong
candidates, each rejected with `!` (`c4 81 ; c3 47 ! 12 ; ...`):
explored-and-abandoned branches.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.data.word_tokenizer import WordTokenizer
from kimi_jax.rewards.pointer_chase import (  # noqa: F401 - the task's verifier
    PointerChaseReward, final_answer)
from kimi_jax.rewards.registry import MODEL_REWARDS

N_STATES = 100
MAX_STEPS = 9
COT_STYLES = ("plain", "detours", "rechecks")
RETRY = "!"
CHECK = "check"


@dataclasses.dataclass(frozen=True)
class PointerChaseConfig:
  name: str = "pointer_chase"
  min_steps: int = 1
  max_steps: int = 8
  # Share of (x, n) pairs held out for evaluation.
  eval_fraction: float = 0.125
  # Share of the other pairs kept apart as a validation split: RL's
  # periodic evaluations read it, so settings are chosen without looking
  # at the held-out pairs, which are evaluated at the end (0: none).
  val_fraction: float = 0.0
  # Fraction of warm-start examples that answer directly, without steps.
  direct_fraction: float = 0.5
  # Share of train problems the warm start sees. RL sees them all, so most
  # RL problems cannot be answered from a memorised direct answer.
  warmstart_fraction: float = 0.25
  # The RL reward: this task's exact verifier, or a reward model trained on
  # its labels (kimi_jax/reward_models; held-out evaluation stays exact).
  reward: str = "pointer_chase"
  # "plain": a chain writes each state once. "detours": before each right
  # state a warm-start chain tries up to `max_detours` wrong candidates, one
  # more with probability `detour_rate` each time, each followed by `!`.
  # "rechecks": after the chain a warm-start solution verifies it, up to
  # `max_rechecks` times, one more with probability `recheck_rate` each
  # time: `check`, the problem restated, every step re-derived.
  cot_style: str = "plain"
  detour_rate: float = 0.0
  max_detours: int = 0
  recheck_rate: float = 0.0
  max_rechecks: int = 0
  # Vision (report 2.3.5, text-rendered data): this share of the problems,
  # train and held out, is shown as an image of "x cN" (32 px by default)
  # instead of text; the prompt is then `image_tokens` placeholders (the
  # model's vision.tokens_per_image), and a warm-start solution first
  # writes out what the picture says ("x cN ="); `reading_repeats` reading
  # drills per train image teach that reading on every picture. 0: a
  # text-only task.
  image_fraction: float = 0.0
  reading_repeats: int = 4
  image_size: int = 32
  image_tokens: int = 16

  def __post_init__(self):
    if not 0.0 <= self.image_fraction <= 1.0:
      raise ValueError(f"task.image_fraction must be in [0, 1], got "
                       f"{self.image_fraction}")
    if self.image_size < 32 or self.image_tokens < 1:
      raise ValueError(f"task.image_size must be >= 32 and "
                       f"task.image_tokens >= 1, got {self.image_size}, "
                       f"{self.image_tokens}")
    if self.name != "pointer_chase":
      raise ValueError(f"task.name: unknown task {self.name!r}")
    if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
      raise ValueError(f"task.min_steps/max_steps: need 1 <= min <= max <= "
                       f"{MAX_STEPS}, got {self.min_steps}, {self.max_steps}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"task.eval_fraction must be in (0, 1), got "
                       f"{self.eval_fraction}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f"task.val_fraction must be in [0, 1), got "
                       f"{self.val_fraction}")
    if not 0.0 < self.warmstart_fraction <= 1.0:
      raise ValueError(f"task.warmstart_fraction must be in (0, 1], got "
                       f"{self.warmstart_fraction}")
    if self.reward != "pointer_chase" and self.reward not in MODEL_REWARDS:
      raise ValueError(f"task.reward must be 'pointer_chase' or one of "
                       f"{MODEL_REWARDS}, got {self.reward!r}")
    if not 0.0 <= self.direct_fraction <= 1.0:
      raise ValueError(f"task.direct_fraction must be in [0, 1], got "
                       f"{self.direct_fraction}")
    if self.cot_style not in COT_STYLES:
      raise ValueError(f"task.cot_style must be one of {COT_STYLES}, got "
                       f"{self.cot_style!r}")
    _check_knobs(self, "detours", "detour_rate", "max_detours",
                 rate_below_one=True)
    _check_knobs(self, "rechecks", "recheck_rate", "max_rechecks",
                 rate_below_one=False)


def _check_knobs(cfg: PointerChaseConfig, style: str, rate_key: str,
                 max_key: str, *, rate_below_one: bool) -> None:
  """A long-CoT style's rate and cap: in range, set exactly when
  `task.cot_style` is `style`."""
  rate, most = getattr(cfg, rate_key), getattr(cfg, max_key)
  if not (0.0 <= rate < 1.0 if rate_below_one else 0.0 <= rate <= 1.0):
    raise ValueError(f"task.{rate_key} must be in [0, 1"
                     f"{')' if rate_below_one else ']'}, got {rate}")
  if most < 0:
    raise ValueError(f"task.{max_key} must be >= 0, got {most}")
  if cfg.cot_style != style and (rate or most):
    raise ValueError(f"task.{rate_key} / task.{max_key} need "
                     f"task.cot_style='{style}'")
  if cfg.cot_style == style and not (rate and most):
    raise ValueError(f"task.cot_style='{style}' needs task.{rate_key} > 0 "
                     f"and task.{max_key} > 0")


def state(s: int) -> str:
  return f"{s:02d}"


def counter(c: int) -> str:
  return f"c{c}"


IMAGE_WORD = "<image>"


def tokenizer(cot_style: str = "plain", images: bool = False
              ) -> WordTokenizer:
  """The task's words; the detour style adds `!`, the recheck style
  `check` and a vision task the image placeholder at the end, so the ids of
  the other words are the same in every variant."""
  extra = {"detours": (RETRY,), "rechecks": (CHECK,)}.get(cot_style, ()) + (
      (IMAGE_WORD,) if images else ())
  return WordTokenizer(("=", ";", ">") + tuple(counter(c) for c in range(
      MAX_STEPS + 1)) + tuple(state(s) for s in range(N_STATES)) + extra)


def permutation(seed: int) -> np.ndarray:
  return np.random.default_rng([seed, 7]).permutation(N_STATES)


def chain(perm: np.ndarray, x: int, n: int) -> list[int]:
  """The states f(x), f(f(x)), ..., f^n(x)."""
  out, s = [], x
  for _ in range(n):
    s = int(perm[s])
    out.append(s)
  return out


def _held_out(x: int, n: int, seed: int, fraction: float,
              salt: str = "") -> bool:
  h = hashlib.sha256(f"{salt}{seed}:{x}:{n}".encode()).digest()
  return int.from_bytes(h[:8], "little") / 2**64 < fraction


def make_problems(cfg: PointerChaseConfig, seed: int
                  ) -> tuple[list[dict], list[dict]]:
  """Every (x, n) pair, split into disjoint train and held-out records."""
  perm = permutation(seed)
  train, held = [], []
  for n in range(cfg.min_steps, cfg.max_steps + 1):
    for x in range(N_STATES):
      rec = {"id": f"pc-{x:02d}-{n}", "prompt": f"{state(x)} {counter(n)} =",
             "answer": state(chain(perm, x, n)[-1]), "difficulty": float(n),
             "x": x, "n": n}
      (held if _held_out(x, n, seed, cfg.eval_fraction) else train).append(rec)
  return train, held


def split_validation(train: Sequence[dict], cfg: PointerChaseConfig,
                     seed: int) -> tuple[list[dict], list[dict]]:
  """`make_problems`' train records as (train, validation): a
  `val_fraction` share, drawn by its own hash, so the held-out split does
  not move."""
  val = [r for r in train
         if _held_out(r["x"], r["n"], seed, cfg.val_fraction, "val:")]
  ids = {r["id"] for r in val}
  return [r for r in train if r["id"] not in ids], val


def cot_solution(record: Mapping[str, Any], perm: np.ndarray,
                 detours_per_step: Sequence[Sequence[int]] = (),
                 rechecks: int = 0) -> str:
  """The chain, each step `c{k} s ;`; `detours_per_step[i]` lists wrong
  states tried (each followed by `!`) before step i's right one; each of
  `rechecks` verification passes writes `check`, the problem and the plain
  chain again."""
  n = record["n"]
  steps = chain(perm, record["x"], n)
  detours = list(detours_per_step) or [()] * n
  if len(detours) != n:
    raise ValueError(f"{len(detours)} detour lists for {n} steps")
  body = " ".join(
      " ".join([counter(n - 1 - i)] + [f"{state(w)} {RETRY}" for w in tried]
               + [state(s), ";"])
      for i, (s, tried) in enumerate(zip(steps, detours)))
  plain = " ".join(f"{counter(n - 1 - i)} {state(s)} ;"
                   for i, s in enumerate(steps))
  # A verification pass restates the problem and re-derives every step.
  problem = f"{state(record['x'])} {counter(n)} ="
  checks = "".join(f" {CHECK} {problem} {plain}" for _ in range(rechecks))
  return f"{body}{checks} > {state(steps[-1])}"


def draw_detours(record: Mapping[str, Any], perm: np.ndarray,
                 cfg: PointerChaseConfig, rng: np.random.Generator
                 ) -> list[list[int]]:
  """Per step, the wrong candidates a detour-style chain tries: up to
  `max_detours`, one more with probability `detour_rate` each time, each a
  uniformly drawn state other than the right one."""
  out = []
  for right in chain(perm, record["x"], record["n"]):
    tried = []
    while len(tried) < cfg.max_detours and rng.random() < cfg.detour_rate:
      wrong = int(rng.integers(N_STATES - 1))
      tried.append(wrong + (wrong >= right))
    out.append(tried)
  return out


def draw_rechecks(cfg: PointerChaseConfig, rng: np.random.Generator) -> int:
  """How many verification passes a recheck-style solution writes: up to
  `max_rechecks`, one more with probability `recheck_rate` each time."""
  k = 0
  while k < cfg.max_rechecks and rng.random() < cfg.recheck_rate:
    k += 1
  return k


def minimal_length(record: Mapping[str, Any]) -> int:
  """Tokens of the shortest chain-of-thought solution, eos included: three
  per step (`c3 12 ;`), the answer (`> 55`) and eos."""
  return 3 * int(record["n"]) + 3


def direct_solution(record: Mapping[str, Any]) -> str:
  return f"> {record['answer']}"


def warmstart_texts(records: list[dict], cfg: PointerChaseConfig, seed: int,
                    size: int) -> list[tuple[str, str]]:
  """`size` (prompt, solution) pairs over a `warmstart_fraction` subset of
  the records; a `direct_fraction` share answers directly."""
  perm = permutation(seed)
  rng = np.random.default_rng([seed, 11])
  pool = [records[i] for i in rng.permutation(len(records))[:max(
      1, round(cfg.warmstart_fraction * len(records)))]]
  out = []
  for i in range(size):
    r = pool[i % len(pool)]
    direct = rng.random() < cfg.direct_fraction
    if direct:
      solution = direct_solution(r)
    elif cfg.cot_style == "detours":
      solution = cot_solution(r, perm, draw_detours(r, perm, cfg, rng))
    elif cfg.cot_style == "rechecks":
      solution = cot_solution(r, perm, rechecks=draw_rechecks(cfg, rng))
    else:
      solution = cot_solution(r, perm)
    if "pixels" in r:
      # An image problem's solution first reads the picture out ("37 c5 =",
      # the text problem's prompt), then solves it: reading is learned from
      # every warm-start image. Its pixels come along for the prompt.
      out.append((r["prompt"], f"{r['prompt']} {solution}", r["pixels"]))
    else:
      out.append((r["prompt"], solution))
  return out


def reading_drills(records: Sequence[Mapping[str, Any]], repeats: int
                   ) -> list[tuple[str, str, Any, bool]]:
  """For every image problem of `records`, `repeats` warm-start examples
  that only read the picture out ("37 c5 =", no end-of-sequence, so the
  loss is on the reading alone and nothing is learned about what follows).

  The warm start's worked solutions cover a `warmstart_fraction` share of
  the problems (so RL has problems whose answer was never shown); reading
  has to be learned for every state drawn, so the drills cover them all.
  Each is (prompt, reading, pixels, eos=False)."""
  return [(r["prompt"], r["prompt"], r["pixels"], False)
          for r in records if "pixels" in r for _ in range(repeats)]


def shown_as_image(x: int, n: int, seed: int, fraction: float) -> bool:
  """Whether problem (x, n) is an image problem: a fixed hash, so the same
  problems are images in every run of a seed."""
  h = hashlib.sha256(f"image:{seed}:{x}:{n}".encode()).digest()
  return int.from_bytes(h[:4], "little") / 2**32 < fraction


def image_text(record: Mapping[str, Any]) -> str:
  """What an image problem's picture shows: the text prompt without its
  "=" (which the response writes after reading the picture out)."""
  return f"{state(record['x'])} {counter(record['n'])}"
