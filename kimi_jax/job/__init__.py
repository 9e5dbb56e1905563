"""The main job and what acts on a run: its typed config (`experiment`), the
stages (`run`), the workdir read back (`workdir`), the Hugging Face export
(`export`) and the memory plan (`plan`)."""

from kimi_jax.job.run import train_and_evaluate

__all__ = ["train_and_evaluate"]
