"""Evaluates a run's checkpoint and splits the figures by what the problems
are (docs/loop.md, "Evaluating a checkpoint, split by problem").

  python launch/evaluate.py --workdir W/rl --split val \\
      --by metadata.word_len --by capitalised=metadata.word:^[A-Z] \\
      --out W/eval_breakdown

The run's own evaluator (its config, tokenizer, verifier, sampling settings
and seeds): on the latest checkpoint it reproduces the run's final held-out
figures. --data reads another JSONL file with the task's fields instead.
Prints pass@1 (± its standard error over problems), greedy accuracy and
mean sampled length, overall and per group of each --by:
  --by FIELD               one group per value of a record field (a dotted
                           path: metadata.word_len, tags.0);
  --by NAME=FIELD:PATTERN  two groups, "yes" and "no": whether the field's
                           text matches the regular expression.
--pass_at K adds pass@K (unbiased, from --samples draws per problem).
With --out, writes breakdown.json (the tables) and responses.jsonl (every
scored response, the greedy one as draw -1, with its groups).
"""

import json
import os
import sys

from absl import app, flags

from kimi_jax.infra import quiet

_WORKDIR = flags.DEFINE_string("workdir", None, "a kimi_jax run's workdir",
                               required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
_SPLIT = flags.DEFINE_enum("split", "eval", ["eval", "val"],
                           "the run's held-out (eval) or validation (val) "
                           "problems")
_DATA = flags.DEFINE_string("data", "", "a JSONL file to evaluate instead of "
                            "the split's (a jsonl task's fields)")
_SAMPLES = flags.DEFINE_integer("samples", None, "draws per problem at the "
                                "run's sampling settings (default: "
                                "rl.eval_samples)")
_BY = flags.DEFINE_multi_string("by", [], "FIELD or NAME=FIELD:PATTERN "
                                "(repeat for several)")
_PASS_AT = flags.DEFINE_multi_integer("pass_at", [], "also pass@k for this "
                                      "k <= --samples (repeat for several)")
_OUT = flags.DEFINE_string("out", "", "directory for breakdown.json and "
                           "responses.jsonl")


def response_rows(drawn, records, splits):
  """One JSON row per scored response (draw -1: greedy)."""
  labels = [{s.name: s.label(r) for s in splits} for r in records]
  for i in range(len(drawn.problem_N)):
    p = int(drawn.problem_N[i])
    yield dict(problem=p, id=records[p].get("id", p),
               draw=int(drawn.draw_N[i]), correct=bool(drawn.correct_N[i]),
               length=int(drawn.length_N[i]), text=str(drawn.text_N[i]),
               **labels[p])


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.job import workdir as workdir_lib
  from kimi_jax.infra.config import ConfigError
  from kimi_jax.data.records import DataError
  from kimi_jax.rl import breakdown as bd
  try:
    splits = [bd.parse_split(s) for s in _BY.value]
    names = [s.name for s in splits]
    if len(set(names)) != len(names) or "all" in names:
      raise ConfigError(f"--by names must be distinct and not 'all': "
                        f"{names}")
    ks = sorted(set(_PASS_AT.value))
    evaluator, cfg = workdir_lib.evaluator(
        _WORKDIR.value, split=_SPLIT.value, data=_DATA.value,
        samples=_SAMPLES.value)
    if ks and not 1 <= ks[0] <= ks[-1] <= evaluator.samples:
      raise ConfigError(f"--pass_at {ks}: each k must be in [1, "
                        f"{evaluator.samples}] (the draws per problem; "
                        f"raise --samples)")
    params, step = workdir_lib.restore_params(
        _WORKDIR.value, cfg, evaluator.sampler.engine.param_shardings,
        _STEP.value)
  except (ConfigError, DataError, ValueError, FileNotFoundError) as exc:
    sys.exit(f"evaluate: {exc}")
  drawn = evaluator.sample(params)
  records = evaluator.records
  tables = bd.breakdown(drawn, records, splits, ks)
  source = _DATA.value or f"the run's {_SPLIT.value} set"
  print(f"{_WORKDIR.value} step {step}: {drawn.n_problems} problems from "
        f"{source}, {evaluator.samples} draws each")
  for name, rows in tables.items():
    print()
    print(bd.format_table(name, rows, ks))
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    report = dict(workdir=os.path.abspath(_WORKDIR.value), step=step,
                  split=_SPLIT.value, data=_DATA.value,
                  samples=evaluator.samples, pass_at=ks,
                  splits=[dict(name=s.name, field=s.field, pattern=s.pattern)
                          for s in splits], tables=tables)
    with open(os.path.join(_OUT.value, "breakdown.json"), "w") as f:
      json.dump(report, f, indent=2)
    with open(os.path.join(_OUT.value, "responses.jsonl"), "w") as f:
      for row in response_rows(drawn, records, splits):
        f.write(json.dumps(row) + "\n")
    print(f"\nwrote {_OUT.value}/breakdown.json and responses.jsonl")


if __name__ == "__main__":
  app.run(main)
