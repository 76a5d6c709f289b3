"""Checks before any route runs (`RequestGuard`): the one middleware every endpoint shares."""
from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from pocketllm.server import protocol as P
from pocketllm.server.config import ServerConfig, ServerState
from pocketllm.server.responses import error_response

# Bodies a web page can POST to any site without a CORS preflight: a JSON route refuses them, so
# that a page the user opens cannot drive a local server.
_CORS_SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_ALWAYS_ANSWERED = ("/health", "/metrics")  # a supervisor must see these even when the server is full


def _host_name(host: str) -> str:
    """The name in a Host header, lower case, without its port and an IPv6 address's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequestGuard:
    """Checks before any route runs: draining, requests in flight, Host and Origin (without an API
    key), API key, content type, body size and body timeout. The body is read here, at most
    `max_bytes` of it within `body_timeout` seconds, and replayed to the app; after it the app sees
    the client's own messages, so a disconnect still reaches it."""

    def __init__(self, app, cfg: ServerConfig, state: ServerState):
        self.app, self.cfg, self.state = app, cfg, state
        self.in_flight = 0
        self.hosts = {_host_name(h) for h in cfg.allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        cfg, path = self.cfg, scope["path"]
        if self.state.draining and path != "/metrics":
            retry = {"Retry-After": str(cfg.drain_retry_after)}
            if path == "/health":
                return await JSONResponse({"status": "draining"}, 503, headers=retry)(scope, receive, send)
            error = P.APIError(503, "The server is shutting down; please retry on another instance or later.",
                               type="server_error", headers=retry)
            return await error_response(error, scope["path"])(scope, receive, send)
        if path in _ALWAYS_ANSWERED:
            return await self._checked(scope, receive, send)
        # Requests are counted here rather than connections by uvicorn: idle connections cost
        # nothing (they time out), and /health stays answerable however many requests run.
        if self.in_flight >= cfg.max_connections:
            error = P.APIError(503, f"The server is serving its maximum of {cfg.max_connections} concurrent "
                                    "requests (--max-connections); please retry shortly.",
                               type="server_error", headers={"Retry-After": "1"})
            return await error_response(error, scope["path"])(scope, receive, send)
        self.in_flight += 1
        try:
            await self._checked(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _checked(self, scope, receive, send):
        cfg, path = self.cfg, scope["path"]
        headers = dict(scope["headers"])
        error = None
        if path != "/health":  # a key shuts out web pages already: they cannot send it without a preflight
            error = self._auth_error(headers) if cfg.api_key else (
                self._host_error(headers) or self._origin_error(scope["method"], headers))
        error = error or self._content_type_error(scope["method"], headers)
        if error is not None:
            return await error_response(error, scope["path"])(scope, receive, send)
        too_large = P.APIError(413, f"The request body is larger than {cfg.max_request_bytes} bytes.",
                               code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > cfg.max_request_bytes:
            return await error_response(too_large, path)(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(receive), cfg.body_timeout)
        except asyncio.TimeoutError:
            error = P.APIError(408, f"The request body did not arrive within {cfg.body_timeout:g} seconds.",
                               code="request_timeout", headers={"Connection": "close"})
            return await error_response(error, scope["path"])(scope, receive, send)
        if body is None:  # the client left
            return
        if len(body) > cfg.max_request_bytes:
            return await error_response(too_large, path)(scope, receive, send)
        await self.app(scope, replaying(bytes(body), receive), send)

    def _auth_error(self, headers: dict) -> P.APIError | None:
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), self.cfg.api_key.encode()):
            return None
        anthropic = headers.get(b"x-api-key")  # how Anthropic's clients send the key
        if anthropic is not None and secrets.compare_digest(anthropic, self.cfg.api_key.encode()):
            return None
        given = given or (anthropic or b"").decode("latin-1")
        msg = ("Incorrect API key provided." if given else
               "You didn't provide an API key. You need to provide your API key in an Authorization "
               "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        return P.APIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _host_error(self, headers: dict) -> P.APIError | None:
        """Without an API key, only localhost, IP addresses and --allowed-hosts: a page that rebinds
        its own domain name to this address (DNS rebinding) is refused by that name."""
        host = headers.get(b"host", b"").decode("latin-1")
        name = _host_name(host)
        if not host or "*" in self.hosts or name in _LOCAL_HOSTS or name in self.hosts or _is_ip_address(name):
            return None
        return P.APIError(400, f"The Host header '{host}' is not allowed: without an API key this server answers "
                               "only localhost, IP addresses and the names given with --allowed-hosts. Start it "
                               f"with --allowed-hosts {name} (or with an API key) to serve that name.",
                          code="invalid_host")

    def _origin_error(self, method: str, headers: dict) -> P.APIError | None:
        """Without an API key, a request that changes state from a browser page must come from the
        server's own origin or one of --allowed-origins (a page's `fetch` may send any body without
        a preflight: a Blob without a type has no Content-Type at all)."""
        origin = headers.get(b"origin")
        if origin is None or method in ("GET", "HEAD", "OPTIONS"):
            return None
        origin = origin.decode("latin-1")
        allowed = self.cfg.allowed_origins
        same = urlsplit(origin).netloc.lower() == headers.get(b"host", b"").decode("latin-1").lower()
        if same or "*" in allowed or origin in allowed:
            return None
        return P.APIError(403, f"Requests from the web page origin '{origin}' are not allowed: start the server "
                               f"with --allowed-origins {origin} (or with an API key) to serve it.",
                          code="origin_not_allowed")

    @staticmethod
    def _content_type_error(method: str, headers: dict) -> P.APIError | None:
        given = headers.get(b"content-type", b"").decode("latin-1")
        media_type = given.partition(";")[0].strip().lower()
        if method != "POST" or media_type not in _CORS_SIMPLE_TYPES:
            return None
        return P.APIError(415, f"Unsupported Content-Type '{media_type}': send the request body as JSON with the "
                               "header 'Content-Type: application/json' (curl: -H 'Content-Type: application/json').",
                          code="unsupported_media_type")

    async def _read_body(self, receive) -> bytearray | None:
        """The body, or None if the client disconnected; stops early past the size limit (this
        also bounds bodies sent without a content-length)."""
        body, more = bytearray(), True
        while more and len(body) <= self.cfg.max_request_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return body


def replaying(body: bytes, receive):
    """An ASGI `receive` that gives the body read already, then the client's own messages (a disconnect)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
