"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`) as a
translation of the chat and completions endpoints: a request becomes a chat request (`options` as
sampling, `format` as a response format, `think` as the template's switch) or, with `raw`, a completion
of its prompt as given; replies are Ollama's objects, streamed as NDJSON lines (the default) with the
final line's counts and durations. Ollama's tool calls arrive whole: a call is sent once its arguments
are complete."""
from __future__ import annotations

import functools
import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, ValidationError

from pocketllm import __version__
from pocketllm.server import embeddings
from pocketllm.server import protocol as P
from pocketllm.server.chat import ChatCompletions
from pocketllm.server.completions import Completions
from pocketllm.server.responses import to_json
from pocketllm.server.serving import Job, OpenAIServing

_LOOSE = dict(extra="ignore", strict=True, allow_inf_nan=False)


class _Body(P._Strict):
    model_config = ConfigDict(**_LOOSE)


class Options(_Body):
    num_ctx: int | None = None  # (the server's context is fixed at start: accepted, not changed)
    num_predict: int | None = None  # -1, -2: no bound but the server's
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ToolFunction(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Body):
    function: ToolFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class _Request(_Body):
    model: str
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    think: bool | Literal["high", "medium", "low"] | None = None
    keep_alive: str | int | float | None = None  # (the model stays loaded: accepted)


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # OpenAI's, passed on: Ollama has none, PocketLLM enforces it


class EmbedRequest(_Body):
    model: str | None = None
    input: str | list[str]
    truncate: bool = True  # an input longer than the context is cut to it (else refused)
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: Any = None  # (the model stays loaded: accepted, not used)


class LegacyEmbedRequest(_Body):
    model: str | None = None
    prompt: str
    options: Options | None = None
    keep_alive: Any = None


class PullRequest(_Body):
    model: str | None = None
    name: str | None = None  # (older clients' name for it)
    insecure: bool = False
    stream: bool = True


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # (older clients' name for it)


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    context: list[int] | None = None


P.name_fields(ChatRequest, GenerateRequest, ShowRequest, Message, Options, ToolCall, ToolFunction)


def _sampling(req: _Request) -> dict:
    """The chat or completion request's sampling fields, from `options` and `format`."""
    o = req.options or Options()
    body: dict[str, Any] = {"stream": req.stream}
    if o.num_predict is not None and o.num_predict > 0:
        body["max_tokens"] = o.num_predict
    for ours, theirs in (("temperature", o.temperature), ("top_p", o.top_p), ("min_p", o.min_p), ("seed", o.seed),
                         ("stop", o.stop), ("repetition_penalty", o.repeat_penalty),
                         ("presence_penalty", o.presence_penalty), ("frequency_penalty", o.frequency_penalty)):
        if theirs is not None:
            body[ours] = theirs
    if o.top_k:
        body["top_k"] = o.top_k
    if req.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": req.format}}
    if req.think is not None:  # the templates' switches: Qwen3's enable_thinking, gpt-oss's reasoning_effort
        body["chat_template_kwargs"] = ({"enable_thinking": req.think} if isinstance(req.think, bool)
                                        else {"reasoning_effort": req.think})
    return body


def _validated(model: type, body: dict):
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise P.from_validation_error(e) from None
    req.check()
    return req


def chat_request(req: ChatRequest) -> P.ChatCompletionRequest:
    messages, calls = [], []  # calls: ids of the assistant's calls that tool messages answer, in order
    for i, m in enumerate(req.messages):
        if m.images:
            raise P.APIError(400, f"messages[{i}].images: images are not supported by this server (text only).",
                             param="images")
        if m.role == "tool":
            call_id = calls.pop(0) if calls else f"call_{i}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": m.content})
            continue
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            ids = [f"call_{i}_{j}" for j in range(len(m.tool_calls))]
            calls = list(ids)
            message["tool_calls"] = [{"id": c_id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for c_id, c in zip(ids, m.tool_calls)]
        if m.thinking:
            message["reasoning_content"] = m.thinking  # (the templates' name)
        messages.append(message)
    body = {"model": req.model, "messages": messages, **_sampling(req)}
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    return _validated(P.ChatCompletionRequest, body)


def generate_request(req: GenerateRequest) -> P.ChatCompletionRequest | P.CompletionRequest:
    """A prompt for the model's chat template (with `system`), or with `raw` the prompt as it is."""
    for name in ("suffix", "template", "images"):
        if getattr(req, name):
            raise P.APIError(400, f"'{name}' is not supported by this server.", param=name)
    sampling = _sampling(req)
    if req.raw:
        sampling.pop("chat_template_kwargs", None)
        sampling.setdefault("max_tokens", None)  # (not the legacy endpoint's 16)
        return _validated(P.CompletionRequest, {"model": req.model, "prompt": req.prompt, **sampling})
    system = [{"role": "system", "content": req.system}] if req.system else []
    return _validated(P.ChatCompletionRequest, {"model": req.model, **sampling,
                                               "messages": [*system, {"role": "user", "content": req.prompt}]})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _counts(job: Job) -> dict:
    """The counts and durations (ns) of Ollama's last object, from the request's arrival and first token."""
    timer, end = job.timers[0], time.monotonic()
    first = timer.first_token_time or end
    usage = job.usage()
    ns = lambda seconds: int(seconds * 1e9)  # noqa: E731
    return {"total_duration": ns(end - timer.arrival), "load_duration": 0,
            "prompt_eval_count": usage["prompt_tokens"], "prompt_eval_duration": ns(first - timer.arrival),
            "eval_count": usage["completion_tokens"], "eval_duration": ns(end - first)}


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


def _calls(tool_calls: list[dict] | None) -> list[dict]:
    out = []
    for c in tool_calls or []:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out


class _Ollama:
    """What /api/chat and /api/generate share: Ollama's objects and NDJSON lines around an endpoint's
    choices. `key`: "message" (chat) or "response" (generate)."""
    key: str

    def reply(self, job: Job, choices: list[dict]) -> dict:
        c = choices[0]
        message = c.get("message") or {"content": c.get("text", "")}
        return {"model": job.model, "created_at": _now(), **self._part(message.get("content") or "",
                message.get("reasoning_content"), _calls(message.get("tool_calls"))),
                "done": True, "done_reason": _done_reason(c["finish_reason"]), **_counts(job)}

    def _part(self, text: str, thinking: str | None = None, calls: list[dict] | None = None) -> dict:
        if self.key == "response":
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def stream_writer(self, job: Job) -> OllamaStream:
        return OllamaStream(job, self)


class OllamaStream:
    """An endpoint's streamed choices as NDJSON lines: a line a text or thinking delta, tool calls once
    whole, and a last line with done, done_reason and the counts."""
    media_type = "application/x-ndjson"

    def __init__(self, job: Job, endpoint: _Ollama):
        self.job, self.endpoint = job, endpoint
        self.calls: list[dict] = []  # the streamed calls, assembled
        self.finish: str | None = None

    def _line(self, part: dict, done: bool = False, **extra) -> str:
        return to_json({"model": self.job.model, "created_at": _now(), **part, "done": done,
                        **extra}) + "\n"

    def start(self) -> list[str]:
        return []

    def choice(self, choice: dict) -> list[str]:
        delta = choice.get("delta") or {"content": choice.get("text")}
        lines = []
        if delta.get("content") or delta.get("reasoning_content"):
            lines.append(self._line(self.endpoint._part(delta.get("content") or "", delta.get("reasoning_content"))))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                self.calls.append({"function": {"name": call["function"]["name"], "arguments": ""}})
            self.calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments") or ""
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return lines

    def end(self) -> list[str]:
        calls = _calls(self.calls)
        lines = [self._line(self.endpoint._part("", None, calls))] if calls else []
        return lines + [self._line(self.endpoint._part(""), True, done_reason=_done_reason(self.finish),
                                   **_counts(self.job))]

    def error(self, e: P.APIError) -> list[str]:
        return [to_json({"error": e.message}) + "\n"]


class OllamaChat(_Ollama, ChatCompletions):
    key = "message"

    async def parse(self, body: bytes) -> P.ChatCompletionRequest:
        return chat_request(await self.serving.parsed(ChatRequest, body))


class OllamaGenerate(_Ollama, ChatCompletions):
    key = "response"

    async def parse(self, body: bytes) -> P.ChatCompletionRequest:
        return generate_request(await self.serving.parsed(GenerateRequest, body))


class OllamaRawGenerate(_Ollama, Completions):
    key = "response"

    async def parse(self, body: bytes) -> P.CompletionRequest:
        return generate_request(await self.serving.parsed(GenerateRequest, body))


def ollama_routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    chat, generate, raw = OllamaChat(serving), OllamaGenerate(serving), OllamaRawGenerate(serving)
    engine, name = serving.engine, serving.cfg.model_name

    def check_model(model: str | None) -> str | None:
        return serving.check_model(model.removesuffix(":latest") if model else model)

    def loaded(model: str, key: str) -> dict:
        """What Ollama answers a request without messages or prompt: the model is loaded."""
        check_model(model)
        return {"model": name, "created_at": _now(), **({"message": {"role": "assistant", "content": ""}}
                if key == "message" else {"response": ""}), "done": True, "done_reason": "load"}

    def request_json(body: bytes) -> dict:
        try:
            value = json.loads(body or b"{}")
        except ValueError:  # (not JSON, or not text)
            raise P.APIError(400, "The request body is not valid JSON.") from None
        if not isinstance(value, dict):
            raise P.APIError(400, "The request body must be a JSON object.")
        if isinstance(value.get("model"), str):
            value["model"] = value["model"].removesuffix(":latest")
        return value

    @router.post("/api/chat")
    async def api_chat(request: Request):
        value = request_json(await request.body())
        if not value.get("messages") and isinstance(value.get("model"), str):
            return loaded(value["model"], "message")
        return await chat.create(request, json.dumps(value).encode())

    @router.post("/api/generate")
    async def api_generate(request: Request):
        value = request_json(await request.body())
        if not value.get("prompt") and isinstance(value.get("model"), str):
            return loaded(value["model"], "response")
        return await (raw if value.get("raw") is True else generate).create(request, json.dumps(value).encode())

    @router.post("/api/embed")
    async def api_embed(request: Request):
        req = await serving.parsed(EmbedRequest, await request.body())
        lora = check_model(req.model)
        if serving.engine.task != "embed":
            raise P.APIError(400, f"{name} does not support embeddings (it is a text generation model).")
        job = await embeddings.embed(serving, request, [req.input] if isinstance(req.input, str) else req.input,
                                     "input", req.dimensions, truncate=req.truncate, lora=lora)
        if job is None:
            return Response(status_code=499)
        counts = _counts(job)
        return {"model": job.model, "embeddings": [out.embedding for out in job.last], "total_duration":
                counts["total_duration"], "load_duration": 0, "prompt_eval_count": counts["prompt_eval_count"]}

    @router.post("/api/embeddings")
    async def api_embeddings(request: Request):  # the older route: one prompt, one vector
        req = await serving.parsed(LegacyEmbedRequest, await request.body())
        lora = check_model(req.model)
        if serving.engine.task != "embed":
            raise P.APIError(400, f"{name} does not support embeddings (it is a text generation model).")
        job = await embeddings.embed(serving, request, [req.prompt], "prompt", truncate=True, lora=lora)
        return Response(status_code=499) if job is None else {"embedding": job.last[0].embedding}

    @router.post("/api/pull")
    async def api_pull(request: Request):
        raise P.APIError(400, f"this server serves one model ({name}); start it with --model for each model "
                              "it should serve (then /api/pull fetches and serves more)")

    @router.get("/api/version")
    async def api_version():
        return {"version": __version__}

    @router.get("/api/tags")
    async def api_tags():
        return {"models": [card()]}

    @router.get("/api/ps")
    async def api_ps():
        on_gpu = engine.device.type == "cuda"
        return {"models": [{**card(), "expires_at": "9999-12-31T23:59:59Z",
                            "size_vram": engine.weight_bytes if on_gpu else 0,
                            "context_length": engine.max_model_len}]}

    @router.post("/api/show")
    async def api_show(request: Request):
        shown = await serving.parsed(ShowRequest, await request.body())
        if not (shown.model or shown.name):
            raise P.APIError(400, "Missing required parameter: 'model'.", param="model")
        check_model(shown.model or shown.name)
        cfg = engine.model_config
        capabilities = ["completion"] + (["tools"] if serving.tool_parser_for(serving.chat_template_for(None))
                                         else []) + (["thinking"] if serving.reasoning else [])
        template = serving.cfg.chat_template or (engine.tokenizer.chat_template if engine.tokenizer else None)
        return {"modelfile": "", "parameters": "", "template": template or "", "details": details(),
                "model_info": {"general.architecture": cfg.architecture, "general.parameter_count": parameters(),
                               "context_length": engine.max_model_len},
                "capabilities": capabilities, "modified_at": modified()}

    @functools.cache
    def file_facts() -> tuple[int, str]:
        """(parameters, quantization level) from the file's header (read again: the loader let it go)."""
        if engine.source.gguf is None:
            return sum(p.numel() for p in engine.runner.model.parameters()), ""
        from gguf import GGUFReader, LlamaFileType

        reader = GGUFReader(engine.source.path)
        field = reader.fields.get("general.file_type")
        level = LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field is not None else ""
        return sum(int(t.n_elements) for t in reader.tensors), level

    def parameters() -> int:
        return file_facts()[0]

    def details() -> dict:
        n, level = file_facts()
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        return {"format": "gguf" if engine.source.is_gguf else "safetensors", "family": engine.model_config.architecture,
                "families": [engine.model_config.architecture], "parameter_size": size, "quantization_level": level,
                "parent_model": ""}

    def modified() -> str:
        path = engine.source.path
        stamp = path.stat().st_mtime if path.exists() else time.time()
        return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")

    def card() -> dict:
        path = engine.source.path
        size = path.stat().st_size if path.is_file() else engine.weight_bytes
        digest = hashlib.sha256(f"{path.resolve()}:{size}:{modified()}".encode()).hexdigest()  # an id, not the blob's hash
        return {"name": name, "model": name, "modified_at": modified(), "size": size, "digest": digest,
                "details": details()}

    return router
