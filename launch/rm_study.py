"""The reward-model study: warm start, both reward models trained and
measured against the exact verifier, RL with each reward compared.

  python launch/rm_study.py --config experiments/rm_tiny.py --workdir /tmp/rm_tiny
  python launch/rm_study.py --config experiments/rm_tiny.py:micro --workdir DIR

Rerun with the same --workdir to resume. Writes WORKDIR/rm_study.json and
prints the comparison table (docs/rewards.md).
"""

import sys

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import ConfigError, define_config_flag, parse_flags

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory",
                               required=True)


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.reward_models import study, train as train_lib
  try:
    train_lib.parse(_CONFIG.value)
  except (ConfigError, ValueError) as exc:
    sys.exit(f"config error: {exc}")
  from kimi_jax.infra.workdir_lock import WorkdirBusyError
  try:
    summary = study.run_study(_CONFIG.value, _WORKDIR.value)
  except WorkdirBusyError as exc:
    sys.exit(f"workdir error: {exc}")
  print(study.table(summary))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
