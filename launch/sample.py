"""Prints completions from a checkpoint.

  python launch/sample.py --config experiments/tiny.py --checkpoint WORKDIR \\
      --prompt "37 c5 =" --num-samples 4 [--temperature 0.8 --top-k 0
      --top-p 1.0 --greedy --seed 0 --max-new-tokens N --step S]

Any --config.KEY=VALUE overrides that key of the config file.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
  from kimi_jax.sampler.cli import main
  main()
