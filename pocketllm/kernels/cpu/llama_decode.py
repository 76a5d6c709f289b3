"""A decode-only step of a Llama-family model's layers in one C call (llama_decode.c), for the
CPU fast path: the layers' weights, norms and caches described once, in ctypes structures; and a
mixture-of-experts block's selected experts for one token in one call (DecodeExperts)."""
from __future__ import annotations

import ctypes

import torch

from pocketllm.kernels.cpu.build import load_cpu_kernels

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Part(ctypes.Structure):
    _fields_ = [("type", _i32), ("passes", _i32), ("interleaved", _i32), ("w", _ptr), ("bias", _ptr), ("n", _i64)]


class _Proj(ctypes.Structure):
    _fields_ = [("nparts", _i64), ("n", _i64), ("k", _i64), ("part", _Part * 3), ("lora_a", _ptr), ("lora_bt", _ptr),
                ("lora_width", _i64)]


class _MoE(ctypes.Structure):
    _fields_ = [("experts", _i64), ("top_k", _i64), ("renormalize", _i32), ("router", _ptr),
                ("gate_up", ctypes.POINTER(_Proj)), ("down", ctypes.POINTER(_Proj)), ("most", _i64),
                ("sigmoid", _i32), ("bias", _ptr), ("groups", _i64), ("top_groups", _i64), ("scaling", _f32),
                ("shared", _i64)]


class _Mla(ctypes.Structure):
    _fields_ = [("rank", _i64), ("rope", _i64), ("nope", _i64), ("v_dim", _i64), ("q_rank", _i64),
                ("interleaved", _i32), ("passes", _i32), ("q", _Proj), ("q_b", _Proj), ("kv_a", _Proj),
                ("q_norm", _ptr), ("kv_norm", _ptr), ("k_type", _i32), ("v_type", _i32), ("k_rows", _ptr),
                ("v_rows", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", _Proj),
                ("o", _Proj), ("gate_up", _Proj), ("down", _Proj), ("k_cache", _ptr), ("v_cache", _ptr),
                ("k_scales", _ptr), ("v_scales", _ptr), ("window", _i64), ("softcap", _f32),
                ("moe", ctypes.POINTER(_MoE)), ("mla", ctypes.POINTER(_Mla))]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("block_size", _i64), ("eps", _f32), ("scale", _f32), ("act", _i32),
                ("cos", _ptr), ("sin", _ptr), ("layers", ctypes.POINTER(_Layer))]


def _f32_ptr(t: torch.Tensor, keep: list) -> int:
    assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    keep.append(t)
    return t.data_ptr()


def _proj(linear, keep: list) -> _Proj | None:
    """A Linear layer's GGUF parts, if every one is on the fast path's kernels (a part that is, a
    GGUF layer, says so by its `fast_path_weights`; a fused projection lists its `parts`)."""
    q = linear.quantized
    parts = list(getattr(q, "parts", None) or [q])
    weights = [p.fast_path_weights() if hasattr(p, "fast_path_weights") else None for p in parts]
    if len(parts) > 3 or any(w is None for w in weights):
        return None
    proj = _Proj(nparts=len(parts), n=sum(p.out_features for p in parts), k=parts[0].in_features)
    for i, (p, (w, interleaved)) in enumerate(zip(parts, weights)):
        keep.append(w)
        proj.part[i] = _Part(type=int(p.qtype), passes=p.int8, interleaved=int(interleaved), w=w.data_ptr(),
                             bias=None if p.bias is None else _f32_ptr(p.bias, keep), n=p.out_features)
    if linear.lora is not None:  # (its slots' tensors are written in place as adapters come and go)
        proj.lora_a, proj.lora_bt = _f32_ptr(linear.lora.a, keep), _f32_ptr(linear.lora.bt, keep)
        proj.lora_width = linear.lora.width
    return proj


def _cache_ptrs(attn, keep: list) -> tuple:
    """(K values, V values, K scales, V scales) of a layer's cache: float32, or int8 with scales."""
    if attn.k_scale is None:
        return _f32_ptr(attn.k_cache, keep), _f32_ptr(attn.v_cache, keep), None, None
    for t in (attn.k_cache, attn.v_cache):
        assert t.dtype == torch.int8 and t.is_contiguous()
        keep.append(t)
    return attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), _f32_ptr(attn.k_scale, keep), _f32_ptr(attn.v_scale, keep)


def _expert_projs(experts, keep: list) -> tuple | None:
    """(gate/up, down): arrays of every expert's projections, or None where one is off the fast path's kernels."""
    gate_up = [_proj(e.gate_up_proj, keep) for e in experts]
    down = [_proj(e.down_proj, keep) for e in experts]
    if any(p is None for p in gate_up + down):
        return None
    arrays = (_Proj * len(experts))(*gate_up), (_Proj * len(experts))(*down)
    keep.extend(arrays)
    return arrays


def _moe(block, keep: list) -> _MoE | None:
    """A mixture-of-experts block (layers.moe.SparseMoE) for the one call: its router, its experts and its shared
    ones (DeepSeek's, an entry after the routed experts), where it routes as the call can (`one_call_routing`)
    and no expert has LoRA adapters; else None."""
    routing = block.one_call_routing()
    every = [*block.experts, *([block.shared_experts] if block.shared_experts is not None else [])]
    if (routing is None or any(e.gate_up_proj.lora is not None or e.down_proj.lora is not None for e in every)
            or routing.groups > 64 or len(block.experts) % routing.groups):  # (route_row's group tables: 64)
        return None
    projs = _expert_projs(every, keep)
    if projs is None:
        return None
    r = routing
    moe = _MoE(len(block.experts), r.top_k, int(r.renormalize), _f32_ptr(r.router, keep), *projs,
               max(e.down_proj.in_features for e in every), int(r.sigmoid),
               None if r.bias is None else _f32_ptr(r.bias, keep), r.groups, r.top_groups, r.scaling,
               len(block.experts) if block.shared_experts is not None else -1)
    keep.append(moe)
    return moe


def _mla(attn, keep: list) -> _Mla | None:
    """DeepSeek's latent attention (models.deepseek.LatentAttention) for the one call, where its projections are on
    the fast path's kernels and it keeps the file's quantized heads (QuantizedHeads: the call multiplies them over
    8-bit activations at any row count, as it does the projections); else None."""
    heads = attn.heads
    if not heads.kept(1):
        return None
    k_part, v_part = heads.parts  # (raw rows, pointer table, type, rows a head, columns)
    assert k_part[3:] == (attn.rank, attn.nope) and v_part[3:] == (attn.v_dim, attn.rank), (k_part[3:], v_part[3:])
    q_lora = bool(attn.q_lora_rank)
    projs = [_proj(x, keep) for x in ((attn.q_a_proj, attn.q_b_proj) if q_lora else (attn.q_proj,))]
    kv_a = _proj(attn.kv_a_proj_with_mqa, keep)
    if kv_a is None or any(p is None for p in projs):
        return None
    keep.extend((k_part, v_part))
    mla = _Mla(attn.rank, attn.rope, attn.nope, attn.v_dim, attn.q_lora_rank or 0, int(attn.interleaved),
               heads.passes, projs[0], projs[1] if q_lora else _Proj(), kv_a,
               _f32_ptr(attn.q_a_layernorm.scale(), keep) if q_lora else None,
               _f32_ptr(attn.kv_a_layernorm.scale(), keep), int(k_part[2]), int(v_part[2]), k_part[1].data_ptr(),
               v_part[1].data_ptr())
    keep.append(mla)
    return mla


class LlamaDecoder:
    """Runs all decoder layers of a decode-only step; build() returns None for a model it does not
    cover (projections off the fast path's kernels, attention sinks, activations other than SiLU and
    tanh GELU or not one for all layers, layers in several KV groups, q/k norms of another epsilon,
    mixture-of-experts blocks that route otherwise, latent attention without its file's quantized heads or with
    LoRA adapters), which then keeps its module-by-module forward."""

    def __init__(self, spec: _Model, layers, keep: list, lora_rows=None):
        self._spec, self._layers, self._keep = spec, layers, keep
        self._lib = load_cpu_kernels()
        self._lora_rows = lora_rows  # LoRA adapters (layers.lora.LoRARows): each step's rows' slots

    @classmethod
    def build(cls, model) -> LlamaDecoder | None:
        lib = load_cpu_kernels()
        layers = model.model.layers
        # (layers of several KV groups read several block tables: the one call has one)
        if lib is None or not len(layers) or any(layer.self_attn.kv_group for layer in layers):
            return None
        keep: list = []
        specs = []
        a0 = layers[0].self_attn
        ffns = [layer.mlp.experts[0] if hasattr(layer.mlp, "experts") else layer.mlp for layer in layers]
        act = getattr(ffns[0], "act_code", None)  # (a mixture's experts' activation is the block's)
        latent = hasattr(a0, "heads")  # (DeepSeek's latent attention: every layer's; its projections take no LoRA here)
        if latent and model.lora_rows is not None:
            return None
        for layer, ffn in zip(layers, ffns):
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            if (getattr(attn, "sinks", None) is not None or act not in (0, 1) or getattr(ffn, "act_code", None) != act
                    or attn.scale != a0.scale or q_norm is not None and q_norm.eps != layer.input_layernorm.eps):
                return None
            moe = _moe(mlp, keep) if ffn is not mlp else None
            mla = _mla(attn, keep) if latent else None
            if ffn is not mlp and moe is None or latent and mla is None:
                return None
            projs = [_Proj() if latent else _proj(attn.qkv_proj, keep), _proj(attn.o_proj, keep)]
            projs += [_Proj(), _Proj()] if moe is not None else [_proj(x, keep) for x in (mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in projs):
                return None
            qn, kn = ((None, None) if q_norm is None else
                      (_f32_ptr(q_norm.scale(), keep), _f32_ptr(attn.k_norm.scale(), keep)))
            specs.append(_Layer(_f32_ptr(layer.input_layernorm.scale(), keep),
                                _f32_ptr(layer.post_attention_layernorm.scale(), keep), qn, kn, *projs,
                                *_cache_ptrs(attn, keep), attn.window or 0, getattr(attn, "softcap", None) or 0.0,
                                ctypes.pointer(moe) if moe is not None else None,
                                ctypes.pointer(mla) if mla is not None else None))
        array = (_Layer * len(specs))(*specs)
        rot = model.rotary
        dense = [ffn.down_proj.in_features for layer, ffn in zip(layers, ffns) if ffn is layer.mlp]
        # (the latent cache: one head of rank + rope values, read as keys and as values)
        kv_heads, head_dim = (1, a0.rank + a0.rope) if latent else (a0.num_kv_heads, a0.head_dim)
        spec = _Model(len(specs), layers[0].input_layernorm.weight.numel(), a0.num_heads, kv_heads, head_dim,
                      max(dense, default=1), a0.k_cache.shape[1], layers[0].input_layernorm.eps, a0.scale, act,
                      _f32_ptr(rot.cos, keep), _f32_ptr(rot.sin, keep), array)
        return cls(spec, array, keep, model.lora_rows)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, hidden] (the embedded tokens; overwritten) -> (last layer's output, residual)."""
        assert x.dtype == torch.float32 and x.is_contiguous()
        tables, lens, slots = meta.decode_block_tables, meta.decode_lens, meta.slot_mapping
        for t in (positions, tables, lens, slots):
            assert t.dtype == torch.int64 and t.is_contiguous()
        residual = torch.empty_like(x)
        lora = None if self._lora_rows is None else self._lora_rows.slots  # each row's adapter slot
        if lora is not None:
            lora = lora[:x.shape[0]].contiguous()  # (decode rows come first)
        rc = self._lib.llama_decode(ctypes.byref(self._spec), x.data_ptr(), residual.data_ptr(), x.shape[0],
                                    positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                                    lens.data_ptr(), None if lora is None else lora.data_ptr(),
                                    torch.get_num_threads())
        assert rc == 0, f"llama_decode failed ({rc})"
        return x, residual


class DecodeExperts:
    """One token's selected experts of a mixture-of-experts block (``layers.moe.SparseMoE``) in one C
    call (moe_decode_experts): every expert's gate/up and down projections described once, and the
    block's shared experts (DeepSeek's) as one more, added last with weight 1 as the module path adds
    them; build() returns None where one is off the fast path's kernels or its activation has no C kernel."""

    def __init__(self, gate_up, down, most: int, act: int, alpha: float, limit: float, shared: int | None,
                 keep: list):
        self._gate_up, self._down, self._keep = gate_up, down, keep
        self._most, self._act, self._alpha, self._limit = most, act, alpha, limit
        self._shared = None if shared is None else (torch.tensor([[shared]]), torch.ones(1, 1))  # (its id, weight)
        self._lib = load_cpu_kernels()

    @property
    def with_shared(self) -> bool:
        return self._shared is not None

    @classmethod
    def build(cls, experts, shared=None) -> DecodeExperts | None:
        every = [*experts, *([shared] if shared is not None else [])]
        act = getattr(experts[0], "act_code", None)  # 0 SiLU, 1 GELU (tanh), 3 clamped SwiGLU: the C activations
        if load_cpu_kernels() is None or act not in (0, 1, 3) or any(getattr(e, "act_code", None) != act for e in every):
            return None
        keep: list = []
        projs = _expert_projs(every, keep)
        if projs is None:
            return None
        e0 = experts[0]
        return cls(*projs, max(e.down_proj.in_features for e in every), act, getattr(e0, "alpha", 0.0),
                   getattr(e0, "limit", 0.0), None if shared is None else len(experts), keep)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [1, hidden] float32, the token's experts ids int64 [1, k] and weights float32 [1, k] ->
        [1, hidden]: the weighted sum of the experts' outputs (plus the shared experts')."""
        assert x.dtype == torch.float32 and x.shape[0] == 1 and x.is_contiguous() and ids.dtype == torch.int64
        weights = weights.to(torch.float32)
        if self._shared is not None:
            ids, weights = torch.cat((ids, self._shared[0]), 1), torch.cat((weights, self._shared[1]), 1)
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty_like(x)
        rc = self._lib.moe_decode_experts(self._gate_up, self._down, ids.numel(), ids.data_ptr(), weights.data_ptr(),
                                          x.data_ptr(), self._most, self._act, self._alpha, self._limit,
                                          out.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"moe_decode_experts failed ({rc})"
        return out
