"""openpi's own client drives the server over localhost: metadata, actions equal to in-process sessions,
episodes (new prompt, reset), one session per connection with nothing shared between them."""

import threading

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from vla_runtime.api import Observation
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig, KVMode
from vla_runtime.serve import ServeConfig

HISTORY = SessionConfig(history="history", kv=KVConfig(KVMode.FULL))


def alone(policy, config, prompt, frames, state=None):
    """The actions an in-process session gives for ``frames`` [steps of uint8 HxWx3]."""
    session = policy.new_session(prompt, config)
    return [session.step(Observation(images={"primary": f}, state=state)).actions for f in frames]


def test_metadata_on_connect_and_actions_match_an_in_process_session(tiny_policy, start_server, frame):
    _, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0))
    client = WebsocketClientPolicy("localhost", port)
    meta = client.get_server_metadata()
    assert meta["server"] == "vla-runtime" and meta["family"] == "openvla"
    assert (meta["action_dim"], meta["action_horizon"], meta["history"]) == (7, 1, "history")
    assert meta["keys"]["images"]["primary"] == "observation/image" and meta["session_id"]
    frames = [frame(i) for i in range(4)]
    expected = alone(tiny_policy, HISTORY, "pick up the cube", frames)
    for i, f in enumerate(frames):
        reply = client.infer({"observation/image": f, "observation/wrist_image": f[::2], "prompt": "pick up the cube"})
        assert reply["actions"].shape == (1, 7) and reply["actions"].dtype == np.float64
        np.testing.assert_array_equal(reply["actions"], expected[i])
        assert (reply["episode"], reply["step"]) == (0, i)
        assert reply["server_timing"]["infer_ms"] > 0 and set(reply["policy_timing"]) >= {"vision", "prefill", "decode", "total"}
        assert ("prev_total_ms" in reply["server_timing"]) == (i > 0)
        assert reply["kv"]["tokens_seen"] > 0
    # the prompt may be left out once the session has one
    reply = client.infer({"observation/image": frames[0]})
    assert reply["step"] == 4


def test_history_differs_from_single_so_the_tests_below_can_see_leaks(tiny_policy, frame):
    frames = [frame(i) for i in range(4)]
    history = alone(tiny_policy, HISTORY, "pick up the cube", frames)
    single = alone(tiny_policy, SessionConfig(), "pick up the cube", frames)
    other_history = alone(tiny_policy, HISTORY, "pick up the cube", [frame(9)] + frames[1:])
    assert not np.array_equal(history[3], single[3])  # the history changes the actions
    assert not np.array_equal(history[3], other_history[3])  # an earlier frame changes later actions


def test_two_clients_interleaved_get_what_each_would_get_alone(tiny_policy, start_server, frame):
    _, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0))
    a_frames, b_frames = [frame(i) for i in range(5)], [frame(100 + i) for i in range(5)]
    a_alone = alone(tiny_policy, HISTORY, "pick up the cube", a_frames)
    b_alone = alone(tiny_policy, HISTORY, "open the drawer", b_frames)
    a, b = WebsocketClientPolicy("localhost", port), WebsocketClientPolicy("localhost", port)
    assert a.get_server_metadata()["session_id"] != b.get_server_metadata()["session_id"]
    for i in range(5):
        ra = a.infer({"observation/image": a_frames[i], "prompt": "pick up the cube"})
        rb = b.infer({"observation/image": b_frames[i], "prompt": "open the drawer"})
        np.testing.assert_array_equal(ra["actions"], a_alone[i])
        np.testing.assert_array_equal(rb["actions"], b_alone[i])


def test_concurrent_clients_in_threads_get_what_each_would_get_alone(tiny_policy, start_server, frame):
    n, steps = 4, 4
    _, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0, queue_size=1))  # a queue of one: clients wait
    frames = [[frame(10 * c + i) for i in range(steps)] for c in range(n)]
    expected = [alone(tiny_policy, HISTORY, f"task {c}", frames[c]) for c in range(n)]
    got: dict[int, list] = {}
    barrier = threading.Barrier(n, timeout=120)  # a generous bound; a client that fails first breaks it at once

    def robot(c):
        try:
            client = WebsocketClientPolicy("localhost", port)
        except BaseException:
            barrier.abort()  # the others stop waiting for this one (BrokenBarrierError) instead of hanging
            raise
        barrier.wait()
        got[c] = [client.infer({"observation/image": f, "prompt": f"task {c}"})["actions"] for f in frames[c]]

    threads = [threading.Thread(target=robot, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in range(n):
        for i in range(steps):
            np.testing.assert_array_equal(got[c][i], expected[c][i])


@pytest.mark.parametrize("kv", ["full", "chunked"])
def test_new_prompt_and_reset_start_new_episodes(tiny_policy, start_server, frame, kv):
    HISTORY = SessionConfig(history="history", kv=KVConfig(mode=kv))
    server, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0))
    client = WebsocketClientPolicy("localhost", port)
    f = [frame(i) for i in range(3)]
    for i in range(3):
        client.infer({"observation/image": f[i], "prompt": "pick up the cube"})
    # a new prompt: a fresh episode for it (same actions as a new session)
    fresh = alone(tiny_policy, HISTORY, "open the drawer", f[:2])
    r0 = client.infer({"observation/image": f[0], "prompt": "open the drawer"})
    r1 = client.infer({"observation/image": f[1], "prompt": "open the drawer"})
    assert (r0["episode"], r0["step"], r1["step"]) == (1, 0, 1)
    np.testing.assert_array_equal(r0["actions"], fresh[0])
    np.testing.assert_array_equal(r1["actions"], fresh[1])
    # a reset message: same prompt, history forgotten
    assert client.infer({"reset": True}) == {"reset": True, "episode": 2}
    r = client.infer({"observation/image": f[0]})
    assert (r["episode"], r["step"]) == (2, 0)
    np.testing.assert_array_equal(r["actions"], fresh[0])
    # a reset together with an observation: the new episode starts with that step
    client.infer({"observation/image": f[2]})
    r = client.infer({"observation/image": f[0], "reset": True, "prompt": "pick up the cube"})
    assert (r["episode"], r["step"]) == (3, 0)
    np.testing.assert_array_equal(r["actions"], alone(tiny_policy, HISTORY, "pick up the cube", f[:1])[0])


def test_state_reaches_the_proprio_projector(tiny_proprio_policy, start_server, frame):
    _, port = start_server(tiny_proprio_policy, SessionConfig(), ServeConfig(port=0))
    client = WebsocketClientPolicy("localhost", port)
    states = [np.linspace(-1, 1, 8, dtype=np.float32), np.linspace(1, -1, 8, dtype=np.float32)]
    for state in states:
        expected = alone(tiny_proprio_policy, SessionConfig(), "stack", [frame(0)], state=state)[0]
        reply = client.infer({"observation/image": frame(0), "observation/state": state, "prompt": "stack"})
        np.testing.assert_allclose(reply["actions"], expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"bad_request: observation `state` has shape \(3,\); this policy expects \[8\]"):
        client.infer({"observation/image": frame(0), "observation/state": np.zeros(3)})
    with pytest.raises(RuntimeError, match="the observation needs `state`"):
        client.infer({"observation/image": frame(0)})
    # the connection is still usable
    assert client.infer({"observation/image": frame(0), "observation/state": states[0]})["actions"].shape == (1, 7)
