"""The websocket edge: openpi's wire protocol in front of a ``PolicyEngine``.

Protocol (what ``openpi_client.websocket_client_policy.WebsocketClientPolicy`` speaks):

- the client opens a websocket (``Authorization: Api-Key <token>`` when the server has a token);
- the server sends one binary msgpack frame of metadata (family, action_dim, action_horizon, keys, limits,
  ``session_id``);
- each binary frame from the client is an observation map (or a reset); the reply is a binary frame
  ``{"actions": [horizon, action_dim], "server_timing": {...}, "policy_timing": {...}, "episode", "step", "kv"}``
  (or ``{"reset": True, "episode"}``);
- anything wrong with a message is answered by one **text** frame ``"vla-runtime <code>: <reason>"``
  (openpi's client raises it as ``RuntimeError``) and the connection stays open.

``GET /healthz`` answers 200 without authentication. Close codes: 1009 message over the size limit,
1013 server full (reason says so), 4408 idle timeout, 1001 server shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import ipaddress
import logging
import threading
import time
from dataclasses import asdict
from enum import Enum

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from . import wire
from .config import ServeConfig
from .engine import InternalError, PolicyEngine
from .messages import BadRequest, parse_request
from .sessions import RobotSession, SessionClosed, SessionLimitReached, SessionRegistry

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
CLOSE_SERVER_FULL = 1013  # "try again later"
CLOSE_IDLE = 4408  # application code: idle timeout
CLOSE_TIMEOUT_S = 2.0  # at shutdown, a client that does not answer the close handshake by then is dropped


class ErrorCode(str, Enum):
    """The ``<code>`` of an error reply."""

    BAD_FRAME = "bad_frame"  # not binary, not msgpack, or a malformed array
    BAD_REQUEST = "bad_request"  # valid msgpack that is not a usable observation
    SESSION_CLOSED = "session_closed"
    INTERNAL = "internal"


def error_reply(code: ErrorCode, reason: object) -> str:
    return f"vla-runtime {code.value}: {reason}"


def authorized(headers: Headers, token: str) -> bool:
    """``Authorization: Api-Key <token>`` (openpi's client) or ``Bearer <token>``, compared in constant time."""
    value = headers.get("Authorization", "")
    scheme, _, given = value.partition(" ")
    if scheme.lower() not in ("api-key", "bearer"):
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class PolicyServer:
    """Serves ``engine`` over websocket with the settings of ``config`` (see the module doc).

    ``serve(stop)`` runs until ``stop`` is set; ``ServerThread`` runs it in a thread of its own.
    """

    def __init__(self, engine: PolicyEngine, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        self.registry = engine.registry
        self.decode_limits = config.limits.decode_limits()
        self.port: int | None = None
        self._connections: dict[str, ServerConnection] = {}
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()

    def metadata(self, robot: RobotSession) -> dict:
        cfg = self.config
        return {
            "server": "vla-runtime",
            "protocol": PROTOCOL_VERSION,
            "session_id": robot.id,
            **self.engine.metadata(),
            "keys": asdict(cfg.keys),
            "limits": asdict(cfg.limits),
            "idle_timeout_s": cfg.idle_timeout_s,
        }

    # ---- lifecycle -------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event, on_ready=None) -> None:
        """Listen until ``stop`` is set; ``on_ready(port)`` is called once the socket is bound."""
        cfg = self.config
        if cfg.api_token is None and not is_loopback(cfg.host):
            log.warning("listening on %s without --api-token: anyone who reaches this port can drive the policy", cfg.host)
        self._slots = asyncio.Semaphore(cfg.queue_size)
        self.engine.start()
        try:
            async with serve(
                self._handle, cfg.host, cfg.port, process_request=self._process_request, compression=None,
                max_size=cfg.limits.max_message_bytes, max_queue=4, close_timeout=CLOSE_TIMEOUT_S,
            ) as server:  # fmt: skip
                self.port = server.sockets[0].getsockname()[1]
                log.info("serving %s on ws://%s:%d (healthz: /healthz)", self.engine.policy.name, cfg.host, self.port)
                reaper = asyncio.create_task(self._reap_idle())
                if on_ready is not None:
                    on_ready(self.port)
                await stop.wait()
                reaper.cancel()
                server.close()
                await server.wait_closed()
        finally:
            await asyncio.to_thread(self.engine.stop)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        token = self.config.api_token
        if token is not None and not authorized(request.headers, token):
            log.warning("refused %s: missing or wrong API token", connection.remote_address)
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API token: send 'Authorization: Api-Key <token>'\n")
        return None

    async def _reap_idle(self) -> None:
        """Close sessions that sent nothing for ``idle_timeout_s`` (their caches are freed)."""
        interval = min(self.config.idle_timeout_s / 4, 1.0)
        while True:
            await asyncio.sleep(interval)
            for robot in self.registry.idle():
                log.info("session %s (%s) idle for %g s: closed", robot.id, robot.peer, self.config.idle_timeout_s)
                self.registry.close(robot)
                ws = self._connections.get(robot.id)
                if ws is not None:
                    self._spawn(ws.close(CLOSE_IDLE, f"idle for {self.config.idle_timeout_s:g} s: session closed"))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- one connection --------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        peer = "%s:%s" % ws.remote_address[:2] if ws.remote_address else "?"
        try:
            robot = self.registry.open(peer)
        except SessionLimitReached as e:
            log.warning("refused %s: %s", peer, e)
            await ws.close(CLOSE_SERVER_FULL, str(e)[:120])
            return
        self._connections[robot.id] = ws
        log.info("session %s opened by %s (%d open)", robot.id, peer, len(self.registry))
        try:
            await ws.send(wire.pack(self.metadata(robot)))
            prev_total_ms = None
            async for frame in ws:
                start = time.perf_counter()
                self.registry.touch(robot)
                reply = await self._reply(robot, frame)
                if isinstance(reply, dict) and "server_timing" in reply and prev_total_ms is not None:
                    reply["server_timing"]["prev_total_ms"] = prev_total_ms
                self.registry.touch(robot)  # before sending: idle time counts from the reply
                await ws.send(reply if isinstance(reply, str) else wire.pack(reply))
                prev_total_ms = (time.perf_counter() - start) * 1e3
        except ConnectionClosed:
            pass
        finally:
            self.registry.close(robot)
            self._connections.pop(robot.id, None)
            log.info("session %s closed (%d open)", robot.id, len(self.registry))

    async def _reply(self, robot: RobotSession, frame: bytes | str) -> dict | str:
        """The reply to one frame: a dict to pack, or an error text. Never raises."""
        if isinstance(frame, str):
            return error_reply(ErrorCode.BAD_FRAME, "expected a binary msgpack frame, got a text frame")
        try:
            request = parse_request(wire.unpack(frame, self.decode_limits), self.config.keys, self.config.limits)
        except wire.WireError as e:
            return error_reply(ErrorCode.BAD_FRAME, e)
        except BadRequest as e:
            return error_reply(ErrorCode.BAD_REQUEST, e)
        except Exception as e:  # noqa: BLE001 - a bug in decoding must not end the connection
            log.exception("decoding a message of session %s failed", robot.id)
            return error_reply(ErrorCode.INTERNAL, f"could not decode the message ({type(e).__name__})")
        robot.in_flight += 1
        try:
            async with self._slots:  # the bounded queue: a full one makes this session wait (backpressure)
                return await asyncio.wrap_future(self.engine.submit(robot, request))
        except BadRequest as e:
            return error_reply(ErrorCode.BAD_REQUEST, e)
        except SessionClosed as e:
            return error_reply(ErrorCode.SESSION_CLOSED, e)
        except InternalError as e:
            return error_reply(ErrorCode.INTERNAL, e)
        except Exception as e:  # noqa: BLE001
            log.exception("request of session %s failed", robot.id)
            return error_reply(ErrorCode.INTERNAL, f"request failed ({type(e).__name__})")
        finally:
            robot.in_flight -= 1


def build_server(policy, session_config, config: ServeConfig, *, clock=time.monotonic) -> PolicyServer:
    """A server for a loaded ``policy`` whose sessions use ``session_config`` (``clock``: the registry's
    monotonic seconds, for idle timeouts; tests pass a fake one)."""
    registry = SessionRegistry(config.max_sessions, config.idle_timeout_s, clock)
    return PolicyServer(PolicyEngine(policy, session_config, registry, config.batch), config)


class ServerThread:
    """A ``PolicyServer`` running in a thread of its own (tests, benchmarks, embedding in an app).

    ``start()`` returns the bound port once the server listens (or raises why it could not);
    ``stop()`` closes every connection, stops the engine and joins the thread.
    """

    def __init__(self, server: PolicyServer) -> None:
        self.server = server
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="vla-serve-loop", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.server.port

    def stop(self) -> None:
        """Stop and join; re-raises an error that ended the server early."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.server.serve(self._stop, on_ready=lambda _: self._ready.set())

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._error = e
        finally:
            self._ready.set()
