"""The README's TPU table, from `launch/plan.py --aot ... --json` reports.

  python benchmarks/aot_table.py docs/results/aot/*.json

Prints one Markdown row per report: the model (from the config's file name
and variant), the slice, the resolved mesh, tokens per sequence, the
per-chip GB the TPU compiler gave for the train step at each length bucket
(smallest to largest), the reference log-probs, the prefill and the decode
call, and whether every function fits. Nothing is estimated here: a row is
exactly its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Mapping

GB = 1e9
# Smallest first: the table's order.
_MODEL = {"qwen2_5_1_5b": "Qwen2.5-1.5B", "gemma3_4b": "Gemma-3-4B",
          "qwen2_5_7b": "Qwen2.5-7B", "qwen3_8b": "Qwen3-8B",
          "llama3_1_8b": "Llama-3.1-8B", "qwen3_30b_a3b": "Qwen3-30B-A3B",
          "qwen2_5_32b": "Qwen2.5-32B"}
HEADER = ("| model | slice (chips x HBM) | mesh | tokens/seq | train step per "
          "length bucket, smallest → largest | reference log-probs | prefill "
          "| decode call | |\n|---|---|---|---|---|---|---|---|---|")


def model_name(config: str) -> str:
  """"experiments/qwen2_5_7b.py:128k" -> "Qwen2.5-7B `:128k`"."""
  path, _, variant = config.partition(":")
  stem = os.path.splitext(os.path.basename(path))[0]
  name = _MODEL.get(stem, stem)
  return f"{name} `:{variant}`" if variant else name


def _order(report: Mapping[str, Any]) -> tuple:
  """Smallest model first, then the variant, then v5p before v5e."""
  path, _, variant = report["config"].partition(":")
  stem = os.path.splitext(os.path.basename(path))[0]
  known = list(_MODEL)
  return (known.index(stem) if stem in known else len(known), stem, variant,
          report["topology"].startswith("v5e"), report["topology"])


def _gb(entry: Mapping[str, Any]) -> str:
  text = f"{entry['total_bytes'] / GB:.1f}"
  return text if entry["fits"] else f"**{text} (out of HBM)**"


def table_row(report: Mapping[str, Any]) -> str:
  """One Markdown row of an `--aot` JSON report."""
  functions = report["functions"]
  steps = sorted((int(re.search(r"_T(\d+)$", name).group(1)), entry)
                 for name, entry in functions.items()
                 if name.startswith("rl_train_step_T"))
  reference = [e for n, e in functions.items()
               if n.startswith("reference_logprobs_T")]
  mesh = ",".join(f"{axis}={size}" for axis, size in report["mesh"].items())
  chips = report["devices"]
  cells = [
      model_name(report["config"]),
      f"`{report['topology']}` ({chips} x {report['hbm_bytes'] / GB:.0f} GB)",
      f"`{mesh}`", str(report["seq_len"]),
      " / ".join(_gb(e) for _, e in steps),
      " / ".join(_gb(e) for e in reference) or "-",
      _gb(functions["sampler_prefill"]),
      _gb(functions["sampler_generate"]),
      "fits" if report["fits"] else "**does not fit**"]
  return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("reports", nargs="+", help="JSON files written by "
                      "launch/plan.py --aot TOPOLOGY --json")
  args = parser.parse_args(argv)
  rows = []
  for path in args.reports:
    with open(path) as f:
      report = json.load(f)
    missing = {"config", "topology", "devices", "mesh", "seq_len",
               "hbm_bytes", "functions", "fits"} - set(report)
    if missing:
      print(f"{path}: not an --aot report (missing {sorted(missing)})",
            file=sys.stderr)
      return 2
    rows.append((_order(report), table_row(report)))
  print(HEADER)
  for _, row in sorted(rows):
    print(row)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
