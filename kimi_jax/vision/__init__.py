"""Vision input for the policy (image understanding): a SigLIP vision tower,
a pixel-shuffle + MLP projector into the language model's width, the merge
of image embeddings into placeholder token positions, and Hugging Face
SigLIP import / export. See docs/vision.md."""

from kimi_jax.vision.config import VisionConfig

__all__ = ["VisionConfig"]
