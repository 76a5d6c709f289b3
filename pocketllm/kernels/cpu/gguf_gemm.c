/* Matrix products with GGUF-quantized weights on the CPU.
 *
 * Each weight block is dequantized once into float32 (with the same formulas as the
 * reference dequantizers) and then multiplied with every activation row, so the
 * dequantization cost is shared by the whole batch and the weights are read once.
 * Rows of the weight matrix are split over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
#else
static inline float h2f(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { exp = 127 - 15 + 1; while (!(man & 0x400)) { man <<= 1; exp--; } man &= 0x3ff; bits = sign | (exp << 23) | (man << 13); }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
}
#endif

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
       Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
       IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, MXFP4 = 39 };

/* The sections, one file each (kernels/cpu/gguf_gemm/), in this order: each uses those before it. */
#include "gguf_gemm/dequant.h"
#include "gguf_gemm/int8.h"
#include "gguf_gemm/int8_lattice.h"
#include "gguf_gemm/x8.h"
#include "gguf_gemm/x8_k.h"

/* Y[B, N] = X[B, K] @ W[N, K]^T on the fast path (X quantized to 8 bits per block, see int8.h):
 * W a table of row pointers, or with `interleaved` the bytes gguf_repack_x8 wrote; -1 where the
 * type or the build has no such path. passes = 2 adds a second 8-bit pass over what the first
 * left (X minus its rounding), as further activation rows of the same kernel: about 15-bit
 * activations, for the output layer, whose top logits decide the sampled token. */
static int int8_gemm(int type, const void *W, int interleaved, int64_t N, int64_t K, const float *X, int64_t B,
                     float *Y, int passes, int nthreads) {
    if (passes < 1 || passes > 2) return -1;
    if (interleaved ? !gguf_x8_supported(type) || N % 8 : !gguf_int8_supported(type)) return -1;
#ifdef HAVE_INT8_DOT
    const int super = int8_k_lookup(type) != 0, qk = super ? 256 : 32;
    if (K % qk) return -1;
    const int64_t nblk = K / qk, rows = B * passes;
    int8_t *xq = malloc((size_t)(rows * K));
    float *xd = malloc((size_t)(rows * nblk) * sizeof(float));
    char *extra = malloc(super ? (size_t)(rows * K / 16) * sizeof(int16_t) : (size_t)(rows * nblk) * sizeof(float));
    float *rest = passes == 2 ? malloc((size_t)(B * K) * sizeof(float)) : 0;
    float *Yall = passes == 2 ? malloc((size_t)(rows * N) * sizeof(float)) : Y;
    int rc = 0;
    if (!xq || !xd || !extra || (passes == 2 && (!rest || !Yall))) {
        rc = -2;
        goto done;
    }
    const size_t extra_row = super ? (size_t)(K / 16) * sizeof(int16_t) : (size_t)nblk * sizeof(float);
    for (int pass = 0; pass < passes; pass++) {
        const float *src = pass ? rest : X;
        int8_t *q = xq + pass * B * K;
        float *d = xd + pass * B * nblk;
        void *e = extra + pass * B * extra_row;
        if (super) quantize_activations_k(src, B, K, q, d, e, nthreads);
        else quantize_activations(src, B, K, q, d, e, nthreads);
        if (pass == 0 && passes == 2)
            for (int64_t i = 0; i < B * K; i++) rest[i] = X[i] - (float)xq[i] * xd[i / qk];
    }
#ifdef HAVE_X8
    if (interleaved && type == Q4_K) {  /* its minimums take the activations' sums per 32 */
        const int16_t *xb = (const int16_t *)extra;
        int16_t *x32 = malloc((size_t)(rows * K / 32) * sizeof(int16_t));
        if (!x32) { rc = -2; goto done; }
        for (int64_t i = 0; i < rows * K / 32; i++) x32[i] = (int16_t)(xb[2 * i] + xb[2 * i + 1]);
        q4_k_x8_gemm(W, N, K, xq, xd, x32, rows, Yall, nthreads);
        free(x32);
    } else
#endif
#ifdef X8_512
    if (interleaved && type == Q2_K) {  /* its minimums take the activations' sums per 16 */
        q2_k_x8_gemm(W, N, K, xq, xd, (const int16_t *)extra, rows, Yall, nthreads);
    } else if (interleaved && (type == Q6_K || type == Q3_K)) {  /* their signed codes take unsigned activations */
        uint8_t *xu = malloc((size_t)(rows * K));
        if (!xu) { rc = -2; goto done; }
        for (int64_t i = 0; i < rows * K; i++) xu[i] = (uint8_t)(xq[i] ^ 0x80);  /* x + 128 */
        if (type == Q6_K) q6_k_x8_gemm(W, N, K, xu, xd, rows, Yall, nthreads);
        else q3_k_x8_gemm(W, N, K, xu, xd, rows, Yall, nthreads);
        free(xu);
    } else
#endif
#ifdef HAVE_X8
    if (interleaved) x8_gemm(type, W, N, K, xq, xd, (const float *)extra, rows, Yall, nthreads);
    else
#endif
    if (super) int8_k_lookup(type)(W, N, K, xq, xd, (const int16_t *)extra, rows, Yall, nthreads);
    else int8_lookup(type)(W, N, K, xq, xd, (const float *)extra, rows, Yall, nthreads);
    if (passes == 2)
        for (int64_t i = 0; i < B * N; i++) Y[i] = Yall[i] + Yall[B * N + i];
done:
    free(xq); free(xd); free(extra); free(rest);
    if (Yall != Y) free(Yall);
    return rc;
#else
    return 0;
#endif
}

int gguf_gemm_int8(int type, const uint8_t *const *W, int64_t N, int64_t K, const float *X, int64_t B, float *Y,
                   int passes, int nthreads) {
    return int8_gemm(type, W, 0, N, K, X, B, Y, passes, nthreads);
}

/* H products at once, Y[h] [B, N] = X[h] [B, K] @ W_h^T, W_h rows h * N .. h * N + N - 1 of the pointer
 * table: MLA's absorbed heads on decode rows, each head its own small matrix (a deepseek2 file's
 * attn_k_b and attn_v_b). The heads split over the threads, each product on one: a head's matrix is
 * too small to share. */
int gguf_heads_gemm_int8(int type, const uint8_t *const *W, int64_t H, int64_t N, int64_t K, const float *X,
                         int64_t B, float *Y, int passes, int nthreads) {
    int rc = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) reduction(|:rc)
    for (int64_t h = 0; h < H; h++)
        rc |= int8_gemm(type, W + h * N, 0, N, K, X + h * B * K, B, Y + h * B * N, passes, 1);
    return rc;
}

/* The same over W repacked by gguf_repack_x8. */
int gguf_gemm_x8(int type, const uint8_t *Wp, int64_t N, int64_t K, const float *X, int64_t B, float *Y,
                 int passes, int nthreads) {
    return int8_gemm(type, Wp, 1, N, K, X, B, Y, passes, nthreads);
}

/* Rows `ids` of a matrix repacked by gguf_repack_x8, dequantized exactly -> out [rows, K]
 * (an embedding table that is also the output layer). */
int gguf_dequant_rows_x8(int type, const uint8_t *Wp, int64_t N, int64_t K, const int64_t *ids, int64_t rows,
                         float *out, int nthreads) {
    int sb, nb, qk, nbytes;
    const deq_fn deq = lookup(type, &qk, &nbytes);
    if (!gguf_x8_supported(type) || !deq || N % 8 || K % qk) return -1;
    const x8_super *L = x8_super_layout(type);
    if (L && !L->deq) return -1;
    if (L) {
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * K >= 65536)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < K / 256; j++)
                L->deq(Wp + ((ids[i] / 8) * (K / 256) + j) * L->group_bytes, (int)(ids[i] % 8), out + i * K + j * 256);
        return 0;
    }
    x8_layout(type, &sb, &nb);
    const int64_t nblk = K / 32;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * K >= 65536)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t g = ids[i] / 8, r = ids[i] % 8;
        uint8_t block[34];  /* the row's block as the file has it */
        for (int64_t j = 0; j < nblk; j++) {
            x8_move(type, sb, (uint8_t *)Wp + (g * nblk + j) * 8 * nb, block, (int)r, 0);
            deq(block, out + i * K + j * 32);
        }
    }
    return 0;
}
