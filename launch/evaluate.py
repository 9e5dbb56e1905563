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

Standard benchmarks from their published files (docs/evaluation.md):

  python launch/evaluate.py --hf DIR --benchmark math500=FILE \\
      --benchmark aime=FILE --benchmark gsm8k=FILE --benchmark humaneval \\
      --samples K --out OUT
  (--workdir W [--step N] instead of --hf: a run's checkpoint; --responses
  FILE instead of either: score another engine's responses, no model)

writes OUT/benchmarks.json and OUT/responses.jsonl and prints a table.
"""

import json
import os
import sys

from absl import app, flags

from kimi_jax.infra import quiet

_WORKDIR = flags.DEFINE_string("workdir", None, "a kimi_jax run's workdir")
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
_BENCHMARK = flags.DEFINE_multi_string(
    "benchmark", [], "NAME=FILE or NAME (humaneval): a standard benchmark "
    "(math500, aime, gsm8k, humaneval, livecodebench, mbpp, mathvista; "
    "repeat for several)")
_HF = flags.DEFINE_string("hf", "", "--benchmark: a Hugging Face checkpoint "
                          "directory to evaluate")
_EXPERIMENT = flags.DEFINE_string(
    "experiment", "experiments/qwen2_5_1_5b.py:cpu_smoke",
    "--hf: the experiment whose sampler, mesh and task prompt format run "
    "the checkpoint (its model comes from the checkpoint)")
_OVERRIDE = flags.DEFINE_multi_string(
    "override", [], "--hf: KEY=VALUE set in --experiment's config (e.g. "
    "sampler.cache_len=4096)")
_RESPONSES = flags.DEFINE_string(
    "responses", "", "--benchmark: score this JSONL of {benchmark, id, "
    "response} rows instead of sampling a model")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "--benchmark: "
                                  "default the config's sampler.temperature")
_TOP_P = flags.DEFINE_float("top_p", None, "--benchmark: default the "
                            "config's sampler.top_p")
_MAX_RESPONSE_LEN = flags.DEFINE_integer(
    "max_response_len", None, "--benchmark: default the config's "
    "rl.max_response_len")
_SEED = flags.DEFINE_integer("seed", 0, "--benchmark: sampling seed")
_JOURNAL = flags.DEFINE_string(
    "journal", None, "--benchmark: finished chunks of problems, sampled and "
    "scored (default OUT/journal.jsonl; '' for none): a rerun of a killed "
    "evaluation samples only what is left")
_CHUNK = flags.DEFINE_integer(
    "chunk_problems", 0, "--benchmark: problems per sampler call and "
    "journal entry (0: 1024 requests' worth)")


def response_rows(drawn, records, splits):
  """One JSON row per scored response (draw -1: greedy)."""
  labels = [{s.name: s.label(r) for s in splits} for r in records]
  for i in range(len(drawn.problem_N)):
    p = int(drawn.problem_N[i])
    yield dict(problem=p, id=records[p].get("id", p),
               draw=int(drawn.draw_N[i]), correct=bool(drawn.correct_N[i]),
               length=int(drawn.length_N[i]), text=str(drawn.text_N[i]),
               **labels[p])


def benchmark_main() -> None:
  """--benchmark: standard benchmarks (kimi_jax/evaluation)."""
  from kimi_jax.evaluation import benchmarks, run, sampling
  from kimi_jax.infra.config import ConfigError
  from kimi_jax.data.records import DataError
  sources = [x for x in (_WORKDIR.value, _HF.value, _RESPONSES.value) if x]
  try:
    if len(sources) != 1:
      raise ConfigError("--benchmark needs exactly one of --workdir, --hf "
                        "or --responses")
    if not _OUT.value:
      raise ConfigError("--benchmark needs --out")
    if _BY.value or _DATA.value:
      raise ConfigError("--by and --data evaluate a run's own task, not "
                        "--benchmark")
    loaded = benchmarks.load_all(_BENCHMARK.value)
    ks = tuple(sorted(set(_PASS_AT.value)))
    samples = run.DEFAULT_SAMPLES if _SAMPLES.value is None else (
        _SAMPLES.value)
    if samples < 1:
      raise ConfigError(f"--samples must be >= 1, got {samples}")
    model, settings = None, run.Settings(pass_at=ks)
    if not _RESPONSES.value:
      if ks and ks[-1] > samples:
        raise ConfigError(f"--pass_at {list(ks)}: k must be <= --samples "
                          f"{samples}")
      from kimi_jax.curation import policy as policy_lib
      from kimi_jax.infra.config import load_config
      from kimi_jax.job import workdir as workdir_lib
      if _WORKDIR.value:
        config = workdir_lib.load_config(_WORKDIR.value)
        policy = policy_lib.load_policy(workdir=_WORKDIR.value,
                                        step=_STEP.value)
      else:
        config = load_config(_EXPERIMENT.value,
                             ["init_from_hf=" + _HF.value] + _OVERRIDE.value)
        policy = policy_lib.load_policy(config=config)
      model = sampling.model_of_policy(policy, config.task)
      pick = lambda flag, default: default if flag is None else flag
      settings = run.Settings(
          samples=samples,
          temperature=pick(_TEMPERATURE.value,
                           float(config.sampler.temperature)),
          top_p=pick(_TOP_P.value, float(config.sampler.top_p)),
          max_response_len=pick(_MAX_RESPONSE_LEN.value,
                                int(config.rl.max_response_len)),
          seed=_SEED.value, pass_at=ks, chunk_problems=_CHUNK.value)
    source = (model.identity if model is not None else
              f"responses {os.path.abspath(_RESPONSES.value)}")
    # Flag unset: OUT/journal.jsonl (""); --journal=: none (None).
    journal = ("" if _JOURNAL.value is None else
               _JOURNAL.value or None)
    report = run.evaluate(loaded, out=_OUT.value, model=model,
                          responses=_RESPONSES.value, settings=settings,
                          source=source, journal=journal)
  except (benchmarks.BenchmarkError, ConfigError, DataError, ValueError,
          FileNotFoundError) as exc:
    sys.exit(f"evaluate: {exc}")
  print(f"{source}\n")
  print(run.format_table(report))
  print(f"\nwrote {_OUT.value}/benchmarks.json and responses.jsonl")


def main(argv):
  del argv
  quiet.start()
  if _BENCHMARK.value:
    return benchmark_main()
  if _HF.value or _RESPONSES.value or not _WORKDIR.value:
    sys.exit("evaluate: without --benchmark, give --workdir (a run's own "
             "task); --hf and --responses need --benchmark")
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
