"""Tensor parallelism on the CPU (gloo): two ranks, each a process holding half of every layer,
give transformers' greedy tokens for every family, with chunked prefill and preemption, and the
top-5 logprobs of one rank at every position (within 1e-4); a GGUF file stays quantized and split at block boundaries;
shapes that do not split are refused before loading."""
from __future__ import annotations

import pytest

from conftest import prompts_of
from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs, ModelConfig
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.models.capabilities import RuntimeCapabilities, check_tensor_parallel
from reference import hf_greedy
from test_parity import LENGTHS, NEW, tight_blocks
from test_quantize import tokenizer_files  # noqa: F401  (a fixture)


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
    model, path = tiny
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
    from pocketllm.loaders.gguf_writer import write_gguf
    from test_quantize import with_tokenizer
    from tiny_models import make_llama256

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
