"""Shared layout of the long-CoT RL experiments on open checkpoints
(Qwen2.5, Qwen3, Llama 3.1, Gemma 3).

Not an experiment itself (the leading underscore keeps it out of the
experiment list).

Choices not fixed by the Kimi k1.5 report are marked "ours" below. From the
report: mirror-descent loss with the mean-reward baseline and the optimizer
reset every iteration (2.3.2), partial rollouts with a per-iteration token
budget and repeat detection with a penalty (2.6.2), the length reward
switched on after a warm-up (2.3.3), prioritized sampling by 1 - success
rate (2.3.4), and packed SFT with two learning-rate stages, 2e-5 decayed to
2e-6 then re-warmed to 1e-5 and decayed to 1e-6 (2.5.2; the report gives
these for its vanilla SFT, and no learning rate for the long-CoT warm-up of
2.2). The report gives no RL learning rate.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from experiments import tiny


def model_section(*, max_seq_len: int, **architecture: Any
                  ) -> ml_collections.ConfigDict:
  """A model section: `architecture` (ModelConfig fields: sizes and family
  features) plus the run settings every full-size experiment shares."""
  return ml_collections.ConfigDict(dict(
      **architecture,
      max_seq_len=max_seq_len,
      param_dtype="bfloat16",
      compute_dtype="bfloat16",
      remat=True,
      # The layers in a lax.scan: compile time independent of depth.
      scan_layers=True,
      # Splash attention on TPU (blockwise elsewhere) and log-probs 1024
      # positions at a time: neither T x T nor T x V is ever held.
      attention="auto",
      attention_block=512,
      logprob_chunk=1024,
  ))


def qwen2_5_model(*, vocab_size: int, d_model: int, n_layers: int,
                  n_heads: int, n_kv_heads: int, mlp_dim: int,
                  tie_embeddings: bool, max_seq_len: int
                  ) -> ml_collections.ConfigDict:
  """A Qwen2.5 model section: the family's fixed choices plus the sizes."""
  return model_section(
      vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=128, mlp_dim=mlp_dim,
      rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=tie_embeddings,
      qkv_bias=True, max_seq_len=max_seq_len)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  out, n = [], lo
  while n < hi:
    out.append(n)
    n *= 2
  return tuple(out) + (hi,)


def long_cot_config(model: ml_collections.ConfigDict, *,
                    mesh: dict[str, int], max_slots: int,
                    prompts_per_iteration: int, minibatch_prompts: int,
                    learning_rate: float) -> ml_collections.ConfigDict:
  """The full experiment, in the same sections and keys as experiments/tiny.py.

  A sequence is prompt + response, at most `model.max_seq_len` tokens: the
  sampler's slots, the prefill buckets (a partial rollout re-prefills its
  prompt plus earlier segments, so buckets reach the full length) and the
  training length buckets all go up to it.
  """
  seq_len = model.max_seq_len
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = model
  # A local Hugging Face directory (e.g. Qwen2.5-7B-Instruct); set per run.
  c.init_from_hf = ""
  # expert: a mixture-of-experts model's expert parallelism (1: none).
  c.mesh = ml_collections.ConfigDict({"expert": 1, **mesh})
  c.sharding = tiny.sharding_config()
  c.task = _task_section()
  c.sft = _sft_section(seq_len)
  c.sampler = _sampler_section(seq_len, max_slots)
  c.rl = _rl_section(seq_len, prompts_per_iteration=prompts_per_iteration,
                     minibatch_prompts=minibatch_prompts,
                     learning_rate=learning_rate)
  # Report 2.3.4: prioritized sampling by 1 - success rate, as tiny.py. A
  # curriculum ("warmup_then_hard" / "stages") needs a `difficulty` field.
  c.prompt_sampling = tiny.prompt_sampling_config()
  # task.reward = rm_cot / verifier_or_rm_cot etc. scores RL with a trained
  # reward model (docs/rewards.md).
  c.reward_model = tiny.reward_model_config()
  c.checkpoint = ml_collections.ConfigDict(dict(every_iterations=5,
                                                max_to_keep=3))
  c.log = ml_collections.ConfigDict(dict(progress=True, plots=True))
  # Weights & Biases: set wandb_project to log there too (optional
  # dependency, requirements-wandb.txt).
  c.metrics = ml_collections.ConfigDict(dict(wandb_project="", wandb_name="",
                                             wandb_entity=""))
  return c


def _task_section() -> ml_collections.ConfigDict:
  """JSONL math prompts, prompted through the checkpoint's chat template."""
  return ml_collections.ConfigDict(dict(
      name="jsonl",
      # JSONL prompt sets (kimi_jax/data/records.py); set per run.
      train_path="",
      eval_path="",
      reward="math",
      prompt_field="prompt",
      answer_field="answer",
      difficulty_field="difficulty",  # optional; curricula need it
      tags_field="tags",  # optional
      tests_field="tests",  # code tasks: stdin/stdout tests
      on_bad_row="error",  # or "skip": drop bad rows and count them
      # A tokenizer directory for a model trained from scratch (only
      # without init_from_hf, which brings the checkpoint's own).
      tokenizer="",
      # Instruct checkpoints are prompted through their chat template (as
      # they were tuned); set False for a base model. The SFT data uses the
      # same template and system prompt, so SFT primes RL's prompt format.
      chat_template=True,
      system_prompt="",  # "" keeps the template's default
      # Reasoning checkpoints (Qwen3): "on" / "off" pass enable_thinking to
      # the chat template; "template" passes nothing (its default).
      thinking="template",
  ))


def _sft_section(seq_len: int) -> ml_collections.ConfigDict:
  """The warm start: packed SFT in two learning-rate stages."""
  # Warm start (report 2.2: a lightweight long-CoT SFT) on sft.train_path.
  # Packed sequences at the full length (2.5.2). Learning rates from 2.5.2's
  # two stages: 2e-5 decayed to 2e-6, then re-warmed to 1e-5 and decayed to
  # 1e-6 (the report's second stage runs at 128k tokens; ours stays at
  # seq_len). Step counts, warm-ups and the cosine shape are ours (the
  # report says "decays", not how).
  return ml_collections.ConfigDict(dict(
      steps=1000,  # ours
      batch_size=64,  # ours
      seq_len=seq_len,
      learning_rate=2e-5,  # 2.5.2, first stage
      warmup_steps=50,  # ours
      weight_decay=0.0,  # ours
      grad_clip=1.0,  # ours
      decay="cosine",  # ours
      final_learning_rate=2e-6,  # 2.5.2, end of the first stage
      stage2_steps=250,  # ours (the report: one epoch per stage)
      stage2_warmup_steps=25,  # ours
      stage2_learning_rate=1e-5,  # 2.5.2, second stage
      stage2_final_learning_rate=1e-6,  # 2.5.2, end of the second stage
      # JSONL of prompt + response or chat messages rows; set per run.
      train_path="",
      # The long-CoT stage: the warm-up rows of launch/warmup_data.py
      # (report 2.2) for the last stage2_steps steps, at 2.5.2's second-stage
      # learning rates (the pairing of 2.2's data with 2.5.2's second stage
      # is ours; the report gives no learning rate for 2.2). "" keeps
      # train_path for both stages.
      stage2_train_path="",
      on_bad_row="error",
      prompt_field="prompt",
      response_field="response",
      messages_field="messages",
      truncate=False,  # 2.5.2's first stage drops over-length examples
  ))


def _sampler_section(seq_len: int, max_slots: int
                     ) -> ml_collections.ConfigDict:
  """Slots and prefill buckets up to the full sequence length."""
  return ml_collections.ConfigDict(dict(
      max_slots=max_slots,
      cache_len=seq_len,
      prefill_buckets=_powers_of_two(512, seq_len),
      # Long prompts are compute-bound already; bigger prefill batches would
      # only multiply the prefill's activation memory.
      prefill_batch_buckets=(1, 2, 4, 8),
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      # ours: long math text repeats short n-grams legitimately; only a block
      # of up to 64 tokens repeated 8 times in a row counts as a loop.
      repeat_ngram=64,
      repeat_times=8,
      # Decode steps per host round trip; the device stops finished slots.
      steps_per_call=16,
      # A row of seq_len per slot; page_size > 0 pools pages (kv_pages of
      # them, 0: every slot at full length) so slots x live tokens, not
      # slots x seq_len, bound memory. Decode reads up to the longest live
      # slot, rounded up to min_view x 2^i entries.
      page_size=0,
      kv_pages=0,
      min_view=512,
      # "xla" (any backend) or "pallas_tpu" (the TPU paged attention
      # kernel; needs page_size > 0).
      attention_kernel="xla",
      # The sampler's weight matmuls: "" as the model computes, or
      # "bfloat16" inputs accumulated in float32 (faster where bfloat16
      # matmul units exist; the log-prob gap to the trainer grows).
      matmul_dtype="",
  ))


def _rl_section(seq_len: int, *, prompts_per_iteration: int,
                minibatch_prompts: int, learning_rate: float
                ) -> ml_collections.ConfigDict:
  """Mirror descent with partial rollouts and the length reward."""
  max_prompt = 2048  # ours: longer math prompts are dropped by the task
  return ml_collections.ConfigDict(dict(
      iterations=1000,
      prompts_per_iteration=prompts_per_iteration,
      samples_per_prompt=8,  # ours (the report's k is not given)
      loss="mirror_descent",
      tau=1.0,  # ours (not given)
      baseline="mean",  # the report: the empirical mean works well
      # ours, per model size: the report gives no RL learning rate; what it
      # fixes is the optimizer reset at each iteration (2.3.2, below).
      learning_rate=learning_rate,
      grad_clip=1.0,
      minibatch_prompts=minibatch_prompts,
      epochs=1,
      reset_optimizer=True,  # 2.3.2: reset at the start of every iteration
      warmup_steps=0,  # ours: learning-rate ramp after each reset
      max_response_len=seq_len - max_prompt,
      # Partial rollouts: a trajectory writes at most this many tokens per
      # iteration and continues from the replay buffer in the next one.
      token_budget=seq_len // 4,
      max_wait_iterations=4,
      # A queue of extra groups that take slots freed mid-window
      # (docs/loop.md); needs prompts_per_iteration x
      # samples_per_prompt <= sampler.max_slots. 0: off.
      queued_prompts=0,
      queued_min_tokens=1,
      # Continue a cut response in the sampler slot that holds its KV cache
      # (earlier weights' keys and values) instead of prefilling it again
      # (docs/rl.md); off.
      keep_partial_kv=False,
      # Train on every segment of a partial rollout, not only the newest:
      # in the tiny study (docs/loop.md, "Which tokens are trained on") the
      # first segment holds the choice between reasoning and a direct
      # answer, and with old segments masked out RL never reinforced it
      # (held-out pass@1 stalled at 0.65). 2.6.2 allows excluding them.
      train_on_old_segments=True,
      reference_logprobs="recompute",
      # Truncated importance sampling of the sampler-trainer gap
      # (docs/rl.md); 0: off.
      tis_cap=0.0,
      length_reward_weight=0.1,  # ours (the report gives no weight)
      length_reward_warmup=100,  # ours: off at first, then constant
      repeat_penalty=-1.0,
      train_len_buckets=_powers_of_two(4096, seq_len),
      pack_sequences=True,
      eval_every=20,
      eval_samples=4,
      # Standard benchmarks at each evaluation, e.g.
      # ("math500=/data/math500.jsonl", "humaneval") (docs/evaluation.md).
      eval_benchmarks=(),
      # Routing replay for a mixture-of-experts policy: the trainer routes each
      # token to the experts the sampler chose (docs/rl.md); dense models: False.
      routing_replay=False,
  ))


# Architecture fields a tiny variant keeps from its family as they are (the
# sizes, and what is tied to them, come from tiny.py or are scaled below).
FAMILY_FIELDS = ("tie_embeddings", "qkv_bias", "qk_norm", "norm_offset",
                 "post_norms", "mlp_activation", "embed_scale",
                 "final_logit_softcap", "rope_theta", "rope_scaling",
                 "sliding_rope_theta")


def tiny_variant(model: ml_collections.ConfigDict
                 ) -> ml_collections.ConfigDict:
  """experiments/tiny.py with `model`'s architecture family at tiny sizes.

  Keeps what makes the family (query heads per kv head, FAMILY_FIELDS,
  remat) and takes every size, the float32 dtypes and the synthetic
  pointer-chasing task from tiny.py, so it runs on a laptop CPU with no
  downloads. Interleaved sliding-window layers become one sliding and one
  global layer (tiny.py's two) with a window of a quarter of the sequence,
  so that both kinds see different keys; query_pre_attn_scalar keeps its
  ratio to head_dim.
  """
  c = tiny.get_config()
  t = c.model
  group = model.n_heads // model.n_kv_heads
  c.model.update(dict(
      n_heads=t.n_kv_heads * group,
      remat=model.remat,
      param_dtype="float32",
      compute_dtype="float32",
  ))
  for name in FAMILY_FIELDS:
    if name in model:
      c.model[name] = model[name]
  if model.get("n_experts"):
    # A mixture-of-experts family stays one: 8 experts, 2 per token.
    c.model.update(dict(n_experts=8, n_experts_per_token=2,
                        expert_mlp_dim=t.mlp_dim // 4,
                        norm_topk_prob=model.norm_topk_prob))
  if "query_pre_attn_scalar" in model:
    c.model.query_pre_attn_scalar = (model.query_pre_attn_scalar *
                                     t.head_dim / model.head_dim)
  if "layer_types" in model:
    kinds = tuple(dict.fromkeys(model.layer_types))  # sliding first
    c.model.layer_types = (kinds * t.n_layers)[:t.n_layers]
    c.model.sliding_window = t.max_seq_len // 4
  return c


def cpu_smoke_variant(full: ml_collections.ConfigDict
                      ) -> ml_collections.ConfigDict:
  """The whole real path at toy lengths, for a laptop CPU: a small Hugging
  Face checkpoint (`init_from_hf`, required), JSONL prompt and SFT sets, 2
  packed SFT steps, 2 RL iterations, the export to WORKDIR/hf_export.

  The model's architecture comes from the checkpoint (a small directory of
  any supported family: Llama, Qwen2, Qwen3, Gemma 3 text); this variant
  sets only the run settings (float32, no remat, 512-token sequences).
  Everything else is the full recipe's (mirror descent, partial rollouts,
  length reward, prioritized sampling, chat template, thinking setting) at
  toy sizes; learning rates are large enough to move a tiny model in two
  steps (ours; no meaning for a real run).
  """
  c = ml_collections.ConfigDict(full.to_dict())
  seq_len = 512
  c.model.update(dict(max_seq_len=seq_len, param_dtype="float32",
                      compute_dtype="float32", remat=False))
  # 512 tokens extend no checkpoint's context: its own rotary stands.
  if "rope_scaling" in c.model:
    del c.model["rope_scaling"]
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1,
                                           tensor=1, expert=1))
  c.sft.update(dict(
      steps=2, batch_size=4, seq_len=256, learning_rate=1e-3,
      warmup_steps=0, decay="constant", final_learning_rate=0.0,
      stage2_steps=0, stage2_warmup_steps=0, stage2_learning_rate=0.0,
      stage2_final_learning_rate=0.0,
      # A small checkpoint's answers may be long: cut rather than fail.
      truncate=True))
  c.sampler.update(dict(
      max_slots=16, cache_len=seq_len,
      prefill_buckets=(64, 128, 256, seq_len),
      prefill_batch_buckets=(4, 16), repeat_ngram=4, repeat_times=4,
      steps_per_call=8))
  c.rl.update(dict(
      iterations=2, prompts_per_iteration=4, samples_per_prompt=4,
      learning_rate=1e-4, minibatch_prompts=2, max_response_len=32,
      token_budget=16, length_reward_warmup=0, eval_every=0,
      eval_samples=2, train_len_buckets=(64, 128, 256, seq_len)))
  c.checkpoint.update(dict(every_iterations=1, max_to_keep=2))
  c.log.update(dict(progress=False, plots=False))
  return c


VARIANTS = ("tiny", "cpu_smoke")


def select(arg: str | None, full: ml_collections.ConfigDict
           ) -> ml_collections.ConfigDict:
  """`get_config(arg)`: the full config, or one of its VARIANTS."""
  if arg in (None, ""):
    return full
  if arg == "tiny":
    return tiny_variant(full.model)
  if arg == "cpu_smoke":
    return cpu_smoke_variant(full)
  raise ValueError(f"unknown config variant {arg!r} (known: "
                   f"{', '.join(VARIANTS)})")
