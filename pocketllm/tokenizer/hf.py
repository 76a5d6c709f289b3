"""Tokenizers of Hugging Face model directories, set up as transformers (5.x) sets them up.

tokenizer.json alone decides what `encode(add_special_tokens=True)` adds: transformers 5 ignores
tokenizer_config.json's add_bos_token/add_eos_token when there is a tokenizer.json, and so do we.
"""

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from pocketllm.errors import ConfigurationError
from pocketllm.tokenizer.base import SPECIAL_TOKEN_NAMES, Tokenizer


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    if not (directory / "tokenizer.json").is_file():
        raise ConfigurationError(f"{directory} has no tokenizer.json (only fast, tokenizers-format tokenizers load)")
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    config = _read_json(directory / "tokenizer_config.json")
    special_tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    # transformers makes every named special token an added special token, so it is matched whole.
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text in special_tokens.values() if text not in known]
    )

    extra_eos_ids = set()
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")  # an id or a list of ids
        if eos is not None:
            extra_eos_ids.update(eos if isinstance(eos, list) else [eos])
    return Tokenizer(
        backend, special_tokens, extra_eos_ids=extra_eos_ids, chat_templates=_chat_templates(directory, config)
    )


def dir_chat_templates(directory: Path) -> dict[str, str]:
    return _chat_templates(directory, _read_json(directory / "tokenizer_config.json"))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: str | dict[str, Any]) -> str:
    # Older configs store a serialized AddedToken: {"content": "<s>", "lstrip": false, ...}.
    return value["content"] if isinstance(value, dict) else value


def _chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates as transformers finds them: `chat_template.jinja` and `additional_chat_templates/<name>.jinja`
    (what newer transformers saves) over tokenizer_config.json's "chat_template", a string or a list of
    {"name", "template"}."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        templates.update({entry["name"]: entry["template"] for entry in configured})
    for path in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return templates
