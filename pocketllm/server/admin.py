"""The endpoints about the server itself: `/v1/models`, `/health`, `/metrics`, `/version`."""
from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pocketllm import __version__
from pocketllm.server import protocol as P
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.metrics import ServerMetrics
from pocketllm.server.responses import error_response
from pocketllm.server.serving import OpenAIServing


def admin_routes(llm: AsyncLLM, serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()
    name, created = serving.cfg.model_name, int(time.time())

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "pocketllm"}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str):
        serving.check_model(model)
        return model_card()

    @router.get("/health")
    async def health():
        if not llm.is_running:
            return error_response(P.APIError(503, "The engine is not running.", type="server_error"))
        return Response(status_code=200)

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version():
        return {"version": __version__}

    return router
