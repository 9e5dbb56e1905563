"""Writes a run's checkpoint as a Hugging Face directory.

  python launch/export_hf.py --workdir WORKDIR --out DIR [--step N]

DIR gets config.json, safetensors weights and, for runs started from a
Hugging Face checkpoint (config.init_from_hf), its tokenizer files, chat
template and generation_config.json; `transformers`, vLLM or SGLang load it
as is. --step is an Orbax step of WORKDIR/checkpoints (default: the latest).
DIR must be new or empty.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True,
                 help="the run's workdir (holds config.json and checkpoints/)")
  p.add_argument("--out", required=True,
                 help="directory to write (new or empty)")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step to export (default: the latest)")
  p.add_argument("--max-shard-gb", type=float, default=None,
                 help="split the weights into files of at most this size")
  p.add_argument("--verbosity", "-v", type=int, default=None,
                 help="show library logs at this absl level (0: INFO); "
                 "default: warnings only")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  from kimi_jax.infra import quiet
  quiet.start(args.verbosity)
  from kimi_jax.job.export import ExportError, export_workdir
  from kimi_jax.model.hf import HFCheckpointError
  shard = None if args.max_shard_gb is None else int(args.max_shard_gb * 2**30)
  try:
    result = export_workdir(args.workdir, args.out, step=args.step,
                            max_shard_bytes=shard)
  except (ExportError, HFCheckpointError, FileNotFoundError) as exc:
    sys.exit(f"export error: {exc}")
  source = result.source_dir or "none (weights and config.json only)"
  print(f"exported step {result.step} of {args.workdir} to {result.out} "
        f"(tokenizer from {source})")


if __name__ == "__main__":
  main()
