"""Runs a test-input generator (`generator.py`) with its bundled dependencies.

Runs inside the code sandbox under its Python 3 (standard library only): the
pure-Python sources of the generator's packages arrive as one JSON file and
are unpacked onto `sys.path`; `random` is seeded with the job's seed.
"""

import json
import os
import random
import runpy
import sys

with open("generator_job.json") as f:
  job = json.load(f)
with open("pydeps.json") as f:
  bundle = json.load(f)
for rel, text in bundle.items():
  path = os.path.join("_pydeps", rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
sys.path.insert(0, os.path.abspath("_pydeps"))
random.seed(job["seed"])
sys.argv = ["generator.py", str(job["seed"])]
runpy.run_path("generator.py", run_name="__main__")
