"""The Prometheus metrics of the server, read back from /metrics, on a tiny random-weight model
(token-id prompts): request counts, aborts, preemptions, token and step histograms."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from conftest import prompts_of
from live_server import in_process
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_model

from pocketllm import SamplingParams
from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig
from pocketllm.server.metrics import ServerMetrics

MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_model("qwen3", tmp_path_factory.mktemp("tiny-metrics"))[1]


def engine_of(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), dtype="float32", **kwargs))


class Metrics:
    """One scrape: `m(name, **labels)` sums the samples `pocketllm:name` with those labels."""

    def __init__(self, text: str):
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def __call__(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples if s.name == f"pocketllm:{name}"
                   and all(s.labels.get(k) == v for k, v in labels.items()))


@contextlib.contextmanager
def serving(engine: LLMEngine):
    """The server on `engine`, in a thread of this process."""
    with in_process(create_app(AsyncLLM(engine), ServerConfig(model_name=MODEL))) as url:
        yield url
    engine.check_no_leaks()


def scrape(url: str) -> Metrics:
    return Metrics(httpx.get(f"{url}/metrics").text)


def wait_until(url: str, cond, timeout: float = 10.0) -> Metrics:
    deadline = time.monotonic() + timeout
    while not cond(m := scrape(url)):
        assert time.monotonic() < deadline, "the server did not reach the expected state"
        time.sleep(0.02)
    return m


def test_each_request_counts_once_and_histograms_match_usage(tiny_qwen3):
    # No prefix caching, a cache that never runs out and no step launched ahead (which may decode a
    # token past a stop): every prompt token is computed once per sequence, and every generated
    # token but each sequence's last once as a decode.
    engine = engine_of(tiny_qwen3, enable_prefix_caching=False, num_kv_blocks=256, max_num_seqs=8,
                       async_scheduling=False)
    p20, p13, p7, p9 = prompts_of([20, 13, 7, 9], seed=3)
    base = {"model": MODEL, "ignore_eos": True, "return_token_ids": True}
    with serving(engine) as url:
        url_c = f"{url}/v1/completions"
        greedy = httpx.post(url_c, json={**base, "prompt": p9, "max_tokens": 4, "temperature": 0}, timeout=60).json()
        bodies = [
            {**base, "prompt": p20, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 5},
            {**base, "prompt": [p13, p7], "max_tokens": 3, "temperature": 0},  # two engine requests
            {**base, "prompt": p9, "max_tokens": 8, "temperature": 0,
             "stop_token_ids": [greedy["choices"][0]["token_ids"][-1]]},  # ends with "stop"
        ]
        # (n, number of prompts, response)
        responses = [(1, 1, greedy)] + [(b.get("n", 1), 2 if b["prompt"] == [p13, p7] else 1,
                                         httpx.post(url_c, json=b, timeout=60).json()) for b in bodies]
        with httpx.stream("POST", url_c, timeout=60,
                          json={**base, "prompt": p7, "max_tokens": 5, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        responses.append((1, 1, {"usage": events[-1]["usage"], "choices": [e["choices"][0] for e in events[:-1]]}))
        m = wait_until(url, lambda m: m("num_requests_running") == 0)

    # One engine request per prompt, counted with its first choice's reason.
    reasons: dict[str, int] = {}
    num_requests = prompt_tokens = completion_tokens = computed = 0
    for n, num_prompts, resp in responses:
        num_requests += num_prompts
        ended = [c for c in resp["choices"] if c["finish_reason"] is not None]
        assert len(ended) == n * num_prompts
        for c in ended:
            if c["index"] % n == 0:
                reasons[c["finish_reason"]] = reasons.get(c["finish_reason"], 0) + 1
        usage = resp["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        computed += n * usage["prompt_tokens"] + usage["completion_tokens"] - n * num_prompts
    assert num_requests == 6 and reasons == {"length": 5, "stop": 1}

    assert m("request_success_total") == num_requests
    for reason, count in reasons.items():
        assert m("request_success_total", finished_reason=reason, model_name=MODEL) == count
    assert m("e2e_request_latency_seconds_count") == num_requests
    assert m("prompt_tokens_total") == prompt_tokens and m("generation_tokens_total") == completion_tokens
    assert m("request_prompt_tokens_count") == num_requests and m("request_prompt_tokens_sum") == prompt_tokens
    assert m("request_generation_tokens_count") == num_requests
    assert m("request_generation_tokens_sum") == completion_tokens
    # vLLM's 1-2-5 buckets up to max_model_len (512)
    assert [s.labels["le"] for s in m.samples if s.name == "pocketllm:request_prompt_tokens_bucket"] == \
        ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
    assert m("request_prompt_tokens_bucket", le="10.0") == 4  # the prompts of 9, 7, 9 and 7 tokens
    for name in ("prefill", "decode", "inference"):
        assert m(f"request_{name}_time_seconds_count") == num_requests
    # inference = prefill + decode, request by request (up to the clamping of a same-step finish)
    assert m("request_inference_time_seconds_sum") == pytest.approx(
        m("request_prefill_time_seconds_sum") + m("request_decode_time_seconds_sum"), abs=0.05)
    assert m("request_inference_time_seconds_sum") > 0
    assert m("num_preemptions_total", model_name=MODEL) == 0
    # One observation per engine step: its tokens, all of them computed once here.
    steps = m("iteration_tokens_total_count")
    assert m("iteration_tokens_total_sum") == computed
    assert m("iteration_tokens_total_bucket", le="+Inf") == steps
    assert steps > 0
    les = [s.labels["le"] for s in m.samples if s.name == "pocketllm:iteration_tokens_total_bucket"]
    assert les[-2:] == ["256.0", "+Inf"]  # cut at max_num_batched_tokens (256 on the CPU)
    counts = [m("iteration_tokens_total_bucket", le=le) for le in les]
    assert counts == sorted(counts)  # cumulative


def test_abort_before_the_first_token_counts_as_abort(tiny_qwen3):
    engine = engine_of(tiny_qwen3, max_num_seqs=1, num_kv_blocks=64)
    step = engine.step

    def slow_step():  # the running request must outlast the waiting one's short life
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    p20, p11 = prompts_of([20, 11], seed=4)
    body = {"model": MODEL, "max_tokens": 480, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    with serving(engine) as url:
        url_c = f"{url}/v1/completions"
        with httpx.stream("POST", url_c, json={**body, "prompt": p20, "stream": True}, timeout=60) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it has tokens
            # Queued behind it; the client gives up before it starts.
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url_c, json={**body, "prompt": p11}, timeout=httpx.Timeout(60, read=0.5))
            m = wait_until(url, lambda m: m("num_requests_waiting") == 0)
            assert m("num_requests_running") == 1
            assert m("request_success_total", finished_reason="abort") == 1  # the waiting one
        # The running one is aborted too, after its first tokens.
        m = wait_until(url, lambda m: m("num_requests_running") == 0 and m("kv_cache_usage_perc") == 0)
    assert m("request_success_total", finished_reason="abort", model_name=MODEL) == 2
    assert m("request_success_total") == 2
    assert m("e2e_request_latency_seconds_count") == 0  # nothing finished
    assert m("request_prompt_tokens_count") == 0 and m("request_prefill_time_seconds_count") == 0
    assert m("prompt_tokens_total") == 20  # only the running one had output


def test_preemptions_are_counted(tiny_qwen3):
    # 12 blocks of 16 tokens for four sequences growing to 120 tokens (8 blocks) each.
    engine = engine_of(tiny_qwen3, max_model_len=128, num_kv_blocks=12, max_num_seqs=4,
                       enable_prefix_caching=False)
    prompts = prompts_of([20, 21, 22, 23], seed=5)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine)
        metrics = ServerMetrics(llm, MODEL)

        async def run(i):
            outs = [o async for o in llm.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}")]
            return outs[-1]

        finals = await asyncio.gather(*(run(i) for i in range(4)))
        await llm.shutdown()
        return finals, Metrics(metrics.render().decode())

    finals, m = asyncio.run(main())
    engine.check_no_leaks()
    assert all(o.finished and len(o.outputs[0].token_ids) == 100 for o in finals)
    preemptions = sum(o.metrics["num_preemptions"] for o in finals)
    assert preemptions > 0, "the small cache should force preemption"
    assert m("num_preemptions_total", model_name=MODEL) == preemptions
    # A preempted sequence recomputes what it had computed: at least one token each time.
    computed_once = sum(len(p) + 100 - 1 for p in prompts)
    assert m("iteration_tokens_total_sum") >= computed_once + preemptions
