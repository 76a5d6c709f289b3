from __future__ import annotations

import pytest
import torch

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
