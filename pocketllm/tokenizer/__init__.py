"""Tokenizers for Hugging Face model directories and GGUF files, and chat-template rendering."""

import os
from pathlib import Path

from pocketllm.errors import ConfigurationError
from pocketllm.tokenizer.base import Tokenizer

__all__ = ["Tokenizer", "get_tokenizer", "has_chat_template"]


def get_tokenizer(path: str | os.PathLike, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory or of a GGUF file; `chat_template` replaces the model's."""
    # Imported here so that importing the package stays cheap.
    from pocketllm.tokenizer.gguf_vocab import load_gguf_tokenizer
    from pocketllm.tokenizer.hf import load_hf_tokenizer

    path = Path(path)
    if path.is_dir():
        tokenizer = load_hf_tokenizer(path)
    elif path.is_file() and _is_gguf(path):
        tokenizer = load_gguf_tokenizer(path)
    else:
        raise ConfigurationError(f"{path} is neither a model directory (with tokenizer.json) nor a GGUF file")
    if chat_template is not None:
        tokenizer.chat_templates = {"default": chat_template}
    return tokenizer


def has_chat_template(path: str | os.PathLike) -> bool | None:
    """Whether a model directory or GGUF file names a chat template, read from its metadata alone
    (no tokenizer built); None where `path` is neither."""
    from pocketllm.tokenizer.gguf_vocab import gguf_chat_templates
    from pocketllm.tokenizer.hf import dir_chat_templates

    path = Path(path)
    if path.is_dir():
        return bool(dir_chat_templates(path))
    if path.is_file() and _is_gguf(path):
        return bool(gguf_chat_templates(path))
    return None


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
