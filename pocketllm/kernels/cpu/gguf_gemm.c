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

/* Y[B, N] = X[B, K] @ W[N, K]^T on the fast path (X quantized to 8 bits per block, see above):
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
