"""Linear layers and embedding lookups over GGUF weights that stay quantized.

Paths (``GGUFLinear.path``):

* ``"dense"``   F32 weights as-is; F16/BF16 widened to float32 at load (2x
  their file size, but exact and BLAS-fast); any type with
  ``dequantize_at_load=True``.
* ``"scratch"`` the default for every quantized type: raw GGUF bytes are kept
  and dequantized (exactly, see ``dequant.py``) into float32 chunks of at most
  ``SCRATCH_BYTES``, each followed by a BLAS ``F.linear``.
* ``"int4"``    opt-in for Q4_0/Q4_1/Q4_K: blocks are mapped onto
  ``aten._weight_int4pack_mm_for_cpu`` (group size 32, float32 activations,
  scales and zeros).  The kernel computes ``w = (q - 8) * scale + zero``; we use
  ``scale = d`` (Q4_1: ``d``; Q4_K: ``d*sc``) and ``zero = 0`` /
  ``8*d + m`` / ``8*d*sc - dmin*m``.  Q4_0 is bit-exact; Q4_1/Q4_K are exact
  whenever the zero fits in float32, else off by at most half an ulp of it.
  Not the default: on x86 torch only vectorises this kernel for bfloat16, the
  float32 version is scalar and slower than the scratch path (see
  ``benchmarks/bench_quant_linear.py``).
* ``"int4_bf16"`` opt-in, same mapping with bfloat16 activations, scales,
  zeros and output: fast (vectorised), but each of those is rounded to bf16
  (relative error up to 2**-9 each), so it is not exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from .dequant import _BLOCK_FNS, as_bytes, dequantize, f16, nibbles, q4_k_values, scale_min_k4
from .gguf_types import check_supported, row_nbytes, type_size

T = GGMLQuantizationType

# Bound on the float32 chunk the scratch path dequantizes at once.  Dequant
# temporaries are at most ~3x that, so a call's extra peak stays under ~16 MiB.
SCRATCH_BYTES = 4 << 20

INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
_PATHS = ("auto", "dense", "scratch", "int4", "int4_bf16")
_GROUP = 32  # int4 kernel group size; every Q4_0/Q4_1/Q4_K (sub-)block is 32 wide


def _int4_fields(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int):
    """GGUF 4-bit blocks -> (q int32 [n, k] in 0..15, scale, zero float32 [n, k/32])."""
    blocks = raw.view(-1, type_size(qtype))
    if qtype == T.Q4_K:
        d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        sc, mn = scale_min_k4(blocks[:, 4:16])
        q = q4_k_values(blocks)
        scale = d * sc.float()
        zero = 8 * scale - dmin * mn.float()
    else:
        off = 2 if qtype == T.Q4_0 else 4
        q = nibbles(blocks[:, off:])
        scale = f16(blocks[:, :2])
        zero = torch.zeros_like(scale) if qtype == T.Q4_0 else 8 * scale + f16(blocks[:, 2:4])
    return q.reshape(n, k).to(torch.int32), scale.reshape(n, -1), zero.reshape(n, -1)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    # the packer wants int32 [N, K]; go 4096 rows at a time (a multiple of its
    # 64-row tiles, so the pieces concatenate) to bound the load-time temporary
    step = 4096
    return torch.cat([
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + step].contiguous(), 1)
        for i in range(0, q.shape[0], step)
    ])


class GGUFLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept in its GGUF encoding."""

    def __init__(self):
        super().__init__()
        self.qtype: GGMLQuantizationType = T.F32
        self.out_features = 0
        self.in_features = 0
        self.path = "dense"
        self.bias: torch.Tensor | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    @classmethod
    def from_gguf(
        cls,
        data_uint8: torch.Tensor,
        qtype: GGMLQuantizationType,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        dequantize_at_load: bool = False,
        path: str = "auto",
    ) -> "GGUFLinear":
        """Wrap raw GGUF bytes of an ``[out_features, in_features]`` weight.

        ``path`` picks the compute path (see module docs); ``"auto"`` means
        ``"dense"`` for float types or ``dequantize_at_load``, else ``"scratch"``.
        """
        qtype = check_supported(qtype)
        if path not in _PATHS:
            raise ValueError(f"path must be one of {_PATHS}, got {path!r}")
        n, k = int(out_features), int(in_features)
        raw = as_bytes(data_uint8)
        want = n * row_nbytes(qtype, k)
        if raw.numel() != want:
            raise ValueError(f"{qtype.name} weight [{n}, {k}] needs {want} bytes, got {raw.numel()}")
        if path == "auto":
            path = "dense" if dequantize_at_load or qtype in _FLOAT_TYPES else "scratch"
        if path.startswith("int4") and (qtype not in INT4_TYPES or n % 16):
            raise ValueError(
                f"path {path!r} needs a Q4_0/Q4_1/Q4_K weight with out_features % 16 == 0, "
                f"got {qtype.name} with out_features={n}"
            )

        self = cls()
        self.qtype, self.out_features, self.in_features, self.path = qtype, n, k, path
        self.bias = None if bias is None else bias.detach().to(torch.float32).reshape(n)
        if path == "dense":
            self._tensors["weight"] = dequantize(raw, qtype, (n, k))
        elif path == "scratch":
            self._tensors["raw"] = raw.view(n, -1)
            # whole rows per chunk, as many as fit in SCRATCH_BYTES of float32
            self._chunk_rows = max(1, SCRATCH_BYTES // (4 * k))
        else:
            q, scale, zero = _int4_fields(raw, qtype, n, k)
            dt = torch.bfloat16 if path == "int4_bf16" else torch.float32
            self._tensors["packed"] = _pack_int4(q)
            # kernel layout: [K/32, N, (scale, zero)], in the activation dtype
            self._tensors["scale_zero"] = torch.stack([scale.T, zero.T], -1).to(dt).contiguous()
        return self

    def nbytes(self) -> int:
        """Bytes of weight data (and bias) this layer holds."""
        held = list(self._tensors.values()) + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, path={self.path}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        if self.path == "dense":
            y = F.linear(x2, self._tensors["weight"])
        elif self.path == "scratch":
            y = self._scratch_linear(x2)
        else:
            dt = torch.bfloat16 if self.path == "int4_bf16" else torch.float32
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(dt).contiguous(), self._tensors["packed"], _GROUP, self._tensors["scale_zero"]
            ).to(torch.float32)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _scratch_linear(self, x2: torch.Tensor) -> torch.Tensor:
        raw, step = self._tensors["raw"], self._chunk_rows
        fn, ts = _BLOCK_FNS[self.qtype], type_size(self.qtype)
        y = x2.new_empty(x2.shape[0], self.out_features)
        for r0 in range(0, self.out_features, step):
            rows = raw[r0:r0 + step]
            w = fn(rows.reshape(-1, ts)).view(rows.shape[0], self.in_features)
            y[:, r0:r0 + rows.shape[0]] = F.linear(x2, w)
        return y


def gguf_embedding_lookup(
    data_uint8: torch.Tensor,
    qtype: GGMLQuantizationType,
    num_embeddings: int,
    dim: int,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """Rows ``token_ids`` of a GGUF ``[num_embeddings, dim]`` table, dequantized to float32.

    Only the requested rows are decoded, so the table stays quantized.
    Returns ``[*token_ids.shape, dim]`` (``[n, dim]`` for 1-D ids).
    """
    qtype = check_supported(qtype)
    table = as_bytes(data_uint8).view(int(num_embeddings), row_nbytes(qtype, int(dim)))
    ids_shape = torch.as_tensor(token_ids).shape
    ids = torch.as_tensor(token_ids).reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise IndexError(f"token ids must be in [0, {num_embeddings}), got {ids.min()}..{ids.max()}")
    rows = table.index_select(0, ids)
    return dequantize(rows, qtype, (ids.numel(), int(dim))).reshape(*ids_shape, int(dim))
