// GGUF matrix products for a few to many activation rows on integer tensor cores (llama.cpp's MMQ
// scheme): activations in 8 bits per 32 (int8_act), each weight tile decoded to int8 codes and float
// scale / minimum per 32 weights in shared memory, `mma.sync.m16n8k32.s8` per 32 weights, and the
// scales applied to each 32-weight product in float:
//     y[m, n] += (d_w[n, g] * d_x[m, g]) * (codes[n, g] . xq[m, g]) - min_w[n, g] * s_x[m, g]
// (s_x: the activations' scaled sum of group g).  The Triton version of this issued each product as a
// synchronous wgmma with a barrier, one program an SM, and lost to the bf16 tile kernel (NOTES, "integer
// tensor cores"); here the warps' mma.sync run freely between the tile's two barriers.
//
// Compiled after gguf_gemv.cu's helpers (the same program text), once per MMQ type: MMQ is the tile
// decoder's prefix (q4_k), MMQ_UNITS / MMQ_BODY / MMQ_HDR its units a block and the block's body and
// header bytes.
// Grid (ceil(N / BN), ceil(M / BM), splits of K); block 128 threads (4 warps, 16 weight rows each, all
// BM activation rows).  part[z, m, n]: split z's float32 sum (the caller adds the splits).

#if defined(__CUDACC__) && defined(MMQ)
#define BN 64         // weight rows a block
#define BM 64         // activation rows a block
#define KB 256        // weights a step (one 256-weight block)
#define LD (KB + 16)  // bytes a row in shared memory: fragment loads of 8 rows x 4 words fall in 32 banks
#define MMQ_THREADS 128
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif

struct __align__(16) MmqTile {
    i8 w[BN][LD];
    i8 x[BM][LD];
    float ws[BN][8], wm[BN][8];  // the weights' scale and minimum of each 32
    float xd[BM][8], xs[BM][8];  // the activations' scale and scaled sum of each 32
};

DEV void mma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEV void st16(i8* p, W4 v) { *(uint4*)p = make_uint4(v.x, v.y, v.z, v.w); }

// Q4_K: unit p of a row's block (p = 0..3): the 32 bytes whose low nibbles are sub-block 2p's codes and
// high nibbles 2p + 1's (gguf_gemv.cu's layout), with the two sub-blocks' d * sc and dmin * m.
#define Q4_K_UNITS 4
DEV void q4_k_tile(MmqTile& t, int r, const u8* body, const u8* hdr, int p) {
    const u32 m = 0x0F0F0F0F;
    W4 q0 = ld_stream(body + 32 * p), q1 = ld_stream(body + 32 * p + 16), h = ld16(hdr);
    W4 l0 = {q0.x & m, q0.y & m, q0.z & m, q0.w & m}, l1 = {q1.x & m, q1.y & m, q1.z & m, q1.w & m};
    W4 h0 = {(q0.x >> 4) & m, (q0.y >> 4) & m, (q0.z >> 4) & m, (q0.w >> 4) & m};
    W4 h1 = {(q1.x >> 4) & m, (q1.y >> 4) & m, (q1.z >> 4) & m, (q1.w >> 4) & m};
    st16(&t.w[r][64 * p], l0);
    st16(&t.w[r][64 * p + 16], l1);
    st16(&t.w[r][64 * p + 32], h0);
    st16(&t.w[r][64 * p + 48], h1);
    u32 sc, mn;
    k4_scales(h.y, h.z, h.w, p, sc, mn);
    float d = half_to_float(h.x), dmin = half_to_float(h.x >> 16);
    t.ws[r][2 * p] = d * (float)(sc & 0xFF);
    t.ws[r][2 * p + 1] = d * (float)(sc >> 8);
    t.wm[r][2 * p] = dmin * (float)(mn & 0xFF);
    t.wm[r][2 * p + 1] = dmin * (float)(mn >> 8);
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS) KERNEL(
        const u8* __restrict__ w, const i8* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, float* __restrict__ part, int N, int M, int row_bytes, int hdr_start,
        int n_blocks, int stride_xq, int stride_xd) {
    __shared__ MmqTile t;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int b0 = (int)((long long)n_blocks * blockIdx.z / gridDim.z);
    const int b1 = (int)((long long)n_blocks * (blockIdx.z + 1) / gridDim.z);
    float acc[BM / 8][4];
#pragma unroll
    for (int j = 0; j < BM / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int blk = b0; blk < b1; blk++) {
        // the weight tile: BN rows x MMQ_UNITS units (rows past N decode row N - 1: not stored)
        for (int u = tid; u < BN * MMQ_UNITS; u += MMQ_THREADS) {
            const int r = u / MMQ_UNITS, n = min(n0 + r, N - 1);
            const u8* row = w + (long long)n * row_bytes;
            CAT(MMQ, _tile)(t, r, row + MMQ_BODY * blk, row + hdr_start + MMQ_HDR * blk, u % MMQ_UNITS);
        }
        // the activation tile: BM rows x 16 pieces of 16 bytes (rows past M are zeros)
        for (int u = tid; u < BM * 16; u += MMQ_THREADS) {
            const int r = u >> 4, c = u & 15, mm = m0 + r;
            W4 v = {0u, 0u, 0u, 0u};
            if (mm < M) v = ld16(xq + (long long)mm * stride_xq + KB * blk + 16 * c);
            st16(&t.x[r][16 * c], v);
        }
        for (int u = tid; u < BM * 8; u += MMQ_THREADS) {
            const int r = u >> 3, s = u & 7, mm = m0 + r;
            const bool ok = mm < M;
            t.xd[r][s] = ok ? ldf(xd + (long long)mm * stride_xd + 8 * blk + s) : 0.0f;
            t.xs[r][s] = ok ? ldf(xs + (long long)mm * stride_xd + 8 * blk + s) : 0.0f;
        }
        __syncthreads();
        const int ra = 16 * warp + g;  // this thread's weight rows ra and ra + 8 of the tile
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const i8* wa = &t.w[ra][32 * s + 4 * q];
            const i8* wb = &t.w[ra + 8][32 * s + 4 * q];
            const u32 a0 = *(const u32*)wa, a1 = *(const u32*)wb, a2 = *(const u32*)(wa + 16),
                      a3 = *(const u32*)(wb + 16);
            const float s0 = t.ws[ra][s], s1 = t.ws[ra + 8][s], mn0 = t.wm[ra][s], mn1 = t.wm[ra + 8][s];
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                const i8* xb = &t.x[8 * j + g][32 * s + 4 * q];
                int c[4] = {0, 0, 0, 0};
                mma_s8(c, a0, a1, a2, a3, *(const u32*)xb, *(const u32*)(xb + 16));
                const int mc = 8 * j + 2 * q;  // this thread's activation rows mc and mc + 1 of the tile
                const float d0 = t.xd[mc][s], d1 = t.xd[mc + 1][s], e0 = t.xs[mc][s], e1 = t.xs[mc + 1][s];
                acc[j][0] = fmaf(s0 * d0, (float)c[0], fmaf(-mn0, e0, acc[j][0]));
                acc[j][1] = fmaf(s0 * d1, (float)c[1], fmaf(-mn0, e1, acc[j][1]));
                acc[j][2] = fmaf(s1 * d0, (float)c[2], fmaf(-mn1, e0, acc[j][2]));
                acc[j][3] = fmaf(s1 * d1, (float)c[3], fmaf(-mn1, e1, acc[j][3]));
            }
        }
        __syncthreads();
    }
    float* out = part + (long long)blockIdx.z * M * N;
#pragma unroll
    for (int j = 0; j < BM / 8; j++) {
        const int mc = m0 + 8 * j + 2 * q, na = n0 + 16 * warp + g;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int mm = mc + (i & 1), nn = na + 8 * (i >> 1);
            if (mm < M && nn < N) out[(long long)mm * N + nn] = acc[j][i];
        }
    }
}
#endif
