// bf16 / fp16 matrix-vector products for a few activation rows (decode), written for streaming the
// weights at memory speed: a mixture of experts' pairs at batch 1 (Qwen3-30B-A3B's 8 experts a token,
// 13.2 + 8.2 us a layer against the Triton grouped GEMV's 16.3 + 8.7, results/h200-dense-gemv.txt).
//
// The layout is gguf_gemv.cu's:
//   - a "piece" is 16 bytes of a weight row (8 values); consecutive threads take consecutive pieces, so
//     a warp's loads are contiguous, and weights are loaded with an L1 no-allocate hint (read once);
//   - a block of NT threads computes R rows for all M activation rows: each thread loads its piece of
//     every activation row once (L1-cached) and reuses it for the R rows;
//   - per thread one float accumulator a row and activation row, reduced by warp shuffles and shared
//     memory at the end, in an order fixed by K, R and NT alone: a row's bits do not depend on M.
// Otherwise block row blockIdx.y takes activation rows blockIdx.y * MAXM onwards (M rows in all).
// GROUPED: block row blockIdx.y is a (token, expert) pair p: weights of matrix ids[p] of a stack of N-row
// matrices, activation row p / x_div (mixture-of-experts pairs), output row p.
// FP8: the weights are block-scaled float8 e4m3 (quant/fp8.py): a piece is 16 values, all in one BR x BC
// tile of `scale`; a piece's 16 products are summed in float32 and the sum times the tile's scale added to
// the row's sum (kernels/triton/fp8.py's order of scaling, so decode and prompt rows agree closely).

typedef unsigned int u32;
typedef unsigned short u16;

struct V4 { u32 x, y, z, w; };

__device__ __forceinline__ V4 ld_stream(const void* p) {  // 16 bytes of weights, read once
    V4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ V4 ld_act(const u16* p) {  // 16 bytes of activations (reused: L1)
    return *reinterpret_cast<const V4*>(p);
}

#if HALF
__device__ __forceinline__ float lo(u32 v) {
    float f;
    asm("{.reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(v));
    return f;
}
__device__ __forceinline__ float hi(u32 v) { return lo(v >> 16); }
#else
__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }
#endif

__device__ __forceinline__ float dot8(float acc, V4 w, V4 x) {  // in order: the 8 values of the piece
    acc = fmaf(lo(w.x), lo(x.x), acc);
    acc = fmaf(hi(w.x), hi(x.x), acc);
    acc = fmaf(lo(w.y), lo(x.y), acc);
    acc = fmaf(hi(w.y), hi(x.y), acc);
    acc = fmaf(lo(w.z), lo(x.z), acc);
    acc = fmaf(hi(w.z), hi(x.z), acc);
    acc = fmaf(lo(w.w), lo(x.w), acc);
    return fmaf(hi(w.w), hi(x.w), acc);
}

#if FP8
// byte i of v, an e4m3 value, as a float: its sign to bit 31 and its exponent and mantissa to bits 26..20
// give a float 2^-120 times the value (subnormals too), so times 2^120 (exact) is the value. Integer and
// float operations: sm_90 issues conversions (cvt) at a fraction of their rate, and they would bound decode.
__device__ __forceinline__ float e4m3(u32 v, int i) {
    const u32 b = v >> (8 * i);
    return __uint_as_float(((b << 24) & 0x80000000u) | ((b << 20) & 0x07F00000u)) * 0x1p120f;
}

__device__ __forceinline__ void widen16(float* f, V4 w) {  // a piece's 16 e4m3 values, in order
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[i] = e4m3(w.x, i);
        f[4 + i] = e4m3(w.y, i);
        f[8 + i] = e4m3(w.z, i);
        f[12 + i] = e4m3(w.w, i);
    }
}

__device__ __forceinline__ void act16(float* f, V4 a, V4 b) {  // 16 activations (two loads), in order
    const u32 v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        f[2 * i] = lo(v[i]);
        f[2 * i + 1] = hi(v[i]);
    }
}
#define VALS 16
#else
#define VALS 8
#endif

__device__ __forceinline__ float load_bias(const u16* b, int i) {
    return lo((u32)b[i]);
}

__device__ __forceinline__ u16 round_out(float v) {
#if HALF
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#else
    u32 b = __float_as_uint(v);
    if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu)) return (u16)((b >> 16) | 0x40);  // NaN stays NaN
    b += 0x7FFF + ((b >> 16) & 1);  // round to nearest even
    return (u16)(b >> 16);
#endif
}

// __launch_bounds__(NT, 1): every row's loads issue before the products (gguf_gemv.cu's finding)
extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL(
        const void* __restrict__ w, const u16* __restrict__ x, u16* __restrict__ y, const u16* __restrict__ bias,
        const long long* __restrict__ ids, int N, int K, int M, int x_div, int stride_x, int stride_y,
        int has_bias, const float* __restrict__ scale, int stride_s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * R;
    long long base = 0;
    int xm = 0, ym = 0;
#if GROUPED
    base = ids[blockIdx.y] * (long long)N;
    xm = blockIdx.y / x_div;
    ym = blockIdx.y;
    M = 1;
#else
    xm = ym = blockIdx.y * MAXM;  // block row blockIdx.y: activation rows xm .. xm + MAXM - 1
    M = min(M - xm, MAXM);
#endif
#if FP8
    typedef unsigned char WT;
    const float* srow = scale + (n0 / BR) * (long long)stride_s;  // BR % R == 0: the block's rows share it
#else
    typedef u16 WT;
#endif
    const WT* rows[R];
#pragma unroll
    for (int r = 0; r < R; r++)  // rows past N read row N - 1 and are not stored
        rows[r] = (const WT*)w + (base + (n0 + r < N ? n0 + r : N - 1)) * (long long)K;
    float acc[R][MAXM];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < MAXM; m++) acc[r][m] = 0.0f;
    const int pieces = K / VALS;
#pragma unroll 2  // two pieces of each row in flight a thread
    for (int pc = threadIdx.x; pc < pieces; pc += NT) {
        V4 wv[R];
#pragma unroll
        for (int r = 0; r < R; r++) wv[r] = ld_stream(rows[r] + pc * VALS);
#if FP8
        const float s = srow[pc * VALS / BC];
        float wf[R][16];
#pragma unroll
        for (int r = 0; r < R; r++) widen16(wf[r], wv[r]);
#endif
#pragma unroll
        for (int m = 0; m < MAXM; m++) {
            if (m < M) {
                const u16* xp = x + (long long)(xm + m) * stride_x + pc * VALS;
#if FP8
                float xf[16];
                act16(xf, ld_act(xp), ld_act(xp + 8));
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float p = 0.0f;
#pragma unroll
                    for (int i = 0; i < 16; i++) p = fmaf(wf[r][i], xf[i], p);
                    acc[r][m] = fmaf(p, s, acc[r][m]);
                }
#else
                const V4 xv = ld_act(xp);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r][m] = dot8(acc[r][m], wv[r], xv);
#endif
            }
        }
    }
    __shared__ float part[NT / 32][R * MAXM];
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int m = 0; m < MAXM; m++) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
            if (lane == 0) part[warp][r * MAXM + m] = v;
        }
    }
    __syncthreads();
    const int i = threadIdx.x, r = i / MAXM, m = i % MAXM;
    if (i < R * MAXM && m < M && n0 + r < N) {
        float v = 0.0f;
#pragma unroll
        for (int j = 0; j < NT / 32; j++) v += part[j][i];
        if (has_bias) v += load_bias(bias, n0 + r);
        y[(long long)(ym + m) * stride_y + n0 + r] = round_out(v);
    }
}
