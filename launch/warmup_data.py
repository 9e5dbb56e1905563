"""Long-CoT warm-up data by rejection sampling (report 2.2;
docs/curation.md).

  python launch/warmup_data.py --config experiments/data/gym_curate.py \\
      --in CURATED.jsonl --out WARMUP.jsonl --report WARMUP_REPORT.json \\
      --config.policy.workdir=W

K responses per prompt (--config.warmup.samples) under a template that
asks for planning, evaluation, reflection and exploration; the responses
the reward (--config.reward.name) verifies are kept (all up to
warmup.max_per_prompt, or the shortest; --config.warmup.accept=score also
rejects right answers that a process check such as reasoning_gym_steps
scores 0) and written as SFT rows
{prompt, response} that --config.sft.train_path of the main job reads. The
report gives the acceptance rate overall and per tag, and examples.
Finished chunks of prompts are journaled as they finish (--journal), so a
killed run, rerun with the same command, samples only what is left.
"""

import json
import sys

from absl import app, flags

from kimi_jax.data import journal as journal_lib
from kimi_jax.infra import quiet
from kimi_jax.infra.config import define_config_flag, parse_flags

_CONFIG = define_config_flag()
_IN = flags.DEFINE_string("in", None, "curated prompt set (JSONL)",
                          required=True)
_OUT = flags.DEFINE_string("out", None, "SFT rows (JSONL)", required=True)
_REPORT = flags.DEFINE_string("report", None, "report (JSON)", required=True)
_JOURNAL, _PROGRESS = journal_lib.define_flags("warmup")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.infra.config import ConfigError
  from kimi_jax.curation import curate as curate_lib
  from kimi_jax.data import records
  from kimi_jax.curation import config as tools_config
  from kimi_jax.curation import warmup
  from kimi_jax.data.records import DataError
  config = _CONFIG.value
  try:
    cfg = tools_config.warmup_config(config)
    fields = tools_config.curate_config(config).fields()
    source = records.load_prompt_source(flags.FLAGS["in"].value, fields)
    reward = tools_config.make_reward(config)
    policy = tools_config.load_policy(tools_config.policy_config(config))
    journal = tools_config.model_journal(
        _JOURNAL.value or tools_config.sibling_path(_OUT.value,
                                                    ".journal.jsonl"),
        policy, config)
    result = warmup.rejection_sample(list(source), cfg, policy=policy,
                                     reward=reward, journal=journal,
                                     progress=_PROGRESS.value)
  except ConfigError as exc:
    sys.exit(f"config error: {exc}")
  except DataError as exc:
    sys.exit(f"data error: {exc}")
  if journal.reused:
    print(f"resumed: {journal.reused} chunks of responses read back from "
          f"{journal.path}", file=sys.stderr)
  curate_lib.write_jsonl(_OUT.value, result.rows)
  report = dict(result.report(), input=flags.FLAGS["in"].value,
                output=_OUT.value)
  with open(_REPORT.value, "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps({k: report[k] for k in ("prompts", "responses", "correct",
                                           "acceptance_rate", "rows")}))
  if not result.rows:
    sys.exit("warm-up: no verified response; nothing to train on (see the "
             "report's acceptance rates)")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
