"""kimi_jax: the Kimi k1.5 reinforcement-learning recipe in JAX."""

__version__ = "0.1.0"
