"""What one request may cost everyone else: its stop strings, stop token ids, bias entries and
penalties cost each step a bounded amount (capped on the server, kept as per-request state built
once); its sequences count against the queue and share one copy of the prompt; detokenization
stays linear whatever the model emits; a cache_salt keeps prefix-cache hits between requests of
the same salt; request ids cannot collide with a request's choices."""
from __future__ import annotations

import asyncio
import json
import random
import tracemalloc

import httpx
import openai
import pytest
import torch
from conftest import prompts_of
from fixtures import default_model_gguf
from live_server import Server
from reference import plain_penalties
from tiny_models import make_tiny_chat_model

from pocketllm.config import EngineArgs
from pocketllm.core.request import Request
from pocketllm.engine.detokenizer import IncrementalDetokenizer, StopStrings
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.errors import RequestError
from pocketllm.runner.draft_position import DraftPosition
from pocketllm.runner.sampler import apply_penalties
from pocketllm.sampling_params import SamplingParams
from pocketllm.server.async_llm import AsyncLLM, QueueFullError
from pocketllm.tokenizer.gguf_vocab import load_gguf_tokenizer

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(default_model_gguf())


# -- stop strings ----------------------------------------------------------------------------------
def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The plain definition: the earliest position where a stop string ends, the longest there."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text.endswith(s, 0, end)]
        if found:
            s = max(found, key=len)
            return end - len(s), s
    return None


def test_stop_strings_find_what_a_plain_scan_finds():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        assert StopStrings(stops).first_match(text, 0) == first_stop(text, stops), (text, stops)


def test_detokenized_stops_and_streamed_text_match_the_whole_decode(tokenizer):
    """Token by token, with stop strings that span tokens: the text is the whole decode cut at the
    first stop string, and what is streamed before the end is a prefix of it that never shrinks."""
    rng = random.Random(1)
    words = tokenizer.encode("the cat sat on the mat, and then the dog ran off.\n\nThe end", add_special_tokens=False)
    for case in range(200):
        ids = [rng.choice(words) for _ in range(40)]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stops = [whole[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(whole)), 3)] if case % 4 else ["never"]
        include = case % 2 == 1
        detok = IncrementalDetokenizer(tokenizer, [], StopStrings(stops), include, True)
        shown, hit = "", None
        for t in ids:
            hit = detok.add(t)
            if hit is not None:
                break
            now = detok.visible_text(False)
            assert now.startswith(shown)
            shown = now
        want = first_stop(whole, stops)
        if want is None:
            assert hit is None and detok.text == whole
        else:
            start, s = want
            assert hit == s and detok.text == whole[:start + len(s) if include else start]
        assert detok.visible_text(True).startswith(shown)


# -- detokenization stays linear -------------------------------------------------------------------
class CountingTokenizer:
    """The real tokenizer, counting the ids it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0
        self.skipped_ids = tokenizer.skipped_ids

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["special", "broken-utf8"])
def test_detokenizing_tokens_that_add_no_text_stays_linear(tokenizer, kind):
    """A stream of special tokens (skipped) or of lone UTF-8 continuation bytes (each decodes to
    U+FFFD) kept the window from moving, so every token decoded all of them again: quadratic."""
    if kind == "special":
        token = min(tokenizer.skipped_ids)
    else:
        token = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, hello, None, False, True)
    n = 2000
    for _ in range(n):
        detok.add(token)
    for t in hello:
        detok.add(t)
    assert counting.decoded < 40 * (n + len(hello)), counting.decoded  # quadratic: ~n * n
    assert detok.text.endswith(" hello")
    assert detok.text == tokenizer.decode([token] * n + hello, skip_special_tokens=True)


# -- penalties and bias: state kept between steps ---------------------------------------------------
def test_penalties_follow_the_output_step_after_step_and_at_draft_positions():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    req = Request("x", [1, 2, 3], SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2))
    for step in range(12):
        logits = torch.randn(1, vocab, generator=g)
        got = apply_penalties(logits, [req], vocab)[0]
        if step == 0:
            state = req.sampling_state
        assert req.sampling_state is state  # built once: each step adds its new tokens to the counts
        want = plain_penalties(logits[0].tolist(), [1, 2, 3], req.output_token_ids, 1.3, 0.5, 0.2)
        assert torch.allclose(got, torch.tensor(want), atol=1e-6), step
        drafts = [5, 5, 7]  # a speculative step: the rows after the first see the drafts before them
        for i in range(1, len(drafts) + 1):
            row = DraftPosition(req, drafts, i)
            got = apply_penalties(logits, [row], vocab)[0]
            want = plain_penalties(logits[0].tolist(), [1, 2, 3], req.output_token_ids + drafts[:i], 1.3, 0.5, 0.2)
            assert torch.allclose(got, torch.tensor(want), atol=1e-6), (step, i)
        for t in torch.randint(0, vocab, (step % 3 + 1,), generator=g).tolist():
            req.append_output_token(t)


# -- sequences in the queue --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineArgs(model=str(tiny_models["llama"][1]), dtype="float32", num_kv_blocks=256,
                                max_num_seqs=1))


def test_the_queue_counts_sequences_not_requests(engine):
    """One running request, then a request of n=3 waits: with a queue of 4, a request of n=2 no
    longer fits (3 + 2 > 4), however few requests wait."""
    prompt = {"prompt_token_ids": prompts_of([8], seed=3)[0]}
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine, max_queued_requests=4)
        running = llm.add_request("running", prompt, long)
        await anext(running)
        llm.add_request("three", prompt, SamplingParams(n=3, max_tokens=400, ignore_eos=True))
        with pytest.raises(QueueFullError):
            llm.add_request("two", prompt, SamplingParams(n=2, max_tokens=4))
        llm.add_request("one", prompt, SamplingParams(n=1, max_tokens=4))
        await llm.shutdown(timeout=0)

    asyncio.run(main())
    engine.check_no_leaks()


def test_choices_share_one_copy_of_the_prompt(engine):
    """n=128 choices of a 500-token prompt: their waiting sequences hold the prompt once (the
    copies were 128 x 2 lists of 500 ids, 1.2 MB)."""
    ids = prompts_of([500], seed=4)[0]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine.add_request("many", {"prompt_token_ids": ids}, SamplingParams(n=128, max_tokens=1))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    engine.abort_request("many")
    assert grown < 600_000, grown
    engine.check_no_leaks()


# -- request ids -------------------------------------------------------------------------------------
def test_request_ids_cannot_name_another_requests_choice(engine):
    params = SamplingParams(n=2, max_tokens=2, temperature=0)
    prompt = {"prompt_token_ids": prompts_of([6], seed=5)[0]}
    engine.add_request("x", prompt, params)
    with pytest.raises(RequestError, match="choices"):
        engine.add_request("x#0", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="non-empty string"):
        engine.add_request("", prompt, SamplingParams(max_tokens=2))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["x"].finished and len(outs["x"].outputs) == 2
    engine.check_no_leaks()


# -- cache_salt ----------------------------------------------------------------------------------------
def test_cache_salt_keeps_prefix_hits_within_a_salt(engine):
    ids = prompts_of([70], seed=6)[0]
    params = SamplingParams(max_tokens=1, temperature=0)

    def cached(salt: str | None) -> int:
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        rid = engine.add_request(None, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    result = out.num_cached_tokens
        return result

    assert cached(None) == 0
    assert cached(None) == 64
    assert cached("alice") == 0  # another user's prompt is not a hit
    assert cached("alice") == 64
    assert cached("bob") == 0
    with pytest.raises(RequestError, match="cache_salt"):
        engine.add_request(None, {"prompt_token_ids": ids, "cache_salt": 3}, params)
    engine.check_no_leaks()


# -- the server's limits -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    s = Server("--served-model-name", MODEL, "--max-stop-strings", "4", "--max-stop-token-ids", "4",
               "--max-logit-bias", "4", "--max-queued-requests", "8", model=model,
               engine_flags=["--max-model-len", "512", "--num-kv-blocks", "256"]).wait_ready()
    yield s
    s.stop()


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("param, value, flag", [
    ("stop", ["a", "b", "c", "d", "e"], "--max-stop-strings"),
    ("stop_token_ids", [1, 2, 3, 4, 5], "--max-stop-token-ids"),
    ("logit_bias", {str(i): 1.0 for i in range(5)}, "--max-logit-bias"),
])
def test_the_server_caps_what_every_step_pays_for(server, param, value, flag):
    r = post(server, {"prompt": "Hi", param: value})
    assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    ok = post(server, {"prompt": "Hi", param: value[:4] if isinstance(value, list) else dict(list(value.items())[:4])})
    assert ok.status_code == 200, ok.text


def test_the_server_refuses_more_sequences_than_its_queue(server):
    r = post(server, {"prompt": [[1, 2], [3, 4], [5, 6]], "n": 3})
    assert r.status_code == 400 and "9 sequences" in r.json()["error"]["message"], r.text
    r = post(server, {"prompt": "Hi", "n": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert post(server, {"prompt": [[1, 2], [3, 4]], "n": 4}).status_code == 200


def test_cache_salt_over_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = "Once upon a time " * 20

    def cached(**extra) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    assert cached(extra_body={"cache_salt": "tenant-a"}) == 0
    assert cached(extra_body={"cache_salt": "tenant-a"}) > 0
    assert cached(extra_body={"cache_salt": "tenant-b"}) == 0
    with pytest.raises(openai.BadRequestError):
        cached(extra_body={"cache_salt": ""})


def test_the_largest_bodies_are_checked_in_a_helper_process(server):
    """A body past SCREENED_BYTES is read in a helper process first: one of 80,000 token ids (a
    list that json.loads reads holding the interpreter lock, and with it the engine
    thread, for its whole call) is refused there, and never read by the server's own process; a large
    body within the limits is then served as any other."""
    import psutil

    from pocketllm.server.body_limits import SCREENED_BYTES

    def helpers() -> list[psutil.Process]:
        return [p for p in psutil.Process(server.proc.pid).children() if "multiprocessing" in " ".join(p.cmdline())]

    ids = [7, 300, 5000, 12] * 20_000
    assert len(json.dumps(ids)) > SCREENED_BYTES
    assert not helpers()
    r = post(server, {"prompt": ids})
    assert r.status_code == 400 and "maximum context length is 512" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"
    started = {p.pid for p in helpers()}
    assert started  # (with multiprocessing's resource tracker)
    r = post(server, {"prompt": "Hi", "stop": ["x" * 100] * 3000})
    assert r.status_code == 400 and "--max-stop-strings" in r.json()["error"]["message"], r.text
    ok = post(server, {"prompt": "Hi", "user": "u" * (SCREENED_BYTES + 1000)})
    assert ok.status_code == 200, ok.text
    assert {p.pid for p in helpers()} == started  # kept for the next one
