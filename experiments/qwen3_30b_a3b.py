"""python launch/tpu_run.py --config experiments/qwen3_30b_a3b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen3-30B-A3B --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Qwen3-30B-A3B, a mixture-of-experts model, on math (Kimi
k1.5 recipe, as experiments/qwen3_8b.py: 32k-token sequences, 8k-token
partial-rollout segments, thinking on). Shapes from its config.json: vocab
151936, hidden 2048, 48 layers, all sparse: 128 SwiGLU experts of width 768,
8 per token, their weights renormalised (norm_topk_prob); 32 query / 4 kv
heads of 128, RMSNorm on each query and key head, no biases, untied
embeddings, rope_theta 1e6, eps 1e-6. intermediate_size (6144) is the dense
MLP no layer uses. 30.5B parameters, 3.3B active per token.

Routing replay is on (rl.routing_replay, docs/rl.md): the sampler records
each token's 48 x 8 experts and the trainer routes every token to them, so
the log-prob it trains is the one the sampler drew the token with.

Mesh (64 chips, e.g. v5p:4x4x4): expert=4 (expert parallelism: each chip
holds 32 of a layer's 128 experts), fsdp=16 (the batch, and the weights'
embedding axis), tensor=1 (kv_heads=4 would allow 4; the batch is split
over data x fsdp only, so fsdp keeps each chip's rows and sampler slots
few). The TPU compiler's check:
`TPU_SKIP_MDS_QUERY=1 python launch/plan.py --config
experiments/qwen3_30b_a3b.py --aot v5p:4x4x4` (docs/results.md).
Tiny CPU variant: `--config experiments/qwen3_30b_a3b.py:tiny` (8 experts,
2 per token, routing replay on).
The whole real path at toy sizes on a laptop CPU, from a small Qwen3-MoE
checkpoint (its model section comes from HF/config.json):
`--config experiments/qwen3_30b_a3b.py:cpu_smoke --workdir W
--config.init_from_hf=HF --config.task.train_path=T.jsonl
--config.task.eval_path=E.jsonl --config.sft.train_path=S.jsonl`
(docs/real_path.md).
"""

import ml_collections

from experiments import _common

_SIZES = dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
              n_kv_heads=4, head_dim=128, mlp_dim=6144, n_experts=128,
              n_experts_per_token=8, expert_mlp_dim=768, norm_topk_prob=True)


def qwen3_moe_model(max_seq_len: int) -> ml_collections.ConfigDict:
  """Qwen3-30B-A3B's model section."""
  return _common.model_section(
      **_SIZES, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False,
      qkv_bias=False, qk_norm=True, max_seq_len=max_seq_len)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  full = _common.long_cot_config(
      qwen3_moe_model(32768),
      mesh=dict(data=-1, fsdp=16, context=1, tensor=1, expert=4),
      max_slots=64, prompts_per_iteration=128, minibatch_prompts=4,
      learning_rate=1e-6)
  full.task.thinking = "on"
  full.rl.routing_replay = True
  c = _common.select(arg, full)
  # The tiny variant keeps the experts (at tiny sizes) and so the replay.
  c.rl.routing_replay = True
  return c
