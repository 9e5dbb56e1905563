"""Length reward (report 2.3.3) against hand-computed tables."""

import numpy as np
import pytest

from kimi_jax.rl.length_reward import length_reward, length_reward_weight

# Each case: lengths, correct, expected (worked out by hand in the comment).
CASES = [
    # min 10, max 30, span 20: lambda = 0.5 - (len - 10) / 20
    #   10 -> 0.5, 20 -> 0.0, 30 -> -0.5, 15 -> 0.25
    # correct keep lambda; incorrect get min(0, lambda).
    ([10, 20, 30, 15], [1, 1, 0, 0], [0.5, 0.0, -0.5, 0.0]),
    ([10, 20, 30, 15], [0, 1, 1, 1], [0.0, 0.0, -0.5, 0.25]),
    # Ties: both 4s are the minimum, 8 the maximum (span 4); 6 -> 0.
    ([4, 8, 4, 6], [1, 0, 0, 1], [0.5, -0.5, 0.0, 0.0]),
    # All lengths equal: zero for everyone, correct or not.
    ([7, 7, 7, 7], [1, 0, 1, 0], [0.0, 0.0, 0.0, 0.0]),
    # All incorrect: only the longer half is penalised.
    # span 12: 3 -> 0.5 -> 0, 6 -> 0.25 -> 0, 12 -> -0.25, 15 -> -0.5
    ([3, 6, 12, 15], [0, 0, 0, 0], [0.0, 0.0, -0.25, -0.5]),
]


@pytest.mark.parametrize("lengths,correct,want", CASES)
def test_table(lengths, correct, want):
  got = length_reward(np.array([lengths], np.int32), np.array([correct], bool))
  assert got.dtype == np.float32 and got.shape == (1, len(lengths))
  np.testing.assert_allclose(got[0], want, atol=1e-7)


def test_k2_and_rows_are_independent():
  # k = 2: shortest +0.5, longest -0.5 when correct; incorrect longest -0.5.
  lengths = np.array([[5, 9], [9, 5], [3, 3], [100, 1]], np.int32)
  correct = np.array([[1, 1], [0, 0], [1, 1], [0, 1]], bool)
  want = [[0.5, -0.5], [-0.5, 0.0], [0.0, 0.0], [-0.5, 0.5]]
  got = length_reward(lengths, correct)
  np.testing.assert_allclose(got, want, atol=1e-7)


def test_weight_warmup():
  w = [length_reward_weight(i, weight=0.3, warmup_iterations=3)
       for i in range(6)]
  assert w == [0.0, 0.0, 0.0, 0.3, 0.3, 0.3]
  assert length_reward_weight(0, weight=0.3, warmup_iterations=0) == 0.3
  with pytest.raises(ValueError, match="warmup_iterations"):
    length_reward_weight(0, weight=0.3, warmup_iterations=-1)
