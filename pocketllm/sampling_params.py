"""Per-request sampling settings, named as vLLM and the OpenAI API name them."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

from pocketllm.errors import RequestError
from pocketllm.structured.spec import normalize


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    # Logprobs of the prompt's tokens (each given the ones before it), with this many top entries
    # besides the prompt's token. Such a prompt is computed in full: prefix-cache hits carry no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # One constraint on the output: {"json": schema} | {"regex": ...} | {"choice": [...]} |
    # {"grammar": ebnf} | {"json_object": True} | {"structural_tag": ...} (see pocketllm.structured.spec)
    structured_outputs: dict | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        try:
            self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except (TypeError, ValueError):
            err = RequestError("logit_bias must map token ids to numbers")
            err.param = "logit_bias"
            raise err from None
        if self.structured_outputs is not None:
            self.structured_outputs = normalize(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> RequestError:
            err = RequestError(f"{param} {msg}")
            err.param = param
            return err

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, f"must be an integer, got {getattr(self, name)!r}")
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**63):
            raise bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids (integers >= 0), got {self.stop_token_ids[:5]}")
        if not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite numbers")
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 or 0 (off) or at least 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set: looked up once per sampled token."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy integers too
