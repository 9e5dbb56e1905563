"""Experiment configs: one `get_config(arg)` per module, run command first in
its docstring. Modules starting with `_` hold shared pieces, not
experiments."""
