"""python launch/tpu_run.py --config experiments/gemma3_4b.py --workdir gs://bucket/run --config.init_from_hf=/path/to/gemma-3-4b-it-text --config.task.train_path=/data/math_train.jsonl --config.task.eval_path=/data/math_eval.jsonl --config.sft.train_path=/data/math_sft.jsonl

Long-CoT RL of Gemma 3 4B (text) on math (Kimi k1.5 recipe). Sequences
(prompt + response) reach 32k tokens, the report's first long-context
stage; partial rollouts generate 8k tokens per trajectory per iteration.
Shapes from the `text_config` of gemma-3-4b-it's config.json: vocab 262208,
hidden 2560, 34 layers, 8 query / 4 kv heads of 256, MLP 10240 (GeGLU),
tied embeddings, eps 1e-6, query_pre_attn_scalar 256, no logit softcaps
(Gemma3TextConfig's defaults; the text_config sets neither), and 5 sliding-
window layers (1024 tokens, rope base 10000) to every global one (rope
base 1e6 with linear rope scaling, factor 8; max_position_embeddings
131072). Mesh: tensor=4 (kv_heads=4 must divide over `tensor`), fsdp=16,
data takes the rest (data=1 on 64 chips, e.g. v5p:4x4x4). Prompts go
through the checkpoint's chat template (Gemma's `<start_of_turn>` turns;
it stops on `<end_of_turn>` as its generation_config says).

The checkpoint: init_from_hf reads a text-only `Gemma3ForCausalLM`
directory. gemma-3-4b-it is published as the multimodal
`Gemma3ForConditionalGeneration`, which is not read; save its language
model as a Gemma3ForCausalLM (config.json = its text_config with
`"architectures": ["Gemma3ForCausalLM"]`, the language model's tensors
under `model.`) with the tokenizer files beside it.
Tiny CPU variant: `--config experiments/gemma3_4b.py:tiny` (one sliding
and one global layer).
The whole real path at toy sizes on a laptop CPU, from any small checkpoint
(its model section comes from HF/config.json):
`--config experiments/gemma3_4b.py:cpu_smoke --workdir W --config.init_from_hf=HF
--config.task.train_path=T.jsonl --config.task.eval_path=E.jsonl
--config.sft.train_path=S.jsonl` (docs/real_path.md).
"""

import ml_collections

from experiments import _common

N_LAYERS = 34
# Every SLIDING_PATTERN-th layer is global, the others slide (Gemma 3's
# sliding_window_pattern: 5 local layers to 1 global).
SLIDING_PATTERN = 6


def layer_types(n_layers: int, pattern: int) -> tuple[str, ...]:
  """Gemma 3's interleaving, as transformers derives it from the pattern."""
  return tuple("full_attention" if (i + 1) % pattern == 0 else
               "sliding_attention" for i in range(n_layers))


def gemma3_model(max_seq_len: int) -> ml_collections.ConfigDict:
  """Gemma 3 4B's text model section."""
  return _common.model_section(
      vocab_size=262208, d_model=2560, n_layers=N_LAYERS, n_heads=8,
      n_kv_heads=4, head_dim=256, mlp_dim=10240, norm_eps=1e-6,
      tie_embeddings=True, qkv_bias=False, qk_norm=True, norm_offset=1.0,
      post_norms=True, mlp_activation="gelu_tanh", embed_scale=True,
      query_pre_attn_scalar=256.0,
      rope_theta=1_000_000.0,
      rope_scaling=dict(rope_type="linear", factor=8.0),
      layer_types=layer_types(N_LAYERS, SLIDING_PATTERN),
      sliding_window=1024, sliding_rope_theta=10_000.0,
      max_seq_len=max_seq_len)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  full = _common.long_cot_config(
      gemma3_model(32768), mesh=dict(data=-1, fsdp=16, context=1, tensor=4),
      max_slots=256, prompts_per_iteration=256, minibatch_prompts=8,
      learning_rate=1e-6)
  return _common.select(arg, full)
