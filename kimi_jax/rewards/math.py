"""Math reward: the final answer, judged by math-verify under a strict policy.

Record fields: `answer` (the reference answer, LaTeX or plain text; numbers
are accepted too).

  answer extraction ........ math_extract.py   (linear time)
  normalisation + policy ... math_policy.py    (conservative: when in doubt,
                                                 reject; docs/rewards.md)
  deadlines ................ verify_pool.py    (forked workers, SIGKILL)

Each item's verdict arrives within `timeout_s` of its dispatch to a worker,
worker restarts included; an item over budget scores incorrect with error
"timeout".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.math_extract import (DEFAULT_ANSWER_PATTERNS,
                                           DEFAULT_BOXED_COMMANDS,
                                           after_thinking, extract_answer,
                                           extract_boxed)
from kimi_jax.rewards.math_policy import CheckOptions
from kimi_jax.rewards.verify_pool import PoolConfig, VerifyPool

__all__ = ["MathReward", "MathRewardConfig", "extract_answer", "extract_boxed"]


@dataclasses.dataclass(frozen=True)
class MathRewardConfig:
  """Options of the math reward.

  timeout_s: wall-clock budget of one check (extract + parse + verify),
    from dispatch to verdict; over it scores incorrect with error "timeout".
  timeout_margin_s: part of the budget kept for killing an overrunning
    worker and reporting (the check itself is cut at timeout_s - margin).
  num_workers: worker processes checking in parallel.
  memory_limit_mb: address-space cap of each worker (None: no cap), so a
    runaway sympy computation fails with MemoryError instead of eating the host.
  max_response_chars: only the last this many characters of a response are
    searched (the final answer sits at the end), after its thinking block
    if it has one (`math_extract.after_thinking`: a boxed value inside
    `<think>...</think>` is a step, not the answer).
  max_answer_chars: an extracted or reference answer longer than this scores
    incorrect without being parsed.
  boxed_commands: LaTeX commands whose argument is the answer; the last one
    in the response wins.
  answer_patterns: regexes tried (in order) when there is no boxed answer;
    group 1 of the last match is the answer.
  start_eagerly: start the verifier's template process when the reward is
    built (its ~2 s start-up then overlaps with whatever comes before the
    first call; the first call waits for it otherwise).
  """

  timeout_s: float = 5.0
  timeout_margin_s: float = 0.25
  num_workers: int = 2
  memory_limit_mb: int | None = 4096
  max_response_chars: int = 100_000
  max_answer_chars: int = 1_000
  boxed_commands: tuple[str, ...] = DEFAULT_BOXED_COMMANDS
  answer_patterns: tuple[str, ...] = DEFAULT_ANSWER_PATTERNS
  start_eagerly: bool = True

  def pool_config(self) -> PoolConfig:
    return PoolConfig(target="kimi_jax.rewards.math_policy:check_answer",
                      warm_up="kimi_jax.rewards.math_policy:warm_up",
                      num_workers=self.num_workers, timeout_s=self.timeout_s,
                      margin_s=min(self.timeout_margin_s,
                                   self.timeout_s / 2),
                      memory_limit_mb=self.memory_limit_mb)

  def check_options(self) -> CheckOptions:
    return CheckOptions(boxed_commands=tuple(self.boxed_commands),
                        answer_patterns=tuple(self.answer_patterns),
                        max_answer_chars=self.max_answer_chars)


def _to_result(out: Mapping[str, Any]) -> RewardResult:
  correct = bool(out.get("correct"))
  info = {"answer": (out.get("answer") or "")[:200] or None}
  if out.get("reason"):
    info["reason"] = out["reason"]
  return RewardResult(score=1.0 if correct else 0.0, correct=correct,
                      error=out.get("error"), info=info)


class MathReward:
  """Reward 1 when the response's final answer equals the record's `answer`.

  Call it for one response or `batch` for many (checked in parallel). Use as a
  context manager, or call `close()`, to stop the worker processes.
  """

  def __init__(self, config: MathRewardConfig | None = None, **options: Any):
    self.config = config or MathRewardConfig(**options)
    self._options = self.config.check_options()
    self._pool = VerifyPool(self.config.pool_config())
    if self.config.start_eagerly:
      self._pool.start()

  def _task(self, record: Mapping[str, Any], response: str
            ) -> tuple[str, str, CheckOptions]:
    if "answer" not in record:
      raise KeyError(f"math record {record.get('id')!r} has no 'answer'")
    if not isinstance(response, str):
      raise TypeError(f"response must be a string, got {type(response)}")
    tail = after_thinking(response)[-self.config.max_response_chars:]
    return str(record["answer"]), tail, self._options

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    return self.batch([record], [response])[0]

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    if len(records) != len(responses):
      raise ValueError(f"{len(records)} records but {len(responses)} responses")
    tasks: list[tuple[str, str, CheckOptions] | None] = []
    early: dict[int, RewardResult] = {}
    for i, (record, response) in enumerate(zip(records, responses)):
      try:
        tasks.append(self._task(record, response))
      except Exception as exc:  # noqa: BLE001 - one bad record scores 0
        tasks.append(None)
        early[i] = RewardResult(0.0, False,
                                error=f"{type(exc).__name__}: {exc}")
    todo = [i for i, t in enumerate(tasks) if t is not None]
    outs = self._pool.run([tasks[i] for i in todo]) if todo else []
    results = dict(early)
    results.update({i: _to_result(out) for i, out in zip(todo, outs)})
    return [results[i] for i in range(len(records))]

  def wait_ready(self) -> None:
    """Blocks until the verifier's workers are up (see VerifyPool)."""
    self._pool.wait_ready()

  def close(self) -> None:
    self._pool.close()

  def __enter__(self) -> "MathReward":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
