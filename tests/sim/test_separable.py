"""Separable steps (``vla_runtime.sim.memory.separable``): the steps of a memory task whose expert action depends on
the answer, which ``finetune --separable-weight`` weights and ``benchmarks/copycat_memory.py`` scores."""

from dataclasses import replace

import numpy as np
import pytest

from vla_runtime.sim.memory import CountingTask, OrderTask, ReferenceTask, TallyTask
from vla_runtime.sim.memory.base import MOVE_GAIN
from vla_runtime.sim.memory.order import PAD_OFFSETS
from vla_runtime.sim.memory.reach import TARGET_Z
from vla_runtime.sim.memory.separable import SEPARATION, separable, separable_steps

ROW = (-0.06, 0.6)


def tally(count: int) -> TallyTask:
    return TallyTask(delay=20, row=ROW, lit=tuple(range(count)))


def beside_middle(dx: float) -> np.ndarray:
    """The hand over the row, ``dx`` metres from the middle pad toward the last one."""
    return np.array([ROW[0] + dx, ROW[1], TARGET_Z])


def test_on_the_shared_way_one_and_two_flashes_part_where_the_gain_stops_saturating():
    # toward the middle pad (two flashes) the move is MOVE_GAIN * distance; toward the first it stays at full speed
    edge = (1.0 - SEPARATION) / MOVE_GAIN  # 2.8 cm: closer than that, the two moves differ by more than SEPARATION
    for count in (1, 2):
        assert not separable(tally(count), beside_middle(0.09))  # both at full speed
        assert not separable(tally(count), beside_middle(edge + 0.002))
        assert separable(tally(count), beside_middle(edge - 0.002))
        assert separable(tally(count), beside_middle(0.0))  # over the middle pad: hold, or go on at full speed
    # three flashes: the last pad lies the other way, so every step on the row is separable
    assert separable(tally(3), beside_middle(0.09)) and separable(tally(3), beside_middle(PAD_OFFSETS[2]))


def test_a_pad_the_hand_is_far_from_in_y_or_z_alone_still_separates():
    # the pads share y and z: a hand off the row moves the same in y and z toward each, only x tells them apart
    hand = beside_middle(0.09) + np.array([0.0, 0.2, 0.1])
    assert not separable(tally(2), hand)
    first = OrderTask(delay=20, row=ROW, first=0, second=2)
    assert separable(first, beside_middle(0.0)) and not separable(first, beside_middle(-0.2))


def test_separable_steps_are_the_separable_observations_from_go():
    episode = tally(2)
    go = episode.go_step
    # the arm held 8 cm from the middle pad until go, then 1 cm a step toward it, then held over it
    xs = [0.08] * go + [0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0.0, 0.0, 0.0]
    hands = np.stack([beside_middle(x) for x in xs])
    assert separable_steps(episode, hands) == [t for t in range(go, len(xs)) if xs[t] < 0.028]
    assert separable_steps(episode, np.stack([beside_middle(0.0)] * len(xs))) == list(range(go, len(xs)))  # not before go
    assert separable_steps(replace(episode, lit=(0, 1, 2)), hands) == list(range(go, len(xs)))
    states = np.concatenate([hands, np.zeros((len(xs), 4))], axis=1)  # a state that starts with the hand
    assert separable_steps(episode, states) == separable_steps(episode, hands)
    with pytest.raises(ValueError, match=r"\[steps, >= 3\].*\(10,\)"):
        separable_steps(episode, np.zeros(10))


def test_reference_separates_the_last_steps_of_the_reach_from_spots_one_success_radius_away():
    spot = (0.0, 0.6)
    episode = ReferenceTask(delay=20, goal=spot)
    edge = (1.0 - SEPARATION) / MOVE_GAIN  # 2.8 cm: the wrong spot straight behind the true one draws full speed

    def hand(offset) -> np.ndarray:
        return np.array([spot[0] + offset[0], spot[1] + offset[1], TARGET_Z])

    for axis in (np.array([1.0, 0.0]), np.array([0.0, -1.0])):
        assert not separable(episode, hand(0.2 * axis))
        assert not separable(episode, hand((edge + 0.002) * axis))
        assert separable(episode, hand((edge - 0.002) * axis))
    # a diagonal approach: separable once no axis is more than the edge from the spot
    diagonal = np.array([0.6, -0.8])
    assert not separable(episode, hand((edge + 0.002) / 0.8 * diagonal))
    assert separable(episode, hand((edge - 0.002) / 0.8 * diagonal))
    # holding over the spot, or anywhere inside the success disc: a wrong spot 6 cm away still draws a move
    assert separable(episode, hand((0.0, 0.0))) and separable(episode, hand((0.02, 0.01)))
    assert not separable(episode, hand((0.0, 0.0)), separation=1.0)  # no move exceeds full speed
    go = episode.go_step
    xs = [0.2] * go + [0.1, 0.05, 0.03, 0.02, 0.01, 0.0, 0.0]
    hands = np.stack([[spot[0] + x, spot[1], TARGET_Z] for x in xs])
    assert separable_steps(episode, hands) == [t for t in range(go, len(xs)) if xs[t] < edge]
    assert separable_steps(episode, np.stack([hands[-1]] * len(xs))) == list(range(go, len(xs)))  # not before go


def test_counting_has_no_separable_step():
    episode = CountingTask.sample(0)
    assert not separable(episode, np.array([0.0, 0.6, TARGET_Z]))
    assert separable_steps(episode, np.zeros((200, 3))) == []
