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


def read_adapter(name: str, path: str | Path, model: torch.nn.Module, max_rank: int) -> LoRAAdapter:
    """A PEFT directory, or a GGUF file of llama.cpp's LoRA format."""
    if str(path).endswith(".gguf"):
        return read_gguf_adapter(name, path, model, max_rank)
    return read_peft_adapter(name, path, model, max_rank)


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
    return _assemble(where, name, path, model, rank, scaling, halves)


def read_gguf_adapter(name: str, path: str | Path, model: torch.nn.Module, max_rank: int) -> LoRAAdapter:
    """A LoRA adapter as llama.cpp's convert_lora_to_gguf.py writes it (general.type "adapter", its
    tensors `blk.N.<tensor>.weight.lora_a` [rank, in] and `.lora_b` [out, rank], Q and K rows in
    llama.cpp's rotary order for llama), refused as `read_peft_adapter` refuses."""
    import numpy as np
    from gguf.quants import dequantize

    from pocketllm.gguf_file import GGUFFile
    from pocketllm.loaders.gguf_loader import block_prefix, layer_names, unpermute_rows

    where = f"LoRA adapter {name!r} ({path})"
    f = GGUFFile(str(path))
    meta = {k: field.contents() for k, field in f.fields.items()}
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ConfigurationError(f"{where}: not a GGUF LoRA adapter (general.type {meta.get('general.type')!r}, "
                                 f"adapter.type {meta.get('adapter.type')!r})")
    arch, alpha = meta.get("general.architecture"), float(meta.get("adapter.lora.alpha") or 0.0)
    table = layer_names(arch)
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    rank = 0
    for t in f.tensors:
        m = re.match(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$", t.name)
        if m is None or m.group(2) not in table:
            raise ConfigurationError(f"{where}: unexpected tensor {t.name!r}")
        shape = tuple(int(x) for x in reversed(t.shape))
        data = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        stem, half = m.group(2), m.group(3).upper()
        if arch == "llama" and stem in ("attn_q", "attn_k") and half == "B":  # (its output rows, as the weight's)
            cfg = model.cfg
            data = unpermute_rows(data, cfg.num_heads if stem == "attn_q" else cfg.num_kv_heads)
        parent, _, leaf = f"{block_prefix(arch).format(m.group(1))}.{table[stem]}".rpartition(".")
        halves.setdefault((parent, leaf), {})[half] = torch.from_numpy(np.ascontiguousarray(data)).float()
        rank = max(rank, shape[0] if half == "A" else shape[1])
    if rank > max_rank:
        raise ConfigurationError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    # llama.cpp's scale: alpha / rank, or 1 where the file has no alpha
    return _assemble(where, name, path, model, rank, alpha / rank if alpha else 1.0, halves)


def _assemble(where: str, name: str, path, model: torch.nn.Module, rank: int, scaling: float,
              halves: dict[tuple[str, str], dict[str, torch.Tensor]]) -> LoRAAdapter:
    """The adapter's (A, B) pairs by module (its `parent` path and checkpoint `leaf` name), checked
    against the model's layers."""
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
        outs, ins = layer.checkpoint_shape
        if tuple(a.shape) != (rank, ins) or tuple(b.shape) != (outs[part], rank):
            raise ConfigurationError(f"{where}: {parent}.{leaf} is [{', '.join(map(str, b.shape))}] x "
                                     f"[{', '.join(map(str, a.shape))}], the model's layer takes "
                                     f"[{outs[part]}, {rank}] x [{rank}, {ins}]: an adapter of another base model")
        # tensor parallelism: this rank's share, as its layer's weight is shared (B's rows, or A's columns)
        if layer.rows:
            lo, n = layer.rows[part]
            b = b[lo:lo + n]
        if layer.cols:
            lo, n = layer.cols
            a = a[:, lo:lo + n]
        weights.setdefault(ours, []).append((part, a.float(), b.float() * scaling))
    if not weights:
        raise ConfigurationError(f"{where}: the adapter holds no LoRA weights")
    return LoRAAdapter(name, str(path), rank, weights)
