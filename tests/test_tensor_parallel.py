"""Tensor parallelism on the CPU (gloo): two ranks, each a process holding half of every layer,
give transformers' greedy tokens for every family, with chunked prefill and preemption, and the
top-5 logprobs of one rank at every position (within 1e-4); a GGUF file stays quantized and split at block boundaries;
shapes that do not split are refused before loading."""
from __future__ import annotations

import pytest
from conftest import prompts_of
from reference import hf_greedy
from test_parity import LENGTHS, NEW, tight_blocks
from test_quantize import tokenizer_files  # noqa: F401  (a fixture)

from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs, ModelConfig
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.models.capabilities import RuntimeCapabilities, check_tensor_parallel
from pocketllm.models.registry import select_runtime


def generate(path, prompts, **engine_args):
    """(token ids, each position's top-5 logprobs {token: logprob}, preemptions) of greedy generation;
    the engine shut down."""
    llm = LLM(str(path), dtype="float32", **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, sum(o.metrics["num_preemptions"] for o in outs)


def max_diff(a: list[list[dict]], b: list[list[dict]], same_top: bool = True) -> float:
    """The largest difference of the logprobs of the same tokens at the same positions; the two
    runs' top tokens must be the same ones (``same_top``), else the tokens both have count."""
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for pa, pb in zip(ra, rb, strict=True):
            assert pa.keys() == pb.keys() or not same_top, (pa, pb)
            worst = max([worst] + [abs(pa[t] - pb[t]) for t in pa.keys() & pb.keys()])
    return worst


def close(a, b, tol: float = 1e-4) -> bool:
    return max_diff(a, b) <= tol


def test_two_ranks_give_the_tokens_of_one_for_every_family(tiny):
    """Every family that declares tensor parallelism; the others refuse two ranks before loading."""
    model, path = tiny
    if not select_runtime(ModelConfig.from_hf_dir(path), EngineArgs(model=str(path)), "cpu",
                          "float32").capabilities.tensor_parallel:
        with pytest.raises(UnsupportedFeatureError, match="does not support tensor parallelism"):
            generate(path, [[1, 2, 3]], exact_kernels=True, tensor_parallel_size=2)
        return
    prompts = prompts_of(LENGTHS)
    expected = [hf_greedy(model, p, NEW) for p in prompts]
    one, lp_one, _ = generate(path, prompts, exact_kernels=True)
    assert one == expected
    # chunks of 16 tokens beside the decodes, and a cache small enough to preempt
    two, lp_two, preempted = generate(path, prompts, exact_kernels=True, tensor_parallel_size=2,
                                      max_num_batched_tokens=16, num_kv_blocks=tight_blocks(path), max_model_len=128)
    assert two == expected
    assert preempted > 0, "the small cache should force preemption"
    assert close(lp_one, lp_two)


def test_a_gguf_file_splits_at_block_boundaries(tmp_path, tokenizer_files):
    """Q8_0 (blocks of 32): each rank holds whole blocks of o_proj's and down_proj's input. The
    exact path gives one rank's tokens and logprobs (within 1e-4); the 8-bit-activation fast path
    its tokens, and logprobs no further from one rank's than the fast path is from the exact one
    (a rank rounds its share of the activations on its own). Q4_K_M (blocks of 256) would split
    them at 2 ranks, and is refused before loading."""
    from test_quantize import with_tokenizer
    from tiny_models import make_llama256

    from pocketllm.loaders.gguf_writer import write_gguf

    _, path = make_llama256(tmp_path)
    src = with_tokenizer(path, tokenizer_files, tmp_path / "src")
    q8 = write_gguf(src, tmp_path / "m.Q8_0.gguf", "Q8_0").path
    prompts = prompts_of([3, 40, 21], vocab=380)
    runs = {}
    for exact in (True, False):
        one, lp_one, _ = generate(q8, prompts, exact_kernels=exact)
        two, lp_two, _ = generate(q8, prompts, exact_kernels=exact, tensor_parallel_size=2, max_num_batched_tokens=16)
        assert two == one
        runs[exact] = lp_one, lp_two
    assert close(*runs[True])
    fast_vs_exact = max_diff(runs[False][0], runs[True][0], same_top=False)  # near-ties may swap 5th places
    assert max_diff(*runs[False], same_top=False) <= 2 * fast_vs_exact
    q4 = write_gguf(src, tmp_path / "m.Q4_K_M.gguf", "Q4_K_M").path
    with pytest.raises(UnsupportedFeatureError, match="splits Q4_K's blocks of 256"):
        LLM(str(q4), tensor_parallel_size=2)


def test_shapes_that_do_not_split_are_refused_before_loading(tiny_models):
    _, qwen2 = tiny_models["qwen2"]  # 6 query heads, 1 KV head
    with pytest.raises(UnsupportedFeatureError, match="does not divide the model's attention heads 6"):
        LLM(str(qwen2), tensor_parallel_size=4)
    cfg = ModelConfig.from_hf_dir(qwen2)
    check_tensor_parallel(cfg, 2, set(), RuntimeCapabilities(), "qwen2")  # 1 KV head: replicated on both ranks
    check_tensor_parallel(cfg, 3, set(), RuntimeCapabilities(), "qwen2")
    with pytest.raises(UnsupportedFeatureError, match="does not support tensor parallelism"):
        check_tensor_parallel(cfg, 2, set(), RuntimeCapabilities(tensor_parallel=False), "qwen2")
    with pytest.raises(ConfigurationError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(model=str(qwen2), tensor_parallel_size=0)
    with pytest.raises(ConfigurationError, match="rank r takes cuda:r"):
        EngineArgs(model=str(qwen2), tensor_parallel_size=2, device="cuda:1")
    with pytest.raises(ConfigurationError, match="a draft model runs with tensor_parallel_size 1 only"):
        EngineArgs(model=str(qwen2), tensor_parallel_size=2,
                   speculative_config={"model": str(qwen2), "num_speculative_tokens": 2})


def test_the_command_line_flag():
    import argparse

    from pocketllm.cli.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["llama3-8b", "--load-format", "dummy", "--tensor-parallel-size", "2"])
    assert engine_args_from(ns).tensor_parallel_size == 2


def test_a_server_of_three_ranks_answers_as_one(tmp_path):
    """The default model (9 query and 3 KV heads, Q4_1) served by three ranks: the official client
    gets the completion the one-rank offline engine gives, and SIGTERM ends every rank."""
    import openai
    import psutil
    from fixtures import default_model_gguf
    from live_server import Server

    prompt, n = "The three primary colours are", 16
    llm = LLM(str(default_model_gguf()), exact_kernels=True, kv_cache_memory=64 << 20)
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0].text
    server = Server("--tensor-parallel-size", "3").wait_ready()
    try:
        ranks = psutil.Process(server.proc.pid).children(recursive=True)
        ranks = [p for p in ranks if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=n,
                                        temperature=0)
        assert got.choices[0].text == expected
    finally:
        assert server.stop() == 0, server.output()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)


def test_a_step_failing_after_the_ranks_began_it_ends_the_engine(tiny_models):
    """The other ranks are inside that step's collectives for good: the engine is dead (a clear
    error, not a hang), its ranks are ended, and a new engine starts in the same process."""
    from pocketllm.errors import EngineDeadError

    _, path = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    ranks = list(llm.engine.ranks.procs)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    llm.engine.runner.model.forward = broken
    with pytest.raises(EngineDeadError, match="a tensor-parallel step failed after its ranks began it"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    llm.shutdown()
    assert not any(p.is_alive() for p in ranks)
    tokens, _, _ = generate(path, [[1, 2, 3]], tensor_parallel_size=2)
    assert len(tokens[0]) == NEW


# -- a rank that dies ------------------------------------------------------------------------------
def rank_processes(pid: int) -> list:
    """The tensor-parallel ranks that process `pid` spawned (psutil processes)."""
    import psutil

    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_a_rank_killed_mid_generation_is_named_and_the_others_end(tiny_models):
    """Three ranks; rank 1 killed (as the out-of-memory killer does) while the engine generates: the
    engine dies with an error naming the rank and its signal, not a collective's timeout, and rank 2
    is ended without waiting for shutdown."""
    import os
    import signal
    import threading
    import time

    from pocketllm.errors import EngineDeadError

    _, path = tiny_models["qwen2"]  # 6 query heads, 1 KV head: three ranks
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=3)
    try:
        rank1, rank2 = llm.engine.ranks.procs
        threading.Timer(1.0, os.kill, (rank1.pid, signal.SIGKILL)).start()
        params = SamplingParams(max_tokens=480, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"tensor-parallel rank 1 \(pid {rank1.pid}\) was killed by SIGKILL"):
            for _ in range(100):  # (long enough for the kill on any machine)
                llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params)
        assert time.monotonic() - t0 < 60
        # Polled, not joined: the watchdog's thread reaps it, and a join racing that reap can return
        # while is_alive() still reads True for an instant.
        deadline = time.monotonic() + 10
        while rank2.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not rank2.is_alive()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("when", ["idle", "mid-stream"])
def test_a_rank_that_dies_makes_the_server_exit_within_seconds(tmp_path, when):
    """A served engine's rank killed, while the server is idle or streams a completion: within seconds
    the stream ends with an error event and the process exits 1 (for a supervisor to restart it), its
    log naming the rank. An idle server used to stay up with /health 200, its engine unusable."""
    import json
    import threading

    import httpx
    from live_server import Server
    from tiny_models import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path)  # 2 query heads, 1 KV head
    server = Server("--tensor-parallel-size", "2", "--served-model-name", "tiny", model=model,
                    engine_flags=["--max-model-len", "4096", "--num-kv-blocks", "1024"]).wait_ready()
    try:
        (rank,) = rank_processes(server.proc.pid)
        events, streaming = [], threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()

        reader = threading.Thread(target=stream, daemon=True)
        if when == "mid-stream":
            reader.start()
            assert streaming.wait(60), server.output()
        rank.kill()
        assert server.proc.wait(timeout=30) == 1, server.output()
        assert f"tensor-parallel rank 1 (pid {rank.pid}) was killed by SIGKILL" in server.output()
        if when == "mid-stream":
            reader.join(30)
            assert not reader.is_alive()
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error", events[-3:]
    finally:
        if server.alive():
            server.proc.kill()
            server.proc.wait()


def test_a_rank_that_dies_at_start_up_is_an_error_within_seconds(tiny_models):
    """Rank 1 killed as soon as it is spawned, before it joins the group: the engine's constructor
    names it within seconds, not after torch's rendezvous timeout (30 minutes on gloo); a new
    engine then starts in the same process."""
    import threading
    import time

    import psutil

    _, path = tiny_models["llama"]
    before = {p.pid for p in rank_processes(psutil.Process().pid)}
    killed = []

    def kill_the_rank() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for p in rank_processes(psutil.Process().pid):
                if p.pid not in before:
                    p.kill()
                    killed.append(p.pid)
            time.sleep(0.005)

    errors = []

    def build() -> None:
        try:
            LLM(str(path), dtype="float32", tensor_parallel_size=2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threading.Thread(target=kill_the_rank, daemon=True).start()
    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    builder.join(60)
    assert not builder.is_alive(), "the engine waited for a rank that had died"
    assert killed and len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert f"tensor-parallel rank 1 (pid {killed[0]}) was killed by SIGKILL" in str(errors[0])
    assert "before joining the tensor-parallel group" in str(errors[0])
    tokens, _, _ = generate(path, [[1, 2, 3]], tensor_parallel_size=2)
    assert len(tokens[0]) == NEW


def test_idle_ranks_wait_past_the_rendezvous_timeout(tiny_models, monkeypatch):
    """The rendezvous's short timeout is not the steps': ranks that waited longer than it for the
    next step (an idle engine) still run it."""
    import time

    from pocketllm.runner import tp_ranks as workers

    monkeypatch.setattr(workers, "RENDEZVOUS_TIMEOUT", 10.0)
    _, path = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        time.sleep(12)  # rank 1 waits in a broadcast for the next step
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
