"""A chain-sum problem's worked solution, and a lucky one: its first step's
result off by one and its answer still right (what a step-checking reward
scores 0 while calling the answer correct)."""

from kimi_jax.rewards.gym_solutions import solution


def good_and_lucky(record) -> tuple[str, str]:
  good = solution(record, "cot")
  first = good.split("\n")[0]
  a, op, b, _, value = first.split()
  return good, good.replace(first, f"{a} {op} {b} = {int(value) + 1}", 1)
