"""Curates an RL prompt set (report 2.1; docs/curation.md).

  python launch/curate.py --config experiments/data/gym_curate.py \\
      --in RAW.jsonl --out CURATED.jsonl --report REPORT.json \\
      --held_out EVAL.jsonl [--held_out VAL.jsonl] --config.policy.workdir=W

Steps (each switchable with --config.curate.<step>=False): format filter
(multiple-choice / true-false / proof), exact and near-duplicate removal
(and of repeats of the --held_out evaluation and validation problems),
domain tags (rules, or --config.curate.tagger=learned: a model fitted on
labelled prompts) and per-tag balance, easy-to-hack filter (no-CoT
guesses), difficulty by pass rate (pass_rate + difficulty bucket), tag cap
(optional), difficulty balance (optional:
--config.curate.bucket_shares="(1, 1, 1)" keeps as many easy as medium as
hard prompts).
The model steps ask the policy of --config.policy.workdir (a kimi_jax run)
or of --config.policy.experiment (+ init_from_hf) through our sampler, and
verify with --config.reward.name. Every dropped row goes to --rejected
(default: OUT with .rejected.jsonl) with its step and reason; the report
counts rows read, kept and dropped per step and reason, and each tag's
most common answers before and after; a warning on stderr names an answer
curation all but removed (curate.answer_shift*; docs/curation.md). The
model steps ask in chunks (curate.chunk_prompts) and journal each finished
one (--journal), so a killed run, rerun with the same command, asks only
for what is left.
"""

import json
import sys

from absl import app, flags

from kimi_jax.data import journal as journal_lib
from kimi_jax.infra import quiet
from kimi_jax.infra.config import define_config_flag, parse_flags

_CONFIG = define_config_flag()
_IN = flags.DEFINE_string("in", None, "raw prompt set (JSONL)", required=True)
_OUT = flags.DEFINE_string("out", None, "curated prompt set (JSONL)",
                           required=True)
_REPORT = flags.DEFINE_string("report", None, "report (JSON)", required=True)
_HELD_OUT = flags.DEFINE_multi_string(
    "held_out", [], "held-out evaluation or validation set (JSONL, same "
    "fields; repeat the flag for several): train prompts that repeat one "
    "of their problems are dropped")
_REJECTED = flags.DEFINE_string(
    "rejected", None, "dropped rows with reasons (JSONL; default: OUT with "
    ".rejected.jsonl)")
_JOURNAL, _PROGRESS = journal_lib.define_flags("curate")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.infra.config import ConfigError
  from kimi_jax.curation import curate as curate_lib
  from kimi_jax.curation import config as tools_config
  from kimi_jax.data.records import DataError
  config = _CONFIG.value
  try:
    cfg = tools_config.curate_config(config)
    # Bad rows stop the run before any weights load.
    curate_lib.read_rows(flags.FLAGS["in"].value, cfg)
    from kimi_jax.data import records
    held_out = [r for path in _HELD_OUT.value
                for r in records.load_prompt_source(path, cfg.fields())]
    policy = reward = journal = None
    if cfg.needs_model:
      reward = tools_config.make_reward(config)
      policy = tools_config.load_policy(tools_config.policy_config(config))
      journal = tools_config.model_journal(
          _JOURNAL.value or tools_config.sibling_path(_OUT.value,
                                                      ".journal.jsonl"),
          policy, config)
    result = curate_lib.curate(flags.FLAGS["in"].value, cfg, policy=policy,
                               reward=reward, held_out=held_out,
                               journal=journal, progress=_PROGRESS.value)
  except ConfigError as exc:
    sys.exit(f"config error: {exc}")
  except DataError as exc:
    sys.exit(f"data error: {exc}")
  report = curate_lib.write_outputs(
      result, _OUT.value,
      _REJECTED.value or tools_config.sibling_path(_OUT.value,
                                                   ".rejected.jsonl"),
      _REPORT.value)
  if journal is not None and journal.reused:
    print(f"resumed: {journal.reused} chunks of model answers read back "
          f"from {journal.path}", file=sys.stderr)
  print(json.dumps({k: report[k] for k in ("rows", "kept", "dropped",
                                           "dropped_by_reason")}))
  for warning in curate_lib.shift_warnings(report):
    print(f"warning: {warning}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
