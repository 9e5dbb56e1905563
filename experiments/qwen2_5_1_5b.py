"""python launch/tpu_run.py --config experiments/qwen2_5_1_5b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-1.5B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl

Long-CoT RL of Qwen2.5-1.5B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 16k tokens: a small model's CoT grows long too, but 16k keeps
an iteration cheap enough for quick recipe experiments; raise
model.max_seq_len, sampler.cache_len and the buckets together for more.
Suggested mesh: tensor=2 (kv_heads=2 must divide over `tensor`), fsdp=8,
data over the rest. Check memory first:
`python launch/plan.py --config experiments/qwen2_5_1_5b.py --mesh data=16,fsdp=8,tensor=2 --device-memory-gb 16`.
At 16k the train step fits a 95 GB chip but not a 16 GB one until attention
and log-probs are chunked; docs/tpu_pod.md lists lengths that fit today.
Tiny CPU variant: `--config experiments/qwen2_5_1_5b.py:tiny`.
"""

import os
import runpy

import ml_collections

_common = runpy.run_path(os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "_common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  model = _common["qwen2_5_model"](
      vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
      mlp_dim=8960, tie_embeddings=True, max_seq_len=16384)
  full = _common["long_cot_config"](
      model, mesh=dict(data=-1, fsdp=8, tensor=2), max_slots=256,
      prompts_per_iteration=256, minibatch_prompts=16, learning_rate=1e-6)
  return _common["select"](arg, full)
