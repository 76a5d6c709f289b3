"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API as a translation of the chat
endpoint. A request becomes a chat request (system text, content blocks as messages, `tool_use` blocks as
tool calls, `tool_result` blocks as tool messages, tools and tool_choice as chat's), which the chat
endpoint prepares (template, tool and reasoning parsers, grammars) and streams; its replies and deltas
become Anthropic's content blocks (`thinking`, `text`, `tool_use`) and events."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from pocketllm.server import protocol as P
from pocketllm.server.chat import ChatCompletions
from pocketllm.server.responses import anthropic_error, to_json
from pocketllm.server.serving import Job

# -- request bodies ---------------------------------------------------------------------------------
_ANY = dict(extra="ignore", strict=True, allow_inf_nan=False)


class _Block(P._Strict):
    model_config = ConfigDict(**_ANY)  # cache_control, citations ... are ignored


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image", "document"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Block):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Block):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Block):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class OutputFormat(_Block):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    model_config = ConfigDict(**_ANY, populate_by_name=True)
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(_Block):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None  # structured output: a JSON schema the reply follows
    output_format: OutputFormat | None = None  # (its earlier name)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None


P.name_fields(MessagesRequest, Message, Tool, ToolChoice, Thinking, TextBlock, ToolUseBlock, ToolResultBlock,
              OutputConfig, OutputFormat)


def _texts(blocks, where: str) -> str:
    """The text of text blocks; anything else (an image, a document) is refused."""
    out = []
    for b in blocks:
        if isinstance(b, ImageBlock):
            raise P.APIError(400, f"{where}: '{b.type}' blocks are not supported by this server (text only).",
                             param=where)
        out.append(b.text)
    return "\n".join(out)


def chat_request(req: CountTokensRequest) -> P.ChatCompletionRequest:
    """The chat request that a Messages request is."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": req.system if isinstance(req.system, str)
                         else _texts(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text = _texts([b for b in m.content if isinstance(b, (TextBlock, ImageBlock))], where)
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                             **({"reasoning_content": thinking} if thinking else {})})  # (the templates' name)
            continue
        texts: list = []  # a user turn: tool results are tool messages, in order with the text between
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if texts:
                    messages.append({"role": "user", "content": _texts(texts, where)})
                    texts = []
                content = b.content if isinstance(b.content, str) else _texts(b.content or [], where)
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {content}" if b.is_error else content})
            elif isinstance(b, ToolUseBlock):
                raise P.APIError(400, f"{where}: a user message cannot hold 'tool_use' blocks.", param=where)
            elif not isinstance(b, ThinkingBlock):
                texts.append(b)
        if texts or not m.content:
            messages.append({"role": "user", "content": _texts(texts, where)})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                          **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise P.APIError(400, "tool_choice: type 'tool' needs a 'name'.", param="tool_choice")
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    kwargs = {}
    if req.thinking is not None:  # the templates of reasoning models take it (Qwen3's enable_thinking)
        kwargs["enable_thinking"] = req.thinking.type == "enabled"
    config = req.output_config or OutputConfig()
    if config.effort:
        kwargs["reasoning_effort"] = config.effort
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    fmt = config.format or req.output_format
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences,
                    **{k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                         ("top_k", req.top_k)) if v is not None})
    try:
        chat = P.ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise P.from_validation_error(e) from None
    chat.check()
    return chat


# -- replies ---------------------------------------------------------------------------------------
def _stop(job: Job, finish: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the job's one choice."""
    out = job.last[0].outputs[0] if job.last and job.last[0] is not None else None
    matched = out.stop_reason if out is not None and isinstance(out.stop_reason, str) else None
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _usage(job: Job) -> dict:
    u = job.usage()
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"], "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class Messages(ChatCompletions):
    id_prefix = "msg_"

    async def parse(self, body: bytes) -> P.ChatCompletionRequest:
        return chat_request(await self.serving.parsed(MessagesRequest, body))

    def reply(self, job: Job, choices: list[dict]) -> dict:
        choice = choices[0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _tool_input(call["function"]["arguments"])})
        reason, sequence = _stop(job, choice["finish_reason"])
        return {"id": job.id, "type": "message", "role": "assistant", "model": job.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(job)}

    def stream_writer(self, job: Job) -> MessagesStream:
        return MessagesStream(job, job.model)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {to_json({'type': name, **data})}\n\n"


class MessagesStream:
    """The chat endpoint's streamed choices as Anthropic's events: message_start, then per content block
    content_block_start, its deltas (text_delta, thinking_delta, input_json_delta) and content_block_stop,
    then message_delta (stop_reason, usage) and message_stop."""
    media_type = "text/event-stream"

    _KINDS = {"content": ("text", "text_delta", "text"), "reasoning_content": ("thinking", "thinking_delta", "thinking")}

    def __init__(self, job: Job, model: str):
        self.job, self.model = job, model
        self.block = -1  # index of the open content block
        self.open: tuple | None = None  # (kind, tool call index) of the open block
        self.finish: str | None = None

    def start(self) -> list[str]:
        usage = {"input_tokens": sum(len(ids) for _, ids in self.job.prompts), "output_tokens": 0}
        return [_event("message_start", {"message": {
            "id": self.job.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})]

    def _switch(self, key: tuple, block: dict) -> list[str]:
        if self.open == key:
            return []
        events = self._close()
        self.block += 1
        self.open = key
        return events + [_event("content_block_start", {"index": self.block, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.block})]

    def choice(self, choice: dict) -> list[str]:
        events = []
        delta = choice.get("delta") or {}
        for key, (kind, delta_type, field) in self._KINDS.items():
            if delta.get(key):
                block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
                events += self._switch((kind, None), block)
                events.append(_event("content_block_delta", {"index": self.block,
                                                             "delta": {"type": delta_type, field: delta[key]}}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call starts: its name comes first
                events += self._switch(("tool_use", call["index"]), {
                    "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                events.append(_event("content_block_delta", {"index": self.block, "delta": {
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}))
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return events

    def end(self) -> list[str]:
        reason, sequence = _stop(self.job, self.finish)
        usage = _usage(self.job)
        return self._close() + [
            _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": usage["output_tokens"]}}),
            _event("message_stop", {})]

    def error(self, e: P.APIError) -> list[str]:
        return [f"event: error\ndata: {to_json(anthropic_error(e))}\n\n"]


async def count_tokens(serving, body: bytes) -> dict:
    """`/v1/messages/count_tokens`: the prompt's tokens as the chat template renders the request."""
    req = chat_request(await serving.parsed(CountTokensRequest, body))
    serving.check_model(req.model)
    _, ids = await serving.chat_prompt(req.messages, serving.tools_of(req), req.chat_template_kwargs)
    return {"input_tokens": len(ids)}
