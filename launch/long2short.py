"""Long2short (report 2.4, 3.4): the long-CoT model, a short-only baseline,
model merging, shortest rejection sampling, DPO and long2short RL, each
evaluated on the same held-out problems.

  python launch/long2short.py --config experiments/long2short_tiny.py --workdir /tmp/l2s
  python launch/long2short.py --config experiments/long2short_tiny.py:micro \\
      --workdir DIR --config.merge.alpha=0.7 --config.l2s.long_workdir=RUN
  python launch/long2short.py --config experiments/long2short_reflect.py \\
      --workdir DIR --config.seed=1   # the long model from the gym pipeline
  python launch/long2short.py --config experiments/long2short_reflect.py \
      --workdir DIR --seeds 5   # seeds 0-4 in DIR/seed<S>, then their means

Writes WORKDIR/long2short.json (one record per method: pass@1, greedy
accuracy, mean and p90 response tokens) and WORKDIR/token_efficiency.png.
Rerun with the same --workdir to continue: finished stages are skipped, and
an interrupted one continues from its checkpoints (the main-job stages, DPO
every config.dpo.checkpoint_every steps) or journal (the samples).
With --seeds N, seeds config.seed ... config.seed + N - 1 each run in
WORKDIR/seed<S> (resumable as above), then WORKDIR/long2short_seeds.json
holds each method's mean ± sd over them and its paired difference to the
long model (kimi_jax/long2short/seeds.py), with
WORKDIR/token_efficiency_seeds.png at the means.
Stages and files: docs/long2short.md.
"""

import sys

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import ConfigError, define_config_flag, parse_flags

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "where every stage's run and the comparison go",
    required=True)
_COMPILE_CACHE = flags.DEFINE_bool(
    "compile_cache", True,
    "keep compiled programs in WORKDIR/compile_cache: the long, short and "
    "long2short RL jobs and the evaluations compile the same programs, so "
    "the later ones load them instead of compiling again")
_SEEDS = flags.DEFINE_integer(
    "seeds", 0,
    "0: one run in WORKDIR; N: seeds config.seed .. config.seed + N - 1, "
    "each in WORKDIR/seed<S>, then their means in "
    "WORKDIR/long2short_seeds.json")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.long2short import pipeline
  if _SEEDS.value < 0:
    sys.exit(f"--seeds must be >= 0, got {_SEEDS.value}")
  try:
    pipeline.check(_CONFIG.value)
  except (ConfigError, ValueError) as exc:
    sys.exit(f"config error: {exc}")
  if _COMPILE_CACHE.value:
    import os
    pipeline.use_compile_cache(os.path.join(_WORKDIR.value, "compile_cache"))
  from kimi_jax.infra.workdir_lock import WorkdirBusyError
  try:
    if _SEEDS.value > 0:
      from kimi_jax.long2short import seeds
      print(seeds.markdown(seeds.run(_CONFIG.value, _WORKDIR.value,
                                     _SEEDS.value)))
    else:
      pipeline.run(_CONFIG.value, _WORKDIR.value)
  except WorkdirBusyError as exc:
    sys.exit(f"workdir error: {exc}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
