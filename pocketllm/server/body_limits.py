"""The count limits of a request (stop strings, stop token ids, bias entries, sequences, messages,
tools, prompt length), checked on a body's plain JSON before it is validated, and the same check in
a helper process for the largest bodies.

Why plain JSON: validating holds the interpreter lock throughout (~4 us per list entry), and with it
the engine thread, for as long as the body's largest list takes; `json.loads` is ~10x faster. Why a
helper process past `SCREENED_BYTES`: even `json.loads` holds the lock for its whole call (~50 ms for
a 4 MB body of token ids), so a client sending such bodies back to back, each refused, would hold
every step of the engine thread up by that much; read in the helper, a refused body never touches
this process's lock, and an accepted one is then validated here without being read twice."""
from __future__ import annotations

import json
from dataclasses import dataclass

from pocketllm.server import protocol as P

# Bodies larger than this are first checked in the helper process (json.loads of 256 KiB: ~3 ms).
SCREENED_BYTES = 256 << 10


def check_limits(*limits: tuple[str, int, int, str]) -> None:
    """(param, count, limit, flag): a 400 for the first count over its limit, naming the flag."""
    for param, count, limit, flag in limits:
        if count > limit:
            raise P.APIError(400, f"Invalid '{param}': {count} entries, more than the {limit} this server "
                                  f"accepts ({flag}).", param=param, code="invalid_value")


@dataclass(frozen=True)
class BodyLimits:
    max_stop_strings: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_messages: int
    max_tools: int
    max_queued_requests: int | None
    max_model_len: int

    def check_counts(self, stops: int, stop_token_ids: int, logit_bias: int, n: int, prompts: int) -> None:
        check_limits(("stop", stops, self.max_stop_strings, "--max-stop-strings"),
                     ("stop_token_ids", stop_token_ids, self.max_stop_token_ids, "--max-stop-token-ids"),
                     ("logit_bias", logit_bias, self.max_logit_bias, "--max-logit-bias"))
        queue = self.max_queued_requests
        if queue is not None and n * prompts > queue:
            what = f"n={n} x {prompts} prompts" if prompts > 1 else f"n={n}"
            raise P.APIError(400, f"The request asks for {n * prompts} sequences ({what}); this server queues at "
                                  f"most {queue} (--max-queued-requests).", param="n" if prompts == 1 else "prompt",
                             code="invalid_value")

    def check_chat_size(self, messages: int, tools: int) -> None:
        check_limits(("messages", messages, self.max_messages, "--max-messages"),
                     ("tools", tools, self.max_tools, "--max-tools"))

    def check_raw(self, raw: dict) -> None:
        """The limits on a body's plain JSON (a wrong type is left for validation to report)."""
        def count(v) -> int:
            return len(v) if isinstance(v, (list, dict)) else 0

        def integer(v, default: int) -> int:
            return v if type(v) is int and v > 0 else default

        stop, prompt = raw.get("stop"), raw.get("prompt")
        ids_prompt = isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int
        prompts = 1 if not isinstance(prompt, list) or ids_prompt else max(1, len(prompt))
        self.check_counts(1 if isinstance(stop, str) else count(stop), count(raw.get("stop_token_ids")),
                          count(raw.get("logit_bias")), integer(raw.get("n"), 1), prompts)
        self.check_chat_size(count(raw.get("messages")), count(raw.get("tools")))
        longest = max((len(p) for p in ([prompt] if ids_prompt else prompt if isinstance(prompt, list) else [])
                       if isinstance(p, list)), default=0)
        if longest > self.max_model_len:
            raise P.APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                  f"However, your prompt has {longest} tokens. Please reduce the length of the "
                                  "prompt.", param="prompt", code="context_length_exceeded")

    def check_body(self, body: bytes) -> None:
        """check_raw on a body that is a JSON object (anything else is validation's to report)."""
        try:
            raw = json.loads(body)
        except ValueError:
            return
        if isinstance(raw, dict):
            self.check_raw(raw)


def refusal(body: bytes, limits: BodyLimits) -> tuple | None:
    """In the helper process: None if the body is within the limits, else the APIError's arguments
    (status, message, type, param, code), which cross the process boundary as plain values."""
    try:
        limits.check_body(body)
    except P.APIError as e:
        return e.status, e.message, e.type, e.param, e.code
    return None
