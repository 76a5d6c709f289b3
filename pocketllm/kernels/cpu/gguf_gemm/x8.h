/* Part of gguf_gemm.c, included there once (one translation unit, one library): interleaved rows
 * (eight a group) of Q4_0, Q4_1, Q8_0, IQ4_NL and MXFP4. */

/* ---- Interleaved rows: Q4_0, Q4_1, Q8_0, IQ4_NL and MXFP4 repacked at load -----------------
 * The per-row kernels above spend most of a 32-element block on float work (convert, scale,
 * horizontal sums) and on unpacking 16 bytes at a time. Repacked so that one block of eight
 * rows is contiguous (the same bytes as the file's, reordered: memory stays the file's), that
 * work is shared by several rows:
 *
 *   for each group of 8 rows and each block column j:
 *     the 8 rows' fp16 scales d (MXFP4: their E8M0 bytes); Q4_1: then their 8 fp16 minimums m;
 *     with AVX-512 VNNI (a 512-bit register holds one block of four rows):
 *       4-bit types: each row's 16 bytes of codes, rows 0..7;
 *       Q8_0: rows 0-3's first 16 values, rows 0-3's last 16, then rows 4-7 likewise;
 *     else (AVX2: one 32-bit lane a row, as llama.cpp's 8x4 repacking on AVX2):
 *       the codes in chunks of 4 bytes, chunk c of rows 0..7 in one 32-byte register.
 *
 * AVX-512: the integer dot products stay in the 4 lanes of each row's 128-bit chunk, are scaled
 * per lane by the row's d times the activation block's scale and are summed across lanes once
 * per row. AVX2: lane r sums row r's products whole (4-bit chunk c holds values 4c..4c+3 in its
 * low nibbles and 16+4c.. in its high ones, against activations broadcast 4 at a time), and the
 * 8 lanes are the 8 rows' outputs: no horizontal sums. The constant part of each value (c = -8d,
 * m, or -128d for the signed types, whose codes go in as w + 128 where vpdpbusd takes them) is
 * c times the activation block's dx * sum(x). */
static int x8_layout(int type, int *scale_bytes, int *block_bytes) {
    switch (type) {
    case Q4_0: *scale_bytes = 16; *block_bytes = 18; return 1;
    case IQ4_NL: *scale_bytes = 16; *block_bytes = 18; return 1;
    case Q4_1: *scale_bytes = 32; *block_bytes = 20; return 1;
    case Q8_0: *scale_bytes = 16; *block_bytes = 34; return 1;
    case MXFP4: *scale_bytes = 8; *block_bytes = 17; return 1;  /* the 8 rows' E8M0 bytes */
    default: return 0;
    }
}

/* The super-block types' interleaved layouts (below): bytes of a group's super-block column,
 * of a file block, and the functions that place a row's block there and read it back. */
typedef struct {
    int type, group_bytes, block_bytes;
    void (*move)(uint8_t *o, const uint8_t *b, int r);
    void (*deq)(const uint8_t *o, int r, float *w);  /* where a tied embedding table reads it */
} x8_super;
static const x8_super *x8_super_layout(int type);

#ifdef HAVE_INT8_DOT
#define HAVE_X8 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define X8_512 1  /* 512-bit registers of four rows' blocks; the super-block types' layouts */
#endif
#ifdef X8_512
/* Where row r's bytes 16i..16i+15 of a 32-byte chunk are among its group's 256 (the 512-bit layouts:
 * rows 0-3's bytes 0-15, rows 0-3's bytes 16-31, then rows 4-7 likewise). */
static inline int x8_chunk(int r, int i) { return (r / 4) * 128 + i * 64 + (r % 4) * 16; }
#endif
int gguf_x8_supported(int type) { int s, b; return x8_super_layout(type) || x8_layout(type, &s, &b); }
#else
int gguf_x8_supported(int type) { (void)type; return 0; }
#endif

/* Row r's block between its file form b and its place in the group's block column o (the layout
 * above): b -> o with to_group, else o -> b. */
static void x8_move(int type, int sb, uint8_t *o, uint8_t *b, int r, int to_group) {
#define X8_MOVE(at_o, at_b, len) (to_group ? memcpy(o + (at_o), b + (at_b), len) : memcpy(b + (at_b), o + (at_o), len))
    if (type == MXFP4) {
        X8_MOVE(r, 0, 1);
#ifdef X8_512
        X8_MOVE(sb + 16 * r, 1, 16);
#else
        for (int c = 0; c < 4; c++) X8_MOVE(sb + 32 * c + 4 * r, 1 + 4 * c, 4);
#endif
        return;
    }
    X8_MOVE(2 * r, 0, 2);
    if (type == Q4_1) X8_MOVE(16 + 2 * r, 2, 2);
    const int codes = type == Q4_1 ? 4 : 2;  /* where the block's codes start */
#ifdef X8_512
    if (type == Q8_0) {
        for (int h = 0; h < 2; h++) X8_MOVE(sb + x8_chunk(r, h), codes + 16 * h, 16);
    } else {
        X8_MOVE(sb + 16 * r, codes, 16);
    }
#else
    for (int c = 0; c < (type == Q8_0 ? 8 : 4); c++) X8_MOVE(sb + 32 * c + 4 * r, codes + 4 * c, 4);
#endif
#undef X8_MOVE
}

/* Bytes of an [N, K] matrix in the interleaved layout. */
int64_t gguf_x8_nbytes(int type, int64_t N, int64_t K) {
    int sb, nb;
    const x8_super *L = x8_super_layout(type);
    if (L) return N / 8 * (K / 256) * L->group_bytes;
    return x8_layout(type, &sb, &nb) ? N * (K / 32) * nb : -1;
}

/* W (a row pointer table, N % 8 == 0) -> out, gguf_x8_nbytes, in the layout above (or a
 * super-block type's); groups split over threads (it runs at load, over every weight). */
int gguf_repack_x8(int type, const uint8_t *const *W, int64_t N, int64_t K, uint8_t *out, int nthreads) {
    int sb = 0, nb = 0;
    const x8_super *L = x8_super_layout(type);
    if (!gguf_x8_supported(type) || N % 8 || K % (L ? 256 : 32)) return -1;
    if (!L) x8_layout(type, &sb, &nb);
    const int64_t cols = L ? K / 256 : K / 32, group_bytes = L ? L->group_bytes : 8 * nb;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t j = 0; j < cols; j++)
            for (int r = 0; r < 8; r++) {
                uint8_t *o = out + (g * cols + j) * group_bytes;
                if (L) L->move(o, W[g * 8 + r] + j * L->block_bytes, r);
                else x8_move(type, sb, o, (uint8_t *)(W[g * 8 + r] + j * nb), r, 1);
            }
    return 0;
}

#ifdef HAVE_X8
/* The 8 rows' scales of a block column: fp16, or MXFP4's E8M0 bytes (e8m0_half of each). */
static inline __m256 x8_scales(const int type, const uint8_t *b) {
    if (type != MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  /* e = 0, 1 */
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

#ifdef X8_512
/* Lane i of a 512-bit float register -> its row: rows 4 * half .. 4 * half + 3, 4 lanes each. */
static inline __m512i x8_lanes(int half) {
    return _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_set1_epi32(4 * half));
}
/* The same for the 32 int16 lanes of the super-block types' scales: 8 lanes a row. */
static const int16_t x8_word_row[64] = {
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7};
/* The 8 rows' results from acc (rows 0-3, 4-7; 4 lanes each): [r0 r0 r2 r2 | r1 r1 r3 r3], then
 * [r0 r2 r4 r6 | r1 r3 r5 r7], in row order. */
static inline __m256 x8_row_sums(const __m512 acc[2]) {
    const __m256 h0 = _mm256_hadd_ps(_mm512_castps512_ps256(acc[0]), _mm512_extractf32x8_ps(acc[0], 1));
    const __m256 h1 = _mm256_hadd_ps(_mm512_castps512_ps256(acc[1]), _mm512_extractf32x8_ps(acc[1], 1));
    return _mm256_permutevar8x32_ps(_mm256_hadd_ps(h0, h1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Rows n0..n0+7 (group g, `nblk` blocks of gb bytes) against R activation rows. */
static inline __attribute__((always_inline)) void x8_group(
    const int R, const int type, const uint8_t *restrict g, int64_t nblk, int64_t K, const int8_t *restrict xq,
    const float *restrict xd, const float *restrict xs, float *restrict Y, int64_t N) {
    int sb, nb;
    x8_layout(type, &sb, &nb);
    const int64_t gb = 8 * nb;
    const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i lane0 = x8_lanes(0), lane1 = x8_lanes(1);
    /* IQ4_NL's or MXFP4's values + 128: unsigned codes for vpdpbusd */
    const int8_t *values = type == MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl;
    const __m512i table = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values)), flip);
    __m512 acc[IRB][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nblk; j++) {
        const uint8_t *b = g + j * gb, *q = b + sb;
        const __m512 d = _mm512_castps256_ps512(x8_scales(type, b));
        const __m512 s0 = _mm512_permutexvar_ps(lane0, d), s1 = _mm512_permutexvar_ps(lane1, d);
        __m512i lo0, hi0, lo1, hi1;  /* values 0-15 and 16-31 of rows 0-3 (0) and 4-7 (1) */
        if (type == Q8_0) {
            lo0 = _mm512_xor_si512(_mm512_loadu_si512(q), flip);
            hi0 = _mm512_xor_si512(_mm512_loadu_si512(q + 64), flip);
            lo1 = _mm512_xor_si512(_mm512_loadu_si512(q + 128), flip);
            hi1 = _mm512_xor_si512(_mm512_loadu_si512(q + 192), flip);
        } else {
            const __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
            lo0 = _mm512_and_si512(v0, nib); hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
            lo1 = _mm512_and_si512(v1, nib); hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
            if (type == IQ4_NL || type == MXFP4) {
                lo0 = _mm512_shuffle_epi8(table, lo0); hi0 = _mm512_shuffle_epi8(table, hi0);
                lo1 = _mm512_shuffle_epi8(table, lo1); hi1 = _mm512_shuffle_epi8(table, hi1);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * K + j * 32;
            const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
            const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16)));
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, xlo), hi0, xhi);
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo1, xlo), hi1, xhi);
            const __m512 sx = _mm512_set1_ps(xd[r * nblk + j]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p0), sx), s0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p1), sx), s1, acc[r][1]);
        }
    }
    /* the constant parts: c of each row and block times the activation block's dx * sum(x) */
    const __m256 cf = _mm256_set1_ps(type == Q4_0 ? -8.f : type == Q4_1 ? 1.f : -128.f);
    const int coff = type == Q4_1 ? 16 : 0;
    __m256 corr[IRB];
    for (int r = 0; r < R; r++) corr[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nblk; j++) {
        const __m256 c = _mm256_mul_ps(x8_scales(type, g + j * gb + coff), cf);
        for (int r = 0; r < R; r++) corr[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(xs[r * nblk + j]), corr[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, _mm256_add_ps(x8_row_sums(acc[r]), corr[r]));
}

#else
/* Rows n0..n0+7 (group g, `nblk` blocks of gb bytes) against R activation rows, lane r row r. */
static inline __attribute__((always_inline)) void x8_group(
    const int R, const int type, const uint8_t *restrict g, int64_t nblk, int64_t K, const int8_t *restrict xq,
    const float *restrict xd, const float *restrict xs, float *restrict Y, int64_t N) {
    int sb, nb;
    x8_layout(type, &sb, &nb);
    const int64_t gb = 8 * nb;
    const int is_signed = type == Q8_0 || type == IQ4_NL || type == MXFP4;
    /* without VNNI: |w| against x with w's sign, and the pair sums of 8 registers added in
     * int16 where they cannot overflow (|w| <= 15: 8 x 2 x 15 x 127 < 2**15) */
    const int short_sums = !VNNI && (type == Q4_0 || type == Q4_1 || type == MXFP4);
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(type == MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl)));
    __m256 acc[IRB];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nblk; j++) {
        const uint8_t *b = g + j * gb, *q = b + sb;
        const __m256 d = x8_scales(type, b);
        const __m256 c = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                                      : _mm256_mul_ps(d, _mm256_set1_ps(type == Q4_0 ? -8.f : -128.f));
        __m256i v[8];  /* v[i]: values 4i..4i+3 of the 8 rows, one row a lane */
        if (type == Q8_0) {
            for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
        } else {
            for (int i = 0; i < 4; i++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
                v[i] = _mm256_and_si256(w, nib);
                v[4 + i] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
                if (is_signed) {
                    v[i] = _mm256_shuffle_epi8(table, v[i]);
                    v[4 + i] = _mm256_shuffle_epi8(table, v[4 + i]);
                }
            }
        }
        if (is_signed && VNNI)
            for (int i = 0; i < 8; i++) v[i] = _mm256_xor_si256(v[i], _mm256_set1_epi8((char)0x80));
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * K + j * 32;
            __m256i p = _mm256_setzero_si256(), p16 = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                int32_t x4;
                memcpy(&x4, x + 4 * i, 4);
                __m256i xb = _mm256_set1_epi32(x4), u = v[i];
                if (is_signed && !VNNI) { xb = _mm256_sign_epi8(xb, v[i]); u = _mm256_sign_epi8(v[i], v[i]); }
                if (short_sums) p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(u, xb));
                else p = DPBUSD(p, u, xb);
            }
            if (short_sums) p = _mm256_madd_epi16(p16, ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nblk + j])), acc[r]);
            if (!is_signed || VNNI) acc[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(xs[r * nblk + j]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * N, acc[r]);
}
#endif

/* Groups of 8 interleaved rows split over threads in blocks of NB rows, each block against all B
 * activation rows IRB at a time (as FOR_ROWS_AND_BATCH). */
#define FOR_GROUPS_AND_BATCH(GROUP)                                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t gb = 0; gb < N / 8; gb += NB / 8)                                                  \
        for (int64_t b0 = 0; b0 < B; b0 += IRB)                                                     \
            for (int64_t g = gb; g < (N / 8 - gb < NB / 8 ? N / 8 : gb + NB / 8); g++) {            \
                switch (B - b0 < IRB ? B - b0 : IRB) {                                              \
                case 1: GROUP(1); break;                                                            \
                case 2: GROUP(2); break;                                                            \
                case 3: GROUP(3); break;                                                            \
                IF_IRB8(case 4: GROUP(4); break; case 5: GROUP(5); break;                           \
                        case 6: GROUP(6); break; case 7: GROUP(7); break;)                          \
                default: GROUP(IRB); break;                                                         \
                }                                                                                   \
            }

#define X8_GROUP(R) x8_group(R, type, Wp + g * nblk * 8 * nb, nblk, K, xq + b0 * K, xd + b0 * nblk, xs + b0 * nblk, \
                             Y + b0 * N + g * 8, N)
#define X8_GEMM_FOR_TYPE(NAME, TYPE)                                                                \
    static void NAME##_x8_gemm(const uint8_t *Wp, int64_t N, int64_t K, const int8_t *xq, const float *xd, \
                               const float *xs, int64_t B, float *Y, int nthreads) {                \
        const int type = TYPE;                                                                      \
        int sb, nb;                                                                                 \
        x8_layout(type, &sb, &nb);                                                                  \
        const int64_t nblk = K / 32;                                                                \
        FOR_GROUPS_AND_BATCH(X8_GROUP)                                                              \
    }
X8_GEMM_FOR_TYPE(q4_0, Q4_0)
X8_GEMM_FOR_TYPE(q4_1, Q4_1)
X8_GEMM_FOR_TYPE(q8_0, Q8_0)
X8_GEMM_FOR_TYPE(iq4_nl, IQ4_NL)
X8_GEMM_FOR_TYPE(mxfp4, MXFP4)
#endif
