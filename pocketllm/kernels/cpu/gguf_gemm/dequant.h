/* Part of gguf_gemm.c, included there once (one translation unit, one library): the block decoders
 * (the reference's formulas) and the float path: dequantize a block once, multiply it with every
 * activation row. */

/* The lattice i-quants' grids, set once from the gguf package's (gguf_set_lattice_tables; the types
 * are unsupported until then): each entry's values as bytes (IQ2_*: 8, IQ3_*: 4; IQ1_*: 8 of -1, 0, 1). Signs: byte j of
 * bit_signs[b] is -1 (0xFF) where bit j of b is set, else +1; ksigns maps a 7-bit sign index to its
 * 8 bits (the eighth the parity). */
static uint64_t iq2xxs_grid[256], iq2xs_grid[512], iq2s_grid[1024], iq1s_grid[2048];
static uint64_t iq1s_grid8[2048];      /* IQ1's entries times 8 (-8, 0, 8): the 8-bit kernels' values 8 * grid + delta */
static uint64_t iq1_delta_lanes[16][4]; /* bit l of the index: lane l's 8 bytes -1, else +1 (IQ1_M's delta signs, BMI2) */
static uint32_t iq3xxs_grid[256], iq3s_grid[512];
static uint8_t ksigns[128];
static uint64_t bit_signs[256];
static uint64_t ksign_lanes[128];  /* bit_signs[ksigns[i]]: a sign index's 8 lanes in one load */
static int lattice_tables_set;

void gguf_set_lattice_tables(const uint8_t *iq2xxs, const uint8_t *iq2xs, const uint8_t *iq2s, const uint8_t *iq3xxs,
                             const uint8_t *iq3s, const uint8_t *iq1s, const uint8_t *signs) {
    memcpy(iq1s_grid, iq1s, sizeof iq1s_grid);
    memcpy(iq2xxs_grid, iq2xxs, sizeof iq2xxs_grid);
    memcpy(iq2xs_grid, iq2xs, sizeof iq2xs_grid);
    memcpy(iq2s_grid, iq2s, sizeof iq2s_grid);
    memcpy(iq3xxs_grid, iq3xxs, sizeof iq3xxs_grid);
    memcpy(iq3s_grid, iq3s, sizeof iq3s_grid);
    memcpy(ksigns, signs, sizeof ksigns);
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((b >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        bit_signs[b] = v;
    }
    for (int i = 0; i < 128; i++) ksign_lanes[i] = bit_signs[ksigns[i]];
    for (int i = 0; i < 2048; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)(uint8_t)(8 * (int8_t)(iq1s_grid[i] >> (8 * j))) << (8 * j);
        iq1s_grid8[i] = v;
    }
    for (int b = 0; b < 16; b++)
        for (int l = 0; l < 4; l++) iq1_delta_lanes[b][l] = (b >> l) & 1 ? 0xFFFFFFFFFFFFFFFFULL : 0x0101010101010101ULL;
    lattice_tables_set = 1;
}

static inline uint64_t grid3_pair(const uint32_t *grid, int i0, int i1) {  /* two IQ3 entries: 8 values */
    return grid[i0] | (uint64_t)grid[i1] << 32;
}

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4: the E2M1 values doubled (0, 0.5, 1, ... 6 -> 0, 1, 2, ... 12), the block's E8M0 scale halved */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {  /* 2**(e - 128): ggml's E8M0 to float, halved */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f; memcpy(&f, &bits, 4); return f;
}

static inline void deq_q4_0(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b);
    for (int i = 0; i < 16; i++) {
        w[i] = (float)((b[2 + i] & 0xF) - 8) * d;
        w[i + 16] = (float)((b[2 + i] >> 4) - 8) * d;
    }
}

static inline void deq_q4_1(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b), m = h2f(b + 2);
    for (int i = 0; i < 16; i++) {
        w[i] = (float)(b[4 + i] & 0xF) * d + m;
        w[i + 16] = (float)(b[4 + i] >> 4) * d + m;
    }
}

static inline void deq_q5_0(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b); uint32_t qh; memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int x0 = ((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16;
        int x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        w[j] = (float)x0 * d; w[j + 16] = (float)x1 * d;
    }
}

static inline void deq_q5_1(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b), m = h2f(b + 2); uint32_t qh; memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        w[j] = (float)x0 * d + m; w[j + 16] = (float)x1 * d + m;
    }
}

static inline void deq_q8_0(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) w[i] = (float)q[i] * d;
}

static inline void deq_iq4_nl(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b);
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)kvalues_iq4nl[b[2 + i] & 0xF];
        w[i + 16] = d * (float)kvalues_iq4nl[b[2 + i] >> 4];
    }
}

static inline void deq_mxfp4(const uint8_t *restrict b, float *restrict w) {
    float d = e8m0_half(b[0]);
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)kvalues_mxfp4[b[1 + i] & 0xF];
        w[i + 16] = d * (float)kvalues_mxfp4[b[1 + i] >> 4];
    }
}

/* Q2_K and Q3_K: weight 128h + 32j + l (l < 32) is 2-bit field j of code byte 32h + l, in
 * sub-block 8h + 2j + l / 16 of 16 weights. */
static inline void deq_q2_k(const uint8_t *restrict b, float *restrict w) {
    /* 16 bytes of 4-bit scale | 4-bit minimum, 64 of codes, fp16 d, fp16 dmin */
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const uint8_t *sc = b, *q = b + 16;
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int g = 0; g < 2; g++) {
                const int s = 8 * h + 2 * j + g;
                const float dl = d * (float)(sc[s] & 0xF), ml = dmin * (float)(sc[s] >> 4);
                for (int l = 16 * g; l < 16 * g + 16; l++)
                    w[128 * h + 32 * j + l] = dl * (float)((q[32 * h + l] >> (2 * j)) & 3) - ml;
            }
}

/* Q3_K's 16 six-bit scales from 12 bytes (low nibbles in bytes 0-7, high 2 bits in 8-11), - 32,
 * as four words of int8s: each byte v < 64 becomes ((v | 0x80) - 32) ^ 0x80, v - 32 with no borrow
 * between bytes. */
static inline void q3_k_scale_words(const uint8_t *p, uint32_t s[4]) {
    uint32_t a[3];
    memcpy(a, p, 12);
    const uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303;
    s[0] = (a[0] & m4) | ((a[2] & m2) << 4);
    s[1] = (a[1] & m4) | (((a[2] >> 2) & m2) << 4);
    s[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4);
    s[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4);
    for (int i = 0; i < 4; i++) s[i] = ((s[i] | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

static inline void deq_q3_k(const uint8_t *restrict b, float *restrict w) {
    /* 32 bytes of high bits (bit 4h + j of byte l; clear means -4), 64 of codes, 12 of scales, fp16 d */
    int8_t sc[16];
    uint32_t words[4];
    q3_k_scale_words(b + 96, words);
    memcpy(sc, words, 16);
    const float d = h2f(b + 108);
    const uint8_t *hm = b, *q = b + 32;
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int g = 0; g < 2; g++) {
                const float dl = d * (float)sc[8 * h + 2 * j + g];
                for (int l = 16 * g; l < 16 * g + 16; l++) {
                    const int v = ((q[32 * h + l] >> (2 * j)) & 3) - ((hm[l] >> (4 * h + j)) & 1 ? 0 : 4);
                    w[128 * h + 32 * j + l] = dl * (float)v;
                }
            }
}

static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static inline void deq_q4_k(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        int s1, m1, s2, m2;
        scale_min_k4(is, sc, &s1, &m1); scale_min_k4(is + 1, sc, &s2, &m2);
        float d1 = d * s1, n1 = dmin * m1, d2 = d * s2, n2 = dmin * m2;
        for (int l = 0; l < 32; l++) w[j + l] = d1 * (float)(q[l] & 0xF) - n1;
        for (int l = 0; l < 32; l++) w[j + 32 + l] = d2 * (float)(q[l] >> 4) - n2;
    }
}

static inline void deq_q5_k(const uint8_t *restrict b, float *restrict w) {
    float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        int s1, m1, s2, m2;
        scale_min_k4(is, sc, &s1, &m1); scale_min_k4(is + 1, sc, &s2, &m2);
        float d1 = d * s1, n1 = dmin * m1, d2 = d * s2, n2 = dmin * m2;
        for (int l = 0; l < 32; l++) w[j + l] = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - n1;
        for (int l = 0; l < 32; l++) w[j + 32 + l] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - n2;
    }
}

static inline void deq_q6_k(const uint8_t *restrict b, float *restrict w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = h2f(b + 208);
    for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        for (int h = 0; h < 32; h += 16) { /* one scale per 16 elements: inner loops vectorize */
            int is = h / 16;
            float s1 = d * sc[is], s2 = d * sc[is + 2], s3 = d * sc[is + 4], s4 = d * sc[is + 6];
            for (int l = h; l < h + 16; l++) {
                w[n + l] = s1 * (float)((int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                w[n + l + 32] = s2 * (float)((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                w[n + l + 64] = s3 * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                w[n + l + 96] = s4 * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

static inline void deq_iq4_xs(const uint8_t *restrict b, float *restrict w0) {
    float *w = w0;
    float d = h2f(b);
    uint16_t sh; memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, qs += 16, w += 32) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            w[j] = dl * (float)kvalues_iq4nl[qs[j] & 0xF];
            w[j + 16] = dl * (float)kvalues_iq4nl[qs[j] >> 4];
        }
    }
}

/* The lattice types: 8 values of a grid entry, each times db with its sign, in the reference's order
 * ((db * grid) * sign). */
static inline void deq_signed_grid(uint64_t g, uint64_t signs, float db, float *restrict w) {
    for (int j = 0; j < 8; j++) {
        const float v = db * (float)(uint8_t)(g >> (8 * j));
        w[j] = (signs >> (8 * j)) & 2 ? -v : v;  /* 0xFF: -1, 0x01: +1 */
    }
}

/* IQ2_XXS / IQ3_XXS: 8 sub-blocks of 32, each with a word of a 4-bit scale s and four 7-bit sign
 * indices: d * (0.5 + s) * (0.25 | 0.5) * value * sign. */
static inline void deq_iq2_xxs(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int ib = 0; ib < 8; ib++, w += 32) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint32_t aux; memcpy(&aux, q + 4, 4);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++)
            deq_signed_grid(iq2xxs_grid[q[l]], bit_signs[ksigns[(aux >> (7 * l)) & 127]], db, w + 8 * l);
    }
}

static inline void deq_iq3_xxs(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int ib = 0; ib < 8; ib++, w += 32) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint32_t aux; memcpy(&aux, b + 66 + 4 * ib, 4);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++)
            deq_signed_grid(grid3_pair(iq3xxs_grid, q[2 * l], q[2 * l + 1]), bit_signs[ksigns[(aux >> (7 * l)) & 127]],
                            db, w + 8 * l);
    }
}

/* IQ2_XS / IQ2_S: a 4-bit scale s per 16 weights, d * (0.5 + s) * 0.25. IQ2_XS: 32 words of a
 * 9-bit grid index and a 7-bit sign index; IQ2_S: 32 bytes of index with 2 high bits each in qh, and
 * a byte of sign bits per 8 weights. */
static inline float half_scale(float d, const uint8_t *scales, int i) {
    return d * (0.5f + (float)((scales[i / 2] >> (4 * (i % 2))) & 0xF)) * 0.25f;
}

static inline void deq_iq2_xs(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int i = 0; i < 32; i++) {
        uint16_t q; memcpy(&q, b + 2 + 2 * i, 2);
        deq_signed_grid(iq2xs_grid[q & 511], bit_signs[ksigns[q >> 9]], half_scale(d, b + 66, i / 2), w + 8 * i);
    }
}

static inline void deq_iq2_s(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int i = 0; i < 32; i++) {
        const int idx = b[2 + i] | ((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8;
        deq_signed_grid(iq2s_grid[idx], bit_signs[b[34 + i]], half_scale(d, b + 74, i / 2), w + 8 * i);
    }
}

/* IQ3_S: 64 grid indices (8 low bits, the ninth in qh), a byte of sign bits per 8 weights, a 4-bit
 * scale s per 32: d * (1 + 2s). */
static inline void deq_iq3_s(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int i = 0; i < 32; i++) {
        const int i0 = b[2 + 2 * i] | ((b[66 + i / 4] >> (2 * (i % 4))) & 1) << 8;
        const int i1 = b[3 + 2 * i] | ((b[66 + i / 4] >> (2 * (i % 4) + 1)) & 1) << 8;
        const float db = d * (float)(1 + 2 * ((b[106 + i / 8] >> (4 * ((i / 4) % 2))) & 0xF));
        deq_signed_grid(grid3_pair(iq3s_grid, i0, i1), bit_signs[b[74 + i]], db, w + 8 * i);
    }
}

/* IQ1_S / IQ1_M: grid values -1, 0, 1 plus a delta of +-1/8, times d * (2s + 1): IQ1_S with an
 * 11-bit index (8 bits in qs, 3 in qh), a 3-bit scale and the delta's sign per 32 weights; IQ1_M
 * with a 3-bit scale per 16, the index's high bits and the delta's sign per 8 in a nibble, and the
 * fp16 d spread over the top nibbles of its four scale words. */
#define IQ1_DELTA 0.125f

static inline void deq_iq1_group(uint64_t g, float dl, float delta, float *restrict w) {
    for (int j = 0; j < 8; j++) w[j] = dl * ((float)(int8_t)(g >> (8 * j)) + delta);
}

static inline void deq_iq1_s(const uint8_t *restrict b, float *restrict w) {
    const float d = h2f(b);
    for (int ib = 0; ib < 8; ib++) {
        uint16_t qh; memcpy(&qh, b + 34 + 2 * ib, 2);
        const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
        for (int l = 0; l < 4; l++)
            deq_iq1_group(iq1s_grid[b[2 + 4 * ib + l] | ((qh >> (3 * l)) & 7) << 8], dl, delta, w + 32 * ib + 8 * l);
    }
}

static inline float iq1_m_d(const uint8_t *b) {  /* the fp16 d from the scale words' top nibbles */
    uint16_t sc[4]; memcpy(sc, b + 48, 8);
    const uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
    return h2f((const uint8_t *)&dbits);
}

static inline void deq_iq1_m(const uint8_t *restrict b, float *restrict w) {
    uint16_t sc[4]; memcpy(sc, b + 48, 8);
    const float d = iq1_m_d(b);
    for (int g = 0; g < 32; g++) {  /* 8 weights; scale g / 2 (16 weights) */
        const int h = (b[32 + g / 2] >> (4 * (g % 2))) & 0xF, s = (sc[g / 8] >> (3 * ((g / 2) % 4))) & 7;
        deq_iq1_group(iq1s_grid[b[g] | (h & 7) << 8], d * (float)(2 * s + 1), h & 8 ? -IQ1_DELTA : IQ1_DELTA, w + 8 * g);
    }
}

static inline void deq_f16(const uint8_t *restrict b, float *restrict w) { for (int i = 0; i < 32; i++) w[i] = h2f(b + 2 * i); }
static inline void deq_f32(const uint8_t *restrict b, float *restrict w) { memcpy(w, b, 32 * sizeof(float)); }

typedef void (*deq_fn)(const uint8_t *, float *);

/* Block geometry: elements and bytes per block; returns 0 for an unsupported type. */
static deq_fn lookup(int type, int *qk, int *nbytes) {
    switch (type) {
    case F32: *qk = 32; *nbytes = 128; return deq_f32;
    case F16: *qk = 32; *nbytes = 64; return deq_f16;
    case Q4_0: *qk = 32; *nbytes = 18; return deq_q4_0;
    case Q4_1: *qk = 32; *nbytes = 20; return deq_q4_1;
    case Q5_0: *qk = 32; *nbytes = 22; return deq_q5_0;
    case Q5_1: *qk = 32; *nbytes = 24; return deq_q5_1;
    case Q8_0: *qk = 32; *nbytes = 34; return deq_q8_0;
    case Q2_K: *qk = 256; *nbytes = 84; return deq_q2_k;
    case Q3_K: *qk = 256; *nbytes = 110; return deq_q3_k;
    case Q4_K: *qk = 256; *nbytes = 144; return deq_q4_k;
    case Q5_K: *qk = 256; *nbytes = 176; return deq_q5_k;
    case Q6_K: *qk = 256; *nbytes = 210; return deq_q6_k;
    case IQ4_NL: *qk = 32; *nbytes = 18; return deq_iq4_nl;
    case IQ4_XS: *qk = 256; *nbytes = 136; return deq_iq4_xs;
    case MXFP4: *qk = 32; *nbytes = 17; return deq_mxfp4;
    case IQ2_XXS: *qk = 256; *nbytes = 66; return lattice_tables_set ? deq_iq2_xxs : 0;
    case IQ2_XS: *qk = 256; *nbytes = 74; return lattice_tables_set ? deq_iq2_xs : 0;
    case IQ2_S: *qk = 256; *nbytes = 82; return lattice_tables_set ? deq_iq2_s : 0;
    case IQ3_XXS: *qk = 256; *nbytes = 98; return lattice_tables_set ? deq_iq3_xxs : 0;
    case IQ3_S: *qk = 256; *nbytes = 110; return lattice_tables_set ? deq_iq3_s : 0;
    case IQ1_S: *qk = 256; *nbytes = 50; return lattice_tables_set ? deq_iq1_s : 0;
    case IQ1_M: *qk = 256; *nbytes = 56; return lattice_tables_set ? deq_iq1_m : 0;
    default: return 0;
    }
}

int gguf_supported(int type) { int qk, nb; return lookup(type, &qk, &nb) != 0; }

#define RB 8 /* activation rows per pass: their accumulators stay in vector registers */

/* One dequantized weight row `w` against R activation rows; R is a compile-time constant so
 * the accumulators live in registers. K is a multiple of 32. */
#if defined(__AVX512F__)
#define ROWS_KERNEL(R)                                                                            \
    static void dot_rows_##R(const float *restrict w, const float *restrict X, int64_t K,          \
                             float *restrict Y, int64_t N, int64_t n) {                          \
        __m512 acc[R];                                                                            \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < K; i += 16) {                                                     \
            __m512 wv = _mm512_load_ps(w + i);                                                    \
            for (int r = 0; r < R; r++)                                                           \
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(X + r * K + i), wv, acc[r]);             \
        }                                                                                         \
        for (int r = 0; r < R; r++) Y[r * N + n] = _mm512_reduce_add_ps(acc[r]);                  \
    }
#else
#define ROWS_KERNEL(R)                                                                            \
    static void dot_rows_##R(const float *restrict w, const float *restrict X, int64_t K,          \
                             float *restrict Y, int64_t N, int64_t n) {                          \
        float acc[R][16] __attribute__((aligned(64)));                                            \
        memset(acc, 0, sizeof(acc));                                                              \
        for (int64_t i = 0; i < K; i += 16)                                                       \
            for (int r = 0; r < R; r++)                                                           \
                for (int l = 0; l < 16; l++) acc[r][l] += X[r * K + i + l] * w[i + l];            \
        for (int r = 0; r < R; r++) {                                                             \
            float s = 0.f;                                                                        \
            for (int l = 0; l < 16; l++) s += acc[r][l];                                          \
            Y[r * N + n] = s;                                                                     \
        }                                                                                         \
    }
#endif
ROWS_KERNEL(1) ROWS_KERNEL(2) ROWS_KERNEL(3) ROWS_KERNEL(4)
ROWS_KERNEL(5) ROWS_KERNEL(6) ROWS_KERNEL(7) ROWS_KERNEL(8)

/* Each weight row is dequantized whole into a per-thread buffer, then multiplied with all
 * activation rows. Dequantizing a full row before reading it back keeps the vector loads
 * clear of the just-written stores (mismatched widths there stall store forwarding). */
#define GEMM_FOR_TYPE(NAME, DEQ, QK, NBYTES)                                                      \
    static void NAME##_gemm(const uint8_t *const *W, int64_t N, int64_t K, const float *X, int64_t B, \
                            float *Y, int nthreads) {                                             \
        const int64_t nblk = K / QK;                                                              \
        _Pragma("omp parallel num_threads(nthreads)")                                             \
        {                                                                                         \
            float *w = aligned_alloc(64, ((K * sizeof(float) + 63) / 64) * 64);                   \
            _Pragma("omp for schedule(static)")                                                   \
            for (int64_t n = 0; n < N; n++) {                                                     \
                const uint8_t *row = W[n];                                                        \
                for (int64_t j = 0; j < nblk; j++) DEQ(row + j * NBYTES, w + j * QK);             \
                for (int64_t b0 = 0; b0 < B; b0 += RB) {                                          \
                    const float *x = X + b0 * K;                                                  \
                    float *y = Y + b0 * N;                                                        \
                    switch (B - b0 < RB ? B - b0 : RB) {                                          \
                    case 1: dot_rows_1(w, x, K, y, N, n); break;                                  \
                    case 2: dot_rows_2(w, x, K, y, N, n); break;                                  \
                    case 3: dot_rows_3(w, x, K, y, N, n); break;                                  \
                    case 4: dot_rows_4(w, x, K, y, N, n); break;                                  \
                    case 5: dot_rows_5(w, x, K, y, N, n); break;                                  \
                    case 6: dot_rows_6(w, x, K, y, N, n); break;                                  \
                    case 7: dot_rows_7(w, x, K, y, N, n); break;                                  \
                    default: dot_rows_8(w, x, K, y, N, n); break;                                 \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            free(w);                                                                              \
        }                                                                                         \
    }

GEMM_FOR_TYPE(f32, deq_f32, 32, 128)
GEMM_FOR_TYPE(f16, deq_f16, 32, 64)
GEMM_FOR_TYPE(q4_0, deq_q4_0, 32, 18)
GEMM_FOR_TYPE(q4_1, deq_q4_1, 32, 20)
GEMM_FOR_TYPE(q5_0, deq_q5_0, 32, 22)
GEMM_FOR_TYPE(q5_1, deq_q5_1, 32, 24)
GEMM_FOR_TYPE(q8_0, deq_q8_0, 32, 34)
GEMM_FOR_TYPE(q2_k, deq_q2_k, 256, 84)
GEMM_FOR_TYPE(q3_k, deq_q3_k, 256, 110)
GEMM_FOR_TYPE(q4_k, deq_q4_k, 256, 144)
GEMM_FOR_TYPE(q5_k, deq_q5_k, 256, 176)
GEMM_FOR_TYPE(q6_k, deq_q6_k, 256, 210)
GEMM_FOR_TYPE(iq4_nl, deq_iq4_nl, 32, 18)
GEMM_FOR_TYPE(iq4_xs, deq_iq4_xs, 256, 136)
GEMM_FOR_TYPE(mxfp4, deq_mxfp4, 32, 17)
GEMM_FOR_TYPE(iq2_xxs, deq_iq2_xxs, 256, 66)
GEMM_FOR_TYPE(iq3_xxs, deq_iq3_xxs, 256, 98)
GEMM_FOR_TYPE(iq2_xs, deq_iq2_xs, 256, 74)
GEMM_FOR_TYPE(iq2_s, deq_iq2_s, 256, 82)
GEMM_FOR_TYPE(iq3_s, deq_iq3_s, 256, 110)
GEMM_FOR_TYPE(iq1_s, deq_iq1_s, 256, 50)
GEMM_FOR_TYPE(iq1_m, deq_iq1_m, 256, 56)

/* Y[B, N] = X[B, K] @ W[N, K]^T. W is given as a table of N row pointers, each to one row of
 * GGUF blocks, so fused projections (QKV, gate/up) are tables over their parts: no copies. */
int gguf_gemm(int type, const uint8_t *const *W, int64_t N, int64_t K, const float *X, int64_t B, float *Y, int nthreads) {
    int qk, nbytes;
    if (!lookup(type, &qk, &nbytes) || K % qk) return -1;
    switch (type) {
    case F32: f32_gemm(W, N, K, X, B, Y, nthreads); break;
    case F16: f16_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q4_0: q4_0_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q4_1: q4_1_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q5_0: q5_0_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q5_1: q5_1_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q8_0: q8_0_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q2_K: q2_k_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q3_K: q3_k_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q4_K: q4_k_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q5_K: q5_k_gemm(W, N, K, X, B, Y, nthreads); break;
    case Q6_K: q6_k_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ4_NL: iq4_nl_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ4_XS: iq4_xs_gemm(W, N, K, X, B, Y, nthreads); break;
    case MXFP4: mxfp4_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ2_XXS: iq2_xxs_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ3_XXS: iq3_xxs_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ2_XS: iq2_xs_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ2_S: iq2_s_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ3_S: iq3_s_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ1_S: iq1_s_gemm(W, N, K, X, B, Y, nthreads); break;
    case IQ1_M: iq1_m_gemm(W, N, K, X, B, Y, nthreads); break;
    default: return -1;
    }
    return 0;
}

/* out[r, K] = dequantized row row_ids[r] of W[N, K] (contiguous rows; for embeddings). */
int gguf_dequant_rows(int type, const uint8_t *W, int64_t K, const int64_t *row_ids, int64_t rows, float *out, int nthreads) {
    int qk, nbytes;
    deq_fn deq = lookup(type, &qk, &nbytes);
    if (!deq || K % qk) return -1;
    const int64_t nblk = K / qk, row_bytes = nblk * nbytes;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = W + row_ids[r] * row_bytes;
        for (int64_t j = 0; j < nblk; j++) deq(row + j * nbytes, out + r * K + j * qk);
    }
    return 0;
}

/* out[r, K] = dequantized row W[r] for r < rows, W a table of row pointers (large batches). */
int gguf_dequant_row_ptrs(int type, const uint8_t *const *W, int64_t K, int64_t rows, float *out, int nthreads) {
    int qk, nbytes;
    deq_fn deq = lookup(type, &qk, &nbytes);
    if (!deq || K % qk) return -1;
    const int64_t nblk = K / qk;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nblk; j++) deq(W[r] + j * nbytes, out + r * K + j * qk);
    return 0;
}
