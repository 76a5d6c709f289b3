"""Request bodies of the OpenAI API (and vLLM's sampling extensions), and its error shape.

Parsing is strict about types (`"temperature": "0.5"` is a 400, as with OpenAI) and ignores
fields it does not know, as OpenAI-compatible servers do.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pocketllm.errors import RequestError
from pocketllm.outputs import Logprob
from pocketllm.sampling_params import SamplingParams


class APIError(Exception):
    """An error response: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_CONFIG = dict(extra="ignore", strict=True, allow_inf_nan=False)  # JSON has no NaN; Infinity is no sampling value
_INT64 = (-(2**63), 2**63 - 1)


class _Strict(BaseModel):
    model_config = ConfigDict(**_CONFIG)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # Other keys are kept for the chat template.
    model_config = ConfigDict(**{**_CONFIG, "extra": "allow"})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def texts(self) -> list[str]:
        """The message's text, as the chat template will see it."""
        parts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content or []]
        return parts + [c.function.arguments for c in self.tool_calls or []]

    def as_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "\n".join(p.text for p in self.content)
        if self.role == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        return d


class JSONSchemaFormat(_Strict):
    model_config = ConfigDict(**_CONFIG, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_INT64[0], le=_INT64[1])  # as vLLM's: a 64-bit integer
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT64[1])]] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids of each choice and its prompt (streamed too)
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt, so that
    # `cached_tokens` cannot tell one user whether another sent the same prompt.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json | regex | choice | grammar | ...

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options", code="invalid_value")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise APIError(400, "Give either 'response_format' or 'structured_outputs', not both.",
                           param="structured_outputs", code="invalid_value")
        internal = {"tool_calls", "reasoning"} & set(self.structured_outputs or {})
        if internal:  # the server derives these from `tools` and its reasoning parser
            raise APIError(400, f"Invalid 'structured_outputs': {sorted(internal)} cannot be given by a client; "
                                "use 'tools' and 'tool_choice'.", param="structured_outputs", code="invalid_value")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            raise APIError(400, "Missing required parameter: 'response_format.json_schema.schema'.",
                           param="response_format", code="missing_required_parameter")

    def output_constraint(self) -> tuple[dict | None, str | None]:
        """The `structured_outputs` asked for, and the parameter that asked."""
        if self.structured_outputs is not None:
            return self.structured_outputs, "structured_outputs"
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None, None
        if rf.type == "json_object":
            return {"json_object": True}, "response_format"
        return {"json": rf.json_schema.schema_}, "response_format"

    def sampling_params(self, max_tokens: int, logprobs: int | None, structured_outputs: dict | None = None,
                        constraint_param: str | None = None, skip_special_tokens: bool = True,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "Invalid 'logit_bias': keys must be token ids.", param="logit_bias",
                           code="invalid_value") from None
        given = {k: v for k, v in dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty).items() if v is not None}
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed, logit_bias=bias,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
                skip_special_tokens=skip_special_tokens, **given)
        except RequestError as e:
            param = getattr(e, "param", None)
            raise APIError(400, str(e), param=constraint_param if param == "structured_outputs" else param,
                           code="invalid_value") from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "Invalid value for 'top_logprobs': 'logprobs' must be set to true "
                                "when 'top_logprobs' is used.", param="top_logprobs", code="invalid_value")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                "are specified.", param="tool_choice", code="invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise APIError(400, f"Invalid value for 'tool_choice': no function named '{name}' in 'tools'.",
                               param="tool_choice", code="invalid_value")

    @property
    def effective_tool_choice(self) -> str | dict:
        """"none", "auto", "required" or {"type": "function", "function": {"name": ...}}, as OpenAI
        defaults it: "auto" when there are tools."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def check(self) -> None:
        super().check()
        prompts = self.prompt_list()
        if not prompts or not all(prompts):
            raise APIError(400, "Invalid 'prompt': the prompt must not be empty.", param="prompt",
                           code="invalid_value")

    def prompt_list(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered with the messages, as the chat request would
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def model_card(name: str, created: int, engine=None, adapter: str | None = None) -> dict:
    """A /v1/models entry: the served model, or one of its engine's LoRA adapters (its base model as
    parent and its path as root, as vLLM lists them)."""
    if adapter is None:
        return {"id": name, "object": "model", "created": created, "owned_by": "pocketllm", "parent": None}
    return {"id": adapter, "object": "model", "created": created, "owned_by": "pocketllm", "parent": name,
            "root": engine.lora.path(adapter)}


class LoadLoRAAdapterRequest(_Strict):  # vLLM's /v1/load_lora_adapter
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):  # vLLM's /v1/unload_lora_adapter
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# -- validation errors in OpenAI's words ---------------------------------------------------------
_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a decimal", list: "an array",
          dict: "an object", type(None): "null"}
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
             "float_type": "a decimal", "bool_type": "a boolean", "list_type": "an array",
             "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}
_FIELDS = {name for m in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions,
                          TokenizeRequest, DetokenizeRequest, MessageToolCall, FunctionCall, ResponseFormat,
                          JSONSchemaFormat, ChatTool, FunctionDefinition, NamedToolChoice)
           for name in m.model_fields} | {"schema"}


def name_fields(*models: type) -> None:
    """Other protocols' request bodies: their fields named in errors as OpenAI's are."""
    _FIELDS.update(name for m in models for name in m.model_fields)


def _param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'. Union-member tags end the path."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def parse(model: type[_Strict], body: bytes) -> Any:
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if hasattr(req, "check"):
        req.check()
    return req


def from_validation_error(e: ValidationError) -> APIError:
    err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest one says the most
    kind, loc, value, ctx = err["type"], err["loc"], err.get("input"), err.get("ctx") or {}
    param = _param(loc)
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request. The OpenAI API expects a "
                             "JSON payload, but what was sent was not valid JSON.")
    if not loc:
        return APIError(400, "Invalid request body: expected a JSON object.", code="invalid_type")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if kind in _EXPECTED:
        got = _KINDS.get(type(value), "another type")
        return APIError(400, f"Invalid type for '{param}': expected {_EXPECTED[kind]}, but got {got} instead.",
                        param=param, code="invalid_type")
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        limit = next(iter(ctx.values()))  # typed as the field is: int or float
        number = "integer" if isinstance(limit, int) else "decimal"
        above = kind.startswith("less")
        op = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}[kind]
        shown = limit if isinstance(limit, int) else f"{limit:g}"  # 2**63 - 1 in full
        return APIError(400, f"Invalid '{param}': {number} {'above maximum' if above else 'below minimum'} "
                             f"value. Expected a value {op} {shown}, but got {value} instead.", param=param,
                        code=f"{number}_{'above_max' if above else 'below_min'}_value")
    if kind == "too_short" and not value:
        return APIError(400, f"Invalid '{param}': empty array. Expected an array with minimum length "
                             f"{ctx.get('min_length', 1)}, but got an empty array instead.", param=param,
                        code="empty_array")
    if kind == "literal_error":
        return APIError(400, f"Invalid value: {value!r}. Supported values are: {ctx.get('expected')}.",
                        param=param, code="invalid_value")
    return APIError(400, f"Invalid '{param}': {err['msg']}.", param=param, code="invalid_value")


# -- response pieces ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(x: float) -> float:
    return max(x, -9999.0)  # OpenAI's stand-in for -inf; JSON has no infinities


def chat_logprobs(entries: list[dict[int, Logprob]], top: int) -> dict:
    """One entry per sampled token: the sampled token first, then the top ones (engine order)."""
    def item(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}

    content = []
    for entry in entries:
        sampled = next(iter(entry.values()))
        ranked = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
        content.append({**item(sampled), "top_logprobs": [item(lp) for lp in ranked]})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict[int, Logprob] | None], text_offset: int,
                        first_token: str = "") -> dict:
    """The legacy completions `logprobs` object. A None entry is the first prompt token of an
    echoed prompt, which has no logprob (`first_token` is its text), as OpenAI sends it."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            tokens.append(first_token)
            token_lps.append(None)
            tops.append(None)
            offsets.append(text_offset)
            text_offset += len(first_token)
            continue
        sampled = next(iter(entry.values()))
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_lps.append(_finite(sampled.logprob))
        tops.append({lp.decoded_token or "": _finite(lp.logprob) for lp in entry.values()})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
