"""Writes raw train and held-out problem sets from reasoning-gym's
generators (docs/curation.md), the input of launch/curate.py.

  python launch/gym_data.py --config experiments/data/gym_curate.py \\
      --train RAW.jsonl --eval EVAL.jsonl [--val VAL.jsonl]

Datasets, sizes and generator options: --config.gym.* (datasets is a
comma-separated list, options_json a JSON object of per-dataset options,
where_json per-dataset {record field: regex} filters, e.g.
'{"spell_backward": {"metadata.word": "^[a-z]+$"}}' for lower-case words).
"""

import json

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import define_config_flag, parse_flags

_CONFIG = define_config_flag()
_TRAIN = flags.DEFINE_string("train", None, "train problems (JSONL)",
                             required=True)
_EVAL = flags.DEFINE_string("eval", None, "held-out problems (JSONL)",
                            required=True)
_VAL = flags.DEFINE_string(
    "val", None, "validation problems (JSONL): --config.gym.val_size per "
    "dataset, the items after the held-out ones; for task.val_path")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.infra.config import to_dataclass
  from kimi_jax.curation.curate import write_jsonl
  from kimi_jax.curation.gym_problems import (GymConfig, problem_sets,
                                              validation_set)
  gym = to_dataclass(GymConfig, _CONFIG.value.gym, "gym")
  if _VAL.value and not gym.has_val():
    raise app.UsageError("--val needs --config.gym.val_size > 0")
  train, held = problem_sets(gym)
  write_jsonl(_TRAIN.value, train)
  write_jsonl(_EVAL.value, held)
  counts = {"train": len(train), "eval": len(held)}
  if _VAL.value:
    val = validation_set(gym)
    write_jsonl(_VAL.value, val)
    counts["val"] = len(val)
  print(json.dumps(counts))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
