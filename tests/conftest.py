from __future__ import annotations

import os

import pytest

# xdist workers that together fill the cores get one OpenMP team's share each, and so do the
# servers they start (they inherit the variable). Teams of the cores' size in every worker spin
# against each other: on 2 cores the suite took 857 s that way against 401-436 s with one thread a
# worker, and a server's 4.8 s request once ran past its client's 120 s timeout
# (benchmarks/results/cpu-test-suite-threads.txt). Set before torch is imported, which reads it
# once. Other thread counts are tested in test_cpu_threads.py.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors; it is chosen when a kernel
    # is decorated, so before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import CONFIGS, make_model  # noqa: E402  (after TRITON_INTERPRET is set)

# The files that take most of the suite's time (the Triton interpreter, servers and ranks started
# per test, fuzzers), the longest first: `pytest -m "not slow"` leaves them out, a run of about five
# minutes on two cores instead of fifteen. CI runs everything, and these first (with xdist's
# --no-loadscope-reorder, pytest.ini), so that no long file starts last while the other worker idles.
SLOW_FILES = ("test_triton_gguf.py", "test_tensor_parallel.py", "test_triton_kernels.py", "test_structured_server.py",
              "test_structured_fuzz.py", "test_fuzz.py", "test_robustness.py", "test_sliding_window_kv.py",
              "test_speculative.py", "test_expert_offload.py", "test_kv_cache_dtype.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    for item in items:
        if item.path.name in first:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (transformers model, safetensors directory), each made when first asked for (a worker makes
    only the ones its tests use; one that cannot be made fails only those)."""
    root = tmp_path_factory.mktemp("tiny")

    class Made(dict):
        def __missing__(self, kind):
            self[kind] = made = make_model(kind, root)
            return made

    return Made()


@pytest.fixture(params=sorted(CONFIGS))
def tiny(request, tiny_models):
    return tiny_models[request.param]


def prompts_of(lengths, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
