"""Long2short (report 2.4, 3.4): model merging, shortest rejection sampling,
DPO and long2short RL on top of the main job, and a token-efficiency
comparison of the resulting models (docs/long2short.md)."""
