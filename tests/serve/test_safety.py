"""The wire's safety: token auth, size limits, malformed messages answered without losing the connection or
the server, the session limit, idle timeouts that free memory, failures confined to their session."""

import gc
import http
import urllib.error
import urllib.request
import weakref

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi_wire
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from vla_runtime.api import Observation
from vla_runtime.config import SessionConfig
from vla_runtime.serve import Limits, ServeConfig

HISTORY = SessionConfig(history="history")
PATIENCE_S = 120.0  # bound on waiting for a server-side condition; never reached when the code is right


def raw(port, **headers):
    """A plain websocket client (the library openpi's client uses); returns (connection, metadata)."""
    ws = connect(f"ws://localhost:{port}", max_size=None, compression=None, additional_headers=headers or None)
    return ws, openpi_wire.unpackb(ws.recv())


def healthz(port, headers=None):
    request = urllib.request.Request(f"http://localhost:{port}/healthz", headers=headers or {})
    with urllib.request.urlopen(request) as response:
        return response.status, response.read()


def test_token_auth(tiny_policy, start_server, frame):
    _, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0, api_token="s3cret"))
    assert healthz(port) == (200, b"ok\n")  # no token needed for the health check
    for key in (None, "wrong", "s3cret2", "s3cre"):
        with pytest.raises(InvalidStatus) as info:
            WebsocketClientPolicy("localhost", port, api_key=key)
        assert info.value.response.status_code == http.HTTPStatus.UNAUTHORIZED
        assert b"Api-Key <token>" in info.value.response.body
    client = WebsocketClientPolicy("localhost", port, api_key="s3cret")  # openpi's header: Api-Key
    assert client.infer({"observation/image": frame(0), "prompt": "go"})["actions"].shape == (1, 7)
    ws, meta = raw(port, Authorization="Bearer s3cret")
    assert meta["server"] == "vla-runtime"
    ws.close()
    with pytest.raises(urllib.error.HTTPError) as info:  # a plain HTTP request on the websocket path
        urllib.request.urlopen(f"http://localhost:{port}/")
    assert info.value.code == http.HTTPStatus.UNAUTHORIZED


BAD_FRAMES = [
    ("text frame", "not msgpack", "bad_frame: expected a binary msgpack frame, got a text frame"),
    ("garbage", b"\xc1\xc1\xc1", "bad_frame: not a valid msgpack frame"),
    ("truncated", openpi_wire.packb({"observation/image": np.zeros((8, 8, 3), np.uint8)})[:-10], "bad_frame"),
    ("a list", msgpack.packb([1, 2, 3]), "bad_request: a message must be a map"),
    ("object dtype",
     msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"cos\nsystem\n(S'true'\ntR.", b"dtype": "|O",
                                          b"shape": [1]}, "prompt": "x"}),
     "bad_frame: array dtype '|O' is not allowed"),
    ("short buffer",
     msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"\x00" * 10, b"dtype": "|u1",
                                          b"shape": [64, 64, 3]}}),
     "bad_frame: numpy array of shape [64, 64, 3] and dtype |u1 needs 12288 bytes, got 10"),
    ("float image", openpi_wire.packb({"observation/image": np.zeros((8, 8, 3), np.float32), "prompt": "x"}),
     "bad_request: 'observation/image' must have dtype uint8"),
    ("too many pixels", openpi_wire.packb({"observation/image": np.zeros((100, 100, 3), np.uint8), "prompt": "x"}),
     "bad_request: 'observation/image' has 10000 pixels (100x100); the limit is 4096"),
    ("no prompt yet", openpi_wire.packb({"observation/image": np.zeros((8, 8, 3), np.uint8)}),
     "bad_request: the first step of a session needs a prompt"),
    ("no observation", openpi_wire.packb({"hello": 1}), "bad_request: the message has neither an observation nor a reset"),
    ("nan state", openpi_wire.packb({"observation/image": np.zeros((8, 8, 3), np.uint8), "prompt": "x",
                                     "observation/state": np.array([np.nan])}), "bad_request: the state"),
]  # fmt: skip


def test_malformed_messages_get_an_error_reply_and_the_connection_lives(tiny_policy, start_server, frame):
    config = ServeConfig(port=0, limits=Limits(max_image_pixels=64 * 64))
    server, port = start_server(tiny_policy, HISTORY, config)
    ws, _ = raw(port)
    bystander = WebsocketClientPolicy("localhost", port)  # another robot, stepping between the bad messages
    frames = [frame(i) for i in range(len(BAD_FRAMES) + 1)]
    expected = [o.actions for o in _alone(tiny_policy, "watch", frames)]
    for i, (what, bad, reply) in enumerate(BAD_FRAMES):
        ws.send(bad)
        answer = ws.recv()
        assert isinstance(answer, str), what  # openpi's client raises text frames as RuntimeError
        assert answer.startswith(f"vla-runtime {reply}"), (what, answer)
        got = bystander.infer({"observation/image": frames[i], "prompt": "watch"})["actions"]
        np.testing.assert_array_equal(got, expected[i])
    # the same connection still serves a valid step, as its first episode step
    ws.send(openpi_wire.packb({"observation/image": frames[0], "prompt": "watch"}))
    reply = openpi_wire.unpackb(ws.recv())
    np.testing.assert_array_equal(reply["actions"], expected[0])
    assert (reply["episode"], reply["step"]) == (0, 0)
    ws.close()


def _alone(policy, prompt, frames, config=HISTORY):
    session = policy.new_session(prompt, config)
    return [session.step(Observation(images={"primary": f})) for f in frames]


def test_oversized_message_closes_only_that_connection(tiny_policy, start_server, frame):
    server, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0, limits=Limits(max_message_bytes=100_000)))
    other = WebsocketClientPolicy("localhost", port)
    big = WebsocketClientPolicy("localhost", port)
    with pytest.raises(ConnectionClosedError) as info:
        big.infer({"observation/image": np.zeros((200, 200, 3), np.uint8), "prompt": "x"})
    assert info.value.rcvd.code == 1009  # message too big: never buffered
    assert other.infer({"observation/image": frame(0), "prompt": "x"})["actions"].shape == (1, 7)
    assert server.registry.wait_for(lambda n: n == 1, PATIENCE_S)
    assert WebsocketClientPolicy("localhost", port).infer({"observation/image": frame(1), "prompt": "x"})["step"] == 0


def test_session_limit_refuses_politely_and_frees_on_disconnect(tiny_policy, start_server, frame):
    server, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0, max_sessions=2))
    first, second = raw(port)[0], WebsocketClientPolicy("localhost", port)
    with pytest.raises(ConnectionClosed) as info:
        WebsocketClientPolicy("localhost", port)
    assert info.value.rcvd.code == 1013  # try again later
    assert info.value.rcvd.reason == "server full: 2 of 2 sessions in use; try again later"
    assert second.infer({"observation/image": frame(0), "prompt": "x"})["step"] == 0  # the others are unaffected
    first.close()
    assert server.registry.wait_for(lambda n: n == 1, PATIENCE_S)
    assert WebsocketClientPolicy("localhost", port).infer({"observation/image": frame(0), "prompt": "x"})["step"] == 0


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_idle_session_is_closed_and_its_cache_freed(tiny_policy, start_server, frame):
    clock = FakeClock()
    server, port = start_server(tiny_policy, HISTORY, ServeConfig(port=0, idle_timeout_s=30), clock=clock)
    idle, active = raw(port)[0], WebsocketClientPolicy("localhost", port)
    idle.send(openpi_wire.packb({"observation/image": frame(0), "prompt": "x"}))
    assert openpi_wire.unpackb(idle.recv())["step"] == 0
    (robot,) = [r for r in server.registry.sessions() if r.episode_session is not None]
    episode = weakref.ref(robot.episode_session)
    clock.now += 29  # not idle yet: a step of the other robot keeps only its own session alive
    active.infer({"observation/image": frame(1), "prompt": "y"})
    gc.disable()  # the episode must be freed by its last reference going, not by a collection some time later
    try:
        clock.now += 2  # the first robot: 31 s silent; the second: 2 s
        with pytest.raises(ConnectionClosed) as info:
            idle.recv()  # returns when the server closes the connection
        assert info.value.rcvd.code == 4408 and info.value.rcvd.reason == "idle for 30 s: session closed"
        assert server.registry.wait_for(lambda n: n == 1, PATIENCE_S)
        assert episode() is None  # the episode session (its KV cache) is gone
    finally:
        gc.enable()
    assert active.infer({"observation/image": frame(2)})["step"] == 1


class ExplodingPolicy:
    """The real policy, except that a session's step raises when the image's first pixel is (255, 255, 255)
    (and it steps sessions one at a time, through ``session.step``)."""

    batched_steps = False

    def __init__(self, policy):
        self._policy = policy

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def new_session(self, instruction, config=None):
        session = self._policy.new_session(instruction, config)
        real_step = session.step

        def step(obs):
            if (obs.images["primary"][0, 0] == 255).all():
                session.cache.reset()  # a half-done step: the cache no longer matches the episode
                raise RuntimeError("boom")
            return real_step(obs)

        session.step = step
        return session


def test_a_failing_step_resets_only_that_episode(tiny_policy, start_server, frame, caplog):
    _, port = start_server(ExplodingPolicy(tiny_policy), HISTORY, ServeConfig(port=0))
    client = WebsocketClientPolicy("localhost", port)
    frames = [frame(i) for i in range(3)]
    client.infer({"observation/image": frames[0], "prompt": "x"})
    poison = frames[1].copy()
    poison[0, 0] = 255
    with pytest.raises(RuntimeError, match=r"vla-runtime internal: internal error \(RuntimeError\) while stepping \(the episode was reset\)"):
        client.infer({"observation/image": poison})
    assert "boom" in caplog.text  # the traceback stays on the server
    reply = client.infer({"observation/image": frames[2]})
    assert (reply["episode"], reply["step"]) == (1, 0)
    np.testing.assert_array_equal(reply["actions"], _alone(tiny_policy, "x", frames[2:])[0].actions)


def test_serve_code_never_unpickles():
    import inspect

    import vla_runtime.serve.engine as engine
    import vla_runtime.serve.messages as messages
    import vla_runtime.serve.server as server
    import vla_runtime.serve.sessions as sessions
    import vla_runtime.serve.wire as wire

    for module in (engine, messages, server, sessions, wire):
        source = inspect.getsource(module)
        assert "import pickle" not in source and "torch.load" not in source and "allow_pickle" not in source, module.__name__
