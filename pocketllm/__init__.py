"""PocketLLM: an LLM inference engine for open-weight models on CPUs and NVIDIA GPUs."""
from pocketllm.config import EngineArgs
from pocketllm.errors import ConfigurationError, RequestError, UnsupportedFeatureError
from pocketllm.llm import LLM
from pocketllm.logging_config import configure_logging
from pocketllm.outputs import CompletionOutput, RequestOutput
from pocketllm.sampling_params import SamplingParams

__version__ = "0.1.0"

configure_logging()


def get_tokenizer(path, chat_template: str | None = None):
    """A model directory or any GGUF file (vocabulary-only ones too) -> its tokenizer."""
    from pocketllm.tokenizer import get_tokenizer as _get

    return _get(path, chat_template=chat_template)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput",
           "ConfigurationError", "UnsupportedFeatureError", "RequestError", "get_tokenizer"]
