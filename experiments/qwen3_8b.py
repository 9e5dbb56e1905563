"""python launch/tpu_run.py --config experiments/qwen3_8b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/Qwen3-8B --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Qwen3-8B on math (Kimi k1.5 recipe). Sequences (prompt +
response) reach 32k tokens (Qwen3's native context, the report's first
long-context stage); partial rollouts generate 8k tokens per trajectory per
iteration. Shapes from Qwen3-8B's config.json: vocab 151936, hidden 4096,
36 layers, 32 query / 8 kv heads of 128, MLP 12288, RMSNorm on each query
and key head, no biases, untied embeddings, rope_theta 1e6, eps 1e-6 (its
max_position_embeddings, 40960, is 32k plus room for generation; ours is
the run's max_seq_len). Mesh: tensor=4 (kv_heads=8 must divide over
`tensor`), fsdp=16, data takes the rest (data=1 on 64 chips, e.g.
v5p:4x4x4).

Thinking: `task.thinking="on"` (ours). Qwen3-8B is a hybrid model whose
chat template switches between a `<think>...</think>` reasoning block and
a direct answer; long-CoT RL trains the reasoning, so RL prompts, SFT rows
and `launch/sample.py` all ask for it explicitly (the template's own
default is also on, but "on" keeps the run's prompts the same whatever a
checkpoint's template defaults to). The math reward reads the answer after
the last `</think>`; SFT responses may hold a `<think>` block before the
answer.

`experiments/qwen3_8b.py:128k` is the report's final stage: 128k-token
sequences with YaRN (factor 4 over the original 32768 positions, as Qwen
documents for Qwen3 past 32k) and context parallelism (`context=4`) on
128 chips (e.g. v5p:4x4x8). With `init_from_hf`, the architecture is the
checkpoint's config.json; a checkpoint without rotary scaling (Qwen3-8B as
released) runs with this file's YaRN, the config.json edit Qwen's model
card asks for, and one with scaling of its own keeps it.
Tiny CPU variant: `--config experiments/qwen3_8b.py:tiny`.
The whole real path at toy sizes on a laptop CPU, from any small checkpoint
(its model section comes from HF/config.json; a small Qwen3 with a
thinking template exercises this file's settings):
`--config experiments/qwen3_8b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common

_SIZES = dict(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
              n_kv_heads=8, head_dim=128, mlp_dim=12288)


def qwen3_model(max_seq_len: int, rope_scaling: dict | None = None
                ) -> ml_collections.ConfigDict:
  """Qwen3-8B's model section (with `rope_scaling` when given)."""
  scaling = {} if rope_scaling is None else dict(rope_scaling=rope_scaling)
  return _common.model_section(
      **_SIZES, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False,
      qkv_bias=False, qk_norm=True, max_seq_len=max_seq_len, **scaling)


def _with_thinking(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  c.task.thinking = "on"
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg == "128k":
    return _config_128k()
  full = _common.long_cot_config(
      qwen3_model(32768), mesh=dict(data=-1, fsdp=16, context=1, tensor=4),
      max_slots=256, prompts_per_iteration=256, minibatch_prompts=8,
      learning_rate=1e-6)
  return _common.select(arg, _with_thinking(full))


def _config_128k() -> ml_collections.ConfigDict:
  """The report's final stage: 128k-token sequences, YaRN, context
  parallelism.

  As experiments/qwen2_5_7b.py:128k: every activation's sequence is split
  over `context` (4 chips per row); params and optimizer state shard over
  fsdp x context; half the 32k stage's minibatch rows. A quarter of its
  sampler slots (64): Qwen3-8B's cache holds 36 layers x 8 kv heads per
  token, 2.6 times Qwen2.5-7B's: 128 slots of 128k tokens would take 77 GB
  of a v5p chip in the analytic plan (`launch/plan.py --mesh data=1,fsdp=8,
  context=4,tensor=4`), 64 slots 39 GB of 93 GB in all. The compiler's
  check: `launch/plan.py --config experiments/qwen3_8b.py:128k --aot
  v5p:4x4x8`.
  """
  yarn = dict(rope_type="yarn", factor=4.0,
              original_max_position_embeddings=32768)
  return _with_thinking(_common.long_cot_config(
      qwen3_model(131072, rope_scaling=yarn),
      mesh=dict(data=-1, fsdp=8, context=4, tensor=4), max_slots=64,
      prompts_per_iteration=128, minibatch_prompts=4, learning_rate=1e-6))
