"""What every endpoint answers with: JSON text, OpenAI error objects, server-sent events."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from pocketllm.server import protocol as P

INTERNAL_ERROR = P.APIError(500, "The server had an error while processing your request.", type="server_error")


def to_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class SSEResponse(StreamingResponse):
    """Calls `on_close` however the response ends, even if the body was never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
