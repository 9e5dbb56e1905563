"""python launch/tpu_run.py --config experiments/qwen2_5_32b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-32B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl

Long-CoT RL of Qwen2.5-32B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens, the report's first long-context stage. Suggested
mesh: tensor=8 (kv_heads=8 must divide over `tensor`; 40 heads, the MLP and
the vocabulary divide by 8 too), fsdp=32 over the rest. Check memory first:
`python launch/plan.py --config experiments/qwen2_5_32b.py --mesh data=1,fsdp=32,tensor=8 --device-memory-gb 16`.
At the full length the train step's activations exceed a chip until attention
and log-probs are chunked; docs/tpu_pod.md lists lengths that fit today.
Tiny CPU variant: `--config experiments/qwen2_5_32b.py:tiny`.
"""

import os
import runpy

import ml_collections

_common = runpy.run_path(os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "_common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  model = _common["qwen2_5_model"](
      vocab_size=152064, d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8,
      mlp_dim=27648, tie_embeddings=False, max_seq_len=32768)
  full = _common["long_cot_config"](
      model, mesh=dict(data=-1, fsdp=32, tensor=8), max_slots=128,
      prompts_per_iteration=256, minibatch_prompts=4, learning_rate=5e-7)
  return _common["select"](arg, full)
