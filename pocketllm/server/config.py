"""The server's settings (every one a `pocketllm serve` flag) and its shared state."""
from __future__ import annotations

from dataclasses import dataclass, field


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

