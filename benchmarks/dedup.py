#!/usr/bin/env python3
"""Near-duplicate search on number-free prompts: exact pairwise vs MinHash.

Number-free prompts fall into one block of `kimi_jax/curation/dedup.py`, where
the pairwise search compares every prompt with every kept one. This times
`find_duplicates` both ways on the same synthetic set and counts what the
MinHash search found of what the pairwise one found (its recall; it never
reports a pair the exact Jaccard rejects).

The set: N prompts of 15-30 words drawn from 3000 made-up words (so no
template shingles), and a planted near duplicate for every tenth: an
earlier prompt with one word replaced (Jaccard of character 5-grams about
0.8-0.9). Pairwise runs up to --pairwise-max prompts (it is quadratic);
MinHash runs at every size.

  python benchmarks/dedup.py --json docs/results/dedup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.curation import dedup  # noqa: E402

SIZES = (1000, 4000, 16000, 64000)


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  vocab = ["".join(rng.choice(letters, rng.integers(3, 9)))
           for _ in range(3000)]
  texts: list[str] = []
  for i in range(n):
    if i % 10 == 9:  # a near duplicate of an earlier prompt
      words = texts[rng.integers(0, i)].split()
      words[rng.integers(0, len(words))] = vocab[rng.integers(0, 3000)]
      texts.append(" ".join(words))
    else:
      texts.append(" ".join(vocab[j] for j in rng.integers(
          0, 3000, rng.integers(15, 31))))
  return texts


def timed(texts: list[str], search: str) -> tuple[float, list]:
  start = time.perf_counter()
  found = dedup.find_duplicates(texts, dedup.DedupConfig(search=search))
  return time.perf_counter() - start, found


def run(sizes, pairwise_max: int) -> dict:
  rows = []
  for n in sizes:
    texts = synthetic_prompts(n)
    mh_s, mh = timed(texts, "minhash")
    row = dict(prompts=n, minhash_s=mh_s, minhash_found=len(mh))
    if n <= pairwise_max:
      pw_s, pw = timed(texts, "pairwise")
      pairs = {(d.index, d.of) for d in pw}
      row.update(pairwise_s=pw_s, pairwise_found=len(pw),
                 minhash_recall=(len(pairs & {(d.index, d.of) for d in mh})
                                 / max(len(pairs), 1)),
                 speedup=pw_s / mh_s)
    rows.append(row)
    print(f"[dedup] {n} prompts: minhash {mh_s:.1f} s"
          + (f", pairwise {row['pairwise_s']:.1f} s" if "pairwise_s" in row
             else ""), file=sys.stderr)
  cfg = dedup.DedupConfig()
  return dict(machine=platform.machine(), cpus=os.cpu_count(),
              bands=cfg.minhash_bands, rows_per_band=cfg.minhash_rows,
              threshold=cfg.threshold, rows=rows)


def print_table(report: dict) -> None:
  print(f"\nnear-duplicate search, number-free prompts ({report['bands']} "
        f"bands x {report['rows_per_band']} rows, threshold "
        f"{report['threshold']})")
  print("| prompts | pairwise s | MinHash s | speed-up | found (pairwise / "
        "MinHash) | MinHash recall |")
  print("|---|---|---|---|---|---|")
  for r in report["rows"]:
    pw = (f"{r['pairwise_s']:.1f} | {r['minhash_s']:.1f} | "
          f"{r['speedup']:.0f}x | {r['pairwise_found']} / "
          f"{r['minhash_found']} | {r['minhash_recall']:.4f}"
          if "pairwise_s" in r else
          f"— | {r['minhash_s']:.1f} | — | — / {r['minhash_found']} | —")
    print(f"| {r['prompts']} | {pw} |")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="\n\n".join(__doc__.split("\n\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                      help="prompt counts, comma-separated")
  parser.add_argument("--pairwise-max", type=int, default=4000,
                      help="largest set the quadratic search runs on")
  parser.add_argument("--json", help="write results here")
  args = parser.parse_args(argv)
  report = run([int(s) for s in args.sizes.split(",")], args.pairwise_max)
  print_table(report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
