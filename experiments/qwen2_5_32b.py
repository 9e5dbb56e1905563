"""python launch/tpu_run.py --config experiments/qwen2_5_32b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen2.5-32B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Qwen2.5-32B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens, the report's first long-context stage. Mesh:
tensor=8 (kv_heads=8 must divide over `tensor`; 40 heads, the MLP and the
vocabulary divide by 8 too), fsdp=32, data over the rest. The TPU
compiler's check, from any host with libtpu:
`python launch/plan.py --config experiments/qwen2_5_32b.py --aot v5p:4x8x8`.
Tiny CPU variant: `--config experiments/qwen2_5_32b.py:tiny`.
The whole real path at toy sizes on a laptop CPU, from any small Qwen2 /
Llama checkpoint (its model section comes from HF/config.json):
`--config experiments/qwen2_5_32b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  model = _common.qwen2_5_model(
      vocab_size=152064, d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8,
      mlp_dim=27648, tie_embeddings=False, max_seq_len=32768)
  full = _common.long_cot_config(
      model, mesh=dict(data=-1, fsdp=32, context=1, tensor=8), max_slots=128,
      prompts_per_iteration=256, minibatch_prompts=4, learning_rate=5e-7)
  # Sequence-parallel residual stream: layer-boundary activations are split
  # over `tensor` along the embedding, so the 64 saved boundaries of 32k
  # tokens take 2.7 GB per chip instead of 21 GB (a 16 GB v5e could not hold
  # them). The per-layer all-reduce of tensor parallelism becomes a
  # reduce-scatter plus an all-gather: the same bytes moved.
  # A batched prefill is not split over the batch axes unless its batch
  # divides them, so every chip runs all of it: 8 prompts of 32k tokens
  # (8 GB of new cache per chip) overflow a 16 GB v5e; 4 fit.
  full.sampler.prefill_batch_buckets = (1, 2, 4)
  full.sharding.rules = tuple(
      (name, "tensor" if name == "act_embed" else axes)
      for name, axes in full.sharding.rules)
  return _common.select(arg, full)
