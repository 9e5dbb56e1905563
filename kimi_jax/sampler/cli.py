"""Completions from a checkpoint: the logic behind launch/sample.py.

  python launch/sample.py --config experiments/tiny.py --checkpoint WORKDIR \\
      --prompt "37 c5 =" --num-samples 4 --temperature 0.8

--checkpoint is a run's workdir (its `checkpoints/` is used) or an Orbax
checkpoint directory written by `kimi_jax.checkpoint.Checkpointer`. The
tokenizer is the one the run trained with: the Hugging Face one when the
config sets `init_from_hf`, else the task's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from kimi_jax import checkpoint as ckpt_lib
from kimi_jax.config import load_config, split_config_args
from kimi_jax.model import transformer
from kimi_jax.sampler.driver import SampleRequest, SampleResult, Sampler
from kimi_jax.sampler.engine import Engine
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import Sharder, make_mesh


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  overrides, rest = split_config_args(list(argv))
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Any --config.KEY=VALUE overrides that key of the config file.")
  p.add_argument("--config", required=True, help="experiment file")
  p.add_argument("--checkpoint", required=True,
                 help="run workdir or Orbax checkpoint directory")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step (default: latest)")
  p.add_argument("--prompt", action="append", required=True,
                 help="prompt text (repeat the flag for several)")
  p.add_argument("--num-samples", type=int, default=1)
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="default: whatever the cache leaves after the prompt")
  p.add_argument("--temperature", type=float, default=None,
                 help="default: config.sampler.temperature")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--greedy", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(rest), overrides


def load_tokenizer(run_cfg: Any) -> Any:
  if run_cfg.init_from_hf:
    from kimi_jax.model.tokenizer import load_hf_tokenizer
    return load_hf_tokenizer(run_cfg.init_from_hf)
  from kimi_jax.data.tasks import make_task
  return make_task(run_cfg.task, run_cfg.seed).tokenizer


def checkpoint_dir(path: str) -> str:
  nested = os.path.join(path, "checkpoints")
  found = nested if os.path.isdir(nested) else path
  if not os.path.isdir(found):
    raise FileNotFoundError(f"--checkpoint: no directory {path}")
  return found


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
  """Prompt ids as the tasks build them: bos (when the tokenizer has one)."""
  bos = getattr(tokenizer, "bos_id", None)
  return tuple(([bos] if bos is not None else []) + tokenizer.encode(text))


def main(argv: Sequence[str] | None = None) -> list[SampleResult]:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from kimi_jax.run import parse_config
  run_cfg = parse_config(load_config(args.config, overrides))
  tokenizer = load_tokenizer(run_cfg)
  engine = Engine(run_cfg.model, run_cfg.engine,
                  sharder=Sharder(make_mesh(run_cfg.mesh), run_cfg.rules))
  ckpt = ckpt_lib.Checkpointer(checkpoint_dir(args.checkpoint))
  params, _, _ = ckpt.restore(
      args.step, params_like=transformer.abstract_params(run_cfg.model),
      params_shardings=engine.param_shardings)
  ckpt.close()
  engine.load_params(params)

  s = run_cfg.sampling
  requests = []
  for i, text in enumerate(args.prompt):
    prompt = encode(tokenizer, text)
    room = engine.cache_len - len(prompt)
    for j in range(args.num_samples):
      requests.append(SampleRequest(
          (i, j), prompt,
          max_new_tokens=min(args.max_new_tokens or room, room),
          stop_tokens=(tokenizer.eos_id,),
          sampling=SamplingParams(
              temperature=s.temperature if args.temperature is None else
              args.temperature,
              top_k=s.top_k if args.top_k is None else args.top_k,
              top_p=s.top_p if args.top_p is None else args.top_p,
              greedy=args.greedy, seed=args.seed + j)))
  results = Sampler(engine, run_cfg.repeat).generate(requests)
  for req, res in zip(requests, results):
    tokens = [t for t in res.tokens if t != tokenizer.eos_id]
    print(f"[prompt {req.id[0]} sample {req.id[1]}] ({res.finish_reason}, "
          f"{len(res.tokens)} tokens, logp {sum(res.logprobs):.2f}) "
          f"{args.prompt[req.id[0]]} -> {tokenizer.decode(tokens)}")
  return results
