/* Part of gguf_gemm.c, included there once (one translation unit, one library): the fast path's 8-bit
 * activations, and the row kernels of the 32-element types and of Q4_K, Q5_K, Q6_K and IQ4_XS. */

/* ---- The fast path: integer dot products over 8-bit activations ----------------------------
 * Activations are quantized once per call to int8, in the block size the weight type needs:
 *
 * - Types with 32-element blocks (Q4_0 .. Q8_0, IQ4_NL): blocks of 32 with one float scale each
 *   (llama.cpp's Q8_0). A weight block is unpacked to 32 unsigned bytes u with value a * u + c
 *   (Q4_0: a = d, c = -8d; Q4_1: a = d, c = m; Q8_0: u = q + 128, c = -128d; ...), so that its
 *   dot product with an activation block of scale dx and int8 values x is
 *       a * dx * sum(u * x) + c * dx * sum(x),
 *   sum(u * x) on integers and dx * sum(x) computed once per activation block.
 * - Super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS): blocks of 256 with one float scale and the
 *   int16 sums of every 16 values (llama.cpp's Q8_K). The sub-block scales and minimums are
 *   small integers, so a whole super-block accumulates on integers: u8 x s8 products summed in
 *   pairs to int16 (vpmaddubsw; no overflow: |u| <= 127 there), times the sub-block's scale and
 *   summed in pairs to int32 (vpdpwssd), and the minimums times the activations' sums; one float
 *   multiply-add per super-block and activation row.
 *
 * vpdpbusd / vpdpwssd (AVX-512 VNNI or AVX-VNNI) add four u8 x s8 products, or two s16 x s16,
 * into each int32 lane in one instruction; plain AVX2 takes two (vpmaddubsw or vpmaddwd, then
 * an add). Without AVX2 the callers keep the exact kernels above. */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_INT8_DOT 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define DPBUSD(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#define DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define VNNI 1
#define DPBUSD(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#define DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define VNNI 0
/* vpmaddubsw saturates its int16 pair sums: exact for u <= 128 (|x| <= 127), so Q8_0 and
 * IQ4_NL, whose u would reach 255, multiply |value| by x with value's sign instead. */
#define DPBUSD(acc, u, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
#define DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#if defined(__AVX512VL__)
#define IRB 8 /* activation rows per pass: 32 vector registers hold their accumulators */
#else
#define IRB 4 /* 16 vector registers */
#endif

static inline __m256i nibbles(const uint8_t *qs) {  /* 16 bytes -> low nibbles, then high nibbles */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

static inline __m256i fifth_bits(const uint8_t *qh) {  /* bit e of the 32-bit qh -> 0x10 in byte e */
    uint32_t bits; memcpy(&bits, qh, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, sel), sel);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
#endif
}

static inline __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
}

static inline __m256i unpack_q4_0(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = -8.f * *a; return nibbles(b + 2);
}
static inline __m256i unpack_q4_1(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = h2f(b + 2); return nibbles(b + 4);
}
static inline __m256i unpack_q5_0(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = -16.f * *a; return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2));
}
static inline __m256i unpack_q5_1(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = h2f(b + 2); return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
}
/* Q8_0 and IQ4_NL: signed values, a = d, c = 0 (see SIGNED below). */
static inline __m256i unpack_q8_0(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = 0.f; return _mm256_loadu_si256((const __m256i *)(b + 2));
}
static inline __m256i unpack_iq4_nl(const uint8_t *b, float *a, float *c) {
    *a = h2f(b); *c = 0.f; return _mm256_shuffle_epi8(iq4_table(), nibbles(b + 2));
}
static inline __m256i unpack_mxfp4(const uint8_t *b, float *a, float *c) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_mxfp4));
    *a = e8m0_half(b[0]); *c = 0.f; return _mm256_shuffle_epi8(table, nibbles(b + 1));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* int8 codes of `n` values (round half to even) with scale amax / 127; returns the scale. */
static inline float quantize_block(const float *v, int n, int8_t *q) {
    float amax = 0.f;
    for (int e = 0; e < n; e++) amax = fmaxf(amax, fabsf(v[e]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int e = 0; e < n; e++) q[e] = (int8_t)nearbyintf(v[e] * id);
    return amax / 127.f;
}

/* Blocks of 32: xq [B, K] int8, xd [B, K/32] scales, xs [B, K/32] = xd * sum(xq) of each block. */
static void quantize_activations(const float *X, int64_t B, int64_t K, int8_t *xq, float *xd, float *xs,
                                 int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (B * K >= 65536)
    for (int64_t i = 0; i < B * (K / 32); i++) {
        xd[i] = quantize_block(X + i * 32, 32, xq + i * 32);
        int sum = 0;
        for (int e = 0; e < 32; e++) sum += xq[i * 32 + e];
        xs[i] = xd[i] * (float)sum;
    }
}

/* Super-blocks of 256: xq [B, K] int8, xd [B, K/256] scales, xb [B, K/16] int16 sums of xq. */
static void quantize_activations_k(const float *X, int64_t B, int64_t K, int8_t *xq, float *xd, int16_t *xb,
                                   int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (B * K >= 65536)
    for (int64_t i = 0; i < B * (K / 256); i++) {
        xd[i] = quantize_block(X + i * 256, 256, xq + i * 256);
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int e = 0; e < 16; e++) sum += xq[i * 256 + g * 16 + e];
            xb[i * 16 + g] = (int16_t)sum;
        }
    }
}

/* Rows of W (a table of row pointers) split over threads, in blocks of NB; each block against
 * all B activation rows, IRB at a time (R a constant after inlining: the accumulators stay in
 * registers), so that IRB activation rows are read from L1 for the whole block. */
#define NB 16
#define FOR_ROWS_AND_BATCH(ROW_DOT)                                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t nb = 0; nb < N; nb += NB)                                                          \
    for (int64_t b0 = 0; b0 < B; b0 += IRB) {                                                       \
        for (int64_t n = nb; n < (N - nb < NB ? N : nb + NB); n++) {                                \
            switch (B - b0 < IRB ? B - b0 : IRB) {                                                  \
            case 1: ROW_DOT(1); break;                                                              \
            case 2: ROW_DOT(2); break;                                                              \
            case 3: ROW_DOT(3); break;                                                              \
            IF_IRB8(case 4: ROW_DOT(4); break; case 5: ROW_DOT(5); break;                           \
                    case 6: ROW_DOT(6); break; case 7: ROW_DOT(7); break;)                          \
            default: ROW_DOT(IRB); break;                                                           \
            }                                                                                       \
        }                                                                                           \
    }
#if IRB == 8
#define IF_IRB8(...) __VA_ARGS__
#else
#define IF_IRB8(...)
#endif

/* One weight row of 32-element blocks against R activation rows (xq, xd, xs at row b0).
 * SIGNED types unpack signed values w: with VNNI, u = w + 128 and c = -128 a; without, |w|
 * against x with w's sign (no int16 saturation). */
#define IGEMM_FOR_TYPE(NAME, UNPACK, NBYTES, SIGNED)                                                     \
    static inline __attribute__((always_inline)) void NAME##_idot(                                  \
        const int R, const uint8_t *restrict row, int64_t nblk, const int8_t *restrict xq,           \
        const float *restrict xd, const float *restrict xs, float *restrict Y, int64_t N, int64_t n) { \
        __m256 acc[IRB];                                                                            \
        float corr[IRB];                                                                            \
        for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); corr[r] = 0.f; }               \
        for (int64_t j = 0; j < nblk; j++) {                                                        \
            float a, c;                                                                             \
            __m256i u = UNPACK(row + j * NBYTES, &a, &c);                                           \
            const __m256i w = u;                                                                    \
            if (SIGNED && VNNI) { u = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); c = -128.f * a; } \
            else if (SIGNED) u = _mm256_sign_epi8(u, u);                                            \
            for (int r = 0; r < R; r++) {                                                           \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (r * nblk + j) * 32));        \
                if (SIGNED && !VNNI) x = _mm256_sign_epi8(x, w);                                    \
                const __m256i p = DPBUSD(_mm256_setzero_si256(), u, x);                             \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a * xd[r * nblk + j]), acc[r]); \
                corr[r] += c * xs[r * nblk + j];                                                    \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) Y[r * N + n] = hsum8(acc[r]) + corr[r];                         \
    }                                                                                               \
    static void NAME##_igemm(const uint8_t *const *W, int64_t N, int64_t K, const int8_t *xq,      \
                             const float *xd, const float *xs, int64_t B, float *Y, int nthreads) { \
        const int64_t nblk = K / 32;                                                                \
        FOR_ROWS_AND_BATCH(IDOT_##NAME)                                                             \
    }
#define IDOT_ARGS(R) (R, W[n], nblk, xq + b0 * K, xd + b0 * nblk, xs + b0 * nblk, Y + b0 * N, N, n)
#define IDOT_q4_0(R) q4_0_idot IDOT_ARGS(R)
#define IDOT_q4_1(R) q4_1_idot IDOT_ARGS(R)
#define IDOT_q5_0(R) q5_0_idot IDOT_ARGS(R)
#define IDOT_q5_1(R) q5_1_idot IDOT_ARGS(R)
#define IDOT_q8_0(R) q8_0_idot IDOT_ARGS(R)
#define IDOT_iq4_nl(R) iq4_nl_idot IDOT_ARGS(R)
#define IDOT_mxfp4(R) mxfp4_idot IDOT_ARGS(R)

IGEMM_FOR_TYPE(q4_0, unpack_q4_0, 18, 0)
IGEMM_FOR_TYPE(q4_1, unpack_q4_1, 20, 0)
IGEMM_FOR_TYPE(q5_0, unpack_q5_0, 22, 0)
IGEMM_FOR_TYPE(q5_1, unpack_q5_1, 24, 0)
IGEMM_FOR_TYPE(q8_0, unpack_q8_0, 34, 1)
IGEMM_FOR_TYPE(iq4_nl, unpack_iq4_nl, 18, 1)
IGEMM_FOR_TYPE(mxfp4, unpack_mxfp4, 17, 1)

/* ---- Super-block types: per 256 weights and activation row, integer sums isum (sub-block
 * scales applied) and msum (minimums times activation sums), then
 *     acc += d * dx * isum + dmin * dx * msum. */

/* Two adjacent sub-blocks of 32 (64 activations from x, for R rows at stride K): the pair sums of
 * the unsigned codes ulo, uhi times the activations, times an int16 scale per pair (slo, shi),
 * added to isum. With AVX-512 BW and VNNI both sub-blocks take one 512-bit instruction of each
 * kind (CPUs that split 512-bit operations run the same work as two). */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i isum_t;
#define ISUM_ZERO() _mm512_setzero_si512()
#define ISUM_NARROW(v) _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
#define WIDEN(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
#define SUB_BLOCK_PAIR(R, ulo, uhi, x, slo, shi, isum)                                              \
    do {                                                                                            \
        const __m512i u_ = WIDEN(ulo, uhi), s_ = WIDEN(slo, shi);                                   \
        for (int r = 0; r < R; r++)                                                                 \
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u_, _mm512_loadu_si512((x) + r * K)), s_); \
    } while (0)
/* unsigned values u against x, negated where bit i of the 64-bit mask `neg` is set (vpdpwssd with the
 * pair's scales) */
#define MASKED_PRODUCTS(R, u512, neg, s512, x, isum)                                                \
    do {                                                                                            \
        const __m512i u_ = (u512), s_ = (s512);                                                     \
        const __mmask64 neg_ = (neg);                                                               \
        for (int r = 0; r < R; r++) {                                                               \
            const __m512i x_ = _mm512_loadu_si512((x) + r * K);                                     \
            const __m512i sx_ = _mm512_mask_sub_epi8(x_, neg_, _mm512_setzero_si512(), x_);         \
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u_, sx_), s_);             \
        }                                                                                           \
    } while (0)
/* signed values v: |v| against x with v's sign */
#define SIGNED_SUB_BLOCK_PAIR(R, vlo, vhi, x, slo, shi, isum)                                       \
    do {                                                                                            \
        const __m512i v_ = WIDEN(vlo, vhi);                                                         \
        MASKED_PRODUCTS(R, _mm512_abs_epi8(v_), _mm512_movepi8_mask(v_), WIDEN(slo, shi), x, isum); \
    } while (0)
/* unsigned grid values whose signs are the bits of `negbits` (byte i negative where bit i is set): the
 * sign bits become the mask as they are, with no sign vectors built */
#define MASKED_SIGNS 1
#define MASKED_SUB_BLOCK_PAIR(R, ulo, uhi, negbits, x, slo, shi, isum)                              \
    MASKED_PRODUCTS(R, WIDEN(ulo, uhi), (__mmask64)(negbits), WIDEN(slo, shi), x, isum)
#else
typedef __m256i isum_t;
#define ISUM_ZERO() _mm256_setzero_si256()
#define ISUM_NARROW(v) (v)
#define SUB_BLOCK(R, u, x, scale, isum)                                                             \
    for (int r = 0; r < R; r++)                                                                     \
        isum[r] = DPWSSD(isum[r], _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)((x) + r * K))), scale)
#define SUB_BLOCK_PAIR(R, ulo, uhi, x, slo, shi, isum)                                              \
    do { SUB_BLOCK(R, ulo, x, slo, isum); SUB_BLOCK(R, uhi, (x) + 32, shi, isum); } while (0)
#define SIGNED_SUB_BLOCK_PAIR(R, vlo, vhi, x, slo, shi, isum)                                       \
    do {                                                                                            \
        const __m256i ulo_ = _mm256_sign_epi8(vlo, vlo), uhi_ = _mm256_sign_epi8(vhi, vhi);         \
        for (int r = 0; r < R; r++) {                                                               \
            const __m256i *x_ = (const __m256i *)((x) + r * K);                                     \
            isum[r] = DPWSSD(isum[r], _mm256_maddubs_epi16(ulo_, _mm256_sign_epi8(_mm256_loadu_si256(x_), vlo)), slo); \
            isum[r] = DPWSSD(isum[r], _mm256_maddubs_epi16(uhi_, _mm256_sign_epi8(_mm256_loadu_si256(x_ + 1), vhi)), shi); \
        }                                                                                           \
    } while (0)
#define MASKED_SIGNS 0
#define MASKED_SUB_BLOCK_PAIR(R, ulo, uhi, negbits, x, slo, shi, isum) SIGNED_SUB_BLOCK_PAIR(R, ulo, uhi, x, slo, shi, isum)
#endif

/* Scales for a 32-weight chunk of two 16-weight sub-blocks, as vpmaddwd's 16-bit operand: lanes
 * 0-7 sub-block e0's, lanes 8-15 e1's, picked from `dup`, eight int16 scales in both 128-bit halves
 * (e0, e1 constants once the loops unroll: one shuffle). */
static inline __m256i pair_scale(__m256i dup, int e0, int e1) {
    return _mm256_shuffle_epi8(dup, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * e1)),
                                                     _mm_set1_epi16((short)(0x0100 + 0x0202 * e0))));
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAIRS_512 1
/* Sub-scales e .. e + 3 of sixteen int16 (s16), eight lanes each: the vpdpwssd operand of a pair of 32-weight
 * chunks in 512 bits, one vpermw where pair_scale takes two shuffles and an insert. */
static inline __m512i scales_of_pair(__m512i s16, int e) {
    return _mm512_permutexvar_epi16(
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(e + 1)), _mm_set1_epi16((short)e))),
                           _mm256_set_m128i(_mm_set1_epi16((short)(e + 3)), _mm_set1_epi16((short)(e + 2))), 1), s16);
}
#endif

/* The K types with sixteen sub-blocks of 16 (Q2_K, Q3_K, Q6_K): their int8 scales s8 as `scales` (SIXTEEN_SCALES),
 * and chunks j, j + 1 of 32 weights of half h (sub-blocks 8h + 2j .. 8h + 2j + 3) against x with them
 * (SCALED_PAIR): with AVX-512 all sixteen as int16 and one vpermw a pair, else two vectors of eight picked by
 * shuffles (pair_scale). */
#if PAIRS_512
#define SIXTEEN_SCALES(scales, s8) const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8))
#define SCALED_PAIR(R, ulo, uhi, x, scales, h, j, isum)                                             \
    do {                                                                                            \
        const __m512i u_ = WIDEN(ulo, uhi), sc_ = scales_of_pair(scales, 8 * (h) + 2 * (j));        \
        for (int r = 0; r < R; r++)                                                                 \
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u_, _mm512_loadu_si512((x) + r * K)), sc_); \
    } while (0)
#else
#define PAIRS_512 0
#define SIXTEEN_SCALES(scales, s8) __m256i scales[2]; dup_scales(s8, &scales[0], &scales[1])
#define SCALED_PAIR(R, ulo, uhi, x, scales, h, j, isum)                                             \
    SUB_BLOCK_PAIR(R, ulo, uhi, x, pair_scale((scales)[h], 2 * (j), 2 * (j) + 1),                   \
                   pair_scale((scales)[h], 2 * (j) + 2, 2 * (j) + 3), isum)
#endif

/* Sixteen int8 sub-block scales as two vectors of eight int16, each in both halves (pair_scale's). */
static inline void dup_scales(__m128i s8, __m256i *lo, __m256i *hi) {
    *lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
    *hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s8, 8)));
}

/* A super-block's integer sums into the float accumulators: acc += d * dx * isum - dmin * dx *
 * (minimums . the activations' sums per 16), the minimums as 16 int16 (Q2_K, Q4_K, Q5_K). */
static inline __attribute__((always_inline)) void finish_minimums(
    const int R, const isum_t *isum, __m256i mins, const int16_t *restrict xb, const float *restrict xd, int64_t nsb,
    float d, float dmin, __m256 *acc) {
    for (int r = 0; r < R; r++) {
        const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + r * nsb * 16)), mins);
        const float dx = xd[r * nsb];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ISUM_NARROW(isum[r])), _mm256_set1_ps(d * dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-dmin * dx), acc[r]);
    }
}

/* The same for codes stored as value + 2**shift (Q3_K: 4, Q6_K: 32): acc += d * dx * (isum -
 * 2**shift * (scales . the activations' sums per 16)), the 16 sub-block scales as int16. */
static inline __attribute__((always_inline)) void finish_offset(
    const int R, const isum_t *isum, __m256i scales, const int shift, const int16_t *restrict xb,
    const float *restrict xd, int64_t nsb, float d, __m256 *acc) {
    for (int r = 0; r < R; r++) {
        const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + r * nsb * 16)), scales);
        const __m256i total = _mm256_sub_epi32(ISUM_NARROW(isum[r]), _mm256_slli_epi32(off, shift));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * xd[r * nsb]), acc[r]);
    }
}

/* The 8 six-bit scales (bytes 0-7) and minimums (bytes 8-15) of a Q4_K / Q5_K super-block's 12
 * packed bytes (scale_min_k4 for all eight at once). */
static inline __m128i scales_mins_k4(const uint8_t *p) {
    uint32_t u[4];
    memcpy(u, p, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    const uint32_t mins_lo = u[1] & m6;
    u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_lo;
    u[0] &= m6;
    return _mm_loadu_si128((const __m128i *)u);
}

/* int16 scale s of sub-block j, broadcast: from the scales as 16 int16 lanes (both halves alike). */
static inline __m256i broadcast_scale(__m256i scales16, int j) {
    const __m256i pick = _mm256_set1_epi16((short)(0x0100 + 0x0202 * j));
    return _mm256_shuffle_epi8(scales16, pick);
}

/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and minimums; code bits 5 (Q5_K) in qh. */
static inline __attribute__((always_inline)) void k45_superblock(
    const int R, const int five, const uint8_t *restrict b, const int8_t *restrict x, const int16_t *restrict xb,
    const float *restrict xd, int64_t K, __m256 *acc) {
    const int64_t nsb = K / 256;
    const float d = h2f(b), dmin = h2f(b + 2);
    const __m128i sm = scales_mins_k4(b + 4);
    const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    const uint8_t *qs = b + (five ? 48 : 16);
    __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
    for (int j = 0; j < 4; j++) {  /* 64 values: low nibbles, then high nibbles */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if (five) {  /* bits 2j and 2j + 1 of each qh byte */
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        SUB_BLOCK_PAIR(R, lo, hi, x + 64 * j, broadcast_scale(scales16, 2 * j), broadcast_scale(scales16, 2 * j + 1),
                       isum);
    }
    /* minimums: each repeated for the two 16-sums of its sub-block */
    const __m128i m8 = _mm_unpackhi_epi64(sm, sm);
    finish_minimums(R, isum, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)), xb, xd, nsb, d, dmin, acc);
}

/* Q6_K: 16 groups of 16 with int8 scales, codes q in [0, 64) worth q - 32. */
static inline __attribute__((always_inline)) void q6_k_superblock(
    const int R, const uint8_t *restrict b, const int8_t *restrict x, const int16_t *restrict xb,
    const float *restrict xd, int64_t K, __m256 *acc) {
    const int64_t nsb = K / 256;
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));  /* int8 scales, one per 16 */
    const float d = h2f(b + 208);
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    SIXTEEN_SCALES(scales, s8);
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
    for (int h = 0; h < 2; h++) {  /* 128 values from 64 bytes of ql and 32 of qh */
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const __m256i qa = _mm256_loadu_si256((const __m256i *)ql), qb = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
            _mm256_or_si256(_mm256_and_si256(qb, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4), _mm256_and_si256(hb, two)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), two)),
        };
        SCALED_PAIR(R, u[0], u[1], x + 128 * h, scales, h, 0, isum);
        SCALED_PAIR(R, u[2], u[3], x + 128 * h + 64, scales, h, 2, isum);
    }
    finish_offset(R, isum, _mm256_cvtepi8_epi16(s8), 5, xb, xd, nsb, d, acc);
}

/* IQ4_XS: 8 sub-blocks of 32 with 6-bit scales (minus 32), codes through the IQ4 value table.
 * The values are signed: |value| times x with value's sign keeps vpmaddubsw's operand unsigned
 * and its pair sums within int16. */
static inline __attribute__((always_inline)) void iq4_xs_superblock(
    const int R, const uint8_t *restrict b, const int8_t *restrict x, const int16_t *restrict xb,
    const float *restrict xd, int64_t K, __m256 *acc) {
    (void)xb;
    const int64_t nsb = K / 256;
    const float d = h2f(b);
    uint16_t sh; memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    const __m256i table = iq4_table();
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
    for (int ib = 0; ib < 8; ib += 2) {
        __m256i v[2], scale[2];
        for (int k = 0; k < 2; k++) {
            const int b = ib + k, ls = ((sl[b / 2] >> (4 * (b % 2))) & 0xF) | (((sh >> (2 * b)) & 3) << 4);
            v[k] = _mm256_shuffle_epi8(table, nibbles(qs + 16 * b));
            scale[k] = _mm256_set1_epi16((int16_t)(ls - 32));
        }
        SIGNED_SUB_BLOCK_PAIR(R, v[0], v[1], x + 32 * ib, scale[0], scale[1], isum);
    }
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ISUM_NARROW(isum[r])), _mm256_set1_ps(d * xd[r * nsb]), acc[r]);
}
#endif  /* AVX2 and FMA: continued in int8_lattice.h */
