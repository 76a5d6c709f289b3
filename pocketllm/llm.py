"""The offline API, named as vLLM names it: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.errors import RequestFailedError
from pocketllm.outputs import RequestOutput
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
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        engine = self.engine
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, sampling_params):
                ids.append(engine.add_request(None, p, sp))
        except BaseException:  # one bad prompt: queue none of the batch
            for rid in ids:
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        show = len(prompts) >= 8 if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not show) as bar:
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
