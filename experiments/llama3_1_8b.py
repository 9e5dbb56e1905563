"""python launch/tpu_run.py --config experiments/llama3_1_8b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Llama-3.1-8B-Instruct --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Llama-3.1-8B(-Instruct) on math (Kimi k1.5 recipe).
Sequences (prompt + response) reach 32k tokens, the report's first
long-context stage; partial rollouts generate 8k tokens per trajectory per
iteration. Shapes from Llama-3.1-8B's config.json: vocab 128256, hidden
4096, 32 layers, 32 query / 8 kv heads of 128, MLP 14336, no biases,
untied embeddings, eps 1e-5, rope_theta 500000 with Llama 3.1's `llama3`
rope scaling (factor 8, low_freq_factor 1, high_freq_factor 4, original
8192 positions; max_position_embeddings 131072). Mesh: tensor=4
(kv_heads=8 must divide over `tensor`), fsdp=16, data takes the rest
(data=1 on 64 chips, e.g. v5p:4x4x4). Prompts go through the checkpoint's
chat template (Llama 3's header turns; it stops on `<|eot_id|>` as its
generation_config says); `task.thinking` stays "template" (the template
has no thinking switch).
Tiny CPU variant: `--config experiments/llama3_1_8b.py:tiny`.
The whole real path at toy sizes on a laptop CPU, from any small checkpoint
(its model section comes from HF/config.json):
`--config experiments/llama3_1_8b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common


def llama3_1_model(max_seq_len: int) -> ml_collections.ConfigDict:
  """Llama-3.1-8B's model section."""
  return _common.model_section(
      vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
      head_dim=128, mlp_dim=14336, rope_theta=500_000.0, norm_eps=1e-5,
      tie_embeddings=False, qkv_bias=False,
      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0,
                        original_max_position_embeddings=8192),
      max_seq_len=max_seq_len)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  full = _common.long_cot_config(
      llama3_1_model(32768), mesh=dict(data=-1, fsdp=16, context=1, tensor=4),
      max_slots=256, prompts_per_iteration=256, minibatch_prompts=8,
      learning_rate=1e-6)
  return _common.select(arg, full)
