/* Part of gguf_gemm.c, included there once (one translation unit, one library): interleaved rows of
 * Q4_K, Q6_K, Q2_K and Q3_K. */

/* ---- Q4_K interleaved ------------------------------------------------------------------------
 * For each group of 8 rows and each super-block column j, 1184 bytes (8 x 148; the file's 8 x 144
 * plus the 6-bit scales and minimums unpacked to bytes):
 *   d[8], dmin[8] (fp16); sc[8 sub-blocks][8 rows] (uint8); the minimums (uint8), AVX-512:
 *   mn[8 rows][8 sub-blocks], AVX2: for each pair of sub-blocks, the 8 rows' two;
 *   then the codes of each pair p of sub-blocks (2p in the low nibbles, 2p + 1 in the high), 256
 *   bytes: AVX-512: rows 0-3's bytes 0-15, rows 0-3's bytes 16-31, then rows 4-7 likewise;
 *   AVX2: chunk c (bytes 4c..4c+3) of rows 0..7, for c = 0..7 (one 32-bit lane a row).
 * AVX-512: a sub-block of four rows is two 512-bit registers; its u8 x s8 products are summed in
 * pairs (vpmaddubsw) and times the rows' scales into int32 (vpdpwssd), over the whole super-block;
 * the minimums times the activations' sums per 32 go through one vpdpwssd per four rows. AVX2: a
 * sub-block of eight rows is eight registers, their pair sums added in int16 (8 x 2 x 15 x 127 <
 * 2**15), then times the rows' scales; the minimums as pairs against the sums' pairs. */
#define Q4K_X8_BYTES 1184

static inline int q4k_x8_min(int r, int s) {  /* where row r's minimum of sub-block s is */
#ifdef X8_512
    return 96 + 8 * r + s;
#else
    return 96 + 16 * (s / 2) + 2 * r + s % 2;
#endif
}

static inline int q4k_x8_code(int r, int p, int i) {  /* where row r's code byte i of pair p is */
#ifdef X8_512
    return 160 + p * 256 + x8_chunk(r, i / 16) + i % 16;
#else
    return 160 + p * 256 + (i / 4) * 32 + 4 * r + i % 4;
#endif
}

static void q4k_x8_move(uint8_t *o, const uint8_t *b, int r) {
    memcpy(o + 2 * r, b, 2);
    memcpy(o + 16 + 2 * r, b + 2, 2);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        o[32 + 8 * s + r] = (uint8_t)sc;
        o[q4k_x8_min(r, s)] = (uint8_t)m;
    }
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 32; i += 4) memcpy(o + q4k_x8_code(r, p, i), b + 16 + 32 * p + i, 4);
}

/* Row r of a group's super-block column o, dequantized as deq_q4_k does from the file's block. */
static void q4k_x8_deq(const uint8_t *o, int r, float *w) {
    const float d = h2f(o + 2 * r), dmin = h2f(o + 16 + 2 * r);
    for (int s = 0; s < 8; s++) {
        const float ds = d * (float)o[32 + 8 * s + r], dm = dmin * (float)o[q4k_x8_min(r, s)];
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = o[q4k_x8_code(r, s / 2, l)];
            w[32 * s + l] = ds * (float)((s & 1) ? byte >> 4 : byte & 0xF) - dm;
        }
    }
}

#ifdef X8_512
/* Rows of group g (nsb super-blocks) against R activation rows: xq [R, K], xd [R, nsb] scales,
 * x32 [R, K / 32] sums per 32. */
static inline __attribute__((always_inline)) void q4k_x8_group(
    const int R, const uint8_t *restrict g, int64_t nsb, int64_t K, const int8_t *restrict xq,
    const float *restrict xd, const int16_t *restrict x32, float *restrict Y, int64_t N) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i rows0 = _mm512_loadu_si512(x8_word_row), rows1 = _mm512_loadu_si512(x8_word_row + 32);
    const __m512i lane0 = x8_lanes(0), lane1 = x8_lanes(1);
    __m512 acc[IRB][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        const uint8_t *b = g + j * Q4K_X8_BYTES;
        __m512i isum[IRB][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")  /* s & 1 a constant in each copy */
        for (int s = 0; s < 8; s++) {
            const uint8_t *q = b + 160 + (s / 2) * 256;
            __m512i a0 = _mm512_loadu_si512(q), b0 = _mm512_loadu_si512(q + 64);
            __m512i a1 = _mm512_loadu_si512(q + 128), b1 = _mm512_loadu_si512(q + 192);
            if (s & 1) {
                a0 = _mm512_srli_epi16(a0, 4); b0 = _mm512_srli_epi16(b0, 4);
                a1 = _mm512_srli_epi16(a1, 4); b1 = _mm512_srli_epi16(b1, 4);
            }
            a0 = _mm512_and_si512(a0, nib); b0 = _mm512_and_si512(b0, nib);
            a1 = _mm512_and_si512(a1, nib); b1 = _mm512_and_si512(b1, nib);
            const __m512i sc = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 32 + 8 * s))));
            const __m512i s0 = _mm512_permutexvar_epi16(rows0, sc), s1 = _mm512_permutexvar_epi16(rows1, sc);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * K + j * 256 + s * 32;
                const __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
                const __m512i xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16)));
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(a0, xa), s0);
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(b0, xb), s0);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(a1, xa), s1);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(b1, xb), s1);
            }
        }
        const __m512 dv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
        const __m512 mv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16))));
        const __m512 d0 = _mm512_permutexvar_ps(lane0, dv), d1 = _mm512_permutexvar_ps(lane1, dv);
        const __m512 m0 = _mm512_permutexvar_ps(lane0, mv), m1 = _mm512_permutexvar_ps(lane1, mv);
        const __m512i mn0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 96)));
        const __m512i mn1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128)));
        for (int r = 0; r < R; r++) {
            const __m512 sx = _mm512_set1_ps(xd[r * nsb + j]);
            const __m512i xs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x32 + r * (K / 32) + j * 8)));
            const __m512 min0 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), mn0, xs));
            const __m512 min1 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), mn1, xs));
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(d0, sx), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(d1, sx), acc[r][1]);
            acc[r][0] = _mm512_fnmadd_ps(min0, _mm512_mul_ps(m0, sx), acc[r][0]);
            acc[r][1] = _mm512_fnmadd_ps(min1, _mm512_mul_ps(m1, sx), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, x8_row_sums(acc[r]));
}
#elif defined(HAVE_X8)
static inline __attribute__((always_inline)) void q4k_x8_group(
    const int R, const uint8_t *restrict g, int64_t nsb, int64_t K, const int8_t *restrict xq,
    const float *restrict xd, const int16_t *restrict x32, float *restrict Y, int64_t N) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    /* 8 bytes (one a row) -> lane r: the row's byte as two int16 */
    const __m256i pairs = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                           4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    __m256 acc[IRB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        const uint8_t *b = g + j * Q4K_X8_BYTES;
        __m256i isum[IRB];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8")  /* s & 1 a constant in each copy */
        for (int s = 0; s < 8; s++) {
            int64_t sc8;
            memcpy(&sc8, b + 32 + 8 * s, 8);
            const __m256i sc = _mm256_shuffle_epi8(_mm256_set1_epi64x(sc8), pairs);
            __m256i u[8];  /* u[c]: values 4c..4c+3 of sub-block s, one row a lane */
            for (int c = 0; c < 8; c++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(b + q4k_x8_code(0, s / 2, 4 * c)));
                if (s & 1) w = _mm256_srli_epi16(w, 4);
                u[c] = _mm256_and_si256(w, nib);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * K + j * 256 + s * 32;
                __m256i p16 = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    int32_t x4;
                    memcpy(&x4, x + 4 * c, 4);
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(x4)));
                }
                isum[r] = DPWSSD(isum[r], p16, sc);
            }
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)));
        __m256i mn[4];  /* lane r: the row's minimums of sub-blocks 2t, 2t + 1 */
        for (int t = 0; t < 4; t++) mn[t] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 96 + 16 * t)));
        for (int r = 0; r < R; r++) {
            const int16_t *xs = x32 + r * (K / 32) + j * 8;
            __m256i msum = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                int32_t x2;
                memcpy(&x2, xs + 2 * t, 4);
                msum = DPWSSD(msum, mn[t], _mm256_set1_epi32(x2));
            }
            const __m256 sx = _mm256_set1_ps(xd[r * nsb + j]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dv, sx), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(mv, sx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, acc[r]);
}
#endif

#ifdef HAVE_X8
#define Q4K_X8_GROUP(R) q4k_x8_group(R, Wp + g * nsb * Q4K_X8_BYTES, nsb, K, xq + b0 * K, xd + b0 * nsb, \
                                     x32 + b0 * (K / 32), Y + b0 * N + g * 8, N)
static void q4_k_x8_gemm(const uint8_t *Wp, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                         const int16_t *x32, int64_t B, float *Y, int nthreads) {
    const int64_t nsb = K / 256;
    FOR_GROUPS_AND_BATCH(Q4K_X8_GROUP)
}
#endif

/* ---- Q6_K interleaved (AVX-512 VNNI) ---------------------------------------------------------
 * For each group of 8 rows and each super-block column j, 1712 bytes (8 x 214; the file's 8 x 210
 * plus an int32 per row and super-block):
 *   d[8] (fp16); sc[16 groups of 16][8 rows] (int8); c[8] (int32, below);
 *   ql: 4 chunks of each row's 32 bytes, qh: 2 chunks, each chunk as rows 0-3's bytes 0-15, rows
 *   0-3's bytes 16-31, then rows 4-7 likewise (ql at 176, qh at 1200).
 * Sub-block s of 32 (half n = s / 4, k = s % 4) takes ql chunk 2n + k % 2 (high nibbles for
 * k >= 2) and qh chunk n's bits 2k, 2k + 1 as the code's bits 4, 5. Codes q - 32 are signed,
 * so here the activations go in unsigned, as x + 128: sum(sc (q - 32) x) = sum(sc (q - 32)
 * (x + 128)) - c with c = 128 sum(sc (q - 32)), a constant of the weights kept in the layout. */
#define Q6K_X8_BYTES 1712

#ifdef X8_512
/* Row r's 192 bytes of codes between its file block b (ql's 4 chunks of 32, then qh's 2: chunk ch at 32 ch) and
 * the group's column o (chunk ch at 176 + 256 ch: qh's at 1200), into o when to_x8, else back into b. */
static void q6k_x8_copy_codes(uint8_t *o, uint8_t *b, int r, int to_x8) {
    for (int h = 0; h < 2; h++)
        for (int ch = 0; ch < 6; ch++) {
            uint8_t *x = o + 176 + 256 * ch + x8_chunk(r, h), *f = b + 32 * ch + 16 * h;
            memcpy(to_x8 ? x : f, to_x8 ? f : x, 16);
        }
}

static void q6k_x8_move(uint8_t *o, const uint8_t *b, int r) {
    const int8_t *sc = (const int8_t *)(b + 192);
    memcpy(o + 2 * r, b + 208, 2);
    int32_t c = 0;
    for (int g = 0; g < 16; g++) o[16 + 8 * g + r] = (uint8_t)sc[g];
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = b + 64 * n, qh = b[128 + 32 * n + l];
            const int q[4] = {(ql[l] & 0xF) | ((qh & 3) << 4), (ql[l + 32] & 0xF) | (((qh >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4)};
            for (int k = 0; k < 4; k++) c += 128 * sc[8 * n + 2 * k + l / 16] * (q[k] - 32);
        }
    memcpy(o + 144 + 4 * r, &c, 4);
    q6k_x8_copy_codes(o, (uint8_t *)b, r, 1);  /* (only read) */
}

/* Row r of a group's super-block column o, dequantized as deq_q6_k does: the file's block put back together. */
static void q6k_x8_deq(const uint8_t *o, int r, float *w) {
    uint8_t b[210];
    q6k_x8_copy_codes((uint8_t *)o, b, r, 0);  /* (only read) */
    for (int g = 0; g < 16; g++) b[192 + g] = o[16 + 8 * g + r];
    memcpy(b + 208, o + 2 * r, 2);
    deq_q6_k(b, w);
}

#endif

/* ---- Q2_K interleaved (AVX-512 VNNI) ---------------------------------------------------------
 * For each group of 8 rows and each super-block column j, 672 bytes (8 x 84, the file's size):
 *   d[8], dmin[8] (fp16); the sub-block scales as pairs, byte 32 + 8p + r: row r's scales of
 *   sub-blocks 2p (low nibble) and 2p + 1 (high); the minimums, byte 96 + 8r + g: row r's of
 *   sub-blocks g (low) and g + 8 (high); then the codes of each half h (128 weights: byte l holds
 *   weights 32c + l in its bit pairs c = 0..3) at 160 + 256h, as Q6_K's chunks: rows 0-3's bytes
 *   0-15, rows 0-3's bytes 16-31, then rows 4-7 likewise.
 * Chunk s (h = s / 4, c = s % 4) is sub-blocks 2p, 2p + 1 with p = s: its two-bit codes times the
 * activations summed in pairs (vpmaddubsw), times the rows' scales into int32 (vpdpwssd) over the
 * super-block; the minimums against the activations' sums per 16, two vpdpwssd for four rows. */
#define Q2K_X8_BYTES 672

#ifdef X8_512
static void q2k_x8_move(uint8_t *o, const uint8_t *b, int r) {
    memcpy(o + 2 * r, b + 80, 2);
    memcpy(o + 16 + 2 * r, b + 82, 2);
    for (int p = 0; p < 8; p++) o[32 + 8 * p + r] = (uint8_t)((b[2 * p] & 0xF) | (b[2 * p + 1] & 0xF) << 4);
    for (int g = 0; g < 8; g++) o[96 + 8 * r + g] = (uint8_t)((b[g] >> 4) | (b[g + 8] & 0xF0));
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++) memcpy(o + 160 + 256 * h + x8_chunk(r, i), b + 16 + 32 * h + 16 * i, 16);
}

/* Row r of a group's super-block column o, dequantized as deq_q2_k does from the file's block. */
static void q2k_x8_deq(const uint8_t *o, int r, float *w) {
    uint8_t b[84];
    memcpy(b + 80, o + 2 * r, 2);
    memcpy(b + 82, o + 16 + 2 * r, 2);
    for (int g = 0; g < 16; g++) {
        const int sc = (o[32 + 8 * (g / 2) + r] >> (4 * (g % 2))) & 0xF;
        const int m = (o[96 + 8 * r + g % 8] >> (4 * (g / 8))) & 0xF;
        b[g] = (uint8_t)(sc | m << 4);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++) memcpy(b + 16 + 32 * h + 16 * i, o + 160 + 256 * h + x8_chunk(r, i), 16);
    deq_q2_k(b, w);
}

/* Rows of group g (nsb super-blocks) against R activation rows: xq [R, K], xd [R, nsb] scales,
 * x16 [R, K / 16] sums per 16. */
static inline __attribute__((always_inline)) void q2k_x8_group(
    const int R, const uint8_t *restrict g, int64_t nsb, int64_t K, const int8_t *restrict xq,
    const float *restrict xd, const int16_t *restrict x16, float *restrict Y, int64_t N) {
    const __m512i three = _mm512_set1_epi8(3), nib = _mm512_set1_epi16(0xF);
    const __m512i rows0 = _mm512_loadu_si512(x8_word_row), rows1 = _mm512_loadu_si512(x8_word_row + 32);
    const __m512i lane0 = x8_lanes(0), lane1 = x8_lanes(1);
    __m512 acc[IRB][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        const uint8_t *b = g + j * Q2K_X8_BYTES;
        __m512i isum[IRB][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")  /* the shift 2 (s % 4) a constant in each copy */
        for (int s = 0; s < 8; s++) {
            const uint8_t *q = b + 160 + (s / 4) * 256;
            __m512i w[4];
            for (int v = 0; v < 4; v++) {
                const __m512i c = _mm512_loadu_si512(q + 64 * v);
                w[v] = _mm512_and_si512(s % 4 ? _mm512_srli_epi16(c, 2 * (s % 4)) : c, three);
            }
            /* w[0], w[1]: rows 0-3, weights 0-15 (sub-block 2s) and 16-31 (2s + 1); w[2], w[3]: rows 4-7 */
            const __m512i sp = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 32 + 8 * s))));
            const __m512i sa = _mm512_and_si512(sp, nib), sb = _mm512_srli_epi16(sp, 4);
            const __m512i sa0 = _mm512_permutexvar_epi16(rows0, sa), sa1 = _mm512_permutexvar_epi16(rows1, sa);
            const __m512i sb0 = _mm512_permutexvar_epi16(rows0, sb), sb1 = _mm512_permutexvar_epi16(rows1, sb);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * K + j * 256 + (s / 4) * 128 + (s % 4) * 32;
                const __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
                const __m512i xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16)));
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(w[0], xa), sa0);
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(w[1], xb), sb0);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(w[2], xa), sa1);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(w[3], xb), sb1);
            }
        }
        const __m512 dv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
        const __m512 mv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16))));
        const __m512 d0 = _mm512_permutexvar_ps(lane0, dv), d1 = _mm512_permutexvar_ps(lane1, dv);
        const __m512 m0 = _mm512_permutexvar_ps(lane0, mv), m1 = _mm512_permutexvar_ps(lane1, mv);
        /* lane r: row r's minimums of sub-blocks 0-7 (lo) and 8-15 (hi) */
        const __m512i mn0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 96)));
        const __m512i mn1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128)));
        const __m512i lo0 = _mm512_and_si512(mn0, nib), hi0 = _mm512_srli_epi16(mn0, 4);
        const __m512i lo1 = _mm512_and_si512(mn1, nib), hi1 = _mm512_srli_epi16(mn1, 4);
        for (int r = 0; r < R; r++) {
            const __m512 sx = _mm512_set1_ps(xd[r * nsb + j]);
            const int16_t *xs = x16 + r * (K / 16) + j * 16;
            const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xs));
            const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xs + 8)));
            const __m512 min0 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_madd_epi16(lo0, xl), hi0, xh));
            const __m512 min1 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_madd_epi16(lo1, xl), hi1, xh));
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(d0, sx), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(d1, sx), acc[r][1]);
            acc[r][0] = _mm512_fnmadd_ps(min0, _mm512_mul_ps(m0, sx), acc[r][0]);
            acc[r][1] = _mm512_fnmadd_ps(min1, _mm512_mul_ps(m1, sx), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, x8_row_sums(acc[r]));
}

#define Q2K_X8_GROUP(R) q2k_x8_group(R, Wp + g * nsb * Q2K_X8_BYTES, nsb, K, xq + b0 * K, xd + b0 * nsb, \
                                     x16 + b0 * (K / 16), Y + b0 * N + g * 8, N)
static void q2_k_x8_gemm(const uint8_t *Wp, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                         const int16_t *x16, int64_t B, float *Y, int nthreads) {
    const int64_t nsb = K / 256;
    FOR_GROUPS_AND_BATCH(Q2K_X8_GROUP)
}
#endif

/* ---- Q3_K interleaved (AVX-512 VNNI) ---------------------------------------------------------
 * For each group of 8 rows and each super-block column j, 944 bytes (8 x 118; the file's 8 x 110 with
 * the scales unpacked and a constant added):
 *   d[8] (fp16); sc[16 sub-blocks][8 rows] (int8, the scale - 32); c[8] (int32, below); the high bits
 *   (32 bytes a row: bit s of byte l is weight 128 (s / 4) + 32 (s % 4) + l's) and the codes of each
 *   half (as Q2_K's) as Q6_K's chunks: rows 0-3's bytes 0-15, rows 0-3's bytes 16-31, then rows 4-7.
 * Chunk s (sub-blocks 2s, 2s + 1) takes bit pair s % 4 of its half's codes and bit s of the high
 * bits: codes q - 4 in -4..3, signed, so the activations go in unsigned as Q6_K's do (x + 128) and
 * c = 128 sum(sc (q - 4)) of each row's super-block comes off. */
#define Q3K_X8_BYTES 944

#ifdef X8_512
static void q3k_x8_move(uint8_t *o, const uint8_t *b, int r) {
    int8_t sc[16];
    uint32_t words[4];
    q3_k_scale_words(b + 96, words);
    memcpy(sc, words, 16);
    memcpy(o + 2 * r, b + 108, 2);
    for (int g = 0; g < 16; g++) o[16 + 8 * g + r] = (uint8_t)sc[g];
    int32_t c = 0;
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                c += 128 * sc[8 * h + 2 * j + l / 16] * (((b[32 + 32 * h + l] >> (2 * j)) & 3) - ((b[l] >> (4 * h + j)) & 1 ? 0 : 4));
    memcpy(o + 144 + 4 * r, &c, 4);
    for (int i = 0; i < 2; i++) {
        memcpy(o + 176 + x8_chunk(r, i), b + 16 * i, 16);
        for (int h = 0; h < 2; h++) memcpy(o + 432 + 256 * h + x8_chunk(r, i), b + 32 + 32 * h + 16 * i, 16);
    }
}

/* Row r of a group's super-block column o, dequantized as deq_q3_k does from the file's block. */
static void q3k_x8_deq(const uint8_t *o, int r, float *w) {
    const float d = h2f(o + 2 * r);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int g = 0; g < 2; g++) {
                const float dl = d * (float)(int8_t)o[16 + 8 * (8 * h + 2 * j + g) + r];
                for (int l = 16 * g; l < 16 * g + 16; l++) {
                    const int at = x8_chunk(r, l / 16) + l % 16;
                    const int v = ((o[432 + 256 * h + at] >> (2 * j)) & 3) - ((o[176 + at] >> (4 * h + j)) & 1 ? 0 : 4);
                    w[128 * h + 32 * j + l] = dl * (float)v;
                }
            }
}

/* The codes of Q6_K's and Q3_K's chunk s, minus their offset (signed): v = 0, 1 rows 0-3's weights 0-15
 * and 16-31, v = 2, 3 rows 4-7's. */
static inline __attribute__((always_inline)) __m512i q6k_x8_codes(const uint8_t *b, int s, int v) {
    const int n = s / 4, k = s % 4;  /* ql chunk 2n + k % 2 (high nibbles for k >= 2), qh chunk n's bits 2k, 2k + 1 */
    __m512i lo = _mm512_loadu_si512(b + 176 + (2 * n + k % 2) * 256 + 64 * v);
    __m512i hi = _mm512_loadu_si512(b + 1200 + n * 256 + 64 * v);
    if (k >= 2) lo = _mm512_srli_epi16(lo, 4);
    /* bits 2k, 2k + 1 of qh to bits 4, 5 */
    hi = k == 0 ? _mm512_slli_epi16(hi, 4) : k == 1 ? _mm512_slli_epi16(hi, 2) : k == 3 ? _mm512_srli_epi16(hi, 2) : hi;
    return _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0F)),
                                           _mm512_and_si512(hi, _mm512_set1_epi8(0x30))), _mm512_set1_epi8(32));
}

static inline __attribute__((always_inline)) __m512i q3k_x8_codes(const uint8_t *b, int s, int v) {
    /* bit pair s % 4 of the half's codes, bit s of the high bits as bit 2 */
    __m512i lo = _mm512_loadu_si512(b + 432 + (s / 4) * 256 + 64 * v), hi = _mm512_loadu_si512(b + 176 + 64 * v);
    if (s % 4) lo = _mm512_srli_epi16(lo, 2 * (s % 4));
    hi = s >= 2 ? _mm512_srli_epi16(hi, s - 2) : _mm512_slli_epi16(hi, 2 - s);
    const __m512i four = _mm512_set1_epi8(4);
    return _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(3)), _mm512_and_si512(hi, four)), four);
}

/* The block four Q6_K blocks further on, on its way to L2. At one activation row the interleaved Q6_K kernel
 * does enough work a byte that the hardware prefetchers alone leave it waiting on memory (~20 GB/s from memory
 * where it reads ~60 from cache). Two blocks ahead into L1: 1.10-1.34x; four into L2: 1.16-1.30x over that,
 * three to five alike, the codes aligned to cache lines slower (results/cpu-x8-prefetch.txt). Q4_K's and Q3_K's
 * interleaved kernels measured a loss with it. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *b, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(b + 4 * bytes + l), _MM_HINT_T1);
}

/* Q6_K's or Q3_K's rows of group g (nsb super-blocks) against R activation rows: xu [R, K] = x + 128
 * (uint8), xd [R, nsb] scales.  Their layouts share d at 0, the scales by sub-block at 16 (groups 2s and
 * 2s + 1 of chunk s: 16 bytes) and c at 144; only the codes differ. */
static inline __attribute__((always_inline)) void signed_x8_group(
    const int R, const int type, const uint8_t *restrict g, int64_t nsb, int64_t K, const uint8_t *restrict xu,
    const float *restrict xd, float *restrict Y, int64_t N) {
    const __m512i rows0 = _mm512_loadu_si512(x8_word_row), rows1 = _mm512_loadu_si512(x8_word_row + 32);
    const __m512i lane0 = x8_lanes(0), lane1 = x8_lanes(1);
    /* the 16 bytes of scales hold groups 2s (rows 0-7) and 2s + 1 (rows 0-7): rows 8-15 of the table pick the second */
    const __m512i eight = _mm512_set1_epi16(8);
    const __m512i rows0b = _mm512_add_epi16(rows0, eight), rows1b = _mm512_add_epi16(rows1, eight);
    const int64_t bytes = type == Q6_K ? Q6K_X8_BYTES : Q3K_X8_BYTES;
    __m512 acc[IRB][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        const uint8_t *b = g + j * bytes;
        if (type == Q6_K) prefetch_ahead(b, bytes);  /* (Q3_K's lighter blocks read slower with it) */
        __m512i isum[IRB][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")  /* s a constant in each copy: the codes' shifts are fixed */
        for (int s = 0; s < 8; s++) {
            __m512i w[4];  /* w[0], w[1]: rows 0-3, values 0-15 and 16-31; w[2], w[3]: rows 4-7 */
            for (int v = 0; v < 4; v++) w[v] = type == Q6_K ? q6k_x8_codes(b, s, v) : q3k_x8_codes(b, s, v);
            const __m512i sa = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(b + 16 + 16 * s))));
            const __m512i sa0 = _mm512_permutexvar_epi16(rows0, sa), sa1 = _mm512_permutexvar_epi16(rows1, sa);
            const __m512i sb0 = _mm512_permutexvar_epi16(rows0b, sa), sb1 = _mm512_permutexvar_epi16(rows1b, sa);
            for (int r = 0; r < R; r++) {
                const uint8_t *x = xu + r * K + j * 256 + s * 32;
                const __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
                const __m512i xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16)));
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(xa, w[0]), sa0);
                isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], _mm512_maddubs_epi16(xb, w[1]), sb0);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(xa, w[2]), sa1);
                isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], _mm512_maddubs_epi16(xb, w[3]), sb1);
            }
        }
        const __m512 dv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
        const __m512 d0 = _mm512_permutexvar_ps(lane0, dv), d1 = _mm512_permutexvar_ps(lane1, dv);
        /* c of each row into the first lane of its chunk */
        const __m512i cv = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 144)));
        const __m512i c0 = _mm512_maskz_permutexvar_epi32(0x1111, lane0, cv);
        const __m512i c1 = _mm512_maskz_permutexvar_epi32(0x1111, lane1, cv);
        for (int r = 0; r < R; r++) {
            const __m512 sx = _mm512_set1_ps(xd[r * nsb + j]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][0], c0)), _mm512_mul_ps(d0, sx), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][1], c1)), _mm512_mul_ps(d1, sx), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, x8_row_sums(acc[r]));
}

#define SIGNED_X8_GROUP(R) signed_x8_group(R, type, Wp + g * nsb * bytes, nsb, K, xu + b0 * K, xd + b0 * nsb, \
                                           Y + b0 * N + g * 8, N)
#define SIGNED_X8_GEMM(NAME, TYPE)                                                                        \
    static void NAME(const uint8_t *Wp, int64_t N, int64_t K, const uint8_t *xu, const float *xd, int64_t B, \
                     float *Y, int nthreads) {                                                             \
        const int type = TYPE;                                                                             \
        const int64_t nsb = K / 256, bytes = TYPE == Q6_K ? Q6K_X8_BYTES : Q3K_X8_BYTES;                  \
        FOR_GROUPS_AND_BATCH(SIGNED_X8_GROUP)                                                              \
    }
SIGNED_X8_GEMM(q6_k_x8_gemm, Q6_K)
SIGNED_X8_GEMM(q3_k_x8_gemm, Q3_K)
#endif

static const x8_super *x8_super_layout(int type) {
    static const x8_super layouts[] = {{Q4_K, Q4K_X8_BYTES, 144, q4k_x8_move, q4k_x8_deq},
#ifdef X8_512  /* Q6_K's, Q2_K's and Q3_K's kernels take 512-bit registers */
                                       {Q6_K, Q6K_X8_BYTES, 210, q6k_x8_move, q6k_x8_deq},
                                       {Q2_K, Q2K_X8_BYTES, 84, q2k_x8_move, q2k_x8_deq},
                                       {Q3_K, Q3K_X8_BYTES, 110, q3k_x8_move, q3k_x8_deq},
#endif
    };
    for (size_t i = 0; i < sizeof layouts / sizeof *layouts; i++)
        if (layouts[i].type == type) return &layouts[i];
    return 0;
}

#ifdef HAVE_X8
static void x8_gemm(int type, const uint8_t *Wp, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, int64_t B, float *Y, int nthreads) {
    switch (type) {
    case Q4_0: q4_0_x8_gemm(Wp, N, K, xq, xd, xs, B, Y, nthreads); break;
    case Q4_1: q4_1_x8_gemm(Wp, N, K, xq, xd, xs, B, Y, nthreads); break;
    case Q8_0: q8_0_x8_gemm(Wp, N, K, xq, xd, xs, B, Y, nthreads); break;
    case IQ4_NL: iq4_nl_x8_gemm(Wp, N, K, xq, xd, xs, B, Y, nthreads); break;
    case MXFP4: mxfp4_x8_gemm(Wp, N, K, xq, xd, xs, B, Y, nthreads); break;
    }
}
#endif
