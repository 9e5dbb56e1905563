"""Reward models (report 2.3.5): a classic value-head model and a
chain-of-thought model that reasons before a JSON verdict, their training
data, training, evaluation and serving as RL rewards. See
docs/rewards.md."""
