"""Running the app under uvicorn: request-head timeouts, the drain on SIGTERM, the open-file limit."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import signal
from collections.abc import Callable

import uvicorn

from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig, ServerState
from pocketllm.server.guard import RequestGuard
from pocketllm.server.router import ModelRouter

log = logging.getLogger("pocketllm")


class _RequestHeadTimeout:
    """Mixed into uvicorn's HTTP protocol (h11 or httptools): a connection is closed when it has not
    sent a complete request head `head_timeout` seconds after it opened or after its last response.
    uvicorn's own keep-alive timeout starts only after a response and stops at the first byte, so a
    connection that never speaks, or sends its head a byte at a time, would stay open for good."""
    head_timeout: float

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._wait_for_head()

    def _wait_for_head(self) -> None:
        self._stop_head_timer()
        self._cycle_before = self.cycle  # uvicorn makes a new cycle once a request head is complete
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._cycle_before:
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait_for_head()  # no pipelined request started: the next head has to come in time

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)


def _http_protocol(head_timeout: float) -> type:
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools if installed, else h11
    return type("HTTPProtocol", (_RequestHeadTimeout, AutoHTTPProtocol), {"head_timeout": head_timeout})


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, cfg: ServerConfig) -> None:
    if not cfg.api_key and not _is_loopback(host):
        log.warning("Listening on %s without an API key: anyone who can reach this address can use the server. "
                    "Set a key with --api-key-file or POCKETLLM_API_KEY.", host)


class _Server(uvicorn.Server):
    """uvicorn with a drain: on SIGTERM/SIGINT the listener stays open and answers 503 while the
    requests in flight finish (or, after `shutdown_timeout`, end with an error); then it stops.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, cfg: ServerConfig, state: ServerState,
                 on_started: Callable[[], None] | None):
        super().__init__(config)
        self.llm, self.cfg, self.state, self.on_started = llm, cfg, state, on_started
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None or not self.started:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drained())

    async def _drained(self) -> None:
        log.info("Draining: new requests get 503; %d in flight get up to %g s to finish",
                 self.llm.num_in_flight, self.cfg.shutdown_timeout)
        await self.llm.shutdown(self.cfg.shutdown_timeout)
        self.should_exit = True

    def engine_died(self, error: BaseException) -> None:
        """From the engine thread: exit non-zero, so that a supervisor restarts the server."""
        def stop() -> None:
            log.critical("the engine died (%s); exiting so that the server can be restarted", error)
            self.exit_code = 1
            self.should_exit = True

        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                self._loop.call_soon_threadsafe(stop)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; a clean stop should exit 0.
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def raise_open_file_limit(want: int = 65536) -> None:
    """Each connection holds a file descriptor, and idle ones hold it until their header timeout: a
    soft limit of 1,024 (a common default) would refuse connections below --max-connections."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)


def serve(llm: AsyncLLM | ModelRouter, cfg: ServerConfig, host: str, port: int,
          on_started: Callable[[], None] | None = None) -> int:
    """Serve one engine, or a router's models, until SIGINT/SIGTERM, then drain (see _Server). Returns the
    exit code: 0 after a clean stop, 1 if the server could not start or the engine died."""
    state = ServerState()
    raise_open_file_limit()
    warn_if_exposed(host, cfg)
    cfg = dataclasses.replace(cfg, allowed_hosts=[*cfg.allowed_hosts, host])  # the name it was started on
    if isinstance(llm, ModelRouter):  # its models' apps are made as they load, each with this config and state
        llm.cfg, llm.state = cfg, state
        app = RequestGuard(llm, cfg, state)
    else:
        app = create_app(llm, cfg, state)
    # No connection limit in uvicorn: it would refuse /health too while idle connections fill it.
    # _Guard bounds the requests in flight; idle connections end after `header_timeout` (none sent
    # yet) or uvicorn's keep-alive timeout of 5 s (after a response).
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            http=_http_protocol(cfg.header_timeout), timeout_graceful_shutdown=5)
    server = _Server(config, llm, cfg, state, on_started)
    llm.on_fatal = server.engine_died
    if llm.error is not None:  # it died before the server was there to hear it
        return 1
    server.run()
    return server.exit_code if server.started else 1
