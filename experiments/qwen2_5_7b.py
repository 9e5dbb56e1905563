"""python launch/tpu_run.py --config experiments/qwen2_5_7b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-7B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Qwen2.5-7B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens, the report's first long-context stage; partial
rollouts generate 8k tokens per trajectory per iteration. Mesh: tensor=4
(kv_heads=4 must divide over `tensor`), fsdp=16, data takes the rest
(data=1 on 64 chips: 4 of the minibatch's 64 rows per chip). The TPU
compiler's check, from any host with libtpu:
`python launch/plan.py --config experiments/qwen2_5_7b.py --aot v5p:4x4x4 --json plan.json`.
`experiments/qwen2_5_7b.py:128k` is the report's final stage: 128k-token
sequences with context parallelism (`context=4`) on `v5p:4x4x8`.
Tiny CPU variant: `--config experiments/qwen2_5_7b.py:tiny`.
The whole real path at toy sizes on a laptop CPU, from any small Qwen2 /
Llama checkpoint (its model section comes from HF/config.json):
`--config experiments/qwen2_5_7b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg == "128k":
    return _config_128k()
  model = _common.qwen2_5_model(
      vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
      mlp_dim=18944, tie_embeddings=False, max_seq_len=32768)
  full = _common.long_cot_config(
      model, mesh=dict(data=-1, fsdp=16, context=1, tensor=4), max_slots=256,
      prompts_per_iteration=256, minibatch_prompts=8, learning_rate=1e-6)
  return _common.select(arg, full)


def _config_128k() -> ml_collections.ConfigDict:
  """The report's final stage: 128k-token sequences, context parallelism.

  Every activation's sequence is split over `context` (4 chips per row,
  keys/values all-gathered in attention); params and optimizer state shard
  over fsdp x context. Half the minibatch rows of the 32k stage (4 prompts
  x 8 samples, 4M tokens per step) and half the sampler slots, so each chip
  holds 128k tokens of activations and 64 slots' cache stays small.
  """
  model = _common.qwen2_5_model(
      vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
      mlp_dim=18944, tie_embeddings=False, max_seq_len=131072)
  return _common.long_cot_config(
      model, mesh=dict(data=-1, fsdp=8, context=4, tensor=4), max_slots=128,
      prompts_per_iteration=128, minibatch_prompts=4, learning_rate=1e-6)
