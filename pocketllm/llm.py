"""The offline API, named as vLLM names it: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.errors import RequestFailedError
from pocketllm.lora_request import LoRARequest
from pocketllm.outputs import RequestOutput
from pocketllm.pooling_params import PoolingParams
from pocketllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (also done when the LLM is collected)."""
        self.engine.shutdown()

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        return self._run(prompts, sampling_params, SamplingParams, use_tqdm, lora_request)

    def embed(self, prompts: str | dict | Sequence[str | dict],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (RequestOutput.embedding), for a model of task embed; `lora_request` as
        `generate`'s."""
        return self._run(prompts, pooling_params, PoolingParams, use_tqdm, lora_request)

    def _run(self, prompts, params, kind, use_tqdm: bool | None, lora=None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if params is None or isinstance(params, kind):
            params = [params or kind()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} {kind.__name__}")
        if lora is None or isinstance(lora, LoRARequest):
            lora = [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora)} LoRA requests")
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p, adapter in zip(prompts, params, lora):
                ids.append(engine.add_request(None, prompt, p, lora_request=adapter))
        except BaseException:  # one bad prompt: queue none of the batch
            for rid in ids:
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        show = len(prompts) >= 8 if use_tqdm is None else use_tqdm
        desc = "Embedding" if kind is PoolingParams else "Generating"
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not show) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.error is not None:
                            raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in ids:
                    engine.abort_request(rid)
                raise
        return [done[i] for i in ids]
