"""Prints completions of a run's policy, from its workdir.

  python launch/sample.py --workdir /tmp/kimi_tiny --prompt "37 c5 =" \\
      --num_samples 4 --temperature 0.8

The run's own config (WORKDIR/config.json), tokenizer and checkpoint (the
latest, or --step) are used; --temperature / --top_k / --top_p default to
the config's sampler section. A prompt is formatted as the run's task
formatted its prompts (the chat template, system prompt and thinking
setting of a run from a Hugging Face checkpoint); --raw feeds the text as
is. --json OUT writes one JSON object per sample: prompt, sample,
prompt_tokens, tokens (the response's ids), text, logp, finish.
"""

import json

from absl import app, flags

from kimi_jax.infra import quiet

_WORKDIR = flags.DEFINE_string("workdir", None, "a kimi_jax run's workdir",
                               required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "prompt text (repeat the "
                                    "flag for several)", required=True)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "samples per prompt")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "default: whatever "
                                "the cache leaves after the prompt")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "sampling temperature")
_TOP_K = flags.DEFINE_integer("top_k", None, "top-k (0: off)")
_TOP_P = flags.DEFINE_float("top_p", None, "top-p (1: off)")
_GREEDY = flags.DEFINE_bool("greedy", False, "argmax decoding")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the first sample")
_RAW = flags.DEFINE_bool("raw", False, "feed the prompt text as is, without "
                         "the run's chat template")
_JSON = flags.DEFINE_string("json", None, "also write the samples to this "
                            "file as a JSON list")


def main(argv):
  del argv
  quiet.start()
  from kimi_jax.job import workdir
  records, lines = workdir.complete(
      _WORKDIR.value, _PROMPT.value, step=_STEP.value,
      num_samples=_NUM_SAMPLES.value, max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      greedy=_GREEDY.value, seed=_SEED.value, raw=_RAW.value)
  for line in lines:
    print(line)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(records, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  app.run(main)
