"""pocketllm.quant.dequant must reproduce gguf.quants.dequantize bit for bit."""

import gguf
import numpy as np
import pytest
import torch

from pocketllm.core import gguf_types
from pocketllm.core.gguf_types import SUPPORTED_TYPES
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.quant.dequant import dequantize

T = gguf.GGMLQuantizationType
ALL = sorted(SUPPORTED_TYPES, key=lambda t: t.value)

# byte offsets of the fp16 scale fields inside one block
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0],
    T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
}


def finite_f16_bits(rng, n):
    """Random fp16 bit patterns (subnormals and extremes included), never inf/NaN."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where(((b >> 10) & 0x1F) == 0x1F, b & ~np.uint16(0x4000), b).astype(np.uint16)


def random_blocks(rng, qtype, rows, cols):
    """Random bytes for a [rows, cols] tensor, fp16 scale fields made finite."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // bs
    blk = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    if qtype == T.F16:
        blk = finite_f16_bits(rng, nb).view(np.uint8).reshape(nb, ts)
    for off in F16_FIELDS.get(qtype, []):
        blk[:, off:off + 2] = finite_f16_bits(rng, nb).view(np.uint8).reshape(nb, 2)
    if qtype == T.IQ1_M:  # fp16 super-scale lives in the top nibbles of 4 scale words
        sc = blk[:, 48:56].copy().view(np.uint16)
        v = finite_f16_bits(rng, nb)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((v >> (4 * i)) & 0xF) << 12)
        blk[:, 48:56] = sc.view(np.uint8)
    return blk.reshape(rows, cols // bs * ts)


def reference(raw, qtype, rows, cols):
    ref = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(ref))


def assert_bits_equal(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.float32
    same = out.view(torch.int32) == ref.view(torch.int32)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


def test_sizes_come_from_gguf():
    assert len(SUPPORTED_TYPES) == 23
    for t in SUPPORTED_TYPES:
        assert (gguf_types.block_size(t), gguf_types.type_size(t)) == gguf.GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,nblocks", [(1, 1), (3, 2), (4, 5)])
def test_bit_exact_vs_gguf(qtype, rows, nblocks):
    rng = np.random.default_rng(1000 * qtype.value + 10 * rows + nblocks)
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = nblocks * (bs if bs > 1 else 32)
    raw = random_blocks(rng, qtype, rows, cols)
    out = dequantize(torch.from_numpy(raw), qtype, (rows, cols))
    assert_bits_equal(out, reference(raw, qtype, rows, cols))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ2_XS, T.Q8_0], ids=lambda t: t.name)
def test_any_byte_layout_and_logical_shape(qtype):
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, qtype, 6, 512)
    ref = reference(raw, qtype, 6, 512)
    flat = torch.from_numpy(raw.reshape(-1))
    assert_bits_equal(dequantize(flat, qtype, (6, 512)), ref)
    out3 = dequantize(flat, qtype, (2, 3, 512))
    assert_bits_equal(out3.reshape(6, 512), ref)
    half = dequantize(flat, qtype, (6, 512), dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, ref.half())


def test_float_tensors_as_reader_gives_them():
    # GGUFReader hands F16/F32 tensors over as float arrays, not bytes
    x = torch.randn(3, 64)
    assert torch.equal(dequantize(x, T.F32, (3, 64)), x)
    assert torch.equal(dequantize(x.half(), T.F16, (3, 64)), x.half().float())
    bf = x.bfloat16()
    assert torch.equal(dequantize(bf.view(torch.uint8), T.BF16, (3, 64)), bf.float())


def test_roundtrip_through_gguf_file(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {t: random_blocks(rng, t, 4, 256) for t in (T.Q4_K, T.Q6_K, T.IQ4_NL, T.Q8_0)}
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for t, raw in tensors.items():
        w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for rt in gguf.GGUFReader(str(path)).tensors:
        rows, cols = (int(s) for s in reversed(rt.shape.tolist()))
        out = dequantize(torch.from_numpy(np.array(rt.data)), rt.tensor_type, (rows, cols))
        assert_bits_equal(out, reference(np.array(rt.data), rt.tensor_type, rows, cols))


def test_errors():
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(torch.zeros(35, dtype=torch.uint8), T.Q8_0, (1, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (1, 128))
    with pytest.raises(UnsupportedFeatureError, match="TQ1_0"):
        dequantize(torch.zeros(54, dtype=torch.uint8), T.TQ1_0, (1, 256))
