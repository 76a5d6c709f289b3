"""`/tokenize` and `/detokenize` (vLLM's): a prompt or a chat's token ids, and the text of ids."""
from __future__ import annotations

from fastapi import Request

from pocketllm.server import protocol as P
from pocketllm.server.serving import OpenAIServing


async def tokenize(serving: OpenAIServing, request: Request) -> dict:
    req = await serving.parsed(P.TokenizeRequest, await request.body())
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise P.APIError(400, "Give exactly one of 'prompt' and 'messages'.", param="prompt",
                         code="invalid_value")
    if req.messages is not None:
        _, ids = await serving.chat_prompt(req.messages, serving.tools_of(req), req.chat_template_kwargs,
                                           req.add_generation_prompt)
    else:
        serving.check_text_size(len(req.prompt), "prompt")
        ids = await serving.off_loop_if_large(len(req.prompt), serving.tokenizer().encode, req.prompt,
                                              add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}


async def detokenize(serving: OpenAIServing, request: Request) -> dict:
    req = await serving.parsed(P.DetokenizeRequest, await request.body())
    serving.check_model(req.model)
    vocab = serving.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise P.APIError(400, f"Token ids out of range [0, {vocab}): {bad[:5]}", param="tokens",
                         code="invalid_value")
    return {"prompt": serving.tokenizer().decode(req.tokens)}
