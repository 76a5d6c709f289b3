from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors; it is chosen when a kernel
    # is decorated, so before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import CONFIGS, make_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (transformers model, safetensors directory)."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_model(kind, root) for kind in CONFIGS}


@pytest.fixture(params=sorted(CONFIGS))
def tiny(request, tiny_models):
    return tiny_models[request.param]


def prompts_of(lengths, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
