"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file
(dequantized to float32)."""
from __future__ import annotations

import pytest
import torch
from fixtures import default_model_gguf
from reference import captured_logits, hf_greedy, hf_last_logits

from pocketllm import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Now three more, and explain how you found them."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_gguf()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(str(gguf_path), exact_kernels=True)  # compared with transformers


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
            for m in CHATS]


def test_last_position_logits_close_to_transformers(llm, hf_model, chat_prompts):
    with captured_logits(llm) as captured:
        for ids in chat_prompts:
            llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    for ids, ours in zip(chat_prompts, captured):
        ref = hf_last_logits(hf_model, ids)
        # Same dequantized weights, float32 both sides: only summation order differs.
        assert float((ours[0] - ref).abs().max()) < 2e-3 * float(ref.abs().max())
        assert int(ours[0].argmax()) == int(ref.argmax())


def test_greedy_chat_continuations_match_transformers(llm, hf_model, chat_prompts):
    ours = llm.generate([{"prompt_token_ids": ids} for ids in chat_prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for ids, out in zip(chat_prompts, ours):
        # pad_token_id equals <|im_end|>, which the prompt contains: hf_greedy passes an all-ones mask.
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 32, hf_model.config.pad_token_id)
    llm.engine.check_no_leaks()


def test_chat_answer_is_sensible_text(llm, chat_prompts):
    out = llm.generate({"prompt_token_ids": chat_prompts[0]}, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn
