"""LoRA adapters as PEFT saves them (`adapter_config.json` and `adapter_model.safetensors`), read and
checked against the model they will run on before any of them runs."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pocketllm.errors import ConfigurationError

# The projections an adapter may target: the attention's and the dense MLP's (not experts, the
# embedding or the output layer)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(.+)\.([A-Za-z_]+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # our module path -> [(part of the fused layer, A [rank, in], B [out, rank] with the scaling folded in)]
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's Linear layers an adapter may target, by module path: each decoder layer's attention and
    dense MLP projections (fused as the model fuses them)."""
    from pocketllm.layers.linear import Linear

    ours = {model.packed_modules.get(t, (t,))[0] for t in TARGETS}
    pattern = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)$")
    return {path: m for path, m in model.named_modules()
            if isinstance(m, Linear) and (hit := pattern.match(path)) and hit.group(2) in ours}


def read_peft_adapter(name: str, path: str | Path, model: torch.nn.Module, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for `model`, refused with a one-line reason where it cannot run there: a rank
    above `max_rank`, a module the model has no adapter slots for, or shapes of another base model."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigurationError(f"{where}: no adapter_config.json (a PEFT LoRA directory is expected)")
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigurationError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank > max_rank:
        raise ConfigurationError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole trained modules)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"), ("alpha_pattern", "per-module alphas")):
        if cfg.get(key):
            raise ConfigurationError(f"{where}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigurationError(f"{where}: trained biases (bias={cfg['bias']!r}) are not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(t for t in targets if t not in TARGETS)
    if unsupported:
        raise ConfigurationError(f"{where}: target modules {unsupported} are not supported; adapters may target "
                                 f"{', '.join(TARGETS)}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensor_file = path / "adapter_model.safetensors"
    if not tensor_file.is_file():
        raise ConfigurationError(f"{where}: no adapter_model.safetensors")
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(tensor_file)).items():
        m = _TENSOR.match(key)
        if m is None:
            raise ConfigurationError(f"{where}: unexpected tensor {key!r}")
        halves.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = tensor
    layers = lora_layers(model)
    weights: dict[str, list] = {}
    for (parent, leaf), ab in sorted(halves.items()):
        fused, part = model.packed_modules.get(leaf, (leaf, 0))
        ours = f"{parent}.{fused}"
        layer = layers.get(ours)
        if layer is None:
            raise ConfigurationError(f"{where}: {parent}.{leaf} is no projection of this model an adapter may "
                                     f"target (another base model?)")
        if set(ab) != {"A", "B"}:
            raise ConfigurationError(f"{where}: {parent}.{leaf} has lora_{''.join(ab)} alone")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (rank, layer.in_features), (layer.out_sizes[part], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ConfigurationError(f"{where}: {parent}.{leaf} is [{', '.join(map(str, b.shape))}] x "
                                     f"[{', '.join(map(str, a.shape))}], the model's layer takes "
                                     f"[{want_b[0]}, {rank}] x [{rank}, {want_a[1]}]: an adapter of another base model")
        weights.setdefault(ours, []).append((part, a.float(), b.float() * scaling))
    if not weights:
        raise ConfigurationError(f"{where}: the adapter holds no LoRA weights")
    return LoRAAdapter(name, str(path), rank, weights)
