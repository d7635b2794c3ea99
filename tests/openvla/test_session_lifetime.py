"""A session's memory: freed as soon as the last reference goes (no reference cycle left to the garbage
collector, which a server relies on when robots come and go); reset after steps with every cache."""

import gc
import weakref

import numpy as np
import pytest

from vla_runtime.api import Observation, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig


@pytest.fixture(scope="module")
def policy(tiny_openvla):
    return load_policy(tiny_openvla, device="cpu")


@pytest.mark.parametrize(("history", "kv"), [("single", "full"), ("history", "full"), ("history", "chunked"), ("history", "sink_window")])
def test_dropped_session_and_cache_are_freed_without_the_cycle_collector(policy, frame, history, kv):
    session = policy.new_session("pick up the cube", SessionConfig(history=history, kv=KVConfig(mode=kv)))
    session.step(Observation(images={"primary": frame(0)}))
    refs = [weakref.ref(session), weakref.ref(session.cache)]
    gc.disable()
    try:
        del session
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("kv", ["full", "chunked", "sink_window"])
def test_reset_after_steps_starts_the_episode_afresh(policy, frame, kv):
    config = SessionConfig(history="history", kv=KVConfig(mode=kv))
    session = policy.new_session("pick up the cube", config)
    for i in range(3):
        session.step(Observation(images={"primary": frame(i)}))
    session.reset()  # outside inference mode, after steps that ran in it
    fresh = policy.new_session("pick up the cube", config)
    for i in (5, 6):
        np.testing.assert_array_equal(
            session.step(Observation(images={"primary": frame(i)})).actions, fresh.step(Observation(images={"primary": frame(i)})).actions
        )
    session.reset("open the drawer")
    other = policy.new_session("open the drawer", config)
    np.testing.assert_array_equal(session.step(Observation(images={"primary": frame(7)})).actions, other.step(Observation(images={"primary": frame(7)})).actions)
