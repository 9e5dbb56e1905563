"""python launch/tpu_run.py --config experiments/qwen2_5_1_5b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-1.5B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Qwen2.5-1.5B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens, the report's first long-context stage. Mesh:
tensor=2 (kv_heads=2 must divide over `tensor`), fsdp=8, data over the rest.
The TPU compiler's check, from any host with libtpu:
`python launch/plan.py --config experiments/qwen2_5_1_5b.py --aot v5e:16x16`.
Tiny CPU variant: `--config experiments/qwen2_5_1_5b.py:tiny`.
The whole real path at toy sizes on a laptop CPU, from any small Qwen2 /
Llama checkpoint (its model section comes from HF/config.json):
`--config experiments/qwen2_5_1_5b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  model = _common.qwen2_5_model(
      vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
      mlp_dim=8960, tie_embeddings=True, max_seq_len=32768)
  full = _common.long_cot_config(
      model, mesh=dict(data=-1, fsdp=8, context=1, tensor=2), max_slots=256,
      prompts_per_iteration=256, minibatch_prompts=16, learning_rate=1e-6)
  return _common.select(arg, full)
