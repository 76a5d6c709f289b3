/* The float32 operations between the matmuls of a decoder layer, for the CPU fast path: each is
 * one call where torch takes several ops (and several microseconds of dispatch each), which at
 * batch 1 costs as much as the matmuls of a small model. Not bit-identical to torch (sums run
 * in another order), so the exact path keeps torch's ops.
 *
 * Reductions use `omp simd reduction`, which lets the compiler vectorize them in any order. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* y[r] = x[r] / rms(x[r]) * w, rows of `dim`. With `res`: x[r] + res[r] is normalized instead
 * and stored in res (the new residual stream). y may be x. */
int cpu_rms_norm(const float *x, float *res, const float *w, float *y, int64_t rows, int64_t dim, float eps,
                 int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *src = (float *)xr;
        if (res) {
            src = res + r * dim;
            #pragma omp simd
            for (int64_t i = 0; i < dim; i++) src[i] += xr[i];
        }
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += src[i] * src[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        float *yr = y + r * dim;
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = src[i] * inv * w[i];
    }
    return 0;
}

/* One head of D values rotated in place by the table rows c, s (D / 2 each). */
static inline void rotate_head(float *x1, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    float *x2 = x1 + half;
    #pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
    }
}

/* Rotary embedding (rotate-half layout), in place: heads h < H of token t start at
 * x + t * row_stride + h * D; cos and sin are [positions, D / 2] tables. */
int cpu_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t row_stride, const int64_t *pos,
               const float *cos_t, const float *sin_t) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            rotate_head(x + t * row_stride + h * D, D, cos_t + pos[t] * (D / 2), sin_t + pos[t] * (D / 2));
    return 0;
}

/* An 8-bit cache (pocketllm/core/kv_dtype.py): each of a token's hkv heads of d values as int8
 * values and a float32 scale, amax / 127, in the reference's arithmetic (nearest even). */
static void quantize_heads(const float *x, int64_t hkv, int64_t d, int8_t *q, float *scales) {
    for (int64_t h = 0; h < hkv; h++) {
        const float *xh = x + h * d;
        float m = 0.f;
        for (int64_t e = 0; e < d; e++) m = fabsf(xh[e]) > m ? fabsf(xh[e]) : m;
        const float s = m / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
        scales[h] = s;
        for (int64_t e = 0; e < d; e++) {
            const float y = nearbyintf(xh[e] * inv);
            q[h * d + e] = (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y);
        }
    }
}

/* A token's keys or values (hkv heads of d floats) into cache slot `slot`: copied, or quantized
 * where the cache is 8-bit (`scales` [slots, hkv] given). */
static inline void store_row(const float *x, int64_t hkv, int64_t d, void *cache, float *scales, int64_t slot) {
    if (scales) quantize_heads(x, hkv, d, (int8_t *)cache + slot * hkv * d, scales + slot * hkv);
    else memcpy((float *)cache + slot * hkv * d, x, (size_t)(hkv * d) * sizeof(float));
}

/* K and V of T tokens (hkv heads of d floats, rows k_stride and v_stride apart) into cache
 * slots; slot -1: nowhere. Caches are [slots, hkv, d]: floats, or int8 with `k_scales` and
 * `v_scales` [slots, hkv] (NULL for a float cache). */
int cpu_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t hkv,
                 int64_t d, const int64_t *slots, void *k_cache, void *v_cache, float *k_scales, float *v_scales) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        store_row(k + t * k_stride, hkv, d, k_cache, k_scales, slots[t]);
        store_row(v + t * v_stride, hkv, d, v_cache, v_scales, slots[t]);
    }
    return 0;
}

/* Blocks ids[0..n) of an int8 cache [blocks, bs, hkv, d] with scales [blocks, bs, hkv], dequantized
 * into out [n, bs, hkv, d] (value times its head's scale: the reference's one product). */
int cpu_gather_int8_blocks(const int8_t *cache, const float *scales, const int64_t *ids, int64_t n, int64_t bs,
                           int64_t hkv, int64_t d, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * bs * hkv * d >= 65536)
    for (int64_t r = 0; r < n * bs; r++) {
        const int64_t slot = ids[r / bs] * bs + r % bs;
        for (int64_t h = 0; h < hkv; h++) {
            const int8_t *q = cache + (slot * hkv + h) * d;
            const float s = scales[slot * hkv + h];
            float *o = out + (r * hkv + h) * d;
            #pragma omp simd
            for (int64_t e = 0; e < d; e++) o[e] = (float)q[e] * s;
        }
    }
    return 0;
}

/* exp(x) in float32 to within a few ulp, branch-free so that `omp simd` loops vectorize it:
 * x = n ln2 + r (|r| <= ln2 / 2), exp(r) by its degree-6 Taylor polynomial, 2^n in the exponent. */
#pragma omp declare simd
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = nearbyintf(x * 1.44269504f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n << 23;
    return u.f;
}

/* Attention of n single-token queries over their paged context.
 * qkv: [n, hq + 2 hkv, d] rows `q_stride` apart (queries, keys, values); caches [blocks, bs, hkv,
 * d] of floats, or of int8 with k_scales and v_scales [blocks, bs, hkv] (an 8-bit cache: a score is
 * scaled by its key's scale, a weight by its value's); tables [n, width] block ids; lens[i]: context length of query i (itself included);
 * window > 0: only its last `window` positions; softcap > 0: scores s become
 * softcap * tanh(s / softcap); sinks (or NULL): a logit per head that joins each softmax and
 * attends to nothing (gpt-oss), added where the chunks merge. out: [n, hq, d].
 * With `slots` (a decode-only step), the queries and keys are first rotated (cos/sin tables at
 * `pos`, unless cos_t is NULL) and the keys and values written into the cache; without, the
 * caller has done both.
 * Tasks are (query, chunk of its context) with all heads: a task reads whole cache rows (every
 * head of a position is adjacent), in order, which the prefetchers stream; a query's context is
 * split into chunks of at least MIN_CHUNK positions, a power of two of them up to MAX_CHUNKS (even
 * shares for 2, 4, 8 ... threads). Each chunk keeps its unnormalized output, maximum and sum per
 * head, merged at the end (flash decoding's split). Weights below e^-80 of the maximum count as 0:
 * no denormal arithmetic. */
#define MIN_CHUNK 64
#define MAX_CHUNKS 8
/* The cache slot of position p, and a cache's row there: `row` values of `es` bytes (4: float32,
 * 1: an 8-bit cache's int8). */
static inline int64_t slot_of(const int64_t *table, int64_t p, int64_t bs) { return table[p / bs] * bs + p % bs; }
static inline const void *cache_row(const void *cache, const int64_t *table, int64_t p, int64_t bs, int64_t row,
                                    int64_t es) {
    return (const char *)cache + slot_of(table, p, bs) * row * es;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
/* The sums of four vectors, as one vector of four (a transposing add: 13 operations, not 4 x 8). */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d x = _mm512_castps_pd(s01), y = _mm512_castps_pd(s23);
    const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Sixteen cache values from p (floats, or int8 widened exactly). */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int I8) {
    return I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)))
              : _mm512_loadu_ps((const float *)p);
}

/* Scores of G query heads (16 DV values each, hs apart in q; their rows of `scores` L apart) that
 * share key head g (values at offset koff of each cache row), over positions c0 .. c0 + L - 1: the
 * queries stay in registers, four positions at a time. An 8-bit cache's dot products are scaled
 * by their key's scale (ks [slots, hkv]). With `add`, the scores of a further piece of wider heads
 * are added to those there. */
static inline __attribute__((always_inline)) void qk_heads(const int DV, const int G, const int I8, const float *q,
        int64_t hs, int add, const void *k_cache, const float *ks, const int64_t *table, int64_t bs, int64_t row,
        int64_t koff, int64_t hkv, int64_t g, int64_t c0, int64_t L, float scale, float *scores) {
    const int64_t es = I8 ? 1 : 4;
    __m512 qv[4][8];
    for (int h = 0; h < G; h++)
        for (int v = 0; v < DV; v++) qv[h][v] = _mm512_loadu_ps(q + h * hs + 16 * v);
    const __m128 sc = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const int64_t s0 = slot_of(table, c0 + j, bs), s1 = slot_of(table, c0 + j + 1, bs);
        const int64_t s2 = slot_of(table, c0 + j + 2, bs), s3 = slot_of(table, c0 + j + 3, bs);
        const char *k0 = (const char *)k_cache + (s0 * row + koff) * es, *k1 = (const char *)k_cache + (s1 * row + koff) * es;
        const char *k2 = (const char *)k_cache + (s2 * row + koff) * es, *k3 = (const char *)k_cache + (s3 * row + koff) * es;
        const __m128 scj = I8 ? _mm_mul_ps(sc, _mm_setr_ps(ks[s0 * hkv + g], ks[s1 * hkv + g], ks[s2 * hkv + g],
                                                           ks[s3 * hkv + g])) : sc;
        for (int h = 0; h < G; h++) {
            __m512 a0 = _mm512_mul_ps(qv[h][0], load16(k0, I8)), a1 = _mm512_mul_ps(qv[h][0], load16(k1, I8));
            __m512 a2 = _mm512_mul_ps(qv[h][0], load16(k2, I8)), a3 = _mm512_mul_ps(qv[h][0], load16(k3, I8));
            for (int v = 1; v < DV; v++) {
                a0 = _mm512_fmadd_ps(qv[h][v], load16(k0 + 16 * v * es, I8), a0);
                a1 = _mm512_fmadd_ps(qv[h][v], load16(k1 + 16 * v * es, I8), a1);
                a2 = _mm512_fmadd_ps(qv[h][v], load16(k2 + 16 * v * es, I8), a2);
                a3 = _mm512_fmadd_ps(qv[h][v], load16(k3 + 16 * v * es, I8), a3);
            }
            __m128 sj = _mm_mul_ps(sum4(a0, a1, a2, a3), scj);
            if (add) sj = _mm_add_ps(_mm_loadu_ps(scores + h * L + j), sj);
            _mm_storeu_ps(scores + h * L + j, sj);
        }
    }
    for (; j < L; j++) {
        const int64_t s0 = slot_of(table, c0 + j, bs);
        const char *k0 = (const char *)k_cache + (s0 * row + koff) * es;
        const float scj = I8 ? scale * ks[s0 * hkv + g] : scale;
        for (int h = 0; h < G; h++) {
            __m512 a = _mm512_mul_ps(qv[h][0], load16(k0, I8));
            for (int v = 1; v < DV; v++) a = _mm512_fmadd_ps(qv[h][v], load16(k0 + 16 * v * es, I8), a);
            scores[h * L + j] = (add ? scores[h * L + j] : 0.f) + _mm512_reduce_add_ps(a) * scj;
        }
    }
}

/* o[h] = sum_j w[h, j] v_j for the G heads sharing value head g (16 DV values each, hs apart in o), their
 * outputs in registers over the whole chunk (an 8-bit cache's weights times their value's scale,
 * vs [slots, hkv]). */
static inline __attribute__((always_inline)) void pv_heads(const int DV, const int G, const int I8, const float *w,
        float *o, int64_t hs, const void *v_cache, const float *vs, const int64_t *table, int64_t bs, int64_t row,
        int64_t koff, int64_t hkv, int64_t g, int64_t c0, int64_t L) {
    const int64_t es = I8 ? 1 : 4;
    __m512 acc[4][8];
    for (int h = 0; h < G; h++)
        for (int v = 0; v < DV; v++) acc[h][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const int64_t s = slot_of(table, c0 + j, bs);
        const char *vr = (const char *)v_cache + (s * row + koff) * es;
        const float f = I8 ? vs[s * hkv + g] : 1.f;
        __m512 vv[8];
        for (int v = 0; v < DV; v++) vv[v] = load16(vr + 16 * v * es, I8);
        for (int h = 0; h < G; h++) {
            const __m512 wh = _mm512_set1_ps(w[h * L + j] * f);
            for (int v = 0; v < DV; v++) acc[h][v] = _mm512_fmadd_ps(wh, vv[v], acc[h][v]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int v = 0; v < DV; v++) _mm512_storeu_ps(o + h * hs + 16 * v, acc[h][v]);
}

/* Both for pieces of 64 and 128 values, in groups of up to 4 (64) or 2 (128) query heads, float or
 * 8-bit caches. */
#define HEADS_CASES(FN, DV, G, I8, ...)                                                             \
    switch ((DV) * 8 + (G)) {                                                                       \
    case 4 * 8 + 1: FN(4, 1, I8, __VA_ARGS__); break;                                               \
    case 4 * 8 + 2: FN(4, 2, I8, __VA_ARGS__); break;                                               \
    case 4 * 8 + 3: FN(4, 3, I8, __VA_ARGS__); break;                                               \
    case 4 * 8 + 4: FN(4, 4, I8, __VA_ARGS__); break;                                               \
    case 8 * 8 + 1: FN(8, 1, I8, __VA_ARGS__); break;                                               \
    case 8 * 8 + 2: FN(8, 2, I8, __VA_ARGS__); break;                                               \
    }
#define HEADS_DISPATCH(FN, DV, G, I8, ...)                                                          \
    do {                                                                                            \
        if (I8) { HEADS_CASES(FN, DV, G, 1, __VA_ARGS__) }                                          \
        else { HEADS_CASES(FN, DV, G, 0, __VA_ARGS__) }                                             \
    } while (0)
/* Head dims of 64 and 128 in one piece; wider multiples of 64 in pieces of 128 and a last one of 64
 * (DeepSeek's latent head, 576 = 4 x 128 + 64) piece by piece: the scores summed over the pieces,
 * the outputs written piece by piece. Returns 0 for a head dim it does not cover. */
static int attend_chunk_avx512(const float *q, const void *k_cache, const void *v_cache, const float *ks,
                               const float *vs, const int64_t *table, int64_t bs, int64_t hkv, int64_t d, int64_t hq,
                               int64_t c0, int64_t L, float scale, float *scores, float *o, int values) {
    if (d % 64) return 0;
    const int64_t group = hq / hkv, row = hkv * d;
    const int i8 = ks != NULL;
    for (int64_t off = 0; off < d; off += 128) {
        const int64_t DV = d - off >= 128 ? 8 : 4, most = DV == 4 ? 4 : 2;
        for (int64_t g = 0; g < hkv; g++)
            for (int64_t h0 = 0; h0 < group; h0 += most) {
                const int64_t G = group - h0 < most ? group - h0 : most, hh = g * group + h0;
                if (!values) {
                    HEADS_DISPATCH(qk_heads, DV, G, i8, q + hh * d + off, d, off > 0, k_cache, ks, table, bs, row,
                                   g * d + off, hkv, g, c0, L, scale, scores + hh * L);
                } else {
                    HEADS_DISPATCH(pv_heads, DV, G, i8, scores + hh * L, o + hh * d + off, d, v_cache, vs, table, bs,
                                   row, g * d + off, hkv, g, c0, L);
                }
            }
    }
    return 1;
}
#else
static int attend_chunk_avx512(const float *q, const void *k_cache, const void *v_cache, const float *ks,
                               const float *vs, const int64_t *table, int64_t bs, int64_t hkv, int64_t d, int64_t hq,
                               int64_t c0, int64_t L, float scale, float *scores, float *o, int values) {
    return 0;
}
#endif

int cpu_decode_attention(float *qkv, int64_t q_stride, void *k_cache, void *v_cache, float *k_scales,
                         float *v_scales, int64_t bs, int64_t hkv, int64_t d, int64_t hq, const int64_t *tables,
                         int64_t width, const int64_t *lens, int64_t n, float scale, int64_t window, float softcap,
                         const float *sinks, float *out, const int64_t *slots, const int64_t *pos,
                         const float *cos_t, const float *sin_t, int nthreads) {
    const int64_t group = hq / hkv, row = hkv * d;
    const int i8 = k_scales != NULL;
    const int64_t es = i8 ? 1 : 4;
    if (slots)
        for (int64_t i = 0; i < n; i++) {
            float *q = qkv + i * q_stride, *k = q + hq * d, *v = k + hkv * d;
            if (cos_t) {
                const float *c = cos_t + pos[i] * (d / 2), *s = sin_t + pos[i] * (d / 2);
                for (int64_t h = 0; h < hq + hkv; h++) rotate_head(q + h * d, d, c, s);
            }
            store_row(k, hkv, d, k_cache, k_scales, slots[i]);
            store_row(v, hkv, d, v_cache, v_scales, slots[i]);
        }
    /* A row's chunks follow from its own context length alone, never from the rest of the batch
     * or the thread count: a query's output is the same bits whatever else the step holds (a
     * speculative step's rows against plain decoding, one sequence against many) and on any
     * number of threads. */
    int64_t *first = malloc((size_t)(n + 1) * sizeof(int64_t)), most = 1;  /* first[i]: row i's first task */
    if (!first) return -2;
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t m = window > 0 && lens[i] > window ? window : lens[i];
        int64_t chunks = 1;
        while (chunks < MAX_CHUNKS && 2 * chunks * MIN_CHUNK <= m) chunks *= 2;
        first[i + 1] = first[i] + chunks;
        most = (m + chunks - 1) / chunks > most ? (m + chunks - 1) / chunks : most;
    }
    const int64_t tasks = first[n];
    int64_t *task_row = malloc((size_t)tasks * sizeof(int64_t));
    float *part = malloc((size_t)(tasks * hq * (d + 2)) * sizeof(float));  /* per task: [hq, d] out, max, sum */
    if (!part || !task_row) { free(part); free(task_row); free(first); return -2; }
    for (int64_t i = 0; i < n; i++)
        for (int64_t t = first[i]; t < first[i + 1]; t++) task_row[t] = i;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc((size_t)(most * hq) * sizeof(float));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t i = task_row[task], chunks = first[i + 1] - first[i], c = task - first[i], len = lens[i];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            const int64_t cl = (len - start + chunks - 1) / chunks, c0 = start + c * cl;
            const int64_t c1 = c0 + cl < len ? c0 + cl : len, L = c1 > c0 ? c1 - c0 : 0;
            const int64_t *table = tables + i * width;
            const float *q = qkv + i * q_stride;
            float *o = part + task * hq * (d + 2), *mx = o + hq * d, *sum = mx + hq;
            memset(o, 0, (size_t)(hq * d) * sizeof(float));
            for (int64_t hh = 0; hh < hq; hh++) { mx[hh] = -INFINITY; sum[hh] = 0.f; }
            if (!scores || L == 0) continue;
            if (!attend_chunk_avx512(q, k_cache, v_cache, k_scales, v_scales, table, bs, hkv, d, hq, c0, L, scale,
                                     scores, o, 0))
                for (int64_t j = 0; j < L; j++) {
                    const void *kr = cache_row(k_cache, table, c0 + j, bs, row, es);
                    const float *ksr = i8 ? k_scales + slot_of(table, c0 + j, bs) * hkv : NULL;
                    for (int64_t hh = 0; hh < hq; hh++) {
                        const float *qh = q + hh * d;
                        const int64_t g = hh / group;
                        float s = 0.f;
                        if (i8) {
                            const int8_t *kh = (const int8_t *)kr + g * d;
                            #pragma omp simd reduction(+ : s)
                            for (int64_t e = 0; e < d; e++) s += qh[e] * (float)kh[e];
                            s *= ksr[g];
                        } else {
                            const float *kh = (const float *)kr + g * d;
                            #pragma omp simd reduction(+ : s)
                            for (int64_t e = 0; e < d; e++) s += qh[e] * kh[e];
                        }
                        scores[hh * L + j] = s * scale;
                    }
                }
            if (softcap > 0.f)
                for (int64_t e = 0; e < hq * L; e++) scores[e] = softcap * tanhf(scores[e] / softcap);
            for (int64_t hh = 0; hh < hq; hh++) {
                float *sh = scores + hh * L, m = -INFINITY, total = 0.f;
                for (int64_t j = 0; j < L; j++) m = sh[j] > m ? sh[j] : m;
                #pragma omp simd reduction(+ : total)
                for (int64_t j = 0; j < L; j++) {
                    const float x = sh[j] - m;
                    sh[j] = x < -80.f ? 0.f : exp_approx(x);
                    total += sh[j];
                }
                mx[hh] = m; sum[hh] = total;
            }
            if (!attend_chunk_avx512(q, k_cache, v_cache, k_scales, v_scales, table, bs, hkv, d, hq, c0, L, scale,
                                     scores, o, 1))
                for (int64_t j = 0; j < L; j++) {
                    const void *vr = cache_row(v_cache, table, c0 + j, bs, row, es);
                    const float *vsr = i8 ? v_scales + slot_of(table, c0 + j, bs) * hkv : NULL;
                    for (int64_t hh = 0; hh < hq; hh++) {
                        const int64_t g = hh / group;
                        const float w = scores[hh * L + j] * (i8 ? vsr[g] : 1.f);
                        float *oh = o + hh * d;
                        if (w == 0.f) continue;
                        if (i8) {
                            const int8_t *vh = (const int8_t *)vr + g * d;
                            #pragma omp simd
                            for (int64_t e = 0; e < d; e++) oh[e] += w * (float)vh[e];
                        } else {
                            const float *vh = (const float *)vr + g * d;
                            #pragma omp simd
                            for (int64_t e = 0; e < d; e++) oh[e] += w * vh[e];
                        }
                    }
                }
        }
        free(scores);
        /* merge the chunks (after the loop's barrier): out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c;
         * a sink is one more chunk of maximum sink, sum 1 and no output */
        #pragma omp for schedule(static)
        for (int64_t ih = 0; ih < (failed ? 0 : n * hq); ih++) {
            const int64_t i = ih / hq, hh = ih % hq;
            float M = sinks ? sinks[hh] : -INFINITY, den = 0.f;
            for (int64_t t = first[i]; t < first[i + 1]; t++) {
                const float m = part[t * hq * (d + 2) + hq * d + hh];
                M = m > M ? m : M;
            }
            float *dst = out + ih * d;
            memset(dst, 0, (size_t)d * sizeof(float));
            if (sinks) den += expf(sinks[hh] - M);
            for (int64_t t = first[i]; t < first[i + 1]; t++) {
                const float *pc = part + t * hq * (d + 2);
                if (pc[hq * d + hh] == -INFINITY) continue;  /* an empty chunk */
                const float f = expf(pc[hq * d + hh] - M);
                den += f * pc[hq * d + hq + hh];
                for (int64_t e = 0; e < d; e++) dst[e] += f * pc[hh * d + e];
            }
            const float inv = 1.f / den;
            for (int64_t e = 0; e < d; e++) dst[e] *= inv;
        }
    }
    free(part);
    free(task_row);
    free(first);
    return failed ? -2 : 0;
}

/* out[t, i] = act(gate[t, i]) * up[t, i] with gate_up [T, 2 I] (gate first); act 0: SiLU,
 * 1: GELU with the tanh approximation. */
int cpu_gated_act(const float *gate_up, int64_t T, int64_t I, int act, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        if (act == 0) {
            #pragma omp simd
            for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < I; i++) {
                const float x = g[i], y = 0.7978845608f * (x + 0.044715f * x * x * x);
                o[i] = x / (1.f + exp_approx(-2.f * y)) * u[i];  /* 0.5 x (1 + tanh y) */
            }
        }
    }
    return 0;
}

/* gpt-oss's experts: out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
 * limit), with gate_up [T, 2 I] (gate first). */
int cpu_clamped_swiglu(const float *gate_up, int64_t T, int64_t I, float alpha, float limit, float *out,
                       int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        #pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i] < limit ? g[i] : limit;
            const float y = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
            o[i] = (y + 1.f) * (x / (1.f + exp_approx(-alpha * x)));
        }
    }
    return 0;
}
