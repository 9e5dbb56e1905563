"""What a run prints: log lines and progress bars, from process 0 only."""

from __future__ import annotations

import sys

import jax



def log(msg: str) -> None:
  """One line on stdout; `tqdm.write` keeps an open progress bar intact."""
  if jax.process_index() == 0:
    from tqdm import tqdm
    tqdm.write(msg)
    sys.stdout.flush()


def progress(iterable, total: int, desc: str, enabled: bool, initial: int = 0):
  """A tqdm bar over `iterable` on stderr, or the iterable itself."""
  if not enabled or jax.process_index() != 0:
    return iterable
  from tqdm import tqdm
  return tqdm(iterable, total=total, desc=desc, initial=initial,
              dynamic_ncols=True, file=sys.stderr)
