"""Hugging Face model directories against transformers' AutoTokenizer on the same directory."""

import json

import pytest
from fixtures import smollm2_reference
from transformers import AutoTokenizer

from pocketllm.errors import ConfigurationError
from pocketllm.tokenizer import get_tokenizer

TEXTS = [
    "Hello world",
    " Leading space, punctuation!? and contractions: I'm, you're, it's.",
    "import torch\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n        return x @ self.w  # matmul\n",
    "Numbers: 0 7 42 1234567 3.5e-10 ٣٤٥ ½",
    "whitespace   runs\t\t\ttabs\n\n\nnewlines \r\n ",
    "Ünïcödé: 日本語, 中文, 한국어, עברית, हिन्दी, emoji 🦙👩‍💻🏳️‍🌈",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json, chat_template.jinja),
    with a generation_config.json as models ship it."""
    directory = tmp_path_factory.mktemp("smollm2")
    smollm2_reference().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return directory


@pytest.fixture(scope="module")
def loaded(model_dir):
    return get_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(loaded, text):
    ours, reference = loaded
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip_special_tokens in (False, True):
        assert ours.decode(ids, skip_special_tokens) == reference.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_and_chat_template(loaded):
    ours, reference = loaded
    assert ours.vocab_size == len(reference)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert ours.eos_token_ids == {0, 2}  # eos_token, plus generation_config's list
    assert set(reference.all_special_ids) <= ours.all_special_ids
    assert ours.chat_template == reference.chat_template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def copy_tokenizer(model_dir, directory, **config_changes):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | config_changes))
    return directory


def test_tokenizer_json_decides_what_encode_adds(model_dir, tmp_path):
    # transformers 5 ignores tokenizer_config.json's add_bos_token/add_eos_token when tokenizer.json exists.
    directory = copy_tokenizer(model_dir, tmp_path, add_bos_token=True, add_eos_token=True)
    ours, reference = get_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text) == ours.encode(text, add_special_tokens=False)


def test_named_chat_templates_in_tokenizer_config(model_dir, tmp_path):
    # The older layout: templates listed in tokenizer_config.json; "tool_use" renders requests with tools.
    templates = [
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | tojson }}{{ bos_token }}{{ messages[-1].content }}"},
    ]
    directory = copy_tokenizer(model_dir, tmp_path, chat_template=templates)
    ours, reference = get_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        assert ours.apply_chat_template(messages, **kwargs) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    assert ours.apply_chat_template(messages, tools=tools).endswith("<|im_start|>Weather in Zürich?")


def test_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(ConfigurationError, match="tokenizer.json"):
        get_tokenizer(tmp_path)
