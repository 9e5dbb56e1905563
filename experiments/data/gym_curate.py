"""The data tools on reasoning-gym problems (docs/curation.md):

  python launch/gym_data.py --config experiments/data/gym_curate.py \\
      --train W/raw.jsonl --eval W/eval.jsonl
  python launch/curate.py --config experiments/data/gym_curate.py \\
      --in W/raw.jsonl --out W/curated.jsonl --report W/curation.json \\
      --config.policy.workdir=SFT_RUN
  python launch/warmup_data.py --config experiments/data/gym_curate.py \\
      --in W/curated.jsonl --out W/warmup.jsonl --report W/warmup.json \\
      --config.policy.workdir=SFT_RUN

SFT_RUN is a kimi_jax workdir whose latest checkpoint answers (a short
vanilla SFT of the model to curate for); or pass
--config.policy.experiment=experiments/qwen2_5_1_5b.py:cpu_smoke
--config.policy.init_from_hf=HF_DIR to ask a Hugging Face checkpoint.
`:cpu_test` is a seconds-scale variant (few problems, short responses)
that tests run end to end.

Datasets (reasoning-gym generators and verifiers, ours to pick): short
chain sums, simple linear equations, counting letters and spelling
backwards, which a tiny model can learn, plus syllogisms, which ask for
Yes/No and show the true/false filter at work on real generator output.
"""

import json

import ml_collections

from kimi_jax.curation.curate import CurateConfig
from kimi_jax.curation.gym_problems import GymConfig
from kimi_jax.curation.warmup import WarmupConfig
from kimi_jax.infra.config import from_dataclass

GYM_OPTIONS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                  "max_digits": 2},
    "simple_equations": {"min_terms": 2, "max_terms": 2, "min_value": 1,
                         "max_value": 20},
    "letter_counting": {"min_words": 3, "max_words": 6},
    "spell_backward": {"min_word_len": 3, "max_word_len": 6},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.gym = from_dataclass(GymConfig, datasets=",".join(
      list(GYM_OPTIONS) + ["syllogism"]), size=200, eval_size=50,
      options_json=json.dumps(GYM_OPTIONS))
  c.policy = ml_collections.ConfigDict(dict(
      workdir="", step=-1, experiment="", init_from_hf=""))
  c.reward = ml_collections.ConfigDict(dict(name="reasoning_gym",
                                            options={}))
  # Steps and their settings: kimi_jax/curation/curate.py (report 2.1).
  c.curate = from_dataclass(CurateConfig)
  # Rejection sampling: kimi_jax/curation/warmup.py (report 2.2).
  c.warmup = from_dataclass(WarmupConfig, max_new_tokens=384)
  if arg == "cpu_test":
    c.gym.size = 12
    c.gym.eval_size = 4
    c.curate.pass_max_tokens = 24
    c.curate.hack_max_tokens = 8
    c.warmup.samples = 4
    c.warmup.max_new_tokens = 24
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (known: cpu_test)")
  return c
