"""Ablations: the arms of a comparison, each run with several seeds, and the
results aggregated with error bars.

  spec       an ablation config (`experiments/ablations.py`) parsed and
             checked: its base, arms and seed key, one `Run` per arm and
             seed, the sweep directory's file names
  sweep      `run_sweep`: the runs through the main job (or the gym
             pipeline), resumed where they stopped, with a warm start
             shared by the arms of a seed when no arm changes what it reads
  aggregate  `aggregate`: mean ± sample std over seeds per arm, paired
             differences to the first arm, gains over the warm start;
             `write_results` writes them with the figure
  table      `markdown_table`: one row per arm; `markdown_levels`: one
             row per difficulty level
  figure     `plot`: the curves per arm with a ±1 std band
  by_difficulty  per-level results and the Figure-5 plot, for runs that
             evaluate by difficulty level
  stats      mean and sample standard deviation over seeds
"""

from kimi_jax.ablation.aggregate import (EVAL_CURVES, FINAL_METRICS,
                                         RL_CURVES, aggregate, mean_std,
                                         read_run, write_results)
from kimi_jax.ablation.by_difficulty import (aggregate_levels, level_curves,
                                             plot_levels, run_levels)
from kimi_jax.ablation.figure import PANELS, VAL_PANEL, plot
from kimi_jax.ablation.spec import (FIGURE, LEVELS_FIGURE, METRICS, RESULTS,
                                    SPEC, SUMMARY, TIMING, WARM_START_DIR,
                                    Ablation, Run, flatten, load_ablation,
                                    nest, parse_ablation)
from kimi_jax.ablation.sweep import (RunFn, check_spec, run_sweep,
                                     seed_warm_start)
from kimi_jax.ablation.table import markdown_levels, markdown_table

__all__ = [
    "EVAL_CURVES", "FIGURE", "FINAL_METRICS", "LEVELS_FIGURE", "METRICS",
    "PANELS", "RESULTS", "RL_CURVES", "SPEC", "SUMMARY", "TIMING",
    "VAL_PANEL", "WARM_START_DIR", "Ablation", "Run", "RunFn", "aggregate",
    "aggregate_levels", "check_spec",
    "flatten", "level_curves", "load_ablation", "markdown_levels",
    "markdown_table", "mean_std", "nest", "parse_ablation", "plot",
    "plot_levels", "read_run", "run_levels", "run_sweep", "seed_warm_start",
    "write_results",
]
