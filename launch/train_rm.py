"""Trains the reward models (report 2.3.5) and measures them.

  python launch/train_rm.py --config experiments/rm_tiny.py \\
      --workdir /tmp/rm --policy_workdir /tmp/kimi_tiny
  python launch/train_rm.py --config experiments/rm_tiny.py:micro \\
      --workdir /tmp/rm --policy_workdir DIR --config.rm_value.loss=bradley_terry

The policy (the latest checkpoint of --policy_workdir, or --policy_step; or
config.init_from_hf) answers the task's prompts, the task's verifier labels
the answers, a classic value-head model and a chain-of-thought model train
on the labels, and both are judged on held-out prompts. Writes
WORKDIR/value, WORKDIR/cot (reward-model directories for
config.reward_model.path), WORKDIR/labelled/*.jsonl and WORKDIR/rm_eval.json
(accuracy, precision, recall against the verifier; the verifier against
config.rm_data.hand_labelled when set). Rerun the same command after a
kill to resume: finished labelling chunks and models are read back, and a
model's training continues from its last checkpoint
(config.rm_value.checkpoint_every / config.rm_cot.checkpoint_every steps).
See docs/rewards.md.
"""

import json
import sys

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import ConfigError, define_config_flag, parse_flags

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory",
                               required=True)
_POLICY = flags.DEFINE_string(
    "policy_workdir", "", "a run's workdir whose checkpoint is the policy "
    "(default: config.init_from_hf)")
_STEP = flags.DEFINE_integer("policy_step", None, "checkpoint step of the "
                             "policy (default: the latest)")
_EXPORT = flags.DEFINE_string(
    "export_value_hf", "", "also export the value model as a Hugging Face "
    "sequence-classification directory here")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.reward_models import train as train_lib
  from kimi_jax.infra.workdir_lock import WorkdirBusyError
  try:
    train_lib.parse(_CONFIG.value)
  except (ConfigError, ValueError) as exc:
    sys.exit(f"config error: {exc}")
  try:
    result = train_lib.train_reward_models(
        _CONFIG.value, _WORKDIR.value, policy_workdir=_POLICY.value,
        policy_step=_STEP.value)
  except ConfigError as exc:
    sys.exit(f"config error: {exc}")
  except WorkdirBusyError as exc:
    sys.exit(f"workdir error: {exc}")
  if _EXPORT.value:
    import os
    import jax
    from kimi_jax.reward_models import store
    from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
    sharder = Sharder(make_mesh(MeshConfig(), jax.local_devices()[:1]))
    store.export_value_hf(store.load(os.path.join(_WORKDIR.value, "value"),
                                     sharder), _EXPORT.value)
  summary = {k: result[k] for k in ("value", "cot") if k in result}
  for v in summary.values():
    v.pop("train", None)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
