"""``vla-runtime serve``: an openpi-compatible websocket policy server with one session per robot.

    from vla_runtime.serve.server import ServerThread, build_server
    thread = ServerThread(build_server(policy, SessionConfig(history="history"), ServeConfig(port=0)))
    port = thread.start()   # ... openpi_client.websocket_client_policy.WebsocketClientPolicy("localhost", port)
    thread.stop()

Layers: ``wire`` (msgpack-numpy, no pickle) -> ``messages`` (a message -> ``Request``) -> ``sessions``
(per-robot state and the registry) -> ``engine`` (the worker that steps sessions, batched when it can)
-> ``server`` (websocket, auth, limits). Only ``server`` imports ``websockets`` (the ``serve`` extra).
"""

from .config import BatchConfig, Limits, ObservationKeys, ServeConfig

__all__ = ["BatchConfig", "Limits", "ObservationKeys", "ServeConfig"]
