"""`/v1/responses` (OpenAI's Responses API) as a translation of the chat endpoint: `input` items (messages,
`function_call`, `function_call_output`) and `instructions` become chat messages, function tools and
`tool_choice` chat's (forced calls held to their schema by a grammar), `text.format` a response format; the
reply's reasoning, text and calls become output items, streamed with the documented events. Stored responses
(`store`, the default) are kept in memory, bounded by count and bytes, for `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}`."""
from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, ValidationError

from pocketllm.server import protocol as P
from pocketllm.server.chat import ChatCompletions
from pocketllm.server.responses import to_json
from pocketllm.server.serving import Job

_LOOSE = dict(extra="ignore", strict=True, allow_inf_nan=False)


class _Body(P._Strict):
    model_config = ConfigDict(**_LOOSE)


class FunctionTool(_Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    model_config = ConfigDict(**_LOOSE, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedFunction | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None


P.name_fields(ResponsesRequest, FunctionTool, NamedFunction, TextFormat, TextConfig)


class ResponsesChat(P.ChatCompletionRequest):
    """The chat request a Responses request is, with that request and its whole conversation (the reply
    echoes the one, the store keeps the other)."""
    origin: Any = Field(None, exclude=True)


class ResponseStore:
    """Stored responses, newest last: the oldest go past `max_count` or `max_bytes` of JSON."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 64 << 20):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()  # id -> (response, input, bytes)
        self.bytes = 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(to_json(response)) + len(to_json(conversation))
        self._items[response["id"]] = (response, conversation, size)
        self.bytes += size
        while self._items and (len(self._items) > self.max_count or self.bytes > self.max_bytes):
            _, (_, _, gone) = self._items.popitem(last=False)
            self.bytes -= gone

    def get(self, rid: str) -> tuple[dict, list[dict]]:
        if rid not in self._items:
            raise P.APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
        self._items.move_to_end(rid)
        response, conversation, _ = self._items[rid]
        return response, conversation

    def delete(self, rid: str) -> None:
        self.get(rid)
        _, _, size = self._items.pop(rid)
        self.bytes -= size


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.APIError(400, f"Invalid '{where}': expected a string or an array of content parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise P.APIError(400, f"Invalid '{where}[{j}]': '{kind}' parts are not supported by this server "
                                  "(text only).", param=where)
        else:
            raise P.APIError(400, f"Invalid '{where}[{j}]': unknown content part type {kind!r}.", param=where)
    return "".join(texts)


def to_messages(items: list[dict]) -> list[dict]:
    """Responses input items -> chat messages (calls join the assistant message before them)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.APIError(400, f"Invalid '{where}': expected an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.APIError(400, f"Invalid '{where}.role': {role!r}.", param=where)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise P.APIError(400, f"Invalid '{where}': a function_call needs call_id, name and arguments "
                                      "(strings).", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise P.APIError(400, f"Invalid '{where}': a function_call_output needs a call_id.", param=where)
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # (earlier reasoning: templates drop it from past turns)
        else:
            raise P.APIError(400, f"Invalid '{where}.type': {kind!r} items are not supported.", param=where)
    return messages


def _items(value: str | list[dict]) -> list[dict]:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


class Responses(ChatCompletions):
    id_prefix = "resp_"

    def __init__(self, serving):
        super().__init__(serving)
        self.store = ResponseStore()

    async def parse(self, body: bytes) -> P.ChatCompletionRequest:
        req = await self.serving.parsed(ResponsesRequest, body)
        conversation = []
        if req.previous_response_id is not None:
            previous, earlier = self.store.get(req.previous_response_id)
            conversation = earlier + [_as_input(item) for item in previous["output"]]
        conversation += _items(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
            + to_messages(conversation)
        body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                                "parallel_tool_calls": req.parallel_tool_calls}
        for key in ("temperature", "top_p"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        if req.max_output_tokens is not None:
            body["max_tokens"] = req.max_output_tokens
        if req.tools:
            bad = [t.type for t in req.tools if t.type != "function"]
            if bad:
                raise P.APIError(400, f"Invalid 'tools': only function tools are supported, not {bad[0]!r}.",
                                 param="tools")
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters))
                if v is not None}} for t in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
                {"type": "function", "function": {"name": req.tool_choice.name}}
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise P.APIError(400, "Missing required parameter: 'text.format.schema'.", param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "format",
                                                                              "schema": fmt.schema_}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        if req.reasoning and req.reasoning.get("effort"):
            body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning["effort"]}
        try:
            chat = ResponsesChat.model_validate(body)
        except ValidationError as e:
            raise P.from_validation_error(e) from None
        chat.check()
        chat.origin = (req, conversation)
        return chat

    def reply(self, job: Job, choices: list[dict]) -> dict:
        message = choices[0]["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(message.get("content") or ""))
        output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in message.get("tool_calls") or []]
        return self.finished(job, output, choices[0]["finish_reason"])

    def response(self, job: Job, output: list[dict], status: str, incomplete: str | None = None) -> dict:
        req, _ = job.req.origin
        usage = job.usage()
        return {"id": job.id, "object": "response", "created_at": job.created, "status": status,
                "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": job.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
                "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if req.text and req.text.format else {"type": "text"})},
                "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                                else req.tool_choice.model_dump()) or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "metadata": req.metadata or {}, "user": req.user,
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}}

    def finished(self, job: Job, output: list[dict], finish: str | None) -> dict:
        """The completed (or cut) response, stored when asked."""
        incomplete = "max_output_tokens" if finish == "length" else None
        response = self.response(job, output, "incomplete" if incomplete else "completed", incomplete)
        req, conversation = job.req.origin
        if req.store:
            self.store.put(response, conversation)
        return response

    def stream_writer(self, job: Job) -> ResponsesStream:
        return ResponsesStream(job, self)


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _as_input(item: dict) -> dict:
    """An output item of a stored response as the next request's input item."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return item


class ResponsesStream:
    """The chat endpoint's streamed choices as the Responses API's events: response.created and
    response.in_progress, then per output item output_item.added, its content (content_part.added,
    output_text.delta ... .done, content_part.done; reasoning_text deltas; function_call_arguments deltas
    and .done) and output_item.done, and response.completed (or .incomplete) with the whole response."""
    media_type = "text/event-stream"

    def __init__(self, job: Job, endpoint: Responses):
        self.job, self.endpoint = job, endpoint
        self.seq = 0
        self.output: list[dict] = []
        self.open: tuple | None = None  # (kind, call index) of the item being streamed
        self.finish: str | None = None

    def _event(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {to_json({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def start(self) -> list[str]:
        shell = self.endpoint.response(self.job, [], "in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        kind, self.open = self.open[0], None
        events = []
        if kind == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        elif kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        if "status" in item:
            item["status"] = "completed"
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _open(self, key: tuple, item: dict) -> list[str]:
        if self.open == key:
            return []
        events = self._close()
        self.output.append(item)
        self.open = key
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if key[0] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def choice(self, choice: dict) -> list[str]:
        events = []
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            events += self._open(("reasoning", None), {**_reasoning_item(""), "status": "in_progress"})
            item = self.output[-1]
            item["content"][0]["text"] += delta["reasoning_content"]
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      delta=delta["reasoning_content"]))
        if delta.get("content"):
            events += self._open(("message", None), _message_item("", "in_progress"))
            item = self.output[-1]
            item["content"][0]["text"] += delta["content"]
            events.append(self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0, delta=delta["content"]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self._open(("call", call["index"]), _call_item(call["id"], call["function"]["name"], "",
                                                                          "in_progress"))
            fragment = call["function"].get("arguments")
            if fragment:
                item = self.output[-1]
                item["arguments"] += fragment
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=len(self.output) - 1, delta=fragment))
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return events

    def end(self) -> list[str]:
        events = self._close()
        if not self.output:  # an empty reply is still a message
            events += self._open(("message", None), _message_item("", "in_progress")) + self._close()
        response = self.endpoint.finished(self.job, self.output, self.finish)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def error(self, e: P.APIError) -> list[str]:
        return [self._event("error", code=e.code or e.type, message=e.message, param=e.param)]


def response_routes(endpoint: Responses) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request):
        return await endpoint.create(request)

    @router.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        return endpoint.store.get(rid)[0]

    @router.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        endpoint.store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    return router

