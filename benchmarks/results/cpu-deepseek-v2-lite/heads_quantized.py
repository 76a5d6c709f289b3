import torch, numpy as np, time, sys
from gguf import GGMLQuantizationType as T, quants
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.quant.quantize import quantize
torch.set_num_threads(2)
def make(qt, H, N, K, seed):
    rng = np.random.default_rng(seed)
    q = quantize(rng.standard_normal((H*N, K)).astype(np.float32)*0.05, qt, search=False)
    raw = torch.from_numpy(q).view(torch.uint8).reshape(H*N, -1).contiguous()
    deq = torch.from_numpy(quants.dequantize(raw.numpy(), qt)).reshape(H, N, K).float()
    return raw, deq
H, L = 16, 27
layers = []
for i in range(L):
    kb, kdeq = make(T.Q5_0, H, 512, 128, i); vb, vdeq = make(T.Q4_K, H, 128, 512, 100+i)
    layers.append((kb, vb, gguf_ops.row_pointers([kb]), gguf_ops.row_pointers([vb]), kdeq.transpose(1,2).contiguous(), vdeq.contiguous()))
x = torch.randn(H, 1, 128); o = torch.randn(H, 1, 512)
def c():
    for l in layers: gguf_ops.heads_gemm(x, l[2], 512, T.Q5_0, 1); gguf_ops.heads_gemm(o, l[3], 128, T.Q4_K, 1)
def bmm():
    for l in layers: torch.bmm(x, l[4]); torch.bmm(o, l[5].transpose(1,2))
for rep in range(3):
  for name, f in [("c", c), ("bmm", bmm)]:
    f()
    t=time.perf_counter()
    for _ in range(10): f()
    print(name, round((time.perf_counter()-t)/10*1e3, 2), "ms per 27 layers")
