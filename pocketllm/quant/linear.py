"""Linear layers and embedding lookups over GGUF weights that stay quantized.

Compute paths (``GGUFLinear.path``):

* ``"c"``      default where the C kernels built (``pocketllm/kernels/cpu``) cover the
  type (F32, F16 and every quantized type: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q6_K IQ1_S IQ1_M
  IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS MXFP4; the lattice types' grids from the gguf
  package's):
  raw GGUF bytes are kept as they are (a view of the file) and each block is
  dequantized, exactly, in registers right before it is used. Up to
  ``dispatch.C_GEMM_ROWS`` activation rows the block is multiplied in the same pass
  (weights read once); larger batches dequantize row chunks into scratch for BLAS.
  With ``int8_activations`` (the engine's ``exact_kernels=False``) the types with integer
  kernels (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4 per block of 32, the others per super-block
  of 256; CPUs with AVX2) take the fast variant: the activations are quantized to
  8 bits per block and each block's dot product runs on integers (not exact: within the
  activations' rounding of the exact result). ``int8_activations=2`` adds a second 8-bit
  pass over the first one's rounding error (the output layer; every layer of a small model,
  ``int8_passes``). Q4_0 Q4_1 Q8_0 IQ4_NL MXFP4 and
  Q4_K matrices on the fast path (rows a multiple of 8), and with AVX-512 VNNI Q6_K too, are
  repacked at load with eight rows' blocks interleaved (the same bytes, reordered; Q4_K's 6-bit
  scales unpacked to bytes: +2.8%, Q6_K with a constant per row and super-block: +1.9%; not a
  view of the file any more), which shares each block's unpacking and
  float work among the rows (four to a 512-bit register, or one to each 32-bit lane on AVX2); a
  tied embedding table then reads its rows from there (``embedding_rows``).
* ``"dense"``  F32 weights as-is; F16/BF16 widened to float32 at load (2x their
  file size, exact, BLAS speed); any type with ``dequantize_at_load=True``.
* ``"planes"`` default for the affine types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q6_K).
  At load the integer codes are re-laid out transposed ([K, N]) as packed
  bit planes with fp16 scales and int8 sub-scales: the GGUF size, plus a few
  percent for k-quants whose 6-bit sub-scales take a byte.  Forward rebuilds
  float32 weights for a slice of output rows at a time in a per-thread scratch
  buffer (<= ``SCRATCH_BYTES``, reused by all layers) and multiplies with BLAS.
  The rebuilt weights are bit-identical to ``gguf.quants.dequantize``; the
  transposed layout makes every step a contiguous or middle-axis broadcast
  op, which torch runs several times faster than GGUF's interleaved layout.
* ``"scratch"`` default for the rest (no C compiler, or a type the C kernels lack): raw blocks are kept and
  dequantized row chunk by row chunk (``dequant.py``, exact), then ``F.linear``.

On a CUDA device (``device=`` of ``from_gguf``) two paths exist:

* ``"triton"`` default for every quantized type (``TRITON_GGUF_TYPES``: Q4_0 Q4_1 Q5_0 Q5_1
  Q8_0 Q2_K..Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS MXFP4): the GGUF
  bytes go to the GPU as they are, re-laid out per row (codes first, then scales: the same bytes,
  the same size; ``kernels/triton/gguf.py``), and every call multiplies them in their GGUF
  encoding, in the activations' dtype.
* ``"dense"`` for the float types or with ``dequantize_at_load``: dequantized exactly (float32)
  at load, then stored in the model's dtype (2 bytes a weight in bfloat16).

Inference only: the planes path reuses its scratch buffer, so no autograd.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pocketllm.core.gguf_types import block_size, check_supported, row_nbytes, type_size
from pocketllm.kernels import dispatch
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.kernels.platform import KernelConfig, kernels_for

from .dequant import AFFINE_TYPES, Affine, affine_fields, as_bytes, dequantize, dequantize_blocks

T = GGMLQuantizationType

# Float32 weight slice rebuilt at once.  The per-thread scratch buffers (this plus
# a quarter for codes) live on across calls and layers: fresh multi-MiB buffers
# each call cost more in page faults than the dequantization itself.  4 MiB
# measured fastest (fewer, larger torch ops; still cache friendly).
SCRATCH_BYTES = 4 << 20

_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
_PATHS = ("auto", "c", "dense", "planes", "scratch", "triton")
_TEMP_FACTOR = 4  # scratch path: float chunk = SCRATCH_BYTES / this
_LOAD_ROWS = 4096  # rows converted at once at load, bounds load-time temporaries
# code bits -> widths of the bit planes that store them
_PIECES = {8: (8,), 6: (4, 2), 5: (4, 1), 4: (4,), 3: (2, 1), 2: (2,)}

_tls = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_tls, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_tls, name, buf)
    return buf[:numel]


def _pack_planes(u: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """uint8 codes [K, N] -> bit planes; plane of width w packs K*w/8 rows per byte row."""
    planes, shift = [], 0
    for w in _PIECES[bits]:
        piece = (u >> shift) & ((1 << w) - 1)
        rows = u.shape[0] * w // 8
        plane = torch.zeros(rows, u.shape[1], dtype=torch.uint8)
        for i in range(8 // w):
            plane |= piece[i * rows:(i + 1) * rows] << (i * w)
        planes.append(plane)
        shift += w
    return planes


def _unpack_planes(planes: list[torch.Tensor], bits: int, out: torch.Tensor) -> None:
    """Inverse of ``_pack_planes`` into ``out`` (uint8 [K, n]); planes already column-sliced."""
    shift = 0  # where this piece lands in the code
    for w, plane in zip(_PIECES[bits], planes):
        rows, mask = plane.shape[0], (1 << w) - 1
        for i in range(8 // w):
            dst, at = out[i * rows:(i + 1) * rows], i * w  # ``at``: its place in the byte
            if shift:  # one shift straight to the destination bits, then mask and merge
                moved = plane << (shift - at) if shift >= at else plane >> (at - shift)
                dst |= moved & (mask << shift)
            elif at + w == 8:
                torch.bitwise_right_shift(plane, at, out=dst)
            else:
                torch.bitwise_and(plane >> at if at else plane, mask, out=dst)
        shift += w


def _cat_row_chunks(rows: torch.Tensor, qtype: GGMLQuantizationType, fn) -> list[torch.Tensor]:
    """Apply ``fn(Affine, n_rows) -> tensors`` to row chunks; concatenate along rows (dim 0)."""
    ts, outs = type_size(qtype), []
    for r0 in range(0, rows.shape[0], _LOAD_ROWS):
        r = rows[r0:r0 + _LOAD_ROWS]
        outs.append(fn(affine_fields(qtype, r.reshape(-1, ts)), r.shape[0]))
    return [torch.cat(parts) for parts in zip(*outs)]


class _Planes:
    """Affine-type weight stored transposed: bit planes of codes, fp16/int8 scales."""

    def __init__(self, rows: torch.Tensor, qtype: GGMLQuantizationType, k: int):
        self.k = k
        nsb = k // block_size(qtype)  # super-blocks per row
        first = affine_fields(qtype, rows[:1].reshape(-1, type_size(qtype)))
        self.bits, self.bias, self.sub, self.sign = first.bits, first.bias, first.sub, first.sign
        has_sc, has_dmin, has_mn = (x is not None for x in (first.sc, first.dmin, first.mn))

        def parts(f: Affine, n: int) -> list[torch.Tensor]:
            # stored code u = code + bias in [0, 2**bits); Q8_0 keeps two's complement bytes
            u = ((f.codes + f.bias) & 0xFF).to(torch.uint8).view(n, k)
            out = [p.T for p in _pack_planes(u.T, self.bits)]  # row-major chunks for cat
            out.append(f.d.view(n, nsb).half())  # exact: d came from fp16
            if has_sc:
                out.append(f.sc.view(n, -1).to(torch.int8))
            if has_dmin:
                out.append(f.dmin.view(n, nsb).half())
            if has_mn:
                out.append(f.mn.view(n, -1).to(torch.int8))
            return out

        held = [t.T.contiguous() for t in _cat_row_chunks(rows, qtype, parts)]  # -> [.., N]
        n_planes = len(_PIECES[self.bits])
        self.planes, rest = held[:n_planes], held[n_planes:]
        self.d = rest.pop(0)
        self.sc = rest.pop(0) if has_sc else None
        self.dmin = rest.pop(0) if has_dmin else None
        self.mn = rest.pop(0) if has_mn else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.planes, self.d, self.sc, self.dmin, self.mn) if t is not None]

    def weights_t(self, cols: slice) -> torch.Tensor:
        """Exact float32 W.T[:, cols] ([K, m]) in the per-thread scratch buffer."""
        k, m = self.k, cols.stop - cols.start
        u = _scratch("codes", k * m, torch.uint8).view(k, m)
        _unpack_planes([p[:, cols] for p in self.planes], self.bits, u)
        codes = u.view(torch.int8)
        if self.bias:
            codes.sub_(self.bias)
        w = _scratch("weights", k * m, torch.float32).view(k, m)
        w.copy_(codes)
        w3 = w.view(-1, self.sub, m)  # [sub-block, element, column]
        w3.mul_(_sub_scale(self.d[:, cols], self.sc, cols).unsqueeze(1))
        if self.dmin is not None:
            off = _sub_scale(self.dmin[:, cols], self.mn, cols).unsqueeze(1)
            if self.sign > 0:
                w3.add_(off)
            else:
                w3.sub_(off)
        return w


def _sub_scale(d16: torch.Tensor, mult: torch.Tensor | None, cols: slice) -> torch.Tensor:
    """float32 [sub-blocks, m]: fp16 super-block scale times its int sub-block multiplier."""
    d = d16.float()
    if mult is None:
        return d
    mult = mult[:, cols].float()
    return (d.unsqueeze(1) * mult.view(d.shape[0], -1, d.shape[1])).view(-1, d.shape[1])


class GGUFLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept in its GGUF encoding (see module docs)."""

    def __init__(self):
        super().__init__()
        self.qtype: GGMLQuantizationType = T.F32
        self.out_features = 0
        self.in_features = 0
        self.path = "dense"
        self.bias: torch.Tensor | None = None
        self._store = None  # dense weight, raw bytes or _Planes, by path
        self.int8 = 0  # the "c" path multiplies over 8-bit activations, in this many passes
        self._rows: torch.Tensor | None = None  # the "c" path's row pointers; None: interleaved rows
        self.dtype = torch.float32  # what forward returns (the triton path: the model's dtype)

    @classmethod
    def from_gguf(
        cls,
        data_uint8: torch.Tensor | list[torch.Tensor],
        qtype: GGMLQuantizationType,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        dequantize_at_load: bool | None = None,
        path: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        int8_activations: int = 0,
        kernels: KernelConfig | None = None,
    ) -> GGUFLinear:
        """Wrap raw GGUF bytes of an ``[out_features, in_features]`` weight.

        ``data_uint8`` may be a list of row blocks of the same type (a fused projection's parts,
        e.g. Q, K and V): the C path points at them where they are, other paths concatenate.

        ``path="auto"`` picks ``"dense"`` for float types or with
        ``dequantize_at_load``, ``"planes"`` for affine types, else ``"scratch"``; on a CUDA
        ``device``, ``"triton"`` for the types the Triton kernels cover, else ``"dense"``.
        ``dtype``: what the dense and triton paths hold off the CPU (the model's dtype); the CPU
        paths compute in float32. ``kernels``: the owning layer's configuration (a GPU model's
        experts in host memory run the CPU's); by default the one of the model being built.
        ``dequantize_at_load``: by default the kernels' setting.
        """
        qtype = check_supported(qtype)
        if path not in _PATHS:
            raise ValueError(f"path must be one of {_PATHS}, got {path!r}")
        n, k = int(out_features), int(in_features)
        device = torch.device("cpu" if device is None else device)
        on_cpu = device.type == "cpu"
        kernels = kernels_for(device) if kernels is None else kernels
        dequantize_at_load = kernels.dequantize_at_load if dequantize_at_load is None else dequantize_at_load
        if path == "auto" and kernels.gpu and not dequantize_at_load:
            from pocketllm.kernels.triton.gguf import TRITON_GGUF_TYPES

            if qtype in TRITON_GGUF_TYPES:
                path = "triton"
        if path == "auto" and not on_cpu:
            path = "dense"
        if path not in ("dense", "triton") and not on_cpu:
            raise ValueError(f"path {path!r} runs on the CPU only, not on {device}")
        if path == "auto":
            if dequantize_at_load or qtype in _FLOAT_TYPES:
                path = "dense"
            elif gguf_ops.supports(qtype):
                path = "c"
            else:
                path = "planes" if qtype in AFFINE_TYPES else "scratch"
        parts = [as_bytes(p) for p in data_uint8] if isinstance(data_uint8, (list, tuple)) else [as_bytes(data_uint8)]
        want = n * row_nbytes(qtype, k)
        got = sum(p.numel() for p in parts)
        if got != want:
            raise ValueError(f"{qtype.name} weight [{n}, {k}] needs {want} bytes, got {got}")
        raw = parts[0] if len(parts) == 1 else None if path == "c" else torch.cat([p.reshape(-1) for p in parts])
        if path == "c" and not gguf_ops.supports(qtype):
            raise ValueError(f"path 'c' does not support {qtype.name} (or the C kernels did not build)")
        if path == "planes" and qtype not in AFFINE_TYPES:
            raise ValueError(f"path 'planes' does not support {qtype.name}")

        self = cls()
        self.qtype, self.out_features, self.in_features, self.path = qtype, n, k, path
        held = torch.float32 if on_cpu and path != "triton" else dtype  # what this layer computes in
        self.bias = None if bias is None else bias.detach().to(device, held).reshape(n)
        if path == "triton":
            from pocketllm.kernels.triton.gguf import pack_gguf

            self._store, self.dtype = pack_gguf(raw.view(n, -1), qtype, k, device), dtype
            return self
        if not on_cpu:  # dense, in the model's dtype
            self._store = _dequantize_rows(raw.view(n, -1), qtype, k, device, dtype)
            return self
        if path == "c":
            self._store = [p.view(-1, row_nbytes(qtype, k)).contiguous() for p in parts]  # views: no copy
            self._rows = gguf_ops.row_pointers(self._store)
            self.int8 = int(int8_activations) if gguf_ops.supports_int8(qtype) else 0
            packed = gguf_ops.repack_x8(self._rows, qtype, k) if self.int8 else None
            if packed is not None:
                self._store, self._rows = [packed], None
            return self
        rows = raw.view(n, -1)
        if path == "dense":
            self._store = dequantize(raw, qtype, (n, k))
        elif path == "scratch":
            self._store = rows  # a view: the caller's bytes are not copied
        else:
            self._store = _Planes(rows, qtype, k)
        return self

    def nbytes(self) -> int:
        """Bytes of weight data (and bias) this layer holds."""
        s = self._store
        held = [s] if isinstance(s, torch.Tensor) else list(s) if isinstance(s, list) else s.tensors()
        if self.bias is not None:
            held.append(self.bias)
        return sum(t.numel() * t.element_size() for t in held)

    def embedding_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``token_ids`` of W dequantized: the lookup of an embedding table held by this layer
        (a tied output layer on the C path, which keeps one part: float32, exactly; on the triton
        path, in the layer's dtype, ids not checked: no host sync inside a CUDA graph)."""
        if self.path == "triton":
            from pocketllm.kernels.triton.gguf import gguf_dequantize

            return gguf_dequantize(self._store, self.qtype, self.in_features, self.dtype, packed=True, rows=token_ids)
        if self._rows is not None:
            return gguf_embedding_lookup(self._store[0], self.qtype, self.out_features, self.in_features, token_ids)
        ids, flat = _checked_ids(token_ids, self.out_features)
        out = gguf_ops.dequant_rows_x8(self._store[0], self.qtype, self.out_features, self.in_features, flat)
        return out.reshape(*ids.shape, self.in_features)

    def fast_path_weights(self) -> tuple[torch.Tensor, bool] | None:
        """For callers of the fast path's C kernels (the one-call decode step): (the row pointer
        table, False) or (the interleaved bytes, True); None where this layer is not on that path."""
        if self.path != "c" or not self.int8:
            return None
        return (self._store[0], True) if self._rows is None else (self._rows, False)

    @property
    def int8_rows(self) -> int:
        """Up to how many activation rows the product runs on 8-bit activations (the GPU's GEMV,
        ``kernels/triton/gguf_q8.py``), whose producers can then write them (``int8_act``); 0: never."""
        if self.path != "triton":
            return 0
        from pocketllm.kernels.dispatch import GEMV_MAX_M
        from pocketllm.kernels.triton.gguf_q8 import Q8_TYPES

        return GEMV_MAX_M if self.qtype in Q8_TYPES else 0

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, path={self.path}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.path == "triton":
            from pocketllm.kernels.triton.gguf import gguf_matmul
            from pocketllm.kernels.triton.int8_act import attached

            y = gguf_matmul(x2, self._store, self.qtype, self.in_features, packed=True, x8=attached(x))
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, self.out_features)
        x2 = x2.to(self._store.dtype if self.path == "dense" else torch.float32)
        if self.path == "c":
            kernel = dispatch.cpu_gguf_kernel(x2.shape[0], self.out_features * self.in_features, passes=self.int8,
                                              interleaved=self._rows is None)
            if kernel == "gemm_x8":
                y = gguf_ops.gemm_x8(x2, self._store[0], self.out_features, self.qtype, self.int8)
            elif kernel == "gemm":
                y = gguf_ops.gemm(x2, self._rows, self.qtype, int8=self.int8)
            else:  # "dequant": rows of W decoded exactly, a slice at a time, for BLAS
                y = self._chunked(x2, SCRATCH_BYTES, lambda c: F.linear(x2, self._dequantized(c)))
        elif self.path == "dense":
            y = F.linear(x2, self._store)
        elif self.path == "planes":
            y = self._chunked(x2, SCRATCH_BYTES, lambda c: x2 @ self._store.weights_t(c))
        else:  # scratch
            y = self._chunked(x2, SCRATCH_BYTES // _TEMP_FACTOR,
                              lambda c: F.linear(x2, self._dequant_rows(c)))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _dequantized(self, rows: slice) -> torch.Tensor:
        """Rows of W, exactly, from the C path's layout (interleaved or a row pointer table)."""
        if self._rows is None:
            ids = torch.arange(rows.start, rows.stop, dtype=torch.int64)
            return gguf_ops.dequant_rows_x8(self._store[0], self.qtype, self.out_features, self.in_features, ids)
        return gguf_ops.dequant_row_ptrs(self._rows[rows], self.qtype, self.in_features)

    def _dequant_rows(self, rows: slice) -> torch.Tensor:
        blocks = self._store[rows].reshape(-1, type_size(self.qtype))
        return dequantize_blocks(blocks, self.qtype).view(-1, self.in_features)

    def _chunked(self, x2: torch.Tensor, budget: int, part) -> torch.Tensor:
        """Output columns in slices whose float32 weights fit in ``budget`` bytes."""
        n, step = self.out_features, max(1, budget // (4 * self.in_features))
        y = x2.new_empty(x2.shape[0], n)
        for c0 in range(0, n, step):
            cols = slice(c0, min(n, c0 + step))
            y[:, cols] = part(cols)
        return y


def _dequantize_rows(rows: torch.Tensor, qtype: GGMLQuantizationType, k: int, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """GGUF rows (uint8 [n, row_bytes]) dequantized, exactly, into a dense [n, k] ``dtype`` tensor
    on ``device``, ``_LOAD_ROWS`` rows at a time (no float32 copy of the whole matrix)."""
    out = torch.empty((rows.shape[0], k), dtype=dtype, device=device)
    gpu = None
    if device.type == "cuda":  # the Triton decoder, where it covers the type (an ulp off: FMA)
        from pocketllm.kernels.triton import gguf as kg

        gpu = kg if qtype in kg.TRITON_GGUF_TYPES else None
    for r0 in range(0, rows.shape[0], _LOAD_ROWS):
        part = rows[r0:r0 + _LOAD_ROWS]
        dst = out[r0:r0 + part.shape[0]]
        if gpu is not None:
            gpu.gguf_dequantize(gpu.pack_gguf(part.contiguous(), qtype, k, device), qtype, k, packed=True, out=dst)
        else:
            dst.copy_(dequantize(part.cpu(), qtype, (part.shape[0], k)))
    return out


def _checked_ids(token_ids, num_embeddings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as a tensor, flattened to int64), every id in [0, num_embeddings)."""
    ids = torch.as_tensor(token_ids)
    flat = ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_embeddings):
        raise IndexError(f"token ids must be in [0, {num_embeddings}), "
                         f"got {int(flat.min())}..{int(flat.max())}")
    return ids, flat


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
    ids, flat = _checked_ids(token_ids, num_embeddings)
    if gguf_ops.supports(qtype):
        out = gguf_ops.dequant_rows(table.contiguous(), qtype, int(dim), flat)
    else:
        out = dequantize(table.index_select(0, flat), qtype, (flat.numel(), int(dim)))
    return out.reshape(*ids.shape, int(dim))
