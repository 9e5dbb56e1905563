"""Prompt-set curation and warm-up data (report 2.1, 2.2): the curation
steps (`curate`, `dedup`, `question_format`, `answer_shift`), long-CoT
warm-up data by rejection sampling (`warmup`), the policy the data tools
ask (`policy`), their typed config (`config`), reasoning-gym raw problems
(`gym_problems`), a text tokenizer for models trained from scratch
(`text_tokenizer`) and the whole raw-problems-to-RL pipeline
(`gym_pipeline`)."""
