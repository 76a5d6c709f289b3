"""`/v1/embeddings` (OpenAI's), and the vectors behind Ollama's `/api/embed`: each input is one engine
request of a model served with task embed, its prompt pooled as the model's config says (PoolingParams)."""
from __future__ import annotations

import base64
import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from pocketllm.errors import RequestError
from pocketllm.pooling_params import PoolingParams
from pocketllm.server import protocol as P
from pocketllm.server.serving import Job, OpenAIServing, merge_outputs, unless_client_leaves

MAX_INPUTS = 2048  # inputs in one request, as OpenAI's API allows


class EmbeddingRequest(P._Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def check_serves_embeddings(serving: OpenAIServing, param: str = "model") -> None:
    if serving.engine.task != "embed":
        raise P.APIError(400, f"The model `{serving.cfg.model_name}` is a text generation model: it does not "
                              "serve embeddings (serve an embedding model, or this one with --task embed).",
                         param=param, code="model_not_supported")


async def embed(serving: OpenAIServing, request: Request, inputs: list[str | list[int]], where: str,
                dimensions: int | None = None, truncate: bool = False, lora: str | None = None) -> Job | None:
    """Each input's finished output (`Job.last`, in input order), or None if the client left first.
    `truncate`: an input longer than the context is cut to it (Ollama's default), else refused. `lora`:
    the LoRA adapter the request named (`serving.check_model`)."""
    check_serves_embeddings(serving)
    if not inputs:
        raise P.APIError(400, f"'{where}' must not be empty.", param=where)
    if len(inputs) > MAX_INPUTS:
        raise P.APIError(400, f"'{where}' has {len(inputs)} items; at most {MAX_INPUTS} are allowed.", param=where)
    engine, limit = serving.engine, serving.engine.max_model_len
    params = PoolingParams(dimensions=dimensions)  # pooled and normalized as the model's config says
    try:
        params.check_width(engine.model_config.hidden_size)
    except RequestError as e:
        raise P.APIError(400, str(e), param=e.param, code="invalid_value") from None
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise P.APIError(400, f"'{where}' holds an empty string; each input must have text.", param=where)
            if not truncate:
                serving.check_prompt_size(item, where)
            ids = await serving.off_loop_if_large(len(item), serving.tokenizer().encode, item)
        else:
            ids = list(item)
        if truncate:
            ids = ids[:limit]
        if len(ids) > limit:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, an input "
                                  f"of your {where} has {len(ids)} tokens. Please reduce its length.",
                             param=where, code="context_length_exceeded")
        try:
            engine.validate_request(ids)
        except RequestError as e:
            raise P.APIError(400, str(e), param=where, code="invalid_value") from None
        prompts.append((item if isinstance(item, str) else None, ids))
    job = Job(f"embd-{uuid.uuid4().hex}", None, prompts, model=lora or serving.cfg.model_name)
    arrival = request.state.arrival_time
    try:
        for i, (text, ids) in enumerate(prompts):
            job.streams.append(serving.llm.add_request(f"{job.id}-{i}", {"prompt": text, "prompt_token_ids": ids},
                                                       params, arrival, lora=lora))
            job.timers.append(serving.metrics.timer(arrival))
            job.last.append(None)

        async def collect():
            async for i, out in merge_outputs(job.streams):
                job.record(i, out)

        work = await unless_client_leaves(request, collect())
        if work is None:
            return None
        work.result()
        return job
    finally:
        job.close()


async def create(serving: OpenAIServing, request: Request):
    req = await serving.parsed(EmbeddingRequest, await request.body())
    lora = serving.check_model(req.model)
    check_serves_embeddings(serving)
    inputs = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) else req.input
    job = await embed(serving, request, inputs, "input", req.dimensions, lora=lora)
    if job is None:
        return Response(status_code=499)  # the client left: nobody will read it
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(out.embedding) if req.encoding_format == "base64" else out.embedding}
            for i, out in enumerate(job.last)]
    tokens = sum(len(ids) for _, ids in job.prompts)
    return {"object": "list", "data": data, "model": job.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()

