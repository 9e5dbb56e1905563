"""Runs the arms of an ablation with several seeds, then aggregates them.

  python launch/ablate.py --config experiments/ablations.py:loss \\
      --workdir /tmp/ablate_loss --seeds 3
  python launch/ablate.py --config experiments/ablations.py:loss,micro \\
      --workdir /tmp/ablate_micro --seeds 2 --config.base.rl.iterations=2

An ablation whose base has a `pipeline` section (`ablations.py:curation`)
runs the whole gym pipeline per arm and seed instead of the main job, the
data and vanilla-SFT stages shared by the arms of a seed.

One run per arm and seed in WORKDIR/<arm>/seed<seed>/ (seeds
first_seed .. first_seed + seeds - 1; first_seed is 0). Rerun the same
command to resume a killed sweep: finished runs (a summary.json) are
skipped, an interrupted one resumes from its own checkpoint. Writes
WORKDIR/ablation.json (per arm: final held-out pass@1, greedy accuracy,
mean response tokens, per-iteration curves, mean and std over seeds, the
paired difference to the first arm) and WORKDIR/ablation.png, and prints a
markdown table. Runs that evaluate by difficulty level (reflect_tiny) also
get per-level results in the JSON, a table per arm and
WORKDIR/by_difficulty_<arm>.png, pass@1 and response length per level
through RL (the report's Figure 5). --aggregate_only skips running and
aggregates whatever has finished.

With more cores, run processes over disjoint seeds (and arms) on the same
workdir, then aggregate (processes over arms of one seed wait for the
first to finish its shared warm start, then reuse it):
  for s in 0 1 2; do python launch/ablate.py --config ...:loss --workdir W \
      --seeds 1 --config.first_seed=$s & done; wait
  python launch/ablate.py --config ...:loss --workdir W --seeds 3 \
      --aggregate_only
"""

import os
import sys
import time

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import ConfigError, define_config_flag, parse_flags

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "sweep directory: one run per arm and seed in "
    "<workdir>/<arm>/seed<seed>/, results in <workdir>/ablation.json and "
    "ablation.png; rerun to resume", required=True)
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds per arm")
_ARMS = flags.DEFINE_list(
    "arms", None, "run only these arms (default: all); e.g. one process per "
    "arm and seed range on a machine with more cores")
_AGGREGATE_ONLY = flags.DEFINE_bool(
    "aggregate_only", False, "run nothing; aggregate the finished runs")
_EARLY_STEP = flags.DEFINE_integer(
    "early_step", 10, "the printed table also shows held-out pass@1 at this "
    "RL iteration (how fast each arm learns); -1 for none")
_SHARE_WARM_START = flags.DEFINE_bool(
    "share_warm_start", True, "run stage one once per seed when no arm "
    "changes what it reads (see kimi_jax/ablation/sweep.py)")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "none", "a JAX persistent compilation cache "
    "directory the runs share ('none': off, each run compiles its own; the "
    "published sweeps ran with it off)")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax import ablation as ablation_lib
  from kimi_jax.infra.workdir_lock import WorkdirBusyError
  try:
    ablation = ablation_lib.parse_ablation(_CONFIG.value)
  except (ConfigError, ValueError) as exc:
    sys.exit(f"config error: {exc}")
  workdir = _WORKDIR.value
  cache = _COMPILATION_CACHE.value
  if cache not in ("", "none"):
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  t0 = time.perf_counter()
  if _AGGREGATE_ONLY.value:
    plan = ablation.plan(workdir, _SEEDS.value)
  else:
    try:
      plan = ablation_lib.run_sweep(
          ablation, workdir, _SEEDS.value,
          share_warm_start=(None if _SHARE_WARM_START.value else False),
          arms=_ARMS.value)
    except (ConfigError, KeyError) as exc:
      sys.exit(f"config error: {exc}")
    except WorkdirBusyError as exc:
      sys.exit(f"workdir error: {exc}")
  results = ablation_lib.write_results(ablation, workdir, plan)
  print(ablation_lib.markdown_table(
      results, None if _EARLY_STEP.value < 0 else _EARLY_STEP.value))
  for arm, data in results["arms"].items():
    if (data.get("by_difficulty") or {}).get("held_out"):
      print(f"\n{arm}, held-out by difficulty level (mean ± std over "
            f"{data['n_seeds']} seeds):")
      print(ablation_lib.markdown_levels(data["by_difficulty"]))
  print(f"wrote {os.path.join(workdir, ablation_lib.RESULTS)} and "
        f"{os.path.join(workdir, ablation_lib.FIGURE)} "
        f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
