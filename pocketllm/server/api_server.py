"""The HTTP API over one `AsyncLLM`: the app, its error handlers and middleware. Each endpoint family
lives in its own module (`chat`, `completions`, `tokenize`, `admin`; the other protocols' translations
`anthropic`, `ollama`, `openai_responses`); `launcher.serve` runs the app under uvicorn."""
from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from pocketllm import __version__
from pocketllm.errors import RequestError, RequestFailedError
from pocketllm.server import anthropic, ollama, openai_responses
from pocketllm.server import embeddings as embedding_endpoints
from pocketllm.server import protocol as P
from pocketllm.server import tokenize as tokenize_endpoints
from pocketllm.server.admin import admin_routes
from pocketllm.server.async_llm import AsyncLLM, EngineUnavailableError
from pocketllm.server.chat import ChatCompletions
from pocketllm.server.completions import Completions
from pocketllm.server.config import ServerConfig, ServerState
from pocketllm.server.guard import RequestGuard
from pocketllm.server.metrics import ServerMetrics
from pocketllm.server.responses import INTERNAL_ERROR, error_response
from pocketllm.server.serving import OpenAIServing

log = logging.getLogger("pocketllm")

# The routes read their bodies themselves (P.parse: strict types, OpenAI's error messages); the
# schema still declares them, for clients and fuzzers.
_BODIES = {"/v1/chat/completions": P.ChatCompletionRequest, "/v1/completions": P.CompletionRequest,
           "/tokenize": P.TokenizeRequest, "/detokenize": P.DetokenizeRequest,
           "/v1/messages": anthropic.MessagesRequest, "/v1/messages/count_tokens": anthropic.CountTokensRequest,
           "/v1/responses": openai_responses.ResponsesRequest, "/v1/embeddings": embedding_endpoints.EmbeddingRequest,
           "/api/chat": ollama.ChatRequest, "/api/generate": ollama.GenerateRequest, "/api/show": ollama.ShowRequest,
           "/api/embed": ollama.EmbedRequest, "/api/embeddings": ollama.LegacyEmbedRequest,
           "/api/pull": ollama.PullRequest, "/v1/load_lora_adapter": P.LoadLoRAAdapterRequest,
           "/v1/unload_lora_adapter": P.UnloadLoRAAdapterRequest}


def _with_request_bodies(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path, model in _BODIES.items():
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def create_app(llm: AsyncLLM, cfg: ServerConfig, state: ServerState | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await llm.shutdown(cfg.shutdown_timeout)
        serving.close()

    app = FastAPI(title="PocketLLM", version=__version__, lifespan=lifespan)
    app.state.server = state = state or ServerState()
    metrics = ServerMetrics(llm, cfg.model_name)
    serving = OpenAIServing(llm, cfg, metrics)
    chat, completions, messages = ChatCompletions(serving), Completions(serving), anthropic.Messages(serving)

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        return error_response(e, request.url.path)

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(request: Request, e: EngineUnavailableError):
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return error_response(P.APIError(503, str(e), type="server_error", headers=headers), request.url.path)

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, e: RequestFailedError):
        return error_response(P.APIError(500, str(e), type="server_error"), request.url.path)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, e: RequestError):
        return error_response(P.APIError(400, str(e), param=getattr(e, "param", None), code="invalid_value"),
                              request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        msg = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return error_response(P.APIError(e.status_code, msg, headers=getattr(e, "headers", None)), request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("request failed", exc_info=e)
        return error_response(INTERNAL_ERROR, request.url.path)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create(request)

    @app.post("/v1/completions")
    async def legacy_completions(request: Request):
        return await completions.create(request)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        return await messages.create(request)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request):
        return await anthropic.count_tokens(serving, await request.body())

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await embedding_endpoints.create(serving, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenize_endpoints.tokenize(serving, request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenize_endpoints.detokenize(serving, request)

    app.include_router(admin_routes(llm, serving, metrics))
    app.include_router(ollama.ollama_routes(serving))
    app.include_router(openai_responses.response_routes(openai_responses.Responses(serving)))
    _with_request_bodies(app)
    app.add_middleware(RequestGuard, cfg=cfg, state=state)
    if cfg.allowed_origins:  # outermost, so that preflight requests need no API key
        # Never credentials with "*": Starlette would echo each origin, letting every site send cookies.
        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins,
                           allow_credentials="*" not in cfg.allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return app
