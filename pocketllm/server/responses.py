"""What every endpoint answers with: JSON text, OpenAI error objects, server-sent events."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from pocketllm.server import protocol as P

INTERNAL_ERROR = P.APIError(500, "The server had an error while processing your request.", type="server_error")


def to_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                     503: "overloaded_error"}


def anthropic_error(e: P.APIError) -> dict:
    """The error in Anthropic's shape (its Messages API)."""
    kind = _ANTHROPIC_ERRORS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: P.APIError, path: str = "") -> JSONResponse:
    """The error as the protocol of the route at `path` shapes it: Anthropic's under /v1/messages, Ollama's under
    /api/, else OpenAI's."""
    body = anthropic_error(e) if path.startswith("/v1/messages") else {"error": e.message} if path.startswith("/api/") \
        else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class SSEResponse(StreamingResponse):
    """Calls `on_close` however the response ends, even if the body was never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
