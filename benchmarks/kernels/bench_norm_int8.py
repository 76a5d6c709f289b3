"""RMSNorm (1 row of 4096, residual) and the gated activation (1 row of 14336) with and without writing the
8-bit form (int8_act), RMSNorm by num_warps: us a launch inside a CUDA graph of 100 launches; and the
separate quantization launch the form replaces. Needs a CUDA GPU:  python benchmarks/kernels/bench_norm_int8.py"""
import torch
from triton.testing import do_bench_cudagraph

from pocketllm.kernels.triton import fused, int8_act

dev = "cuda"
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
r = torch.randn_like(x)
w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
out, ro = torch.empty_like(x), torch.empty_like(x)
q = int8_act.Int8Activations.empty(1, 4096, dev)
def norm(nw, int8):
    def f():
        for _ in range(100):
            fused._rms_norm_kernel[(1,)](x, r, w, out, ro, *q, 4096, 128, 4096, 4096, 4096, 4096, 4096, 1e-5, 0.0,
                                         HAS_RES=True, BLOCK=4096, INT8=int8, num_warps=nw)
    return f
for nw in (4, 8, 16):
    for int8 in (False, True):
        print(f"rms_norm warps={nw} int8={int8}: {do_bench_cudagraph(norm(nw, int8), rep=200) * 10:.2f} us")
def quant():
    for _ in range(100):
        int8_act.quantize_activations(x)
print(f"quantize 4096: {do_bench_cudagraph(quant, rep=200) * 10:.2f} us")
gu = torch.randn(1, 2 * 14336, device=dev, dtype=torch.bfloat16)
for rows in (0, 1):
    def g():
        for _ in range(100):
            fused.gated_act(gu, 0, int8_rows=rows)
    print(f"gated_act 14336 int8_rows={rows}: {do_bench_cudagraph(g, rep=200) * 10:.2f} us")
