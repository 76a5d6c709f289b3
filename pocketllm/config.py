"""One configuration object for the engine (`EngineArgs`) and the parsed model shape (`ModelConfig`).

Everything here is checked before any weight is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pocketllm.core.hub_name import HubName
from pocketllm.errors import ConfigurationError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # what the KV cache holds: pocketllm.core.kv_dtype
TASKS = ("auto", "generate", "embed")


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory or .gguf file; None = the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides memory-based sizing
    kv_cache_memory: int = 1 << 30  # bytes of KV cache on CPU
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8: 8-bit values, a scale per token and head
    # CPU: write the KV cache's memory at start, so that the process holds all it will use from the
    # first request on (and fails then, not mid-request, where memory is short); off: pages are
    # taken as blocks are first used. `pocketllm serve` turns it on. (CUDA memory is always held.)
    reserve_kv_cache: bool = False
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    # Most tokens one step computes; None: 2048 on a GPU, 256 on the CPU, where prefill throughput
    # hardly depends on the chunk's size past that.
    max_num_batched_tokens: int | None = None
    # Most prompt tokens in a step that also decodes (chunked prefill); None: no more than the step's
    # own limit on a GPU, 64 on the CPU, where a step's time grows with its tokens (about 2 ms a token
    # for the default model on 2 cores) and every decoding stream waits for the step.
    max_prefill_tokens_with_decodes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    enforce_eager: bool = False
    # Schedule and launch the next step while the GPU runs the last one; None: on for CUDA, off on
    # CPU (where the host is the device, so nothing overlaps). See docs/performance/gpu-engine.md.
    async_scheduling: bool | None = None
    dequantize_at_load: bool = False  # GGUF blocks and FP8 weights: trade memory for speed
    # CPU: False (the fast path) takes integer dot products over activations quantized to 8 bits
    # for GGUF weights and fused C kernels between the matmuls (float32; not bit-identical to
    # torch's ops); True multiplies exactly dequantized weights in float32 with torch's ops
    # between (token-identical to transformers on the same weights).
    exact_kernels: bool = False
    load_format: str = "auto"  # auto | dummy (random weights; `model` may name a shape, e.g. llama3-8b)
    tokenizer: str | None = None  # defaults to the model's own
    num_threads: int | None = None  # CPU threads for torch; None = torch's default
    # vLLM's speculative_config, as a dict or its JSON text: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    speculative_config: str | dict | None = None
    # GPU: the experts of the first N mixture-of-experts layers ("all": every one) held in host memory and
    # computed there by the CPU's kernels (llama.cpp's --n-cpu-moe), the rest of the model on the GPU
    cpu_offload_experts: str | None = None
    # How offloaded experts run: "compute" (on the CPU, as above) or "copy" (to the GPU as steps select them,
    # into `expert_cache_slots` slots a layer holding the most selected; None: 4 x the experts a token takes)
    expert_offload: str = "compute"
    expert_cache_slots: int | None = None
    # generate | embed (requests are pooled into vectors: /v1/embeddings); auto: embed for an embedding
    # model (an encoder, sentence-transformers files, a GGUF's pooling_type), generate otherwise
    task: str = "auto"
    # ranks of one engine, each holding a shard of every layer (vLLM's name); on CUDA one GPU each,
    # on the CPU processes sharing the cores (gloo)
    tensor_parallel_size: int = 1
    # LoRA adapters, vLLM's names: slots for `max_loras` adapters at once (of rank <= `max_lora_rank`) on the
    # projections adapters may target; `lora_modules` ["name=path", ...] (PEFT directories) loaded at start;
    # `max_cpu_loras` adapters kept read in host memory (None: max_loras). A request names its adapter.
    enable_lora: bool = False
    lora_modules: list[str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def resolve_step_tokens(self, device_type: str) -> None:
        """The platform's step sizes where none was given (before anything reads them)."""
        cpu = device_type == "cpu"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 256 if cpu else 2048
        if self.max_prefill_tokens_with_decodes is None:
            self.max_prefill_tokens_with_decodes = 64 if cpu else self.max_num_batched_tokens
        self.validate()

    @property
    def lora_paths(self) -> dict[str, str]:
        """`lora_modules` as name -> path."""
        items = self.lora_modules or []
        return dict(item.split("=", 1) if "=" in item else ("", item) for item in items)

    @property
    def expert_cache(self) -> int | None:
        """Offloaded experts copied to the device: its slots a layer (0: the default); None: computed on the CPU."""
        return None if self.expert_offload == "compute" else self.expert_cache_slots or 0

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigurationError(msg)

        need(self.dtype in _DTYPES, f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda; got {self.device!r}")
        need(isinstance(self.block_size, int) and self.block_size > 0 and self.block_size % 8 == 0
             and self.block_size <= 256,
             f"block_size must be a multiple of 8 in [8, 256]; got {self.block_size}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        need(self.max_prefill_tokens_with_decodes is None or self.max_prefill_tokens_with_decodes >= 1,
             f"max_prefill_tokens_with_decodes must be >= 1; got {self.max_prefill_tokens_with_decodes}")
        need(self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be >= 1; got {self.max_model_len}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        need(self.cpu_offload_experts is None or self.cpu_offload_experts == "all"
             or str(self.cpu_offload_experts).isdigit(),
             f"cpu_offload_experts must be a number of layers or 'all'; got {self.cpu_offload_experts!r}")
        need(self.expert_offload in ("compute", "copy"),
             f"expert_offload must be compute or copy; got {self.expert_offload!r}")
        need(self.expert_cache_slots is None or self.expert_cache_slots >= 1,
             f"expert_cache_slots must be >= 1; got {self.expert_cache_slots}")
        need(self.expert_offload == "compute" and self.expert_cache_slots is None or self.cpu_offload_experts,
             "expert_offload copy and expert_cache_slots are for experts offloaded with cpu_offload_experts")
        need(self.task in TASKS, f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        need(self.kv_cache_memory > 0, f"kv_cache_memory must be > 0 bytes; got {self.kv_cache_memory}")
        need(0 < self.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        need(self.num_threads is None or self.num_threads >= 1,
             f"num_threads must be >= 1; got {self.num_threads}")
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be an integer >= 1; got {self.tensor_parallel_size!r}")
        need(self.tensor_parallel_size == 1 or not self.device.startswith("cuda:"),
             f"device {self.device!r} names one GPU; with tensor_parallel_size {self.tensor_parallel_size} rank r "
             "takes cuda:r (choose the GPUs with CUDA_VISIBLE_DEVICES)")
        need(self.load_format in ("auto", "dummy"), f"load_format must be auto or dummy; got {self.load_format!r}")
        if self.model is not None and not (self.load_format == "dummy" and self._named_shape()):
            need(os.path.exists(self.model) or HubName.parse(self.model) is not None,
                 f"model path {self.model!r} does not exist; give a Hugging Face model directory, a .gguf file "
                 "or a name on the hub (org/name[@revision][:QUANT])")
        need(self.enable_lora or not self.lora_modules, "lora_modules needs enable_lora")
        need(isinstance(self.max_loras, int) and self.max_loras >= 1, f"max_loras must be >= 1; got {self.max_loras!r}")
        need(isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
             f"max_lora_rank must be >= 1; got {self.max_lora_rank!r}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        for name, path in self.lora_paths.items():
            need(bool(name) and (os.path.isdir(path) or path.endswith(".gguf") and os.path.isfile(path)),
                 f"lora_modules: {name}={path}: give name=path, a PEFT adapter directory or a GGUF LoRA file")
        spec = self.speculative  # parsed here so that a bad one fails before loading
        need(spec is None or spec.model is None or self.tensor_parallel_size == 1,
             "speculative_config: a draft model runs with tensor_parallel_size 1 only (n-gram speculation works with any)")
        if spec is not None and spec.model is not None and not (self.load_format == "dummy" and self._named_shape(spec.model)):
            need(os.path.exists(spec.model) or HubName.parse(spec.model) is not None,
                 f"speculative_config: the draft model {spec.model!r} does not exist; give a Hugging Face model "
                 "directory, a .gguf file or a name on the hub")
        if not self.enable_chunked_prefill and None not in (self.max_model_len, self.max_num_batched_tokens):
            need(self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill, max_num_batched_tokens "
                 f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")

    def _named_shape(self, model: str | None = None) -> bool:
        from pocketllm.core.shapes import SHAPES
        return (model or self.model) in SHAPES

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigurationError(
                f"unknown engine argument(s) {unknown}; valid ones are {sorted(names)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM configures it.

    - "ngram" (prompt lookup): the next `num_speculative_tokens` tokens are proposed by finding the
      sequence's last n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max],
      earlier in its prompt and output, and copying what followed them.
    - "draft_model" (given by `model`): a smaller model of the same vocabulary (a lower-bit GGUF
      of the target itself, say) proposes its greedy continuation.
    - "mtp": the checkpoint's own next-token-prediction layer (DeepSeek-V3's) proposes from the
      model's hidden states; `num_speculative_tokens` defaults to 1 (a longer chain reuses the layer).

    `row_invariant` (CUDA, off by default): a row computes the same bits at any number of rows in its
    step, so that drafts are verified with the bits plain decoding computes however many rows the
    steps hold (cuBLAS changes kernel for `o` and `down` from 64 rows: these take a row-invariant GEMM
    from 49 rows, 1.5-2.2x cuBLAS's time). For bit-exact comparisons in bf16 (a random-weight model's
    near-tied logits); a real model's tokens seldom depend on those last bits."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    row_invariant: bool = False
    # a draft model's own LoRA adapters ["name=path", ...]: a request of adapter `name` drafts with the draft's
    # adapter of that name (the draft runs without one for other requests)
    lora_modules: list[str] | None = None

    KEYS = {"ngram": {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "row_invariant"},
            "draft_model": {"num_speculative_tokens", "model", "row_invariant", "lora_modules"},
            "mtp": {"num_speculative_tokens", "row_invariant"}}

    @classmethod
    def parse(cls, raw: str | dict) -> SpeculativeConfig:
        where = "speculative_config"
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigurationError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{where} must be a JSON object; got {type(raw).__name__}")
        raw = dict(raw)
        method = raw.pop("method", "draft_model" if "model" in raw else None)
        if method not in cls.KEYS:
            raise ConfigurationError(f"{where}: method must be one of {', '.join(cls.KEYS)} (or give a draft "
                                     f"\"model\"); got {method!r}")
        unknown = sorted(set(raw) - cls.KEYS[method])
        if unknown:
            raise ConfigurationError(f"{where}: unknown keys {unknown} for method {method!r}; "
                                     f"valid ones are {sorted(cls.KEYS[method])}")
        k = raw.get("num_speculative_tokens", 1 if method == "mtp" else None)
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # vLLM's rule: one bound given sets both; neither gives 5.
        lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo or 5)
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{where}: {name} must be an integer >= 1; got {value!r}")
        if lo > hi:
            raise ConfigurationError(f"{where}: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        model = raw.get("model")
        if method == "draft_model" and not isinstance(model, str):
            raise ConfigurationError(f"{where}: a draft model needs \"model\": a model directory, a .gguf file "
                                     "or (with load_format dummy) a shape name")
        row_invariant = raw.get("row_invariant", False)
        if not isinstance(row_invariant, bool):
            raise ConfigurationError(f"{where}: row_invariant must be true or false; got {row_invariant!r}")
        loras = raw.get("lora_modules")
        if loras is not None and (not isinstance(loras, list) or not all(isinstance(m, str) and "=" in m
                                                                          for m in loras)):
            raise ConfigurationError(f"{where}: lora_modules must be a list of \"name=path\"; got {loras!r}")
        return cls(method, k, lo, hi, model, row_invariant, loras)


@dataclass
class ModelConfig:
    """Model shape and behaviour in one normalised form, whatever file it came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    # Mixture of experts (0 experts: a dense MLP): each token's top `num_experts_per_tok` of
    # `num_experts` gated MLPs of width `moe_intermediate_size`; `norm_topk_prob`: the selected
    # experts' router probabilities renormalised to sum to 1 (Qwen3-MoE's switch)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # An embedding model's pooling ("last" | "mean" | "cls", as its sentence-transformers files or its
    # GGUF's pooling_type say; None: not known to be one) and whether it normalizes the vector
    pooling: str | None = None
    normalize_embeddings: bool = True
    # Family-specific keys (sliding windows, soft-capping, ...) stay in the raw dict.
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigurationError("config.json has no 'architectures' entry")
        text = cfg.get("text_config") or {}
        cfg = {**cfg, **text}

        def get(key: str, default: Any = None) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        num_heads = get("num_attention_heads")
        hidden = get("hidden_size")
        # transformers >= 5 nests rope settings under rope_parameters; older files keep them flat.
        rope = dict(get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or get("rope_theta", 10000.0)
        scaling = get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type") or scaling.get("type") or "default"
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        eos = get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", num_heads),
            head_dim=get("head_dim", hidden // num_heads),
            max_position_embeddings=get("max_position_embeddings", 2048),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            torch_dtype=str(get("torch_dtype") or get("dtype") or "float32"),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            hidden_act=get("hidden_act") or get("hidden_activation") or "silu",
            num_experts=get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0,
            num_experts_per_tok=get("num_experts_per_tok", 0),
            moe_intermediate_size=get("moe_intermediate_size") or get("intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            raw=cfg,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.exists():
            raise ConfigurationError(f"{path} has no config.json; is it a Hugging Face model directory?")
        config = cls.from_hf_dict(json.loads(cfg_path.read_text()))
        config.pooling, config.normalize_embeddings = sentence_transformers_pooling(Path(path))
        return config


_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def sentence_transformers_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling, normalize) from a sentence-transformers model's modules.json and its Pooling module's
    config; (None, True) where the directory has none."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return None, True
    pooling, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            try:
                cfg = json.loads((path / str(module.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                continue
            pooling = next((mode for key, mode in _ST_POOLING.items() if cfg.get(key)), None)
    return pooling, normalize
