"""uvicorn under ``kvslim serve``: connection limits, read timeouts, graceful shutdown.

- A connection must deliver each request's headers within ``read_timeout``
  (slowloris), and its body too (``read_json``); a stream being written has no
  time limit.
- More than ``max_connections`` open connections are answered 503.
- SIGTERM/SIGINT: stop accepting, end queued requests with an error, let
  running ones finish, end the rest with an error event and ``[DONE]``, and exit 0
  within ``grace`` seconds (what an orchestrator allows before SIGKILL): running
  requests get all of it but the last ``exit_reserve(grace)``, which ending them and
  exiting take (~0.2 s measured; the interpreter's teardown, 1-2 s with torch loaded,
  is skipped). A model that fails to load exits 1.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import ServerState, build_app

log = logging.getLogger("kvslim.server")


class Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request's headers."""

    read_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _read_timed_out(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete     # no handler running on this connection
        if idle and self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server with kvslim's drain before connections are closed."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.grace = state, grace
        self.stopped_by: int | None = None                          # the signal that stopped it, if one did

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = sig
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:                                  # stop accepting first
            server.close()
        await drain(self.state, self.grace)
        await super().shutdown(sockets)


def exit_reserve(grace: float) -> float:
    """Seconds of the grace period kept for ending running requests and exiting."""
    return min(0.75, grace / 2)


async def drain(state: ServerState, grace: float) -> None:
    """Queued requests get an error now; running ones may finish until ``exit_reserve`` before
    the end of ``grace`` s, then are ended."""
    sched = state.scheduler
    if sched is None:
        return
    sched.close()
    deadline = time.monotonic() + grace - exit_reserve(grace)
    while not sched.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not sched.idle():
        log.warning("shutdown: ending %d running requests after the %.0f s grace period",
                    sched.snapshot()["running"], grace)
        sched.abort_active(f"the server is shutting down (grace period of {grace:g} s over)")
    # the streams write their last events while uvicorn closes connections; the engine thread
    # is not waited for past its current step's first 0.2 s (a daemon: the process may end)
    await asyncio.to_thread(sched.shutdown, 0.2)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_server(options: dict, host: str) -> tuple[Server, ServerState]:
    options = {**options, "loopback_only": is_loopback(host)}
    state = ServerState(options)
    protocol = type("KvslimProtocol", (Protocol,), {"read_timeout": float(options.get("read_timeout", 30.0))})
    config = uvicorn.Config(build_app(state), http=protocol, lifespan="off", log_level="warning",
                            access_log=bool(options.get("verbose")), timeout_keep_alive=5,
                            limit_concurrency=options.get("max_connections", 512),
                            timeout_graceful_shutdown=1, server_header=False)
    return Server(config, state, float(options.get("grace", 8.0))), state


class Handle:
    """A server running in a background thread (tests, benchmarks): ``shutdown()`` drains and stops it."""

    def __init__(self, server: Server, thread: threading.Thread):
        self.server, self.thread = server, thread
        self.state = server.state

    def shutdown(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start(options: dict, host: str = "127.0.0.1", port: int = 8080) -> Handle:
    """Bind (raises OSError when the port is taken), load the model in the background, serve in a thread."""
    sock = bind(host, port)
    server, state = make_server(options, host)
    threading.Thread(target=state.load, name="kvslim-load", daemon=True).start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvslim-http", daemon=True)
    thread.start()
    return Handle(server, thread)


def serve(options: dict, host: str, port: int, on_listening=None) -> int:
    """Serve in the main thread until SIGTERM/SIGINT; 0 after a clean shutdown, 1 when the model failed."""
    sock = bind(host, port)
    server, state = make_server(options, host)

    def failed():
        server.should_exit = True
    state.on_load_failed = failed
    # uvicorn re-raises the signal it caught once it has shut down: a no-op handler meanwhile lets us exit 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        threading.Thread(target=state.load, name="kvslim-load", daemon=True).start()
        if on_listening is not None:
            on_listening()
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 1 if state.load_error else 0
    if server.stopped_by is not None:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process once every client is answered, skipping the interpreter's teardown: freeing
    torch's objects module by module takes 1-2 s, past the grace an orchestrator allows before SIGKILL."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
