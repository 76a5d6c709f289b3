/* Part of gguf_gemm.c, included there once (one translation unit, one library): the lattice i-quants
 * (IQ1-IQ3), Q2_K and Q3_K on 8-bit activations, and the super-block types' row drivers. */

#if defined(__AVX2__) && defined(__FMA__)  /* continued from int8.h */
/* The lattice types on 8-bit activations: per sub-block of 32 weights the grid values with their
 * signs as int8 (|v| <= 62: vpmaddubsw's pair sums stay in int16; IQ1's 8 * grid +- 1 with its delta),
 * the scale's odd integer factor (2s + 1) per 16 or 32 weights, and one float factor per super-block
 * (lattice_d).
 *
 * Signs as 32 bytes of +1 / -1 for weights 8i + j: from 32 bits (bit j of byte i; IQ2_S, IQ3_S),
 * each byte spread to its 8 lanes and tested bit by bit, or from four 7-bit sign indices through
 * the table (IQ2_XXS, IQ2_XS, IQ3_XXS: measured faster there than forming the bits). */
static inline __m256i signs_of_bits(uint32_t bits) {
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                          _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                            0x0101010101010101LL, 0));
    const __m256i m = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, m), m), _mm256_set1_epi8(1));
}

static inline __m256i signs_of_indices(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return _mm256_set_epi64x((long long)ksign_lanes[d], (long long)ksign_lanes[c], (long long)ksign_lanes[b],
                             (long long)ksign_lanes[a]);
}

/* A sub-block's 32 grid values: four 8-value entries (IQ2_*, IQ1_*) or eight 4-value ones (IQ3_*),
 * from scalar loads, or for IQ3_S gathered (its eight indices' ninth bits formed by vector shifts:
 * faster there; four-entry gathers were slower than scalar loads on AMD). */
static inline __m256i grid4_gather(const uint32_t *grid, __m256i idx) {
    return _mm256_i32gather_epi32((const int *)grid, idx, 4);
}

static inline __m256i grid4(const uint64_t *grid, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
    return _mm256_set_epi64x((long long)grid[i3], (long long)grid[i2], (long long)grid[i1], (long long)grid[i0]);
}

#ifdef __BMI2__
/* Four 8-byte grid entries: index low bytes q[0..3] and high bits `hi`, four fields of `bits` bits from
 * bit 0 (IQ1_S, IQ1_M: 3; IQ2_S: 2), deposited into 16-bit lanes by two pdep as llama.cpp does, instead
 * of a shift, mask and or each (BMI2: the builds for CPUs whose pdep is fast, build.py; without it each type
 * forms its indices). */
static inline __m256i grid4x8(const uint64_t *grid, const uint8_t *q, uint32_t hi, int bits) {
    uint16_t i[4];
    uint32_t q32;
    memcpy(&q32, q, 4);
    const uint64_t p = _pdep_u64(q32, 0x00FF00FF00FF00FFULL) |
                       _pdep_u64(hi, bits == 3 ? 0x0700070007000700ULL : 0x0300030003000300ULL);
    memcpy(i, &p, 8);
    return grid4(grid, i[0], i[1], i[2], i[3]);
}
#endif

static inline __m256i odd_scales(int s_lo, int s_hi) {  /* 2s + 1 for weights 0-15, then 16-31 */
    return _mm256_set_m128i(_mm_set1_epi16((short)(2 * s_hi + 1)), _mm_set1_epi16((short)(2 * s_lo + 1)));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* A super-block's 16 sub-scales (one per 16 weights) as odd factors 2s + 1 in 16-bit lanes, for the types
 * with two per sub-block of 32: IQ1_M's 3-bit scale i at bits 3(i % 4) of scale word i / 4 (whose top
 * nibble is part of d), IQ2_XS / IQ2_S's 4-bit scale i in nibble i % 2 of byte i / 2. */
static inline __m256i sub_scales16(int type, const uint8_t *b) {
    __m256i s;
    if (type == IQ1_M) {
        const __m256i words = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                       _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 48))));
        s = _mm256_and_si256(_mm256_srlv_epi16(words, _mm256_setr_epi16(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9)),
                             _mm256_set1_epi16(7));
    } else {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(b + (type == IQ2_XS ? 66 : 74))));
        const __m256i pairs = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                                       _mm256_castsi128_si256(bytes));
        s = _mm256_and_si256(_mm256_srlv_epi16(pairs, _mm256_setr_epi16(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)),
                             _mm256_set1_epi16(15));
    }
    return _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1));
}
/* Sub-block k's pair: lanes 0-7 sub-scale 2k, 8-15 2k + 1 (the super-block's vector is the same for its eight
 * sub-blocks: built once when the loop unrolls). */
static inline __m256i sub_block_scales(__m256i s16, int k) {
    return _mm256_permutexvar_epi16(_mm256_set_m128i(_mm_set1_epi16((short)(2 * k + 1)), _mm_set1_epi16((short)(2 * k))), s16);
}
#else
/* With AVX2 alone (as llama.cpp lays them out): the even sub-scales in the low 128-bit lane, the odd ones in the
 * high lane, so that sub-block k's pair is word k of both lanes, one in-lane shuffle; IQ1_M's fields cut by
 * 32-bit variable shifts (scales 4j and 4j + 2 of word j in dword j of the low lane, 4j + 1 and 4j + 3 in the
 * high lane's). */
static inline __m256i sub_scales16(int type, const uint8_t *b) {
    __m256i s;
    if (type == IQ1_M) {
        const __m128i w = _mm_loadl_epi64((const __m128i *)(b + 48));
        const __m256i d = _mm256_cvtepu16_epi32(_mm_unpacklo_epi64(w, w));
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(d, _mm256_setr_epi32(0, 0, 0, 0, 3, 3, 3, 3)),
                                            _mm256_set1_epi32(7));
        const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(d, _mm256_setr_epi32(10, 10, 10, 10, 7, 7, 7, 7)),
                                            _mm256_set1_epi32(7 << 16));
        s = _mm256_or_si256(lo, hi);
    } else {  /* scale 2j: byte j's low nibble, 2j + 1: its high one */
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(b + (type == IQ2_XS ? 66 : 74))), m = _mm_set1_epi8(0x0F);
        s = _mm256_set_m128i(_mm_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), m)),
                             _mm_cvtepu8_epi16(_mm_and_si128(bytes, m)));
    }
    return _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1));
}
static inline __m256i sub_block_scales(__m256i s16, int k) {
    return _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * k)));
}
#endif

/* A grid's unsigned values u and their signs: where the caller takes masked signs (`masked`) u as it is
 * and the 32 sign bits in *neg, else the signed values.  The signs as 32 bits (IQ2_S, IQ3_S) or four
 * 7-bit ksigns indices (IQ2_XXS, IQ2_XS, IQ3_XXS). */
static inline __m256i with_signs(__m256i u, uint32_t bits, int masked, uint32_t *neg) {
    if (masked) {
        *neg = bits;
        return u;
    }
    return _mm256_sign_epi8(u, signs_of_bits(bits));
}
static inline __m256i with_ksigns(__m256i u, uint32_t a, uint32_t b, uint32_t c, uint32_t d, int masked, uint32_t *neg) {
    if (masked) {
        *neg = ksigns[a] | (uint32_t)ksigns[b] << 8 | (uint32_t)ksigns[c] << 16 | (uint32_t)ksigns[d] << 24;
        return u;
    }
    return _mm256_sign_epi8(u, signs_of_indices(a, b, c, d));
}

/* Sub-block k (32 weights) of a lattice super-block: its values and scale factors; with `masked`
 * (MASKED_SIGNS builds, types with sign bits: all but IQ1_*) the unsigned values and *neg their signs. */
static inline __attribute__((always_inline)) void lattice_sub_block(const int type, const uint8_t *restrict b, int k,
                                                                    int masked, __m256i *v, __m256i *scale,
                                                                    uint32_t *neg) {
    uint32_t aux;
    switch (type) {
    case IQ2_XXS: {
        const uint8_t *q = b + 2 + 8 * k;
        memcpy(&aux, q + 4, 4);
        *v = with_ksigns(_mm256_set_epi64x((long long)iq2xxs_grid[q[3]], (long long)iq2xxs_grid[q[2]],
                                           (long long)iq2xxs_grid[q[1]], (long long)iq2xxs_grid[q[0]]),
                         aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127, masked, neg);
        *scale = odd_scales(aux >> 28, aux >> 28);
        break;
    }
    case IQ3_XXS: {
        const uint8_t *q = b + 2 + 8 * k;
        memcpy(&aux, b + 66 + 4 * k, 4);
        *v = with_ksigns(_mm256_set_epi64x((long long)grid3_pair(iq3xxs_grid, q[6], q[7]),
                                           (long long)grid3_pair(iq3xxs_grid, q[4], q[5]),
                                           (long long)grid3_pair(iq3xxs_grid, q[2], q[3]),
                                           (long long)grid3_pair(iq3xxs_grid, q[0], q[1])),
                         aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127, masked, neg);
        *scale = odd_scales(aux >> 28, aux >> 28);
        break;
    }
    case IQ2_XS: {
        uint16_t q[4];
        memcpy(q, b + 2 + 8 * k, 8);
        *v = with_ksigns(_mm256_set_epi64x((long long)iq2xs_grid[q[3] & 511], (long long)iq2xs_grid[q[2] & 511],
                                           (long long)iq2xs_grid[q[1] & 511], (long long)iq2xs_grid[q[0] & 511]),
                         q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9, masked, neg);
        *scale = sub_block_scales(sub_scales16(IQ2_XS, b), k);
        break;
    }
    case IQ2_S: {
        const uint8_t *q = b + 2 + 4 * k, h = b[66 + k];
        uint32_t sb; memcpy(&sb, b + 34 + 4 * k, 4);
#ifdef __BMI2__
        const __m256i u = grid4x8(iq2s_grid, q, h, 2);
#else
        const __m256i u = grid4(iq2s_grid, q[0] | ((h << 8) & 0x300), q[1] | ((h << 6) & 0x300), q[2] | ((h << 4) & 0x300),
                                q[3] | ((h << 2) & 0x300));
#endif
        *v = with_signs(u, sb, masked, neg);
        *scale = sub_block_scales(sub_scales16(IQ2_S, b), k);
        break;
    }
    case IQ1_S: {  /* values 8 * grid + the delta's sign, in [-9, 9]: w = d (2s + 1) / 8 * value */
        const uint8_t *q = b + 2 + 4 * k;
        uint16_t qh; memcpy(&qh, b + 34 + 2 * k, 2);
#ifdef __BMI2__
        const __m256i g = grid4x8(iq1s_grid8, q, qh & 0xFFF, 3);
#else
        const __m256i g = grid4(iq1s_grid8, q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700), q[2] | ((qh << 2) & 0x700),
                                q[3] | ((qh >> 1) & 0x700));
#endif
        *v = _mm256_add_epi8(g, _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
        *scale = odd_scales((qh >> 12) & 7, (qh >> 12) & 7);
        break;
    }
    case IQ1_M: {  /* the same, with a 3-bit scale per 16 weights and the delta's sign per 8 */
        const uint8_t *q = b + 4 * k;
        uint16_t hh;
        memcpy(&hh, b + 32 + 2 * k, 2);
        const uint32_t h = hh;
#ifdef __BMI2__  /* the index bits and the delta signs (bit 3 of each nibble) compacted by pext */
        *v = _mm256_add_epi8(grid4x8(iq1s_grid8, q, _pext_u32(h, 0x7777), 3),
                             _mm256_loadu_si256((const __m256i *)iq1_delta_lanes[_pext_u32(h, 0x8888)]));
#else
        const __m256i g = grid4(iq1s_grid8, q[0] | ((h << 8) & 0x700), q[1] | ((h << 4) & 0x700), q[2] | (h & 0x700),
                                q[3] | ((h >> 4) & 0x700));
        const __m128i neg = _mm_cmpeq_epi32(_mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)h), _mm_setr_epi32(3, 7, 11, 15)),
                                                          _mm_set1_epi32(1)), _mm_set1_epi32(1));
        *v = _mm256_add_epi8(g, _mm256_or_si256(_mm256_cvtepi32_epi64(neg), _mm256_set1_epi8(1)));
#endif
        *scale = sub_block_scales(sub_scales16(IQ1_M, b), k);
        break;
    }
    default: {  /* IQ3_S */
        const uint8_t *q = b + 2 + 8 * k, h = b[66 + k];
        uint32_t sb; memcpy(&sb, b + 74 + 4 * k, 4);
        /* the 8 indices, their ninth bits from h, gathered as 8 words of 4 values */
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                            _mm256_set1_epi32(1));
        *v = with_signs(grid4_gather(iq3s_grid, _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8))), sb, masked, neg);
        const int s = (b[106 + k / 2] >> (4 * (k % 2))) & 0xF;
        *scale = _mm256_set1_epi16((short)(2 * s + 1));
    }
    }
}

/* The float factor of a super-block's integer sums: d times 1/8 (IQ2_*, IQ1_*), 1/4 (IQ3_XXS) or 1
 * (IQ3_S); IQ1_M's fp16 d is spread over the top nibbles of its four scale words. */
static inline float lattice_d(int type, const uint8_t *b) {
    if (type == IQ1_M) return iq1_m_d(b) * 0.125f;
    return h2f(b) * (type == IQ3_S ? 1.0f : type == IQ3_XXS ? 0.25f : 0.125f);
}

static inline __attribute__((always_inline)) void lattice_superblock(
    const int R, const int type, const uint8_t *restrict b, const int8_t *restrict x, const float *restrict xd,
    int64_t K, __m256 *acc) {
    const int64_t nsb = K / 256;
    const float d = lattice_d(type, b);
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
    /* masked signs: the types with sign bits; those with ksigns indices only from 2 activation rows (at
     * one, their sign vectors from the table measured faster: results/cpu-lattice-masked-signs.txt) */
    const int masked = MASKED_SIGNS && (type == IQ2_S || type == IQ3_S || (R > 1 && type != IQ1_S && type != IQ1_M));
    for (int k = 0; k < 8; k += 2) {
        __m256i v[2], scale[2];
        uint32_t neg[2];
        lattice_sub_block(type, b, k, masked, &v[0], &scale[0], &neg[0]);
        lattice_sub_block(type, b, k + 1, masked, &v[1], &scale[1], &neg[1]);
        if (masked)
            MASKED_SUB_BLOCK_PAIR(R, v[0], v[1], neg[0] | (uint64_t)neg[1] << 32, x + 32 * k, scale[0], scale[1], isum);
        else
            SIGNED_SUB_BLOCK_PAIR(R, v[0], v[1], x + 32 * k, scale[0], scale[1], isum);
    }
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ISUM_NARROW(isum[r])), _mm256_set1_ps(d * xd[r * nsb]), acc[r]);
}

/* Q2_K and Q3_K's codes of 128 weights (h) against x: 2-bit field j of the 32 code bytes is the
 * chunk of weights 32j .. 32j + 31, sub-blocks 8h + 2j and 8h + 2j + 1; Q3_K adds its high bit. */
#define K23_HALF(R, q, hb, h, scales, x, isum, three, one)                                             \
    for (int j = 0; j < 4; j += 2) {                                                                \
        __m256i ulo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), three);                         \
        __m256i uhi = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j + 2), three);                     \
        if (hb) {                                                                                   \
            ulo = _mm256_or_si256(ulo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(*(hb), 4 * (h) + j), one), 2)); \
            uhi = _mm256_or_si256(uhi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(*(hb), 4 * (h) + j + 1), one), 2)); \
        }                                                                                           \
        SCALED_PAIR(R, ulo, uhi, (x) + 32 * j, scales, h, j, isum);                                 \
    }

/* Q2_K with AVX-512: each pair of 32-weight chunks (j, j + 1 of half h) in one 512-bit vector from the start:
 * the codes' two 2-bit fields by one variable shift of the half's 32 code bytes (in both 256-bit halves), the
 * pair's four sub-scales by one vpermw of all sixteen; the same sums as K23_HALF's pairs
 * (Q3_K's high bits the same way measured 0.94-1.01x: it keeps K23_HALF). */
#if PAIRS_512
static inline __attribute__((always_inline)) void q2_k_pairs_512(const int R, const uint8_t *restrict codes,
                                                                __m512i scales, const int8_t *restrict x, int64_t K,
                                                                isum_t *isum) {
    const __m512i three = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(codes + 32 * h)));
        for (int j = 0; j < 4; j += 2) {
            const __m512i u = _mm512_and_si512(
                _mm512_srlv_epi16(q, _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 2)), 1)),
                three);
            const __m512i sc = scales_of_pair(scales, 8 * h + 2 * j);
            for (int r = 0; r < R; r++)
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u, _mm512_loadu_si512(x + r * K + 128 * h + 32 * j)), sc);
        }
    }
}
#endif

/* Q2_K: 16 sub-blocks of 16 with a 4-bit scale and a 4-bit minimum, codes q in [0, 4). */
static inline __attribute__((always_inline)) void q2_k_superblock(
    const int R, const uint8_t *restrict b, const int8_t *restrict x, const int16_t *restrict xb,
    const float *restrict xd, int64_t K, __m256 *acc) {
    const int64_t nsb = K / 256;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const __m128i sm = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0F);
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
#if PAIRS_512
    SIXTEEN_SCALES(scales, _mm_and_si128(sm, low4));
    q2_k_pairs_512(R, b + 16, scales, x, K, isum);
#else
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    SIXTEEN_SCALES(scales, _mm_and_si128(sm, low4));
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
        K23_HALF(R, q, (const __m256i *)0, h, scales, x + 128 * h, isum, three, one);
    }
#endif
    finish_minimums(R, isum, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), low4)), xb, xd, nsb, d, dmin,
                    acc);
}

/* Q3_K: 16 sub-blocks of 16 with signed 6-bit scales, codes u = q | high bit << 2 in [0, 8) worth u - 4. */
static inline __attribute__((always_inline)) void q3_k_superblock(
    const int R, const uint8_t *restrict b, const int8_t *restrict x, const int16_t *restrict xb,
    const float *restrict xd, int64_t K, __m256 *acc) {
    const int64_t nsb = K / 256;
    uint32_t w[4];
    q3_k_scale_words(b + 96, w);
    const __m128i s8 = _mm_set_epi32((int)w[3], (int)w[2], (int)w[1], (int)w[0]);
    const float d = h2f(b + 108);
    isum_t isum[IRB];
    for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hb = _mm256_loadu_si256((const __m256i *)b);
    SIXTEEN_SCALES(scales, s8);
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
        K23_HALF(R, q, &hb, h, scales, x + 128 * h, isum, three, one);
    }
    finish_offset(R, isum, _mm256_cvtepi8_epi16(s8), 2, xb, xd, nsb, d, acc);
}

#define Q2_K_SB(R, b, x, xb, xd, K, acc) q2_k_superblock(R, b, x, xb, xd, K, acc)
#define Q3_K_SB(R, b, x, xb, xd, K, acc) q3_k_superblock(R, b, x, xb, xd, K, acc)
#define Q4_K_SB(R, b, x, xb, xd, K, acc) k45_superblock(R, 0, b, x, xb, xd, K, acc)
#define Q5_K_SB(R, b, x, xb, xd, K, acc) k45_superblock(R, 1, b, x, xb, xd, K, acc)
#define Q6_K_SB(R, b, x, xb, xd, K, acc) q6_k_superblock(R, b, x, xb, xd, K, acc)
#define IQ4_XS_SB(R, b, x, xb, xd, K, acc) iq4_xs_superblock(R, b, x, xb, xd, K, acc)
#define IQ2_XXS_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ2_XXS, b, x, xd, K, acc)
#define IQ2_XS_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ2_XS, b, x, xd, K, acc)
#define IQ2_S_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ2_S, b, x, xd, K, acc)
#define IQ3_XXS_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ3_XXS, b, x, xd, K, acc)
#define IQ3_S_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ3_S, b, x, xd, K, acc)
#define IQ1_S_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ1_S, b, x, xd, K, acc)
#define IQ1_M_SB(R, b, x, xb, xd, K, acc) lattice_superblock(R, IQ1_M, b, x, xd, K, acc)

/* One weight row of super-blocks against R activation rows (xq, xd, xb at row b0). */
#define KGEMM_FOR_TYPE(NAME, SUPERBLOCK, NBYTES)                                                    \
    static inline __attribute__((always_inline)) void NAME##_kdot(                                  \
        const int R, const uint8_t *restrict row, int64_t K, const int8_t *restrict xq,              \
        const float *restrict xd, const int16_t *restrict xb, float *restrict Y, int64_t N, int64_t n) { \
        const int64_t nsb = K / 256;                                                                \
        __m256 acc[IRB];                                                                            \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                   \
        for (int64_t j = 0; j < nsb; j++)                                                           \
            SUPERBLOCK(R, row + j * NBYTES, xq + j * 256, xb + j * 16, xd + j, K, acc);             \
        for (int r = 0; r < R; r++) Y[r * N + n] = hsum8(acc[r]);                                   \
    }                                                                                               \
    static void NAME##_kgemm(const uint8_t *const *W, int64_t N, int64_t K, const int8_t *xq,      \
                             const float *xd, const int16_t *xb, int64_t B, float *Y, int nthreads) { \
        FOR_ROWS_AND_BATCH(KDOT_##NAME)                                                             \
    }
#define KDOT_ARGS(R) (R, W[n], K, xq + b0 * K, xd + b0 * (K / 256), xb + b0 * (K / 16), Y + b0 * N, N, n)
#define KDOT_q2_k(R) q2_k_kdot KDOT_ARGS(R)
#define KDOT_q3_k(R) q3_k_kdot KDOT_ARGS(R)
#define KDOT_q4_k(R) q4_k_kdot KDOT_ARGS(R)
#define KDOT_q5_k(R) q5_k_kdot KDOT_ARGS(R)
#define KDOT_q6_k(R) q6_k_kdot KDOT_ARGS(R)
#define KDOT_iq4_xs(R) iq4_xs_kdot KDOT_ARGS(R)
#define KDOT_iq2_xxs(R) iq2_xxs_kdot KDOT_ARGS(R)
#define KDOT_iq3_xxs(R) iq3_xxs_kdot KDOT_ARGS(R)
#define KDOT_iq2_xs(R) iq2_xs_kdot KDOT_ARGS(R)
#define KDOT_iq2_s(R) iq2_s_kdot KDOT_ARGS(R)
#define KDOT_iq3_s(R) iq3_s_kdot KDOT_ARGS(R)
#define KDOT_iq1_s(R) iq1_s_kdot KDOT_ARGS(R)
#define KDOT_iq1_m(R) iq1_m_kdot KDOT_ARGS(R)

KGEMM_FOR_TYPE(q2_k, Q2_K_SB, 84)
KGEMM_FOR_TYPE(q3_k, Q3_K_SB, 110)
KGEMM_FOR_TYPE(q4_k, Q4_K_SB, 144)
KGEMM_FOR_TYPE(q5_k, Q5_K_SB, 176)
KGEMM_FOR_TYPE(q6_k, Q6_K_SB, 210)
KGEMM_FOR_TYPE(iq4_xs, IQ4_XS_SB, 136)
KGEMM_FOR_TYPE(iq2_xxs, IQ2_XXS_SB, 66)
KGEMM_FOR_TYPE(iq3_xxs, IQ3_XXS_SB, 98)
KGEMM_FOR_TYPE(iq2_xs, IQ2_XS_SB, 74)
KGEMM_FOR_TYPE(iq2_s, IQ2_S_SB, 82)
KGEMM_FOR_TYPE(iq3_s, IQ3_S_SB, 110)
KGEMM_FOR_TYPE(iq1_s, IQ1_S_SB, 50)
KGEMM_FOR_TYPE(iq1_m, IQ1_M_SB, 56)

/* The lattice types over more than IRB activation rows (prefill): NB weight rows' super-blocks are
 * decoded once into a per-thread buffer (signed values, scale factors, float factors), then every
 * block of IRB activation rows multiplies from there; the grid lookups, the costly part of these
 * types, run once a weight instead of once per block of activation rows. */
static inline __attribute__((always_inline)) void decoded_dot(
    const int R, const __m256i *restrict v, const __m256i *restrict sc, const float *restrict f,
    const int8_t *restrict x, const float *restrict xd, int64_t K, float *restrict Y, int64_t N, int64_t n) {
    const int64_t nsb = K / 256;
    __m256 acc[IRB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        isum_t isum[IRB];
        for (int r = 0; r < R; r++) isum[r] = ISUM_ZERO();
        for (int k = 0; k < 8; k += 2)
            SIGNED_SUB_BLOCK_PAIR(R, v[8 * j + k], v[8 * j + k + 1], x + 256 * j + 32 * k, sc[8 * j + k],
                                  sc[8 * j + k + 1], isum);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ISUM_NARROW(isum[r])), _mm256_set1_ps(f[j] * xd[r * nsb + j]),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) Y[r * N + n] = hsum8(acc[r]);
}

static void lattice_kgemm_decoded(const int type, const int nbytes, const uint8_t *const *W, int64_t N, int64_t K,
                                  const int8_t *xq, const float *xd, int64_t B, float *Y, int nthreads) {
    const int64_t nsb = K / 256;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        __m256i *v = aligned_alloc(64, (size_t)(NB * K)), *sc = aligned_alloc(64, (size_t)(NB * K));
        float *f = malloc((size_t)(NB * nsb) * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (int64_t nb = 0; nb < N; nb += NB) {
            const int64_t rows = N - nb < NB ? N - nb : NB;
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < nsb; j++) {
                    const uint8_t *b = W[nb + i] + j * nbytes;
                    f[i * nsb + j] = lattice_d(type, b);
                    for (int k = 0; k < 8; k++)
                        lattice_sub_block(type, b, k, 0, &v[(i * nsb + j) * 8 + k], &sc[(i * nsb + j) * 8 + k], 0);
                }
            for (int64_t b0 = 0; b0 < B; b0 += IRB)
                for (int64_t i = 0; i < rows; i++) {
#define DECODED_DOT(R) decoded_dot(R, v + i * nsb * 8, sc + i * nsb * 8, f + i * nsb, xq + b0 * K, xd + b0 * nsb, K, \
                                   Y + b0 * N, N, nb + i)
                    switch (B - b0 < IRB ? B - b0 : IRB) {
                    case 1: DECODED_DOT(1); break;
                    case 2: DECODED_DOT(2); break;
                    case 3: DECODED_DOT(3); break;
                    IF_IRB8(case 4: DECODED_DOT(4); break; case 5: DECODED_DOT(5); break;
                            case 6: DECODED_DOT(6); break; case 7: DECODED_DOT(7); break;)
                    default: DECODED_DOT(IRB); break;
                    }
#undef DECODED_DOT
                }
        }
        free(v); free(sc); free(f);
    }
}

/* A lattice type's kernel: row by row up to IRB activation rows (decode), else decoded once. */
#define LATTICE_KGEMM(NAME, TYPE, NBYTES)                                                           \
    static void NAME##_lattice_kgemm(const uint8_t *const *W, int64_t N, int64_t K, const int8_t *xq, \
                                     const float *xd, const int16_t *xb, int64_t B, float *Y, int nthreads) { \
        if (B > IRB) lattice_kgemm_decoded(TYPE, NBYTES, W, N, K, xq, xd, B, Y, nthreads);          \
        else NAME##_kgemm(W, N, K, xq, xd, xb, B, Y, nthreads);                                     \
    }
LATTICE_KGEMM(iq2_xxs, IQ2_XXS, 66)
LATTICE_KGEMM(iq2_xs, IQ2_XS, 74)
LATTICE_KGEMM(iq2_s, IQ2_S, 82)
LATTICE_KGEMM(iq3_xxs, IQ3_XXS, 98)
LATTICE_KGEMM(iq3_s, IQ3_S, 110)
LATTICE_KGEMM(iq1_s, IQ1_S, 50)
LATTICE_KGEMM(iq1_m, IQ1_M, 56)

typedef void (*igemm_fn)(const uint8_t *const *, int64_t, int64_t, const int8_t *, const float *, const float *,
                         int64_t, float *, int);
typedef void (*kgemm_fn)(const uint8_t *const *, int64_t, int64_t, const int8_t *, const float *, const int16_t *,
                         int64_t, float *, int);

static igemm_fn int8_lookup(int type) {
    switch (type) {
    case Q4_0: return q4_0_igemm;
    case Q4_1: return q4_1_igemm;
    case Q5_0: return q5_0_igemm;
    case Q5_1: return q5_1_igemm;
    case Q8_0: return q8_0_igemm;
    case IQ4_NL: return iq4_nl_igemm;
    case MXFP4: return mxfp4_igemm;
    default: return 0;
    }
}

static kgemm_fn int8_k_lookup(int type) {
    switch (type) {
    case Q2_K: return q2_k_kgemm;
    case Q3_K: return q3_k_kgemm;
    case Q4_K: return q4_k_kgemm;
    case Q5_K: return q5_k_kgemm;
    case Q6_K: return q6_k_kgemm;
    case IQ4_XS: return iq4_xs_kgemm;
    case IQ2_XXS: return lattice_tables_set ? iq2_xxs_lattice_kgemm : 0;
    case IQ3_XXS: return lattice_tables_set ? iq3_xxs_lattice_kgemm : 0;
    case IQ2_XS: return lattice_tables_set ? iq2_xs_lattice_kgemm : 0;
    case IQ2_S: return lattice_tables_set ? iq2_s_lattice_kgemm : 0;
    case IQ3_S: return lattice_tables_set ? iq3_s_lattice_kgemm : 0;
    case IQ1_S: return lattice_tables_set ? iq1_s_lattice_kgemm : 0;
    case IQ1_M: return lattice_tables_set ? iq1_m_lattice_kgemm : 0;
    default: return 0;
    }
}
#else
static void *int8_lookup(int type) { (void)type; return 0; }
static void *int8_k_lookup(int type) { (void)type; return 0; }
#endif

int gguf_int8_supported(int type) { return int8_lookup(type) != 0 || int8_k_lookup(type) != 0; }
