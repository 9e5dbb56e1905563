"""python launch/tpu_run.py --config experiments/qwen2_5_7b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-7B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl

Long-CoT RL of Qwen2.5-7B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens, the report's first long-context stage; partial
rollouts generate 8k tokens per trajectory per iteration. Suggested mesh:
tensor=4 (kv_heads=4 must divide over `tensor`), fsdp=16 over the rest with
data taking what is left, e.g. data=4 on 256 chips. Check memory first:
`python launch/plan.py --config experiments/qwen2_5_7b.py --mesh data=4,fsdp=16,tensor=4 --device-memory-gb 95`.
At the full length the train step's activations exceed a chip until attention
and log-probs are chunked; docs/tpu_pod.md lists lengths that fit today.
Tiny CPU variant: `--config experiments/qwen2_5_7b.py:tiny`.
"""

import os
import runpy

import ml_collections

_common = runpy.run_path(os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "_common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  model = _common["qwen2_5_model"](
      vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
      mlp_dim=18944, tie_embeddings=False, max_seq_len=32768)
  full = _common["long_cot_config"](
      model, mesh=dict(data=-1, fsdp=16, tensor=4), max_slots=256,
      prompts_per_iteration=256, minibatch_prompts=8, learning_rate=1e-6)
  return _common["select"](arg, full)
