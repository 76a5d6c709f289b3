// GGUF matrix products for a few to many activation rows on integer tensor cores (llama.cpp's MMQ
// scheme): activations in 8 bits per 32 (int8_act), each weight tile decoded to int8 codes and a float
// scale (and minimum) per group of G = 32 or 16 weights in shared memory, one `mma.sync` s8 product per
// group (m16n8k32 or m16n8k16), and the scales applied to each group's integer product in float:
//     y[m, n] += (s_w[n, g] * d_x[m, g]) * (codes[n, g] . xq[m, g]) - min_w[n, g] * s_x[m, g]
// (d_x, s_x: the activations' scale and scaled sum of their group of 32).  The Triton version of this
// issued each product as a synchronous wgmma with a barrier, one program an SM, and lost to the bf16
// tile kernel (NOTES, "integer tensor cores"); here the warps' mma.sync run freely between the tile's
// two barriers.
//
// Compiled after gguf_gemv.cu's helpers (the same program text).  The tile decoders (``<type>_tile``)
// also compile as host C++: tests/test_cuda_gguf.py checks them against gguf's dequantization.
// The kernel, once per type (MMQ = the decoder's prefix, MMQ_UNITS its units a step of 256 weights,
// MMQ_G its group, MMQ_MIN whether it has minimums): grid (ceil(N / BN), ceil(M / BM), splits of K);
// 128 threads (4 warps, 16 weight rows each, all BM activation rows).  part[z, m, n]: split z's float32
// sum (the caller adds the splits in order).

#define BN 64         // weight rows a block
#define BM 64         // activation rows a block
#define KB 256        // weights a step
#define LD (KB + 16)  // bytes a row in shared memory: fragment loads of 8 rows x 4 words fall in 32 banks

struct alignas(16) MmqTile {
    i8 w[BN][LD];
    i8 x[BM][LD];
    float ws[BN][16], wm[BN][16];  // the weights' scale and minimum of each group (32: entries 0-7)
    float xd[BM][8], xs[BM][8];    // the activations' scale and scaled sum of each 32
};

DEV void st16(i8* p, W4 v) {  // 16 bytes to a 16-byte aligned place (shared memory in the kernel)
#if defined(__CUDA_ARCH__)
    *(uint4*)p = make_uint4(v.x, v.y, v.z, v.w);
#else
    memcpy(p, &v, 16);
#endif
}

// ---- tile decoders: unit u of 256-weight step `step` of weight row `row` (packed as pack_gguf) into
// tile row r: its int8 codes at their weights' places, its groups' scales (and minimums) --------------

// Q4_K: unit p (0..3): the 32 bytes whose low nibbles are sub-block 2p's codes and high nibbles 2p + 1's.
#define Q4_K_UNITS 4
#define Q4_K_G 32
#define Q4_K_MIN 1
DEV void q4_k_tile(MmqTile& t, int r, const u8* row, int hdr_start, int step, int p, const u32* lut) {
    const u8 *body = row + Q4_K_BODY * step, *hdr = row + hdr_start + Q4_K_HDR * step;
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

// Q6_K: unit (n, i) = 2n + i: weights 128n + 32j + 16i + l (j, l as gguf_gemv.cu's pieces), codes q - 32,
// groups of 16 with int8 scales.
#define Q6_K_UNITS 4
#define Q6_K_G 16
#define Q6_K_MIN 0
DEV void q6_k_tile(MmqTile& t, int r, const u8* row, int hdr_start, int step, int u, const u32* lut) {
    const u8 *body = row + Q6_K_BODY * step, *hdr = row + hdr_start + Q6_K_HDR * step;
    const int n = u >> 1, i = u & 1;
    const W4 qa = ld_stream(body + 64 * n + 16 * i), qb = ld_stream(body + 64 * n + 32 + 16 * i),
             qc = ld_stream(body + 128 + 32 * n + 16 * i);
    const u32 m = 0x0F0F0F0F, m2 = 0x30303030, off = 0x20202020;
    const u32 a[4] = {qa.x, qa.y, qa.z, qa.w}, b[4] = {qb.x, qb.y, qb.z, qb.w}, c[4] = {qc.x, qc.y, qc.z, qc.w};
    const float d = half_to_float(ld_u16(hdr + 16));
    for (int j = 0; j < 4; j++) {  // ql's low nibbles (j = 0, 1) or high (2, 3) of qa (even j) or qb
        u32 v[4];
        for (int k = 0; k < 4; k++) {
            u32 lo = ((j & 1 ? b[k] : a[k]) >> (j & 2 ? 4 : 0)) & m, hi = ((c[k] >> (2 * j)) << 4) & m2;
            v[k] = ((lo | hi) | 0x80808080u) - off;  // bytes q - 32 without borrows (bit 7 set first, then cleared)
            v[k] ^= 0x80808080u;
        }
        W4 vv = {v[0], v[1], v[2], v[3]};
        st16(&t.w[r][128 * n + 32 * j + 16 * i], vv);
        t.ws[r][8 * n + 2 * j + i] = d * (float)(int)(i8)ld_field<unsigned char>(hdr + 8 * n + 2 * j + i);
    }
}

// Q8_0: 32-weight blocks: unit u is block 8 * step + u.
#define Q8_0_UNITS 8
#define Q8_0_G 32
#define Q8_0_MIN 0
DEV void q8_0_tile(MmqTile& t, int r, const u8* row, int hdr_start, int step, int u, const u32* lut) {
    const int blk = 8 * step + u;
    const u8* body = row + Q8_0_BODY * blk;
    st16(&t.w[r][32 * u], ld_stream(body));
    st16(&t.w[r][32 * u + 16], ld_stream(body + 16));
    t.ws[r][u] = half_to_float(ld_u16(row + hdr_start + Q8_0_HDR * blk));
}

// IQ2_XXS: unit u is group u (32 weights: four grid entries, their signs and a 4-bit scale); the grid's
// words from the table in global memory (lut from word 128 on, as the GEMV's shared copy).
#define IQ2_XXS_UNITS 8
#define IQ2_XXS_G 32
#define IQ2_XXS_MIN 0
DEV void iq2_xxs_tile(MmqTile& t, int r, const u8* row, int hdr_start, int step, int u, const u32* lut) {
    const u8* body = row + IQ2_XXS_BODY * step + 8 * u;
    const u32 idx = ld_u32(body), aux = ld_u32(body + 4);
    const u32* grid = lut + 128;
    u32 v[8];
    for (int e = 0; e < 4; e++) {
        const u32 k = (idx >> (8 * e)) & 0xFF;
        const Signs sg = ksigns((aux >> (7 * e)) & 127);
        const u32 s0 = spread(sg.lo), s1 = spread(sg.hi);
        v[2 * e] = (ld_field<unsigned int>((const u8*)(grid + 2 * k)) ^ (s0 * 0xFF)) + s0;
        v[2 * e + 1] = (ld_field<unsigned int>((const u8*)(grid + 2 * k + 1)) ^ (s1 * 0xFF)) + s1;
    }
    W4 a = {v[0], v[1], v[2], v[3]}, b = {v[4], v[5], v[6], v[7]};
    st16(&t.w[r][32 * u], a);
    st16(&t.w[r][32 * u + 16], b);
    t.ws[r][u] = 0.125f * half_to_float(ld_u16(row + hdr_start + IQ2_XXS_HDR * step)) * (float)(2 * (int)(aux >> 28) + 1);
}

// ---- the kernel ------------------------------------------------------------------------------------

#if defined(__CUDACC__) && defined(MMQ)
#define MMQ_THREADS 128
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif

DEV void mma_k32(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
DEV void mma_k16(int* c, u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS) KERNEL(
        const u8* __restrict__ w, const i8* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, float* __restrict__ part, const u32* __restrict__ lut, int N, int M,
        int row_bytes, int hdr_start, int n_steps, int stride_xq, int stride_xd) {
    __shared__ MmqTile t;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int s0 = (int)((long long)n_steps * blockIdx.z / gridDim.z);
    const int s1 = (int)((long long)n_steps * (blockIdx.z + 1) / gridDim.z);
    float acc[BM / 8][4];
#pragma unroll
    for (int j = 0; j < BM / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const int ra = 16 * warp + g;  // this thread's weight rows ra and ra + 8 of the tile
    for (int step = s0; step < s1; step++) {
        // the weight tile: BN rows x MMQ_UNITS units (rows past N decode row N - 1: not stored)
        for (int u = tid; u < BN * MMQ_UNITS; u += MMQ_THREADS) {
            const int r = u / MMQ_UNITS;
            CAT(MMQ, _tile)(t, r, w + (long long)min(n0 + r, N - 1) * row_bytes, hdr_start, step, u % MMQ_UNITS, lut);
        }
        // the activation tile: BM rows x 16 pieces of 16 bytes (rows past M are zeros)
        for (int u = tid; u < BM * 16; u += MMQ_THREADS) {
            const int r = u >> 4, c = u & 15, mm = m0 + r;
            W4 v = {0u, 0u, 0u, 0u};
            if (mm < M) v = ld16(xq + (long long)mm * stride_xq + KB * step + 16 * c);
            st16(&t.x[r][16 * c], v);
        }
        for (int u = tid; u < BM * 8; u += MMQ_THREADS) {
            const int r = u >> 3, s = u & 7, mm = m0 + r;
            const bool ok = mm < M;
            t.xd[r][s] = ok ? ldf(xd + (long long)mm * stride_xd + 8 * step + s) : 0.0f;
            t.xs[r][s] = ok ? ldf(xs + (long long)mm * stride_xd + 8 * step + s) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < KB / MMQ_G; s++) {  // group s of MMQ_G weights
            const i8* wa = &t.w[ra][MMQ_G * s + 4 * q];
            const i8* wb = &t.w[ra + 8][MMQ_G * s + 4 * q];
            const float sa = t.ws[ra][s], sb = t.ws[ra + 8][s];
#if MMQ_MIN
            const float ma = t.wm[ra][s], mb = t.wm[ra + 8][s];
#endif
            const int gx = s * MMQ_G / 32;  // the activations' group of 32
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                const i8* xb = &t.x[8 * j + g][MMQ_G * s + 4 * q];
                int c[4] = {0, 0, 0, 0};
#if MMQ_G == 32
                mma_k32(c, *(const u32*)wa, *(const u32*)wb, *(const u32*)(wa + 16), *(const u32*)(wb + 16),
                        *(const u32*)xb, *(const u32*)(xb + 16));
#else
                mma_k16(c, *(const u32*)wa, *(const u32*)wb, *(const u32*)xb);
#endif
                const int mc = 8 * j + 2 * q;  // this thread's activation rows mc and mc + 1 of the tile
                const float d0 = t.xd[mc][gx], d1 = t.xd[mc + 1][gx];
                float y0 = acc[j][0], y1 = acc[j][1], y2 = acc[j][2], y3 = acc[j][3];
#if MMQ_MIN
                const float e0 = t.xs[mc][gx], e1 = t.xs[mc + 1][gx];
                y0 = fmaf(-ma, e0, y0);
                y1 = fmaf(-ma, e1, y1);
                y2 = fmaf(-mb, e0, y2);
                y3 = fmaf(-mb, e1, y3);
#endif
                acc[j][0] = fmaf(sa * d0, (float)c[0], y0);
                acc[j][1] = fmaf(sa * d1, (float)c[1], y1);
                acc[j][2] = fmaf(sb * d0, (float)c[2], y2);
                acc[j][3] = fmaf(sb * d1, (float)c[3], y3);
            }
        }
        __syncthreads();
    }
    float* out = part + (long long)blockIdx.z * M * N;
#pragma unroll
    for (int j = 0; j < BM / 8; j++) {
        const int mc = m0 + 8 * j + 2 * q, na = n0 + ra;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int mm = mc + (i & 1), nn = na + 8 * (i >> 1);
            if (mm < M && nn < N) out[(long long)mm * N + nn] = acc[j][i];
        }
    }
}
#endif
