"""PocketLLM: an LLM inference engine for open-weight models on CPUs and NVIDIA GPUs."""
import os
import sys

# After each parallel region libgomp's threads spin ~300,000 times before they sleep. Next to other
# busy programs that spinning holds the cores our own threads then wait for: with a busy process per
# core, single-stream decode ran at 0.19x of its idle speed with 300,000 spins and 0.50x with 30,000,
# whose idle speed is the same (benchmarks/results/cpu-under-load*.md). libgomp reads it once, when
# torch loads it; a user's setting wins.
OPENMP_SPINS = 30000
if "torch" not in sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPINS)

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import ConfigurationError, RequestError, UnsupportedFeatureError  # noqa: E402
from pocketllm.logging_config import configure_logging  # noqa: E402
from pocketllm.lora_request import LoRARequest  # noqa: E402
from pocketllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pocketllm.pooling_params import PoolingParams  # noqa: E402
from pocketllm.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

configure_logging()


def __getattr__(name: str):
    # LLM imports torch (about 2 s): only on first use, so that `pocketllm --help` and light
    # commands start at once.
    if name == "LLM":
        from pocketllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pocketllm' has no attribute {name!r}")


def get_tokenizer(path, chat_template: str | None = None):
    """A model directory or any GGUF file (vocabulary-only ones too) -> its tokenizer."""
    from pocketllm.tokenizer import get_tokenizer as _get

    return _get(path, chat_template=chat_template)


__all__ = ["LLM", "SamplingParams", "PoolingParams", "LoRARequest", "EngineArgs", "RequestOutput", "CompletionOutput",
           "ConfigurationError", "UnsupportedFeatureError", "RequestError", "get_tokenizer"]
