"""python launch/tpu_run.py --config experiments/tiny.py --workdir /tmp/kimi_tiny

The tiny default: a 2-layer policy learns to follow a hidden permutation n
steps (kimi_jax/data/pointer_chase.py), a synthetic task where writing every
intermediate state out helps and a direct answer cannot generalise. Stage one is a
short supervised warm start on a mix of chain-of-thought and direct answers;
stage two is Kimi k1.5 RL (mirror descent, length reward after warm-up,
partial rollouts, prioritized prompt sampling). Runs on a laptop CPU in a few
minutes. `experiments/tiny.py:micro` is a seconds-scale variant for tests.
"""

import ml_collections


def model_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      vocab_size=128,
      d_model=64,
      n_layers=2,
      n_heads=4,
      n_kv_heads=2,
      head_dim=16,
      mlp_dim=256,
      rope_theta=1_000_000.0,
      norm_eps=1e-6,
      tie_embeddings=True,
      qkv_bias=True,
      max_seq_len=64,
      param_dtype="float32",
      compute_dtype="float32",
      remat=False,
      # Unrolled layers in training: faster for a shallow model, the same
      # numbers (docs/speed.md); deep models keep the scan.
      scan_layers=False,
      # kimi_jax/model/attention.py: dot | blockwise | splash | auto (splash
      # on TPU, blockwise elsewhere).
      attention="auto",
      attention_block=512,
      logprob_chunk=1024,
  ))


def sharding_config() -> ml_collections.ConfigDict:
  """Logical axis -> mesh axes (kimi_jax.sharding.DEFAULT_RULES)."""
  return ml_collections.ConfigDict(dict(rules=(
      ("batch", ("data", "fsdp")), ("length", None),
      ("act_length", "context"), ("embed", ("fsdp", "context")),
      ("act_embed", None), ("mlp", "tensor"), ("heads", "tensor"),
      ("kv_heads", "tensor"), ("head_dim", None), ("vocab", "tensor"),
      ("layers", None), ("norm", None), ("experts", "expert"),
      ("expert_mlp", "tensor"))))


def prompt_sampling_config() -> ml_collections.ConfigDict:
  # Report 2.3.4. curriculum: none | warmup_then_hard | stages; prioritized
  # draws problem i with weight max(1 - success_i, priority_floor).
  return ml_collections.ConfigDict(dict(
      curriculum="none",
      warmup_iterations=0,
      hard_threshold=0.0,
      stages=((0, 0.0),),
      prioritized=True,
      priority_floor=0.05,
      success_tracking="ema",
      ema_decay=0.5,
      initial_success=0.0,
      # A curated set's measured pass rate as the starting success rate
      # ("pass_rate", kimi_jax/curation/curate.py); "" uses initial_success.
      initial_success_field="",
  ))


def reward_model_config() -> ml_collections.ConfigDict:
  """The reward model RL scores with when task.reward names one
  (kimi_jax/reward_models/config.py); unused otherwise."""
  return ml_collections.ConfigDict(dict(
      path="",  # a directory written by launch/train_rm.py
      threshold=0.5,  # value model: correct when P(correct) >= this
      max_slots=64,  # CoT model: its sampler's slots and steps per call
      steps_per_call=16,
      batch_rows=16,  # value model: packed rows per forward
      audit=False,  # also run the task's verifier and log agreement
  ))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = model_config()
  # Import real weights instead of random init: a local Hugging Face dir.
  c.init_from_hf = ""
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1,
                                         tensor=1, expert=1))
  c.sharding = sharding_config()
  c.task = task_config()
  c.sft = sft_config()
  c.sampler = sampler_config()
  c.rl = rl_config()
  c.prompt_sampling = prompt_sampling_config()
  c.reward_model = reward_model_config()
  c.checkpoint = ml_collections.ConfigDict(dict(every_iterations=1,
                                                max_to_keep=2))
  c.log = ml_collections.ConfigDict(dict(progress=True, plots=True))
  c.metrics = metrics_config()
  if arg == "micro":
    shrink_to_micro(c)
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: micro)")
  return c


def metrics_config() -> ml_collections.ConfigDict:
  """Weights & Biases off; set metrics.wandb_project to log there too
  (optional dependency, requirements-wandb.txt)."""
  return ml_collections.ConfigDict(dict(wandb_project="", wandb_name="",
                                        wandb_entity=""))


def task_config() -> ml_collections.ConfigDict:
  """Pointer chasing, 1 to 8 steps, with its exact verifier as reward."""
  return ml_collections.ConfigDict(dict(
      name="pointer_chase",
      min_steps=1,
      max_steps=8,
      eval_fraction=0.125,
      # A validation split of the rest: RL's periodic evaluations read it;
      # the held-out split is evaluated after the warm start and at the end.
      val_fraction=0.125,
      # Fraction of warm-start examples that answer directly, without steps.
      direct_fraction=0.5,
      warmstart_fraction=0.25,
      # RL reward: the exact verifier, or a trained reward model (rm_value,
      # rm_cot, verifier_or_rm_*; docs/rewards.md) read from
      # reward_model.path.
      reward="pointer_chase",
  ))


def sft_config() -> ml_collections.ConfigDict:
  """The warm start: 250 steps on the task's own warm-start pairs."""
  return ml_collections.ConfigDict(dict(
      steps=250,
      batch_size=64,
      seq_len=32,
      learning_rate=3e-3,
      warmup_steps=10,
      weight_decay=0.0,
      grad_clip=1.0,
      # After warm-up: "constant", or "linear" / "cosine" decay to
      # final_learning_rate; stage2_* re-warm for the last stage2_steps.
      decay="constant",
      final_learning_rate=0.0,
      stage2_steps=0,
      stage2_warmup_steps=0,
      stage2_learning_rate=0.0,
      stage2_final_learning_rate=0.0,
      # SFT data: a JSONL of prompt + response or chat messages; "" uses the
      # task's own warm-start pairs (pointer chasing has them).
      train_path="",
      # The last stage2_steps steps train on this set instead (the long-CoT
      # warm-up rows of launch/warmup_data.py); "" keeps train_path.
      stage2_train_path="",
      on_bad_row="error",  # or "skip": drop bad rows and count them
      prompt_field="prompt",
      response_field="response",
      messages_field="messages",
      truncate=False,  # True: cut examples longer than seq_len
  ))


def sampler_config() -> ml_collections.ConfigDict:
  """128 slots over a 48-token cache."""
  return ml_collections.ConfigDict(dict(
      max_slots=128,
      cache_len=48,
      prefill_buckets=(8, 16, 32, 48),
      prefill_batch_buckets=(),  # () = powers of two up to max_slots
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      repeat_ngram=4,
      repeat_times=4,
      # Decode steps per jitted call (host round trip); the device stops
      # finished slots and results do not depend on it (docs/sampler.md).
      steps_per_call=16,
      # KV cache layout (docs/sampler.md): 0 = a row of cache_len per slot;
      # > 0 = a pool of pages, kv_pages of them (0: every slot at full
      # length). A decode step reads at most the longest live slot, rounded
      # up to min_view x 2^i entries.
      page_size=0,
      kv_pages=0,
      min_view=64,
      # "xla" (any backend) or "pallas_tpu" (the TPU paged attention
      # kernel; needs page_size > 0).
      attention_kernel="xla",
      # The sampler's weight matmuls: "" as the model computes, or
      # "bfloat16" inputs accumulated in float32 (faster where bfloat16
      # matmul units exist; the log-prob gap to the trainer grows).
      matmul_dtype="",
  ))


def rl_config() -> ml_collections.ConfigDict:
  """Mirror descent with partial rollouts and the length reward."""
  return ml_collections.ConfigDict(dict(
      iterations=80,
      prompts_per_iteration=32,
      samples_per_prompt=8,
      loss="mirror_descent",  # or "rest"
      tau=1.0,
      baseline="mean",  # or "soft"
      learning_rate=2e-4,
      grad_clip=1.0,
      minibatch_prompts=16,
      epochs=2,
      reset_optimizer=True,
      warmup_steps=0,  # ours: learning-rate ramp after each reset
      max_response_len=32,
      # Partial rollouts: tokens a trajectory may generate per iteration.
      token_budget=12,
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
      # Long chains span three iterations and the first token decides
      # between reasoning and a direct answer: train on every segment
      # (see docs/loop.md).
      train_on_old_segments=True,
      reference_logprobs="recompute",
      # Truncated importance sampling of the sampler-trainer gap
      # (docs/rl.md); 0: off.
      tis_cap=0.0,
      length_reward_weight=0.1,
      length_reward_warmup=40,
      repeat_penalty=-1.0,
      train_len_buckets=(16, 32, 48),
      # Minibatch sequences packed into rows, no cross-attention between
      # them (see docs/loop.md); False puts one response per row.
      pack_sequences=True,
      eval_every=10,
      eval_samples=4,
      eval_benchmarks=(),
      # Routing replay for a mixture-of-experts policy: the trainer routes each
      # token to the experts the sampler chose (docs/rl.md); dense models: False.
      routing_replay=False,
  ))


def shrink_to_micro(c: ml_collections.ConfigDict) -> None:
  """Seconds-scale variant for tests: a few SFT steps, 3 RL iterations."""
  c.task.max_steps = 3
  c.sft.steps = 20
  c.sampler.max_slots = 32
  c.rl.iterations = 3
  c.rl.prompts_per_iteration = 8
  c.rl.samples_per_prompt = 4
  c.rl.minibatch_prompts = 4
  c.rl.length_reward_warmup = 1
  c.rl.eval_every = 0
  c.rl.eval_samples = 1
  c.log.progress = False
  c.log.plots = False
