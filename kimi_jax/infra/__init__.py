"""What every job stands on: config files, printing, result files, dtypes,
multi-process start-up, checkpoints, metrics, the workdir lock, compiler
options and ahead-of-time compilation. Nothing here imports the rest of
kimi_jax."""
