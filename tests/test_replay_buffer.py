"""Partial-rollout buffer: reassembly, group completion, wait limit, state."""

import json

import numpy as np
import pytest

from kimi_jax.rl.replay_buffer import (BUDGET_EXHAUSTED, RolloutBuffer,
                                       Segment, loss_mask)


def test_trajectory_split_over_three_iterations_reassembles():
  buf = RolloutBuffer(group_size=1, max_wait_iterations=5)
  gid = buf.new_group(prompt_index=7)
  parts = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-0.4, -0.5]),
           ([6], [-0.6])]
  for it, (toks, lps) in enumerate(parts):
    (traj,) = buf.pending()
    assert list(traj.tokens) == sum((p[0] for p in parts[:it]), [])
    reason = "stop" if it == 2 else None
    buf.add_segment(gid, 0, toks, lps, version=10 + it, finish_reason=reason)
  assert buf.pending() == []
  (group,) = buf.complete_groups()
  (traj,) = group.trajectories
  assert group.prompt_index == 7 and traj.prompt_index == 7
  assert traj.tokens == (1, 2, 3, 4, 5, 6)
  assert traj.logprobs == (-0.1, -0.2, -0.3, -0.4, -0.5, -0.6)
  assert traj.segments == (Segment(0, 3, 10), Segment(3, 5, 11),
                           Segment(5, 6, 12))
  np.testing.assert_array_equal(traj.token_versions(),
                                [10, 10, 10, 11, 11, 12])
  assert traj.length == 6 and traj.waited == 2
  assert traj.finish_reason == "stop"
  assert len(buf) == 0


def test_group_completes_only_when_all_k_finished():
  buf = RolloutBuffer(group_size=3, max_wait_iterations=4)
  g0 = buf.new_group(0)
  g1 = buf.new_group(0)                   # same prompt in flight twice
  assert [(t.group_id, t.sample_index) for t in buf.pending()] == [
      (g0, 0), (g0, 1), (g0, 2), (g1, 0), (g1, 1), (g1, 2)]
  # Iteration 0: g0 has one carried response; g1 finishes outright.
  buf.add_segment(g0, 0, [1], [-1.0], version=0, finish_reason="stop")
  buf.add_segment(g0, 1, [2, 2], [-1.0, -1.0], version=0, finish_reason=None)
  buf.add_segment(g0, 2, [3], [-1.0], version=0, finish_reason="max_length")
  for j in range(3):
    buf.add_segment(g1, j, [9], [-0.5], version=0, finish_reason="stop")
  done = buf.complete_groups()
  assert [g.group_id for g in done] == [g1]
  assert [(t.group_id, t.sample_index) for t in buf.pending()] == [(g0, 1)]
  assert buf.complete_groups() == []
  # Iteration 1: the carried response finishes; now g0 is complete.
  buf.add_segment(g0, 1, [4], [-2.0], version=1, finish_reason="stop")
  (group,) = buf.complete_groups()
  assert group.group_id == g0
  assert [t.sample_index for t in group.trajectories] == [0, 1, 2]
  assert group.trajectories[1].tokens == (2, 2, 4)
  assert buf.stats == {"groups_opened": 2, "groups_completed": 2,
                       "segments": 7, "carried_over": 1,
                       "budget_exhausted": 0}


@pytest.mark.parametrize("max_wait", [0, 2])
def test_max_wait_force_finishes(max_wait):
  buf = RolloutBuffer(group_size=2, max_wait_iterations=max_wait)
  gid = buf.new_group(3)
  buf.add_segment(gid, 1, [5], [-0.5], version=0, finish_reason="stop")
  # Response 0 hits the budget every iteration: carried max_wait times, then
  # finished as "budget_exhausted" at iteration max_wait.
  for it in range(max_wait + 1):
    assert buf.complete_groups() == []
    (traj,) = buf.pending()
    traj = buf.add_segment(gid, 0, [it], [-1.0], version=it,
                           finish_reason=None)
  assert traj.finish_reason == BUDGET_EXHAUSTED
  assert traj.waited == max_wait and traj.length == max_wait + 1
  (group,) = buf.complete_groups()
  assert [t.finish_reason for t in group.trajectories] == [
      BUDGET_EXHAUSTED, "stop"]
  assert buf.stats["budget_exhausted"] == 1
  assert buf.stats["carried_over"] == max_wait


def test_add_segment_validation():
  buf = RolloutBuffer(group_size=1, max_wait_iterations=1)
  gid = buf.new_group(0)
  with pytest.raises(ValueError, match="logprobs"):
    buf.add_segment(gid, 0, [1, 2], [-1.0], version=0, finish_reason=None)
  with pytest.raises(ValueError, match="buffer only"):
    buf.add_segment(gid, 0, [1], [-1.0], version=0,
                    finish_reason=BUDGET_EXHAUSTED)
  buf.add_segment(gid, 0, [1], [-1.0], version=3, finish_reason=None)
  with pytest.raises(ValueError, match="newer"):
    buf.add_segment(gid, 0, [1], [-1.0], version=3, finish_reason=None)
  buf.add_segment(gid, 0, [2], [-1.0], version=4, finish_reason="stop")
  with pytest.raises(ValueError, match="already finished"):
    buf.add_segment(gid, 0, [1], [-1.0], version=5, finish_reason="stop")
  with pytest.raises(KeyError):
    buf.add_segment(gid + 1, 0, [1], [-1.0], version=5, finish_reason="stop")


def test_state_round_trip_is_exact():
  buf = RolloutBuffer(group_size=2, max_wait_iterations=3)
  rng = np.random.default_rng(0)
  lp = rng.normal(size=5).astype(np.float32)   # arbitrary float32 values
  g0, g1, g2 = buf.new_group(4), buf.new_group(5), buf.new_group(4)
  buf.add_segment(g0, 0, [1, 2], lp[:2], version=0, finish_reason=None)
  buf.add_segment(g0, 1, [3], lp[2:3], version=0, finish_reason="stop")
  buf.add_segment(g1, 0, [4, 5], lp[3:5], version=0, finish_reason=None)
  buf.add_segment(g0, 0, [6], lp[:1], version=1, finish_reason=None)
  buf.complete_groups()
  text = json.dumps(buf.state_dict())
  restored = RolloutBuffer(group_size=2, max_wait_iterations=3)
  restored.load_state_dict(json.loads(text))
  assert restored.pending() == buf.pending()
  assert restored.stats == buf.stats and len(restored) == len(buf) == 3
  assert restored.pending()[0].logprobs == tuple(float(x) for x in
                                                 (lp[0], lp[1], lp[0]))
  # Both continue identically, including new group ids.
  for b in (buf, restored):
    b.add_segment(g0, 0, [7], [-0.1], version=2, finish_reason="stop")
    b.add_segment(g1, 0, [8], [-0.1], version=2, finish_reason="stop")
    b.add_segment(g1, 1, [], [], version=2, finish_reason="stop")
    assert b.new_group(9) == 3
  assert buf.complete_groups() == restored.complete_groups()
  assert restored.pending() == buf.pending()
  assert len(buf.pending()) == 4             # g2 and the new group
  assert g2 in {t.group_id for t in restored.pending()}
  with pytest.raises(ValueError, match="group_size"):
    RolloutBuffer(group_size=3, max_wait_iterations=3).load_state_dict(
        json.loads(text))


def test_loss_mask_both_switch_values():
  versions = np.array([4, 4, 4, 5, 5, 6, 6, 6])
  np.testing.assert_array_equal(
      loss_mask(versions, 6, train_on_old_segments=False),
      [0, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(
      loss_mask(versions, 6, train_on_old_segments=True), [1] * 8)
  # A response finished in an earlier iteration gets no tokens by default.
  assert not loss_mask(np.array([5, 5]), 6).any()
  with pytest.raises(ValueError, match="newer"):
    loss_mask(versions, 5)


def test_length_counts_all_segments_while_mask_counts_current_only():
  buf = RolloutBuffer(group_size=1, max_wait_iterations=2)
  gid = buf.new_group(0)
  buf.add_segment(gid, 0, [1] * 4, [-1.0] * 4, version=0, finish_reason=None)
  buf.add_segment(gid, 0, [2] * 3, [-1.0] * 3, version=1, finish_reason="stop")
  (traj,) = buf.complete_groups()[0].trajectories
  assert traj.length == 7
  assert int(loss_mask(traj.token_versions(), 1).sum()) == 3


def test_groups_to_open_counts_unfinished_responses():
  from kimi_jax.rl.rollout import groups_to_open
  buf = RolloutBuffer(group_size=4, max_wait_iterations=3)
  assert groups_to_open(buf, 3) == 3  # empty: 12 responses wanted
  g = buf.new_group(0)
  for j in range(3):  # three of four finish; one long response waits
    buf.add_segment(g, j, [5], [-0.1], version=0, finish_reason="stop")
  buf.add_segment(g, 3, [5], [-0.1], version=0, finish_reason=None)
  # 1 unfinished response: ceil((12 - 1) / 4) = 3 new groups, not 2.
  assert groups_to_open(buf, 3) == 3
  buf.new_group(1)
  assert groups_to_open(buf, 3) == 2  # 5 unfinished: ceil(7 / 4)


def test_record_results_leaves_unstarted_requests_untouched():
  from kimi_jax.rl.rollout import record_results
  from kimi_jax.sampler.driver import SampleResult
  buf = RolloutBuffer(group_size=2, max_wait_iterations=1)
  g = buf.new_group(7)
  counts = record_results(buf, [
      SampleResult((g, 0), (4, 5), (-0.5, -0.25), "budget"), None], version=3)
  assert counts["budget"] == 1 and counts["unstarted"] == 1
  started, unstarted = buf.pending()
  assert (started.tokens, started.waited) == ((4, 5), 1)
  assert started.segments == (Segment(0, 2, 3),)
  # Not started: no segment, no wait used; it is simply asked for again.
  assert (unstarted.tokens, unstarted.segments, unstarted.waited) == (
      (), (), 0)
