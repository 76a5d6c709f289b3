"""The endpoints about the server itself: `/v1/models`, `/health`, `/metrics`, `/version`."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pocketllm import __version__
from pocketllm.errors import ConfigurationError
from pocketllm.server import protocol as P
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.metrics import ServerMetrics
from pocketllm.server.responses import error_response
from pocketllm.server.serving import OpenAIServing


def admin_routes(llm: AsyncLLM, serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()
    name, created = serving.cfg.model_name, int(time.time())

    def model_card(adapter: str | None = None) -> dict:
        return P.model_card(name, created, serving.engine, adapter)

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(), *(model_card(a) for a in serving.lora_adapters())]}

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str):
        return model_card(serving.check_model(model))

    # vLLM's routes for LoRA adapters at run time (behind the API key, as every /v1 route)
    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = await serving.parsed(P.LoadLoRAAdapterRequest, await request.body())
        lora = lora_manager()
        if req.lora_name == name or req.lora_name in lora.names():
            raise P.APIError(400, f"The name `{req.lora_name}` is taken; unload that adapter first.", param="lora_name")
        try:
            await asyncio.to_thread(lora.load, req.lora_name, req.lora_path)
        except ConfigurationError as e:
            raise P.APIError(400, str(e), param="lora_path") from None
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = await serving.parsed(P.UnloadLoRAAdapterRequest, await request.body())
        lora = lora_manager()
        if req.lora_name not in lora.names():
            raise P.APIError(404, f"No LoRA adapter named `{req.lora_name}` is loaded.", param="lora_name",
                             code="model_not_found")
        lora.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    def lora_manager():
        if serving.engine.lora is None:
            raise P.APIError(400, "This server runs no LoRA adapters: start it with --enable-lora.")
        return serving.engine.lora

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
