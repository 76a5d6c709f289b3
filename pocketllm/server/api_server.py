"""The OpenAI-compatible HTTP API over one `AsyncLLM`, and its uvicorn runner."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import ipaddress
import json
import logging
import re
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from pocketllm import __version__
from pocketllm.errors import PocketLLMError, RequestError, RequestFailedError
from pocketllm.outputs import RequestOutput
from pocketllm.sampling_params import SamplingParams
from pocketllm.server import protocol as P
from pocketllm.server.async_llm import AsyncLLM, EngineUnavailableError, RequestStream
from pocketllm.server.metrics import RequestTimer, ServerMetrics
from pocketllm.structured.chat import ReplyParser, template_messages, template_tools, tool_constraint
from pocketllm.structured.reasoning import get_reasoning_parser, infer_reasoning_parser
from pocketllm.structured.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser, infer_tool_parser
from pocketllm.structured.worker import GrammarBusyError, GrammarCompilerFailedError, GrammarWorkers
from pocketllm.tokenizer.chat_template import TemplateOutputTooLongError, render_limits

log = logging.getLogger("pocketllm")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    chat_template: str | None = None  # overrides the model's
    tool_call_parser: str | None = None  # a TOOL_PARSERS name; default: inferred from the template
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 | openai_gptoss; default: openai_gptoss for gpt-oss
    max_request_bytes: int = 4 << 20
    body_timeout: float = 30.0  # seconds a client has to send its request body (then 408)
    max_connections: int = 1024  # concurrent requests (idle connections do not count); more get 503
    header_timeout: float = 10.0  # seconds a connection has to send a complete request head (then closed)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names served without an API key; "*": any
    shutdown_timeout: float = 30.0  # on SIGTERM: seconds running requests get to finish
    # What a request may carry that every step of it pays for (stop strings are matched per token,
    # bias entries added per step); the sequences it asks for are bounded by the engine's queue.
    max_stop_strings: int = 256
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 2048
    # What a chat request may give its template (OpenAI's limits), and the time its grammar may take.
    max_messages: int = 2048
    max_tools: int = 128
    max_grammar_compile_time: float = 10.0  # seconds; then 400 (the compilation is stopped)
    default_max_tokens: int = 2048  # a reply's bound when its request sets none (0: the context's end)
    drain_retry_after: int = 5  # Retry-After of the 503s answered while draining


@dataclass
class ServerState:
    """What every request checks first: whether the server is draining (SIGTERM)."""
    draining: bool = False


_INTERNAL = P.APIError(500, "The server had an error while processing your request.", type="server_error")


def _json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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


class _Guard:
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
            return await _error_response(error)(scope, receive, send)
        if path in _ALWAYS_ANSWERED:
            return await self._checked(scope, receive, send)
        # Requests are counted here rather than connections by uvicorn: idle connections cost
        # nothing (they time out), and /health stays answerable however many requests run.
        if self.in_flight >= cfg.max_connections:
            error = P.APIError(503, f"The server is serving its maximum of {cfg.max_connections} concurrent "
                                    "requests (--max-connections); please retry shortly.",
                               type="server_error", headers={"Retry-After": "1"})
            return await _error_response(error)(scope, receive, send)
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
            return await _error_response(error)(scope, receive, send)
        too_large = P.APIError(413, f"The request body is larger than {cfg.max_request_bytes} bytes.",
                               code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > cfg.max_request_bytes:
            return await _error_response(too_large)(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(receive), cfg.body_timeout)
        except asyncio.TimeoutError:
            error = P.APIError(408, f"The request body did not arrive within {cfg.body_timeout:g} seconds.",
                               code="request_timeout", headers={"Connection": "close"})
            return await _error_response(error)(scope, receive, send)
        if body is None:  # the client left
            return
        if len(body) > cfg.max_request_bytes:
            return await _error_response(too_large)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _auth_error(self, headers: dict) -> P.APIError | None:
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), self.cfg.api_key.encode()):
            return None
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


class _SSEResponse(StreamingResponse):
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


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:  # the common case: no task per output
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Job:
    """One API request: its engine requests (one per prompt), their timers and outputs."""
    id: str
    kind: str  # "chat" | "completion"
    req: P.ChatCompletionRequest | P.CompletionRequest
    prompts: list[tuple[str | None, list[int]]]
    streams: list[RequestStream] = field(default_factory=list)
    timers: list[RequestTimer] = field(default_factory=list)
    last: list[RequestOutput | None] = field(default_factory=list)
    replies: list[ReplyParser] | None = None  # per choice, when tools or reasoning shape chat replies
    created: int = field(default_factory=lambda: int(time.time()))

    def close(self) -> None:
        for stream, timer, out in zip(self.streams, self.timers, self.last):
            stream.close()
            timer.finish(out, aborted=out is None or not out.finished)

    def record(self, i: int, out: RequestOutput) -> None:
        self.last[i] = out
        if out.finished:
            self.timers[i].finish(out)

    def usage(self) -> dict:
        outs = [o for o in self.last if o is not None]
        return P.usage(sum(len(p[1]) for p in self.prompts),
                       sum(len(c.token_ids) for o in outs for c in o.outputs),
                       sum(o.num_cached_tokens for o in outs))


def _check_limits(*limits: tuple[str, int, int, str]) -> None:
    """(param, count, limit, flag): a 400 for the first count over its limit, naming the flag."""
    for param, count, limit, flag in limits:
        if count > limit:
            raise P.APIError(400, f"Invalid '{param}': {count} entries, more than the {limit} this server "
                                  f"accepts ({flag}).", param=param, code="invalid_value")


async def _unless_client_leaves(request: Request, coro) -> asyncio.Future | None:
    """Runs coro to its end, or cancels it when the client disconnects first: its finished task,
    or None if the client left."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return None if work.cancelled() else work


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, cfg: ServerConfig, metrics: ServerMetrics):
        self.llm, self.cfg, self.metrics = llm, cfg, metrics
        self.engine = llm.engine
        if cfg.tool_call_parser is not None:
            get_tool_parser(cfg.tool_call_parser)  # an unknown name fails at start-up
        model_template = self.engine.tokenizer.chat_template if self.engine.tokenizer is not None else None
        if self.engine.tokenizer is not None and not (cfg.chat_template or model_template):
            log.warning("%s has no chat template (a base model?): /v1/chat/completions will answer 400; send "
                        "prompts to /v1/completions, or give a template with --chat-template FILE", cfg.model_name)
        reasoning = cfg.reasoning_parser or infer_reasoning_parser(cfg.chat_template or model_template)
        self.reasoning = get_reasoning_parser(reasoning) if reasoning else None
        # One thread prepares the large requests (parse, render, tokenize), one after the other:
        # their work holds the interpreter lock in stretches, and each thread more doing so slows
        # the engine thread's steps again, and holds one more large request's memory.
        self._prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pocketllm-prep")

    def close(self) -> None:
        """Stop the helpers: the grammar compiler process (if one started) and the preparation thread."""
        if "_grammars" in self.__dict__:
            self._grammars.close()
        self._prep.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args, **kwargs))

    # -- building a job --------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name:
            raise P.APIError(404, f"The model `{name}` does not exist or you do not have access to it; "
                                  f"this server serves `{self.cfg.model_name}`.", param="model", code="model_not_found")

    def _check_request_size(self, req: P.ChatCompletionRequest | P.CompletionRequest) -> None:
        """Refuse, before any work, what would make each step costly for everyone: too many stop
        strings, stop token ids or bias entries, or more sequences (n x prompts) than the queue holds."""
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        prompts = len(req.prompt_list()) if isinstance(req, P.CompletionRequest) else 1
        self._check_counts(len(stops), len(req.stop_token_ids or []), len(req.logit_bias or {}), req.n, prompts)

    def _check_counts(self, stops: int, stop_token_ids: int, logit_bias: int, n: int, prompts: int) -> None:
        cfg = self.cfg
        _check_limits(("stop", stops, cfg.max_stop_strings, "--max-stop-strings"),
                      ("stop_token_ids", stop_token_ids, cfg.max_stop_token_ids, "--max-stop-token-ids"),
                      ("logit_bias", logit_bias, cfg.max_logit_bias, "--max-logit-bias"))
        queue = self.llm.max_queued_requests
        if queue is not None and n * prompts > queue:
            what = f"n={n} x {prompts} prompts" if prompts > 1 else f"n={n}"
            raise P.APIError(400, f"The request asks for {n * prompts} sequences ({what}); this server queues at "
                                  f"most {queue} (--max-queued-requests).", param="n" if prompts == 1 else "prompt",
                             code="invalid_value")

    def _check_raw_counts(self, raw: dict) -> None:
        """The count limits, on a large body's plain JSON before it is validated: validating holds
        the interpreter lock throughout (~4 us per message or list entry), and with it the engine
        thread, for as long as the body's largest list takes; json.loads is ~10x faster."""
        def count(v) -> int:
            return len(v) if isinstance(v, (list, dict)) else 0

        def integer(v, default: int) -> int:
            return v if type(v) is int and v > 0 else default  # a wrong type is validation's to report

        stop, prompt = raw.get("stop"), raw.get("prompt")
        ids_prompt = isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int
        prompts = 1 if not isinstance(prompt, list) or ids_prompt else max(1, len(prompt))
        self._check_counts(1 if isinstance(stop, str) else count(stop), count(raw.get("stop_token_ids")),
                           count(raw.get("logit_bias")), integer(raw.get("n"), 1), prompts)
        self._check_chat_size(count(raw.get("messages")), count(raw.get("tools")))
        longest = max((len(p) for p in ([prompt] if ids_prompt else prompt if isinstance(prompt, list) else [])
                       if isinstance(p, list)), default=0)
        if longest > self.engine.max_model_len:
            raise P.APIError(400, f"This model's maximum context length is {self.engine.max_model_len} tokens. "
                                  f"However, your prompt has {longest} tokens. Please reduce the length of the "
                                  "prompt.", param="prompt", code="context_length_exceeded")

    def _tokenizer(self):
        if self.engine.tokenizer is None:
            raise P.APIError(400, "This model has no tokenizer: send token ids to /v1/completions.",
                             param="prompt", code="invalid_value")
        return self.engine.tokenizer

    def _template(self, tools: list[dict] | None) -> str | None:
        tok = self._tokenizer()
        return self.cfg.chat_template or (tools and tok.chat_templates.get("tool_use")) or tok.chat_template

    def _tool_parser(self, template: str | None) -> ToolParser | None:
        name = self.cfg.tool_call_parser or infer_tool_parser(template)
        return get_tool_parser(name) if name else None

    _RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")

    def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        template = self._template(tools)
        dicts = [m.as_template_dict() for m in messages]
        reserved = [k for k in self._RESERVED_TEMPLATE_KWARGS if k in (template_kwargs or {})]
        if reserved:
            raise P.APIError(400, f"Invalid 'chat_template_kwargs': {reserved} are set by the request itself.",
                             param="chat_template_kwargs", code="invalid_value")
        if template is None:
            raise P.APIError(400, "This model has no chat template (a base model?): send a prompt to "
                                  "/v1/completions, or start the server with --chat-template FILE.",
                             param="messages", code="invalid_value")
        try:
            parser = self._tool_parser(template) or get_tool_parser("hermes")
            dicts = template_messages(dicts, tools, template, parser)
            tools = template_tools(tools, template)
            # A longer text than max_chars cannot fit the context; the template is also bounded in time.
            with render_limits(max_chars=self._max_prompt_chars):
                return self._tokenizer().apply_chat_template(
                    dicts, tools=tools, add_generation_prompt=add_generation_prompt, chat_template=template,
                    **(template_kwargs or {}))
        except P.APIError:
            raise
        except TemplateOutputTooLongError:  # at least max_model_len + 1 tokens: _check_tokens raises
            self._check_tokens(self._max_prompt_chars // (2 * self._tokenizer().max_token_chars), "messages",
                               f"rendered to more than {self._max_prompt_chars} characters")
            raise
        except Exception as e:  # noqa: BLE001  (a template raises what it likes: raise_exception, overflows, recursion)
            message = str(e) if isinstance(e, (jinja2.TemplateError, PocketLLMError)) else f"{type(e).__name__}: {e}"
            raise P.APIError(400, f"The chat template could not render the messages: {message}", param="messages",
                             code="invalid_value") from None

    @staticmethod
    def _tools(req) -> list[dict] | None:
        """The request's tools as the chat template takes them (chat and tokenize requests)."""
        tools = getattr(req, "tools", None)
        return [t.model_dump(exclude_none=True) for t in tools] if tools else None

    def _reply_tool_parser(self, req, tools: list[dict] | None) -> ToolParser | None:
        """The parser that finds calls in the replies: none when calls are off."""
        choice = req.effective_tool_choice
        if not tools or choice == "none":
            return None
        parser = self._tool_parser(self._template(tools))
        if parser is None and choice == "auto":
            raise P.APIError(400, "\"auto\" tool choice needs a tool-call parser: start the server with "
                                  f"--tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}).", param="tool_choice",
                             code="invalid_value")
        return (parser or get_tool_parser("hermes")).for_tools(tools)  # forced calls: the grammar fixes the syntax

    def _constraint(self, req, tools, parser: ToolParser | None, opened: bool | None) -> tuple[dict | None, str]:
        """`structured_outputs` for the request, and the parameter its errors belong to."""
        constraint, param = req.output_constraint()
        if parser is not None:
            forced = tool_constraint(tools, req.effective_tool_choice, req.parallel_tool_calls, parser)
            if forced is not None:
                constraint, param = forced, "tools"
        if constraint is not None and self.reasoning is not None and isinstance(req, P.ChatCompletionRequest):
            prefix = self.reasoning.grammar_prefix(opened, calls="tool_calls" in constraint)
            if prefix is not None:
                constraint = {**constraint, "reasoning": prefix}
        return constraint, param

    # Tokenizing or rendering more text than this runs on a worker thread, not on the event loop.
    _OFF_LOOP_CHARS = 16384

    async def _off_loop_if_large(self, num_chars: int, fn, *args, **kwargs):
        """fn(*args, **kwargs), on a worker thread when it works on more than _OFF_LOOP_CHARS."""
        if num_chars > self._OFF_LOOP_CHARS:
            return await self._prepare(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def _parsed(self, model: type, body: bytes):
        """The request, validated on a worker thread when the body is large, after its counts are
        checked on its plain JSON (_check_raw_counts)."""
        if len(body) <= self._OFF_LOOP_CHARS:
            return P.parse(model, body)
        return await self._prepare(self._parse_large, model, body)

    def _parse_large(self, model: type, body: bytes):
        try:
            raw = json.loads(body)
        except ValueError:
            raw = None  # P.parse says what is wrong with it
        if isinstance(raw, dict):
            self._check_raw_counts(raw)
        del raw
        return P.parse(model, body)

    def _check_tokens(self, at_least: int, where: str, what: str) -> None:
        """Refuse what cannot fit the context, `at_least` tokens being a lower bound of its length."""
        if at_least > self.engine.max_model_len:
            raise P.APIError(400, f"This model's maximum context length is {self.engine.max_model_len} tokens. "
                                  f"However, your {where} {what}, which is at least {at_least} tokens. Please "
                                  f"reduce the length of the {where}.", param=where, code="context_length_exceeded")

    def _check_text_size(self, num_chars: int, where: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: no token covers more
        than `max_token_chars` characters (halved again for normalizers that shrink text)."""
        at_least = num_chars // (2 * self._tokenizer().max_token_chars)
        self._check_tokens(at_least, where, f"{'have' if where == 'messages' else 'has'} {num_chars} characters")

    @functools.cached_property
    def _max_prompt_chars(self) -> int:
        """The longest text that may fit the context (see _check_text_size)."""
        return (self.engine.max_model_len + 1) * 2 * self._tokenizer().max_token_chars

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern | None:
        """The special tokens the tokenizer always splits out of a text, as one token each."""
        added = self._tokenizer()._backend.get_added_tokens_decoder().values()
        texts = {t.content for t in added if t.special and t.content and not t.single_word and not t.normalized}
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None

    def _check_prompt_size(self, text: str, where: str, rendered: bool = False) -> None:
        """_check_text_size, counting each special token as the one token it is: a rendered chat of
        many short messages is mostly role markers (30,000 empty messages: 60,000 markers)."""
        if len(text) <= self.engine.max_model_len or self._special_tokens is None:  # (a token has a character at least)
            return self._check_text_size(len(text), where)
        markers = self._special_tokens.findall(text)
        rest = len(text) - sum(map(len, markers))
        self._check_tokens(len(markers) + rest // (2 * self._tokenizer().max_token_chars), where,
                           f"{'rendered to' if rendered else 'has'} {len(text)} characters with {len(markers)} "
                           "special tokens")

    def _check_chat_size(self, messages: int, tools: int) -> None:
        _check_limits(("messages", messages, self.cfg.max_messages, "--max-messages"),
                      ("tools", tools, self.cfg.max_tools, "--max-tools"))

    async def _chat_prompt(self, messages: list[P.ChatMessage], tools: list[dict] | None,
                           template_kwargs: dict | None = None,
                           add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        self._check_chat_size(len(messages), len(tools or []))
        num_chars = sum(len(p) for m in messages for p in m.texts())
        # Each message costs at least a token in any template (its role's marker).
        self._check_tokens(max(num_chars // (2 * self._tokenizer().max_token_chars), len(messages)), "messages",
                           f"({len(messages)} of them) have {num_chars} characters")
        # Always on a worker thread: a template is the model file's code, and may run for its whole time limit.
        text = await self._prepare(self.render_chat, messages, add_generation_prompt, tools, template_kwargs)
        self._check_prompt_size(text, "messages", rendered=True)
        # The template writes the special tokens it wants (BOS included).
        return text, await self._off_loop_if_large(len(text), self._tokenizer().encode, text, add_special_tokens=False)

    async def _prompts(self, req, tools: list[dict] | None) -> list[tuple[str | None, list[int]]]:
        if isinstance(req, P.ChatCompletionRequest):
            return [await self._chat_prompt(req.messages, tools, req.chat_template_kwargs)]
        out = []
        for p in req.prompt_list():
            if isinstance(p, str):
                self._check_prompt_size(p, "prompt")
                out.append((p, await self._off_loop_if_large(len(p), self._tokenizer().encode, p)))
            else:  # token ids: decoded for echo only once validated (_echo_texts)
                out.append((None, list(p)))
        return out

    def _echo_texts(self, prompts: list[tuple[str | None, list[int]]]) -> list[tuple[str | None, list[int]]]:
        """Token-id prompts of an echo request with their text, decoded from validated ids."""
        tok = self.engine.tokenizer
        if tok is None:
            return prompts
        return [(tok.decode(ids) if text is None else text, ids) for text, ids in prompts]

    def _params(self, req, prompts, constraint: dict | None = None, constraint_param: str | None = None,
                skip_special_tokens: bool = True) -> SamplingParams:
        chat = isinstance(req, P.ChatCompletionRequest)
        limit = self.engine.max_model_len
        longest = max(len(ids) for _, ids in prompts)
        asked = req.max_new_tokens if chat else req.max_tokens
        if asked is not None:
            max_tokens = asked
        else:  # bounded by default, so that a model that loops does not run to the end of the context
            max_tokens = min(limit - longest, self.cfg.default_max_tokens or limit)
        where = "messages" if chat else "prompt"
        if max_tokens < 1:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                  f"{where} resulted in {longest} tokens. Please reduce the length of the "
                                  f"{where}.", param=where, code="context_length_exceeded")
        if longest + max_tokens > limit:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                  f"requested {longest + max_tokens} tokens ({longest} in the {where}, "
                                  f"{max_tokens} in the completion). Please reduce the length of the {where} "
                                  "or completion.", param=where, code="context_length_exceeded")
        # echo with logprobs: the prompt's tokens get logprobs too (legacy completions, as OpenAI's)
        echo_lps = req.logprobs if not chat and req.echo else None
        params = req.sampling_params(max_tokens, req.num_logprobs if chat else req.logprobs, constraint,
                                     constraint_param, skip_special_tokens, prompt_logprobs=echo_lps)
        for _, ids in prompts:
            try:
                self.engine.validate_request(ids, params)
            except RequestError as e:
                raise P.APIError(400, str(e), param=getattr(e, "param", None) or where,
                                 code="invalid_value") from None
        return params

    @functools.cached_property
    def _grammars(self) -> GrammarWorkers:
        return GrammarWorkers(self.engine.structured)

    async def _grammar(self, request: Request, spec: dict, where: str):
        """The request's compiled grammar, handed to the engine with it (the engine thread never
        compiles for the server); None if the client left meanwhile, which stops the compilation."""
        compiled = self.engine.structured.cached(spec)
        if compiled is not None:
            return compiled
        work = await _unless_client_leaves(request, self._grammars.compile(spec, self.cfg.max_grammar_compile_time))
        if work is None:
            return None
        try:
            return work.result()
        except RequestError as e:
            raise P.APIError(400, str(e), param=where, code="invalid_value") from None
        except GrammarBusyError as e:
            raise EngineUnavailableError(str(e), retry_after=1) from None
        except GrammarCompilerFailedError as e:
            log.error("%s", e)
            raise RequestFailedError(f"The server could not compile the request's grammar ({e}).") from None

    async def create(self, request: Request, model: type[P.ChatCompletionRequest] | type[P.CompletionRequest]):
        req = await self._parsed(model, await request.body())
        self._check_model(req.model)
        self._check_request_size(req)
        kind = "chat" if model is P.ChatCompletionRequest else "completion"
        tools = self._tools(req)
        prompts = await self._prompts(req, tools)
        parser = self._reply_tool_parser(req, tools) if kind == "chat" else None
        opened = self.reasoning.prompt_state(prompts[0][0]) if kind == "chat" and self.reasoning else None
        constraint, where = self._constraint(req, tools, parser, opened)
        # Reply parsers whose markers are special tokens read them in the text.
        readers = [p for p in (parser, self.reasoning if kind == "chat" else None) if p is not None]
        params = self._params(req, prompts, constraint, where, not any(p.needs_special_tokens for p in readers))
        if kind == "completion" and req.echo:
            prompts = self._echo_texts(prompts)
        grammar = None
        if params.structured_outputs:  # compiled here, so a bad one is a 400 before queueing
            grammar = await self._grammar(request, params.structured_outputs, where)
            if grammar is None:
                return Response(status_code=499)  # the client left: nobody will read it
        job = _Job(f"chatcmpl-{uuid.uuid4().hex}" if kind == "chat" else f"cmpl-{uuid.uuid4().hex}",
                   kind, req, prompts)
        if kind == "chat" and (parser is not None or self.reasoning is not None):
            job.replies = [ReplyParser(self.reasoning, opened, parser) for _ in range(req.n)]
        arrival = request.state.arrival_time
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = job.id if len(prompts) == 1 else f"{job.id}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids}
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                job.streams.append(self.llm.add_request(rid, prompt, params,
                                                        arrival, grammar=grammar))
                job.timers.append(self.metrics.timer(arrival))
                job.last.append(None)
        except BaseException:
            job.close()
            raise
        if req.stream:
            return _SSEResponse(self._stream(job), job.close)
        try:
            return await self._complete(request, job)
        finally:
            job.close()

    # -- responses -------------------------------------------------------------------------------
    def _first_token(self, job: _Job, i: int) -> str:
        """The text of prompt i's first token (an echoed prompt's first logprob entry)."""
        ids = job.prompts[i][1]
        tok = self.engine.tokenizer
        return tok.decode(ids[:1]) if ids and tok is not None else ""

    @staticmethod
    def _choices(job: _Job):
        """(index, prompt position, CompletionOutput) of every choice, in index order."""
        return [(i * job.req.n + c.index, i, c) for i, out in enumerate(job.last) for c in out.outputs]

    async def _complete(self, request: Request, job: _Job) -> Response:
        async def collect():
            async for i, out in _merge(job.streams):
                job.timers[i].tokens_sent(1)  # the first call is the TTFT; the count only feeds ITL
                job.record(i, out)

        work = await _unless_client_leaves(request, collect())
        if work is None:
            return Response(status_code=499)  # nobody will read it
        work.result()
        choices = []
        for idx, i, c in self._choices(job):
            if job.kind == "chat":
                logprobs = P.chat_logprobs(c.logprobs, job.req.num_logprobs) if c.logprobs is not None else None
                message, finish = {"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason
                if job.replies is not None:
                    message, finish = job.replies[idx].message(c.text, c.finish_reason)
                choice = {"index": idx, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                prefix = (job.prompts[i][0] or "") if job.req.echo else ""
                entries = c.logprobs
                if entries is not None and job.req.echo:
                    entries = job.last[i].prompt_logprobs + entries
                logprobs = (P.completion_logprobs(entries, 0, self._first_token(job, i))
                            if entries is not None else None)
                choice = {"text": prefix + c.text, "index": idx, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
            if job.req.return_token_ids:
                choice.update(prompt_token_ids=job.prompts[i][1], token_ids=c.token_ids)
            choices.append(choice)
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return JSONResponse({"id": job.id, "object": obj, "created": job.created, "model": self.cfg.model_name,
                             "choices": choices, "usage": job.usage(), "system_fingerprint": None})

    async def _stream(self, job: _Job) -> AsyncIterator[str]:
        chat = job.kind == "chat"
        req = job.req
        base = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": job.created, "model": self.cfg.model_name, "system_fingerprint": None}
        # As OpenAI: with include_usage every chunk has a usage, null until the last one.
        usage = {"usage": None} if req.include_usage else {}

        def chunk(choice: dict) -> str:
            return f"data: {_json({**base, 'choices': [choice], **usage})}\n\n"

        n = req.n
        sent_text = [0] * (n * len(job.prompts))
        sent_tokens = [0] * len(sent_text)
        ended = [False] * len(sent_text)  # a finished choice stays in its request's later outputs
        echo = [(job.prompts[k // n][0] or "") if not chat and req.echo else "" for k in range(n * len(job.prompts))]
        echo_text = list(echo)  # what precedes the completion's text (its offsets start after it)
        try:
            if chat:
                for k in range(len(sent_text)):
                    yield chunk({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            async for i, out in _merge(job.streams):
                events, new_tokens = [], 0
                for c in out.outputs:
                    k = i * n + c.index
                    if ended[k]:
                        continue
                    ended[k] = c.finish_reason is not None
                    start, text = sent_text[k], c.text[sent_text[k]:]
                    entries = (c.logprobs or [])[sent_tokens[k]:len(c.token_ids)]
                    # vLLM's extension: each chunk carries its new token ids (the first also the prompt's).
                    new_ids = c.token_ids[sent_tokens[k]:] if req.return_token_ids else []
                    ids = {"token_ids": new_ids} if req.return_token_ids else {}
                    if ids and sent_tokens[k] == 0:
                        ids["prompt_token_ids"] = job.prompts[i][1]
                    new_tokens = max(new_tokens, len(c.token_ids) - sent_tokens[k])
                    sent_text[k], sent_tokens[k] = len(c.text), len(c.token_ids)
                    if chat:
                        reply = job.replies[k] if job.replies is not None else None
                        if reply is None:
                            deltas = [{"content": text}] if text or entries or new_ids else []
                        else:
                            deltas = reply.deltas(c.text, c.finish_reason is not None) or (
                                [{}] if entries or new_ids else [])
                        lp = P.chat_logprobs(entries, req.num_logprobs) if c.logprobs is not None else None
                        for j, delta in enumerate(deltas):
                            events.append(chunk({"index": k, "delta": delta, "logprobs": None if j else lp,
                                                 "finish_reason": None, **({} if j else ids)}))
                        if c.finish_reason is not None:
                            finish = c.finish_reason
                            if reply is not None and reply.called and finish == "stop":
                                finish = "tool_calls"
                            events.append(chunk({"index": k, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish}))
                    elif text or entries or new_ids or c.finish_reason is not None:
                        lp = None
                        if c.logprobs is not None and echo[k]:  # the first chunk: the echoed prompt's too
                            lp = P.completion_logprobs(out.prompt_logprobs + entries, 0, self._first_token(job, i))
                        elif c.logprobs is not None:
                            lp = P.completion_logprobs(entries, len(echo_text[k]) + start)
                        events.append(chunk({"text": echo[k] + text, "index": k, "logprobs": lp,
                                             "finish_reason": c.finish_reason, **ids}))
                        echo[k] = ""
                job.timers[i].tokens_sent(new_tokens)
                job.record(i, out)
                for e in events:
                    yield e
            if req.include_usage:
                yield f"data: {_json({**base, 'choices': [], 'usage': job.usage()})}\n\n"
        except EngineUnavailableError as e:  # headers are sent: the error goes in the stream, as OpenAI's do
            yield f"data: {_json(P.APIError(503, str(e), type='server_error').body())}\n\n"
        except RequestFailedError as e:
            yield f"data: {_json(P.APIError(500, str(e), type='server_error').body())}\n\n"
        except Exception:
            log.exception("a streaming response failed")
            yield f"data: {_json(_INTERNAL.body())}\n\n"
        yield "data: [DONE]\n\n"

    # -- the small endpoints -------------------------------------------------------------------
    async def tokenize(self, request: Request) -> dict:
        req = await self._parsed(P.TokenizeRequest, await request.body())
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.APIError(400, "Give exactly one of 'prompt' and 'messages'.", param="prompt",
                             code="invalid_value")
        if req.messages is not None:
            _, ids = await self._chat_prompt(req.messages, self._tools(req), req.chat_template_kwargs,
                                             req.add_generation_prompt)
        else:
            self._check_text_size(len(req.prompt), "prompt")
            ids = await self._off_loop_if_large(len(req.prompt), self._tokenizer().encode, req.prompt,
                                  add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req = await self._parsed(P.DetokenizeRequest, await request.body())
        self._check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise P.APIError(400, f"Token ids out of range [0, {vocab}): {bad[:5]}", param="tokens",
                             code="invalid_value")
        return {"prompt": self._tokenizer().decode(req.tokens)}


# The routes read their bodies themselves (P.parse: strict types, OpenAI's error messages); the
# schema still declares them, for clients and fuzzers.
_BODIES = {"/v1/chat/completions": P.ChatCompletionRequest, "/v1/completions": P.CompletionRequest,
           "/tokenize": P.TokenizeRequest, "/detokenize": P.DetokenizeRequest}


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
    created = int(time.time())

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        return _error_response(e)

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(request: Request, e: EngineUnavailableError):
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return _error_response(P.APIError(503, str(e), type="server_error", headers=headers))

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, e: RequestFailedError):
        return _error_response(P.APIError(500, str(e), type="server_error"))

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, e: RequestError):
        return _error_response(P.APIError(400, str(e), param=getattr(e, "param", None), code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        msg = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return _error_response(P.APIError(e.status_code, msg, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("request failed", exc_info=e)
        return _error_response(_INTERNAL)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.create(request, P.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.create(request, P.CompletionRequest)

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "pocketllm"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        serving._check_model(model)
        return model_card()

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return _error_response(P.APIError(503, "The engine is not running.", type="server_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.detokenize(request)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    _with_request_bodies(app)
    app.add_middleware(_Guard, cfg=cfg, state=state)
    if cfg.allowed_origins:  # outermost, so that preflight requests need no API key
        # Never credentials with "*": Starlette would echo each origin, letting every site send cookies.
        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins,
                           allow_credentials="*" not in cfg.allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return app


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


def serve(llm: AsyncLLM, cfg: ServerConfig, host: str, port: int,
          on_started: Callable[[], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then drain (see _Server). Returns the exit code: 0 after a
    clean stop, 1 if the server could not start or the engine died."""
    state = ServerState()
    raise_open_file_limit()
    warn_if_exposed(host, cfg)
    cfg = dataclasses.replace(cfg, allowed_hosts=[*cfg.allowed_hosts, host])  # the name it was started on
    # No connection limit in uvicorn: it would refuse /health too while idle connections fill it.
    # _Guard bounds the requests in flight; idle connections end after `header_timeout` (none sent
    # yet) or uvicorn's keep-alive timeout of 5 s (after a response).
    config = uvicorn.Config(create_app(llm, cfg, state), host=host, port=port, log_level="info",
                            http=_http_protocol(cfg.header_timeout), timeout_graceful_shutdown=5)
    server = _Server(config, llm, cfg, state, on_started)
    llm.on_fatal = server.engine_died
    if llm.error is not None:  # it died before the server was there to hear it
        return 1
    server.run()
    return server.exit_code if server.started else 1
