"""A simulated kill of `kimi_jax.step_loop.run_steps`, shared by the
resume tests."""

from kimi_jax import step_loop


def kill_at_placement(monkeypatch, n: int,
                      exc: type[BaseException] = KeyboardInterrupt) -> None:
  """The loop's n-th batch placement raises `exc`, as a kill between steps
  would stop it (the real placement serves every call before that). Undo
  with `monkeypatch.undo()` or a `monkeypatch.context()`."""
  real, calls = step_loop.place_batch, []

  def place(sharder, batch):
    calls.append(1)
    if len(calls) == n:
      raise exc(f"killed at placement {n}")
    return real(sharder, batch)

  monkeypatch.setattr(step_loop, "place_batch", place)
