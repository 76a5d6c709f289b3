"""Several models behind one server (`pocketllm serve --model A --model B`), as Ollama and llama-server's
router serve them: each model is a whole single-model app (its engine, its `create_app`) made on the first
request that names it (or at start with --preload) and dropped after `keep_alive` seconds without requests
(Ollama's per-request `keep_alive` honoured). A request names its model in its body's `model` field;
requests to a model that is loading wait for it. When a model cannot fit beside the loaded ones (its
memory plan refuses it), the least recently used idle model is unloaded first. The router answers the
listings itself (`/v1/models`, `/api/tags`, `/api/ps`), `/health`, and `/metrics` for every loaded model."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, Response

from pocketllm import __version__, hub
from pocketllm.config import EngineArgs
from pocketllm.core.hub_name import HubName
from pocketllm.errors import ConfigurationError, DoesNotFitError
from pocketllm.server import protocol as P
from pocketllm.server.async_llm import AsyncLLM, EngineUnavailableError
from pocketllm.server.config import ServerConfig, ServerState
from pocketllm.server.guard import replaying
from pocketllm.server.responses import error_response

log = logging.getLogger("pocketllm")
DEFAULT_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's 5 minutes)


@dataclass
class ModelSpec:
    name: str  # what requests call it
    engine_args: EngineArgs


@dataclass
class _Slot:
    spec: ModelSpec
    llm: AsyncLLM | None = None
    app: Callable | None = None
    lifespan: _Lifespan | None = None  # the app's own: its shutdown stops the engine and the helper threads
    loading: asyncio.Task | None = None
    active: int = 0  # requests inside its app
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # the last request's keep_alive (None: the server's)

    @property
    def loaded(self) -> bool:
        return self.llm is not None


class ModelRouter:
    def __init__(self, specs: list[ModelSpec], cfg: ServerConfig, state: ServerState,
                 build: Callable[[EngineArgs], object], keep_alive: float = DEFAULT_KEEP_ALIVE,
                 llm_options: dict | None = None, load_timeout: float = 600.0, base_args: EngineArgs | None = None):
        """`base_args`: the engine settings of a model pulled later (Ollama's /api/pull); None: no pulling."""
        names = [s.name for s in specs]
        if not specs or len(set(names)) != len(names):
            raise ConfigurationError(f"give each model a different name (served names: {', '.join(names)})")
        self.slots = {s.name: _Slot(s) for s in specs}
        self.cfg, self.state, self.build = cfg, state, build
        self.keep_alive, self.llm_options, self.load_timeout = keep_alive, llm_options or {}, load_timeout
        self.base_args = base_args
        self.created = int(time.time())
        self.on_fatal: Callable[[BaseException], None] | None = None  # (the launcher's hook: unused, see _died)
        self.error = None
        self._reaper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's: the reaper's and the unloads'

    # -- what the launcher asks of a service --------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return sum(s.llm.num_in_flight for s in self.slots.values() if s.loaded)

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self._unload(s, timeout) for s in self.slots.values() if s.loaded))

    async def preload(self) -> None:
        for slot in self.slots.values():
            await self._ready(slot)

    # -- ASGI -----------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        self._start_reaper()
        path, method = scope["path"], scope["method"]
        own = self._own_route(path, method)
        if own is not None:
            return await (await own())(scope, receive, send)
        body = await _body(receive)
        if body is None:  # the client left
            return
        if method == "POST" and path == "/api/pull":
            return await (await self._pull(body))(scope, receive, send)
        try:
            value = json.loads(body) if body else {}
        except ValueError:
            value = None
        asked = value.get("model") if isinstance(value, dict) else None
        slot = self._slot_of(asked)
        if slot is None:
            error = P.APIError(404, f"The model `{asked}` does not exist; this server serves: "
                                    f"{', '.join(self.slots)}.", param="model", code="model_not_found")
            return await error_response(error, path)(scope, receive, send)
        if isinstance(value, dict) and "keep_alive" in value:
            slot.keep_alive = _seconds(value["keep_alive"], self.keep_alive)
        try:
            await self._ready(slot)
        except (ConfigurationError, EngineUnavailableError, asyncio.TimeoutError) as e:
            message = str(e) or (f"it is still loading after {self.load_timeout:g} s (--max-queue-time); "
                                 "retry shortly")
            error = P.APIError(503, f"The model `{slot.spec.name}` could not be loaded: {message}",
                               type="server_error", headers={"Retry-After": "5"})
            return await error_response(error, path)(scope, receive, send)
        slot.active += 1
        try:
            await slot.app(scope, replaying(body, receive), send)
        finally:
            slot.active -= 1
            slot.last_used = time.monotonic()
            if slot.keep_alive == 0 and slot.active == 0:
                await self._unload(slot)

    def _slot_of(self, asked) -> _Slot | None:
        """The model a request names (Ollama's ":latest" tag dropped); with one model served, any."""
        if isinstance(asked, str):
            found = self.slots.get(asked) or self.slots.get(asked.removesuffix(":latest"))
            return found or next((s for s in self.slots.values() if asked in self._adapters(s)), None)
        return next(iter(self.slots.values())) if asked is None else None

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._start_reaper()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown(self.cfg.shutdown_timeout)
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- loading and unloading ------------------------------------------------------------------------
    async def _ready(self, slot: _Slot) -> None:
        """Returns once `slot` is loaded: loads it, or waits for the load under way."""
        if slot.loaded:
            return
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load(slot))
        try:
            await asyncio.wait_for(asyncio.shield(slot.loading), self.load_timeout)
        finally:
            if slot.loading is not None and slot.loading.done():
                slot.loading = None

    async def _load(self, slot: _Slot) -> None:
        from pocketllm.server.api_server import create_app

        while True:
            try:
                llm = await asyncio.to_thread(
                    AsyncLLM, lambda: self.build(dataclasses.replace(slot.spec.engine_args)), **self.llm_options)
                break
            except DoesNotFitError:
                idle = [s for s in self.slots.values() if s.loaded and s.active == 0 and s is not slot]
                if not idle:
                    raise
                victim = min(idle, key=lambda s: s.last_used)
                log.info("unloading %s (least recently used) to make room for %s", victim.spec.name, slot.spec.name)
                await self._unload(victim)
        llm.on_fatal = lambda error: self._died(slot, error)
        cfg = dataclasses.replace(self.cfg, model_name=slot.spec.name)
        app = create_app(llm, cfg, self.state)
        slot.lifespan = _Lifespan(app)
        await slot.lifespan.send("startup")
        slot.app, slot.llm = app, llm
        slot.last_used = time.monotonic()
        log.info("loaded %s", slot.spec.name)

    async def _unload(self, slot: _Slot, timeout: float = 5.0) -> None:
        llm, lifespan, slot.llm, slot.app, slot.lifespan = slot.llm, slot.lifespan, None, None, None
        if llm is None:
            return
        await llm.shutdown(timeout)  # (its requests get up to `timeout` s; the app's shutdown then finds it stopped)
        await lifespan.send("shutdown")
        device = llm.engine.device if llm.engine is not None else None
        if llm.engine is not None:
            llm.engine.release()
        del llm, lifespan
        _forget_endpoints()
        gc.collect()
        _trim_heap()
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        log.info("unloaded %s", slot.spec.name)

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._loop = asyncio.get_running_loop()
            self._reaper = asyncio.ensure_future(self._reap())

    def _died(self, slot: _Slot, error: BaseException) -> None:
        """From the engine thread: the model's engine cannot go on; it is dropped, to be loaded again."""
        log.error("the engine of %s died (%s); it will be loaded again on its next request", slot.spec.name, error)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._unload(slot)))

    async def _reap(self) -> None:
        """Unloads the models idle past their keep_alive, once a second."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in self.slots.values():
                keep = self.keep_alive if slot.keep_alive is None else slot.keep_alive
                if slot.loaded and slot.active == 0 and keep >= 0 and now - slot.last_used > keep:
                    with contextlib.suppress(Exception):
                        await self._unload(slot)

    # -- the router's own routes ----------------------------------------------------------------------
    def _own_route(self, path: str, method: str):
        if method == "GET" and path == "/v1/models":
            return self._models
        if method == "GET" and path.startswith("/v1/models/"):
            return lambda: self._model(path.removeprefix("/v1/models/"))
        if method == "GET" and path in ("/api/tags", "/api/ps"):
            return lambda: self._ollama_list(loaded_only=path == "/api/ps")
        if method == "GET" and path in ("/version", "/api/version"):
            return self._version
        if method == "GET" and path == "/health":
            return self._health
        if method == "GET" and path == "/metrics":
            return self._metrics
        return None

    async def _pull(self, body: bytes) -> Response:
        """Ollama's /api/pull: a model by its hub name fetched into the cache and served under that name."""
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        name = value.get("model") or value.get("name") if isinstance(value, dict) else None
        hub_name = HubName.parse(name) if isinstance(name, str) else None
        if hub_name is None or self.base_args is None:
            why = "this server pulls no models" if self.base_args is None else \
                f"'model' must name a Hugging Face repo (org/name[:QUANT]); got {name!r}"
            return error_response(P.APIError(400, why), "/api/")
        try:
            path = await asyncio.to_thread(hub.resolve, hub_name)
        except ConfigurationError as e:
            return error_response(P.APIError(400, str(e)), "/api/")
        if name not in self.slots:
            self.slots[name] = _Slot(ModelSpec(name, dataclasses.replace(self.base_args, model=str(path))))
        statuses = [{"status": "pulling manifest"}, {"status": "verifying sha256 digest"}, {"status": "success"}]
        if value.get("stream") is False:
            return JSONResponse(statuses[-1])
        return Response("".join(json.dumps(s) + "\n" for s in statuses), media_type="application/x-ndjson")

    def _card(self, slot: _Slot, adapter: str | None = None) -> dict:
        return P.model_card(slot.spec.name, self.created, slot.llm.engine if slot.loaded else None, adapter)

    @staticmethod
    def _adapters(slot: _Slot) -> list[str]:
        """A loaded model's LoRA adapters (requests name them as their model)."""
        return slot.llm.engine.lora.names() if slot.loaded and slot.llm.engine.lora is not None else []

    async def _models(self) -> Response:
        return JSONResponse({"object": "list", "data": [card for s in self.slots.values() for card in
                                                        [self._card(s), *(self._card(s, a) for a in self._adapters(s))]]})

    async def _model(self, name: str) -> Response:
        slot = self._slot_of(name)
        if slot is None:
            return error_response(P.APIError(404, f"The model `{name}` does not exist.", param="model",
                                             code="model_not_found"))
        return JSONResponse(self._card(slot, name if name in self._adapters(slot) else None))

    async def _ollama_list(self, loaded_only: bool) -> Response:
        stamp = datetime.fromtimestamp(self.created, timezone.utc).isoformat().replace("+00:00", "Z")
        models = []
        for slot in self.slots.values():
            if loaded_only and not slot.loaded:
                continue
            name = slot.spec.name
            entry = {"name": name, "model": name, "modified_at": stamp, "size": 0,
                     "digest": hashlib.sha256(name.encode()).hexdigest(), "details": {"format": ""}}
            if slot.loaded:
                engine = slot.llm.engine
                keep = self.keep_alive if slot.keep_alive is None else slot.keep_alive
                expires = "9999-12-31T23:59:59Z" if keep < 0 else datetime.fromtimestamp(
                    time.time() + keep - (time.monotonic() - slot.last_used), timezone.utc).isoformat()
                entry.update(size=engine.weight_bytes, expires_at=expires, context_length=engine.max_model_len,
                             size_vram=engine.weight_bytes if engine.device.type == "cuda" else 0)
            models.append(entry)
        return JSONResponse({"models": models})

    async def _version(self) -> Response:
        return JSONResponse({"version": __version__})

    async def _health(self) -> Response:
        return Response(status_code=200)

    async def _metrics(self) -> Response:
        """Every loaded model's metrics in one exposition, each family once (their samples labelled by model)."""
        texts = []
        for slot in self.slots.values():
            if slot.loaded:
                scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": [], "query_string": b"",
                         "state": {"arrival_time": time.monotonic()}}
                texts.append(await _get(slot.app, scope))
        registry = CollectorRegistry()
        registry.register(_Merged(texts))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _trim_heap() -> None:
    """glibc keeps freed heap memory for the next allocations: an unloaded model's would stay in the process."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _forget_endpoints() -> None:
    """FastAPI remembers, in module-level caches of up to 4,096 callables, what kind of function each endpoint
    is: an unloaded model's endpoints (and through their closures its whole app) would stay there."""
    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cache = getattr(models, name, None)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()


class _Lifespan:
    """An ASGI app's lifespan, run by hand: its startup when the model loads, its shutdown when it goes."""

    def __init__(self, app):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                              self.inbox.get, self.outbox.put))

    async def send(self, phase: str) -> None:
        await self.inbox.put({"type": f"lifespan.{phase}"})
        message = await self.outbox.get()
        if message["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"the app's lifespan {phase} failed: {message.get('message')}")
        if phase == "shutdown":
            await self.task


class _Merged:
    def __init__(self, texts: list[str]):
        self.texts = texts

    def collect(self):
        families = {}
        for text in self.texts:
            for family in text_string_to_metric_families(text):
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()


async def _get(app, scope) -> str:
    """The body an ASGI app answers a bodiless request with."""
    chunks: list[bytes] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return b"".join(chunks).decode()


async def _body(receive) -> bytes | None:
    """A request's whole body (the guard in front has bounded it), or None if the client left."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


def _seconds(value, default: float) -> float:
    """Ollama's keep_alive: seconds, or a duration such as "5m", "1h", "30s"; negative: for good."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        units = {"s": 1, "m": 60, "h": 3600}
        try:
            return float(value[:-1]) * units[value[-1]] if value[-1] in units else float(value)
        except ValueError:
            return default
    return default
