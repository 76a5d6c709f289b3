// GGUF matrix products for a few dozen activation rows (batched decode) on integer tensor cores (llama.cpp's MMQ
// scheme): activations in 8 bits per 32 (int8_act), each weight tile decoded to int8 codes and a float
// scale (and minimum) per group of G = 32 or 16 weights in shared memory, one `mma.sync` s8 product per
// group (m16n8k32 or m16n8k16), and the scales applied to each group's integer product in float:
//     y[m, n] += (s_w[n, g] * d_x[m, g]) * (codes[n, g] . xq[m, g]) - min_w[n, g] * s_x[m, g]
// (d_x, s_x: the activations' scale and scaled sum of their group of 32).  The Triton version of this
// issued each product as a synchronous wgmma with a barrier, one program an SM, and lost to the bf16
// tile kernel (docs/performance/gpu-kernels.md, "integer tensor cores"); here the warps' mma.sync run
// freely between the tile's two barriers, and a step's loads are in flight during the step before.
// Measured on the H200 (results/h200-cuda-mmq-rows.txt): 1.47-2.92x the best other kernel at 4-16 rows, 1.1-2.2x at 32; at 64 the
// float work per group, which grows with the rows, makes it 0.69-1.44x (dispatch.py's MMQ_MAX_M routes by that).
// Its bf16 variant (MMQ_X16, below the integer kernel's loop) keeps the tiles and the loads and turns each
// weight into bf16 once a block instead: 0.69-0.96x the time of the best other kernel at 64 rows
// (results/h200-cuda-mmq-x16.txt; dispatch.py's MMQ_X16_MIN_M / MMQ_X16_MAX_M).
//
// Compiled after gguf_gemv.cu's helpers (the same program text).  The tile decoders (``<type>_tile``)
// also compile as host C++: tests/test_cuda_gguf.py checks them against gguf's dequantization.

#define BN 64         // weight rows a block
#define KB 256        // weights a step
#ifndef MMQ_PAD
#define MMQ_PAD 32
#endif
#define LD (KB + MMQ_PAD)  // bytes a row in shared memory.  Groups of 32 (pad 32: 72 words): a half-warp's
                           // 8-byte fragment loads (rows g, bytes 8q) fall in 32 distinct banks; groups of 16
                           // (pad 16: 68 words): a warp's 4-byte loads (rows g, bytes 4q) do

struct alignas(16) MmqTile {  // a step's weights: int8 codes, each group's scale and minimum
    i8 w[BN][LD];
    float ws[BN][16], wm[BN][16];  // groups of 32: entries 0-7
};

DEV void st16(i8* p, W4 v) {  // 16 bytes to a 16-byte aligned place (shared memory in the kernel)
#if defined(__CUDA_ARCH__)
    *(uint4*)p = make_uint4(v.x, v.y, v.z, v.w);
#else
    memcpy(p, &v, 16);
#endif
}

// ---- tile decoders: unit u of 256-weight step `step` of weight row `row` (packed as pack_gguf) into
// tile row r: its int8 codes at their weights' places, its groups' scales (and minimums).  Each is a
// fetch (global memory to registers: the kernel issues it a step ahead) and a put (registers to the tile);
// <type>_tile is both.  <TYPE>_BIAS, where defined, is what makes every code of the type a 7-bit unsigned
// number (0 or 64): the bf16 variant (MMQ_X16) needs that to turn codes into bf16 by byte permutes.
// -------------------------------------------------------------------------------------------------------

#define MMQ_TILE(name)                                                                                      \
    DEV void name##_tile(MmqTile& t, int r, const u8* row, int hdr_start, int step, int u, const u32* lut) {  \
        name##_put(t, r, name##_fetch(row, hdr_start, step, u), u, lut);                                     \
    }

DEV void k4_put_scales(MmqTile& t, int r, W4 h, int p) {  // Q4_K / Q5_K: sub-blocks 2p and 2p + 1's
    u32 sc, mn;
    k4_scales(h.y, h.z, h.w, p, sc, mn);
    const float d = half_to_float(h.x), dmin = half_to_float(h.x >> 16);
    t.ws[r][2 * p] = d * (float)(sc & 0xFF);
    t.ws[r][2 * p + 1] = d * (float)(sc >> 8);
    t.wm[r][2 * p] = dmin * (float)(mn & 0xFF);
    t.wm[r][2 * p + 1] = dmin * (float)(mn >> 8);
}

DEV u32 sub_bytes(u32 v, u32 c) { return ((v | 0x80808080u) - c) ^ 0x80808080u; }  // v - c a byte (< 128)

// Q4_K: unit p (0..3): the 32 bytes whose low nibbles are sub-block 2p's codes and high nibbles 2p + 1's.
#define Q4_K_UNITS 4
#define Q4_K_G 32
#define Q4_K_MIN 1
#define Q4_K_BIAS 0
struct MmqQ4_K { W4 q0, q1, h; };
DEV MmqQ4_K q4_k_fetch(const u8* row, int hdr_start, int step, int p) {
    const u8 *body = row + Q4_K_BODY * step, *hdr = row + hdr_start + Q4_K_HDR * step;
    return {ld_stream(body + 32 * p), ld_stream(body + 32 * p + 16), ld16(hdr)};
}
DEV void q4_k_put(MmqTile& t, int r, const MmqQ4_K& a, int p, const u32* lut) {
    const u32 m = 0x0F0F0F0F;
    const W4 q0 = a.q0, q1 = a.q1, h = a.h;
    W4 l0 = {q0.x & m, q0.y & m, q0.z & m, q0.w & m}, l1 = {q1.x & m, q1.y & m, q1.z & m, q1.w & m};
    W4 h0 = {(q0.x >> 4) & m, (q0.y >> 4) & m, (q0.z >> 4) & m, (q0.w >> 4) & m};
    W4 h1 = {(q1.x >> 4) & m, (q1.y >> 4) & m, (q1.z >> 4) & m, (q1.w >> 4) & m};
    st16(&t.w[r][64 * p], l0);
    st16(&t.w[r][64 * p + 16], l1);
    st16(&t.w[r][64 * p + 32], h0);
    st16(&t.w[r][64 * p + 48], h1);
    k4_put_scales(t, r, h, p);
}
MMQ_TILE(q4_k)

// Q6_K: unit (n, i) = 2n + i: weights 128n + 32j + 16i + l (j, l as gguf_gemv.cu's pieces), codes q - 32,
// groups of 16 with int8 scales.
#define Q6_K_UNITS 4
#define Q6_K_G 16
#define Q6_K_MIN 0
#define Q6_K_BIAS 64
struct MmqQ6_K { W4 qa, qb, qc; u32 sc, d; };
DEV MmqQ6_K q6_k_fetch(const u8* row, int hdr_start, int step, int u) {
    const u8 *body = row + Q6_K_BODY * step, *hdr = row + hdr_start + Q6_K_HDR * step;
    const int n = u >> 1, i = u & 1;
    u32 sc = 0;  // scales 8n + 2j + i (j = 0..3) as bytes j
    for (int j = 0; j < 4; j++) sc |= ld_field<unsigned char>(hdr + 8 * n + 2 * j + i) << (8 * j);
    return {ld_stream(body + 64 * n + 16 * i), ld_stream(body + 64 * n + 32 + 16 * i),
            ld_stream(body + 128 + 32 * n + 16 * i), sc, ld_u16(hdr + 16)};
}
DEV void q6_k_put(MmqTile& t, int r, const MmqQ6_K& w, int u, const u32* lut) {
    const int n = u >> 1, i = u & 1;
    const u32 m = 0x0F0F0F0F, m2 = 0x30303030;
    const u32 a[4] = {w.qa.x, w.qa.y, w.qa.z, w.qa.w}, b[4] = {w.qb.x, w.qb.y, w.qb.z, w.qb.w},
              c[4] = {w.qc.x, w.qc.y, w.qc.z, w.qc.w};
    const float d = half_to_float(w.d);
    for (int j = 0; j < 4; j++) {  // ql's low nibbles (j = 0, 1) or high (2, 3) of qa (even j) or qb
        u32 v[4];
        for (int k = 0; k < 4; k++) {
            u32 lo = ((j & 1 ? b[k] : a[k]) >> (j & 2 ? 4 : 0)) & m, hi = ((c[k] >> (2 * j)) << 4) & m2;
            v[k] = sub_bytes(lo | hi, 0x20202020u);  // q - 32
        }
        W4 vv = {v[0], v[1], v[2], v[3]};
        st16(&t.w[r][128 * n + 32 * j + 16 * i], vv);
        t.ws[r][8 * n + 2 * j + i] = d * (float)(int)(i8)(w.sc >> (8 * j));
    }
}
MMQ_TILE(q6_k)

// Q8_0: 32-weight blocks: unit u is block 8 * step + u.
#define Q8_0_UNITS 8
#define Q8_0_G 32
#define Q8_0_MIN 0
struct MmqQ8_0 { W4 a, b; u32 d; };
DEV MmqQ8_0 q8_0_fetch(const u8* row, int hdr_start, int step, int u) {
    const int blk = 8 * step + u;
    const u8* body = row + Q8_0_BODY * blk;
    return {ld_stream(body), ld_stream(body + 16), ld_u16(row + hdr_start + Q8_0_HDR * blk)};
}
DEV void q8_0_put(MmqTile& t, int r, const MmqQ8_0& w, int u, const u32* lut) {
    st16(&t.w[r][32 * u], w.a);
    st16(&t.w[r][32 * u + 16], w.b);
    t.ws[r][u] = half_to_float(w.d);
}
MMQ_TILE(q8_0)

// IQ2_XXS: unit u is group u (32 weights: four grid entries, their signs and a 4-bit scale); the grid's
// words from the table in global memory (lut from word 128 on, as the GEMV's shared copy).
#define IQ2_XXS_UNITS 8
#define IQ2_XXS_G 32
#define IQ2_XXS_MIN 0
#define IQ2_XXS_BIAS 64
struct MmqIQ2_XXS { u32 idx, aux, d; };
DEV MmqIQ2_XXS iq2_xxs_fetch(const u8* row, int hdr_start, int step, int u) {
    const u8* body = row + IQ2_XXS_BODY * step + 8 * u;
    return {ld_u32(body), ld_u32(body + 4), ld_u16(row + hdr_start + IQ2_XXS_HDR * step)};
}
DEV void iq2_xxs_put(MmqTile& t, int r, const MmqIQ2_XXS& w, int u, const u32* lut) {
    const u32* grid = lut + 128;
    u32 v[8];
    for (int e = 0; e < 4; e++) {
        const u32 k = (w.idx >> (8 * e)) & 0xFF;
        const Signs sg = ksigns((w.aux >> (7 * e)) & 127);
        const u32 s0 = spread(sg.lo), s1 = spread(sg.hi);
        v[2 * e] = (ld_field<unsigned int>((const u8*)(grid + 2 * k)) ^ (s0 * 0xFF)) + s0;
        v[2 * e + 1] = (ld_field<unsigned int>((const u8*)(grid + 2 * k + 1)) ^ (s1 * 0xFF)) + s1;
    }
    W4 a = {v[0], v[1], v[2], v[3]}, b = {v[4], v[5], v[6], v[7]};
    st16(&t.w[r][32 * u], a);
    st16(&t.w[r][32 * u + 16], b);
    t.ws[r][u] = 0.125f * half_to_float(w.d) * (float)(2 * (int)(w.aux >> 28) + 1);
}
MMQ_TILE(iq2_xxs)

// The 32-weight types: unit u is block 8 * step + u (a step past K leaves the units after its last block
// to the kernel: MMQ_K32).
struct MmqNib { W4 q; u32 h, qh; };  // 16 bytes of nibbles (weight j low in byte j, 16 + j high), header words
DEV MmqNib nib_fetch(const u8* row, int hdr_start, int blk, int body, int hdr) {  // hdr: the header's bytes
    const u8* h = row + hdr_start + hdr * blk;
    MmqNib r = {ld_stream(row + body * blk), 0u, 0u};
    r.h = hdr == 1 ? ld_field<unsigned char>(h) : hdr == 4 || hdr == 8 ? ld_u32(h) : ld_u16(h);
    if (hdr == 6) r.qh = ld_u16(h + 2) | (ld_u16(h + 4) << 16);  // Q5_0: qh after d, 2-byte aligned
    if (hdr == 8) r.qh = ld_u32(h + 4);                          // Q5_1: after d, m
    return r;
}
DEV void put_halves(MmqTile& t, int r, int u, W4 lo, W4 hi) {  // weights 0-15, then 16-31 of unit u
    st16(&t.w[r][32 * u], lo);
    st16(&t.w[r][32 * u + 16], hi);
}
DEV void nibble_halves(W4 q, W4& lo, W4& hi) {
    const u32 m = 0x0F0F0F0F;
    lo = {q.x & m, q.y & m, q.z & m, q.w & m};
    hi = {(q.x >> 4) & m, (q.y >> 4) & m, (q.z >> 4) & m, (q.w >> 4) & m};
}
DEV void fifth_bits(W4& lo, W4& hi, u32 qh) {  // bit j of qh as bit 4 of weight j's code (Q5_0, Q5_1)
    lo = {lo.x | spread4(qh), lo.y | spread4(qh >> 4), lo.z | spread4(qh >> 8), lo.w | spread4(qh >> 12)};
    hi = {hi.x | spread4(qh >> 16), hi.y | spread4(qh >> 20), hi.z | spread4(qh >> 24), hi.w | spread4(qh >> 28)};
}
DEV W4 sub_w4(W4 v, u32 c) { return {sub_bytes(v.x, c), sub_bytes(v.y, c), sub_bytes(v.z, c), sub_bytes(v.w, c)}; }
DEV void table_halves(W4 q, u32 t0, u32 t1, u32 t2, u32 t3, W4& lo, W4& hi) {
    table16(q.x, t0, t1, t2, t3, lo.x, hi.x);
    table16(q.y, t0, t1, t2, t3, lo.y, hi.y);
    table16(q.z, t0, t1, t2, t3, lo.z, hi.z);
    table16(q.w, t0, t1, t2, t3, lo.w, hi.w);
}

// The nibble types' units (block 8 * step + u) are fetched alike (NIB_FETCH), and the Q4 / Q5 ones put alike:
// their codes less `off` a byte (none where the kernel subtracts a minimum, -m), their fifth bits where `fifth`.
#define NIB_FETCH(name, NAME)                                                           \
    DEV MmqNib name##_fetch(const u8* row, int hdr_start, int step, int u) {            \
        return nib_fetch(row, hdr_start, 8 * step + u, NAME##_BODY, NAME##_HDR);       \
    }
DEV void q45_put(MmqTile& t, int r, const MmqNib& w, int u, bool fifth, u32 off, bool min) {
    W4 lo, hi;
    nibble_halves(w.q, lo, hi);
    if (fifth) fifth_bits(lo, hi, w.qh);
    if (off) put_halves(t, r, u, sub_w4(lo, off), sub_w4(hi, off));
    else put_halves(t, r, u, lo, hi);
    t.ws[r][u] = half_to_float(w.h);
    if (min) t.wm[r][u] = -half_to_float(w.h >> 16);
}
#define Q45_TILE(name, NAME, fifth, off)                                                \
    NIB_FETCH(name, NAME)                                                               \
    DEV void name##_put(MmqTile& t, int r, const MmqNib& w, int u, const u32* lut) {     \
        q45_put(t, r, w, u, fifth, off, NAME##_MIN);                                    \
    }                                                                                   \
    MMQ_TILE(name)

// Q4_0: w = d * (q - 8).
#define Q4_0_UNITS 8
#define Q4_0_G 32
#define Q4_0_MIN 0
#define Q4_0_BIAS 64
Q45_TILE(q4_0, Q4_0, false, 0x08080808u)

// Q4_1: w = d * q + m (the kernel subtracts its minimum: -m).
#define Q4_1_UNITS 8
#define Q4_1_G 32
#define Q4_1_MIN 1
#define Q4_1_BIAS 0
Q45_TILE(q4_1, Q4_1, false, 0u)

// Q5_0: w = d * (q - 16), q's fifth bit from qh.
#define Q5_0_UNITS 8
#define Q5_0_G 32
#define Q5_0_MIN 0
#define Q5_0_BIAS 64
Q45_TILE(q5_0, Q5_0, true, 0x10101010u)

// Q5_1: w = d * q + m, q's fifth bit from qh.
#define Q5_1_UNITS 8
#define Q5_1_G 32
#define Q5_1_MIN 1
#define Q5_1_BIAS 0
Q45_TILE(q5_1, Q5_1, true, 0u)

// IQ4_NL: w = d * table[q].
#define IQ4_NL_UNITS 8
#define IQ4_NL_G 32
#define IQ4_NL_MIN 0
NIB_FETCH(iq4_nl, IQ4_NL)
DEV void iq4_nl_put(MmqTile& t, int r, const MmqNib& w, int u, const u32* lut) {
    W4 lo, hi;
    table_halves(w.q, IQ4_TABLE, lo, hi);
    put_halves(t, r, u, lo, hi);
    t.ws[r][u] = half_to_float(w.h);
}
MMQ_TILE(iq4_nl)

// MXFP4: w = 2^(e - 128) * table[q] (E2M1 values doubled).
#define MXFP4_UNITS 8
#define MXFP4_G 32
#define MXFP4_MIN 0
#define MXFP4_BIAS 64
NIB_FETCH(mxfp4, MXFP4)
DEV void mxfp4_put(MmqTile& t, int r, const MmqNib& w, int u, const u32* lut) {
    W4 lo, hi;
    table_halves(w.q, MXFP4_TABLE, lo, hi);
    put_halves(t, r, u, lo, hi);
    t.ws[r][u] = bits_float(w.h < 2 ? 0x00200000u << w.h : (w.h - 1) << 23);
}
MMQ_TILE(mxfp4)

// IQ4_XS: unit u is sub-block u (IQ4_NL's 16 bytes); w = d * (ls - 32) * table[q].
#define IQ4_XS_UNITS 8
#define IQ4_XS_G 32
#define IQ4_XS_MIN 0
struct MmqIQ4_XS { W4 q; u32 h0, h1; };
DEV MmqIQ4_XS iq4_xs_fetch(const u8* row, int hdr_start, int step, int u) {
    const u8* hdr = row + hdr_start + IQ4_XS_HDR * step;
    return {ld_stream(row + IQ4_XS_BODY * step + 16 * u), ld_u32(hdr), ld_u32(hdr + 4)};
}
DEV void iq4_xs_put(MmqTile& t, int r, const MmqIQ4_XS& w, int u, const u32* lut) {
    W4 lo, hi;
    table_halves(w.q, IQ4_TABLE, lo, hi);
    put_halves(t, r, u, lo, hi);
    const int ls = (int)(((w.h1 >> (4 * u)) & 15) | (((w.h0 >> (16 + 2 * u)) & 3) << 4)) - 32;
    t.ws[r][u] = half_to_float(w.h0) * (float)ls;
}
MMQ_TILE(iq4_xs)

// Q5_K: Q4_K's units with their fifth bits (bit s of qh byte j for weight j of sub-block s).
#define Q5_K_UNITS 4
#define Q5_K_G 32
#define Q5_K_MIN 1
#define Q5_K_BIAS 0
struct MmqQ5_K { W4 q0, q1, h0, h1, h; };
DEV MmqQ5_K q5_k_fetch(const u8* row, int hdr_start, int step, int p) {
    const u8 *body = row + Q5_K_BODY * step, *hdr = row + hdr_start + Q5_K_HDR * step;
    return {ld_stream(body + 32 + 32 * p), ld_stream(body + 48 + 32 * p), ld_stream(body), ld_stream(body + 16),
            ld16(hdr)};
}
DEV W4 with_fifth(W4 v, W4 qh, int s) {
    return {v.x | fifth(qh.x, s), v.y | fifth(qh.y, s), v.z | fifth(qh.z, s), v.w | fifth(qh.w, s)};
}
DEV void q5_k_put(MmqTile& t, int r, const MmqQ5_K& a, int p, const u32* lut) {
    W4 l0, h0, l1, h1;
    nibble_halves(a.q0, l0, h0);
    nibble_halves(a.q1, l1, h1);
    st16(&t.w[r][64 * p], with_fifth(l0, a.h0, 2 * p));
    st16(&t.w[r][64 * p + 16], with_fifth(l1, a.h1, 2 * p));
    st16(&t.w[r][64 * p + 32], with_fifth(h0, a.h0, 2 * p + 1));
    st16(&t.w[r][64 * p + 48], with_fifth(h1, a.h1, 2 * p + 1));
    k4_put_scales(t, r, a.h, p);
}
MMQ_TILE(q5_k)

// ---- the kernel ------------------------------------------------------------------------------------
// Once per type (MMQ = the decoder's prefix, MMQ_UNITS its units a step, MMQ_G its group, MMQ_MIN whether it
// has minimums, MMQ_K32 whether its blocks are 32 weights: then K is any multiple of 32 and the last step's
// blocks past k_blocks = K / 32 are zeros) and activation rows a block (MMQ_BM: 16, 32 or 64).  A step's
// loads are issued a step ahead: the weights' bytes and the activations' scales into registers, the
// activations' codes by cp.async into the other of two buffers, so global memory's latency hides behind the
// step's products.
// Fragments: in a group of 32, thread q's k slots 4q..4q+3 and 16+4q..16+4q+3 of both operands are weights
// 8q..8q+7 (one 8-byte load each; a product may take its k in any order that both operands share).
// A group's int32 product starts at MAGIC, so it reads as the float 1.5 * 2^23 + product (|product| < 2^22:
// at most 32 * 127 * 127) and one subtraction converts it (I2F issues at a quarter of the FP32 rate).

#if defined(__CUDACC__) && defined(MMQ)
#ifndef MMQ_X16
#define MMQ_X16 0
#endif
#define MMQ_THREADS 128
#define BM MMQ_BM
#define MAGIC 0x4B400000
#ifndef CAT
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#endif

#if MMQ_X16
#define LDX (KB + 32)  // bf16 activations a row in shared memory: 576 bytes, so that a quarter-warp's 16-byte
                       // fragment loads (rows g, g + 1, bytes 16q) fall in distinct banks
struct alignas(16) MmqAct { u16 x[BM][LDX]; };  // a step's bf16 activations
#else
struct alignas(16) MmqAct { i8 x[BM][LD]; };                       // a step's activation codes
struct alignas(16) MmqActScales { float v[8][BM / 2][4]; };  // by group and pair of rows: both rows' scales,
                                                             // then their scaled sums (one 16-byte load)
#endif

DEV void cp_async16(void* dst, const void* src, bool ok) {  // 16 bytes, or zeros where !ok
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 16 : 0));
}
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
DEV void cp_async_wait_prior() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }  // all but the last group

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

// MMQ_X16: bf16 activations as they are, and each warp's weight fragments turned into bf16 with their
// group's scale and minimum applied (w = s * code - min: codes + MMQ_BIAS put under bf16's exponent of 128
// by byte permutes, the 128 + bias taken off exactly, then one bf16x2 fma), fed to bf16 mma (m16n8k16,
// float accumulators).  A weight's float work is then done once a block whatever its activation rows,
// where the integer form's grows with them (per group and activation row: the scale product, conversion,
// minimum).  Fragments: thread q's k slots 2q, 2q + 1, 2q + 8, 2q + 9 of a group's two halves are weights
// 8q..8q+7 of both operands (one 8-byte load of codes, one 16-byte load of activations).
#if MMQ_X16
DEV u32 bf16x2_of(float a) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(a));
    return r;
}
DEV u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
DEV void codes_bf16(u32 c, u32 s2, u32 m2, u32& lo, u32& hi) {  // 4 codes as two bf16 pairs s * code - min
#if MMQ_BIAS
    c = (c ^ 0x40404040u) & 0x7F7F7F7Fu;  // code + 64 a byte (codes in -64..63)
#endif
    const u32 one = 0x3F803F80u, off = MMQ_BIAS ? 0xC340C340u : 0xC300C300u;  // 1.0; -(128 + bias)
    lo = fma_bf16x2(fma_bf16x2(__byte_perm(c, 0x43434343u, 0x4140), one, off), s2, m2);
    hi = fma_bf16x2(fma_bf16x2(__byte_perm(c, 0x43434343u, 0x4342), one, off), s2, m2);
}
DEV void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// grid (ceil(N / BN), ceil(M / BM), splits of K); 128 threads (4 warps: 16 weight rows each, all BM
// activation rows); dynamic shared memory: MmqTile, two MmqAct, MmqActScales (the integer form's).
// part[z, m, n]: split z's float32 sum (the caller adds the splits in order).
// MMQ_MOE (a mixture-of-experts layer, no splits): row block y holds expert experts[y]'s (token, expert) pairs
// pairs[y * BM ...] (M = the number of pairs P, which pads), w its N rows from expert e * N on; a pair p reads
// activation row p / x_div and writes part row p.
extern "C" __global__ void __launch_bounds__(MMQ_THREADS, 2) KERNEL(
        const u8* __restrict__ w, const i8* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, float* __restrict__ part, const u32* __restrict__ lut, int N, int M,
        int row_bytes, int hdr_start, int n_steps, int stride_xq, int stride_xd,
        const int* __restrict__ pairs, const int* __restrict__ experts, int x_div, int k_blocks) {
    extern __shared__ __align__(16) unsigned char smem[];
    MmqTile& t = *(MmqTile*)smem;
    MmqAct* ax = (MmqAct*)(smem + sizeof(MmqTile));
#if MMQ_X16
    constexpr int XC = BM * 32 / MMQ_THREADS;  // 16-byte pieces of a step's activations a thread
    const u16* xh = (const u16*)xq;            // (xq: the bf16 activations, stride_xq in elements)
#else
    MmqActScales& as = *(MmqActScales*)(smem + sizeof(MmqTile) + 2 * sizeof(MmqAct));
    constexpr int XS = BM * 8 / MMQ_THREADS, XC = BM * 16 / MMQ_THREADS;
    static_assert(XS >= 1, "a thread's share of the activation scales");
#endif
    constexpr int PER = BN * MMQ_UNITS / MMQ_THREADS;
    static_assert(PER * MMQ_THREADS == BN * MMQ_UNITS, "a thread's share of a step");
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int s0 = (int)((long long)n_steps * blockIdx.z / gridDim.z);
    const int s1 = (int)((long long)n_steps * (blockIdx.z + 1) / gridDim.z);
#if MMQ_MOE
    const int e = experts[blockIdx.y];
    if (e < 0) return;  // row blocks past the last expert's
    w += (long long)e * N * row_bytes;
    auto out_row = [&](int r) { const int p = pairs[m0 + r]; return p < M ? p : -1; };
    auto in_row = [&](int r) { const int p = out_row(r); return p < 0 ? -1 : p / x_div; };
#else
    auto out_row = [&](int r) { return m0 + r < M ? m0 + r : -1; };
    auto in_row = out_row;
#endif
    int rows_c[XC];  // the activation rows of this thread's 16-byte pieces (-1: none)
#pragma unroll
    for (int i = 0; i < XC; i++) rows_c[i] = in_row((tid + i * MMQ_THREADS) / (MMQ_X16 ? 32 : 16));
#if !MMQ_X16
    int rows_s[XS];  // and of its scales
#pragma unroll
    for (int i = 0; i < XS; i++) rows_s[i] = in_row((tid + i * MMQ_THREADS) >> 3);
    float rd[XS], rs[XS];
#endif

    decltype(CAT(MMQ, _fetch)(w, 0, 0, 0)) raw[PER];
    auto fetch = [&](int step) {  // the step's weight units and activation scales, to registers
#pragma unroll
        for (int i = 0; i < PER; i++) {  // rows past N fetch row N - 1 (their outputs are not stored)
            const int u = tid + i * MMQ_THREADS, r = u / MMQ_UNITS;
#if MMQ_K32
            if (8 * step + u % MMQ_UNITS >= k_blocks) {  // past K: codes 0 with a scale of 0
                raw[i] = {};
                continue;
            }
#endif
            raw[i] = CAT(MMQ, _fetch)(w + (long long)min(n0 + r, N - 1) * row_bytes, hdr_start, step, u % MMQ_UNITS);
        }
#if !MMQ_X16
#pragma unroll
        for (int i = 0; i < XS; i++) {
            const int blk = 8 * step + ((tid + i * MMQ_THREADS) & 7);
            const bool ok = rows_s[i] >= 0 && blk < k_blocks;
            const long long at = (long long)rows_s[i] * stride_xd + blk;
            rd[i] = ok ? ldf(xd + at) : 0.0f;
            rs[i] = MMQ_MIN && ok ? ldf(xs + at) : 0.0f;
        }
#endif
    };
    auto copy_x = [&](int step, MmqAct& b) {  // the step's activations, by cp.async (no row: zeros)
#pragma unroll
        for (int i = 0; i < XC; i++) {
#if MMQ_X16  // piece i: row warp + 4i, weights 8 * lane.. (offsets in 32 bits: the caller checks M * stride)
            const int mm = rows_c[i];
            const bool ok = mm >= 0 && 8 * step + (lane >> 2) < k_blocks;
            const u32 at = ok ? (u32)mm * (u32)stride_xq + (u32)(KB * step + 8 * lane) : 0u;
            cp_async16(&b.x[warp + 4 * i][8 * lane], xh + at, ok);
#else
            const int u = tid + i * MMQ_THREADS, r = u >> 4, c = u & 15, mm = rows_c[i];
            const bool ok = mm >= 0 && (KB * step + 16 * c) / 32 < k_blocks;
            cp_async16(&b.x[r][16 * c], ok ? xq + (long long)mm * stride_xq + KB * step + 16 * c : xq, ok);
#endif
        }
        cp_async_commit();
    };

    float acc[BM / 8][4];
#pragma unroll
    for (int j = 0; j < BM / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const int ra = 16 * warp + g;  // this thread's weight rows ra and ra + 8 of the tile
    if (s0 < s1) {
        fetch(s0);
        copy_x(s0, ax[0]);
    }
    for (int step = s0; step < s1; step++) {
        const MmqAct& X = ax[(step - s0) & 1];
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int u = tid + i * MMQ_THREADS;
            CAT(MMQ, _put)(t, u / MMQ_UNITS, raw[i], u % MMQ_UNITS, lut);
        }
#if !MMQ_X16
#pragma unroll
        for (int i = 0; i < XS; i++) {
            const int u = tid + i * MMQ_THREADS;
            const int r = u >> 3;
            as.v[u & 7][r >> 1][r & 1] = rd[i];
            as.v[u & 7][r >> 1][2 + (r & 1)] = rs[i];
        }
#endif
        if (step + 1 < s1) {
            fetch(step + 1);
            copy_x(step + 1, ax[(step + 1 - s0) & 1]);
        } else {
            cp_async_commit();  // an empty group: the wait below still leaves only the newest pending
        }
        cp_async_wait_prior();
        __syncthreads();
#if MMQ_X16
#pragma unroll
        for (int s = 0; s < KB / 32; s++) {  // weights 32s.. of the step: this thread's 8q..8q+7 of them
            const int gs = MMQ_G == 32 ? s : 2 * s + (q >> 1);  // their group
            const u32 sa = bf16x2_of(t.ws[ra][gs]), sb = bf16x2_of(t.ws[ra + 8][gs]);
            const u32 ma = MMQ_MIN ? bf16x2_of(-t.wm[ra][gs]) : 0u, mb = MMQ_MIN ? bf16x2_of(-t.wm[ra + 8][gs]) : 0u;
            const uint2 ca = *(const uint2*)&t.w[ra][32 * s + 8 * q], cb = *(const uint2*)&t.w[ra + 8][32 * s + 8 * q];
            u32 a[8];  // rows ra, ra + 8: weights (8q, 8q + 1), (8q + 2, 8q + 3), ...
            codes_bf16(ca.x, sa, ma, a[0], a[1]);
            codes_bf16(ca.y, sa, ma, a[2], a[3]);
            codes_bf16(cb.x, sb, mb, a[4], a[5]);
            codes_bf16(cb.y, sb, mb, a[6], a[7]);
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                const uint4 xb = *(const uint4*)&X.x[8 * j + g][32 * s + 8 * q];
                mma_bf16(acc[j], a[0], a[4], a[1], a[5], xb.x, xb.y);
                mma_bf16(acc[j], a[2], a[6], a[3], a[7], xb.z, xb.w);
            }
        }
#else
#pragma unroll
        for (int s = 0; s < KB / MMQ_G; s++) {  // group s of MMQ_G weights
            const float sa = t.ws[ra][s], sb = t.ws[ra + 8][s];
#if MMQ_MIN
            const float ma = t.wm[ra][s], mb = t.wm[ra + 8][s];
#endif
            const int gx = s * MMQ_G / 32;  // the activations' group of 32
#if MMQ_G == 32
            const uint2 wa = *(const uint2*)&t.w[ra][32 * s + 8 * q], wb = *(const uint2*)&t.w[ra + 8][32 * s + 8 * q];
#else
            const u32 wa = *(const u32*)&t.w[ra][16 * s + 4 * q], wb = *(const u32*)&t.w[ra + 8][16 * s + 4 * q];
#endif
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                int c[4] = {MAGIC, MAGIC, MAGIC, MAGIC};
#if MMQ_G == 32
                const uint2 xb = *(const uint2*)&X.x[8 * j + g][32 * s + 8 * q];
                mma_k32(c, wa.x, wb.x, wa.y, wb.y, xb.x, xb.y);
#else
                mma_k16(c, wa, wb, *(const u32*)&X.x[8 * j + g][16 * s + 4 * q]);
#endif
                const int mc = 8 * j + 2 * q;  // this thread's activation rows mc and mc + 1 of the tile
                const float4 de = *(const float4*)as.v[gx][mc >> 1];
                const float2 d = {de.x, de.y};
                float y0 = acc[j][0], y1 = acc[j][1], y2 = acc[j][2], y3 = acc[j][3];
#if MMQ_MIN
                const float2 e = {de.z, de.w};
                y0 = fmaf(-ma, e.x, y0);
                y1 = fmaf(-ma, e.y, y1);
                y2 = fmaf(-mb, e.x, y2);
                y3 = fmaf(-mb, e.y, y3);
#endif
                const float magic = bits_float(MAGIC);  // 1.5 * 2^23
                acc[j][0] = fmaf(sa * d.x, __int_as_float(c[0]) - magic, y0);
                acc[j][1] = fmaf(sa * d.y, __int_as_float(c[1]) - magic, y1);
                acc[j][2] = fmaf(sb * d.x, __int_as_float(c[2]) - magic, y2);
                acc[j][3] = fmaf(sb * d.y, __int_as_float(c[3]) - magic, y3);
            }
        }
#endif
        __syncthreads();
    }
    float* out = part + (long long)blockIdx.z * M * N;
#pragma unroll
    for (int j = 0; j < BM / 8; j++) {
        const int r0 = out_row(8 * j + 2 * q), r1 = out_row(8 * j + 2 * q + 1), na = n0 + ra;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int mm = i & 1 ? r1 : r0, nn = na + 8 * (i >> 1);
            if (mm >= 0 && nn < N) out[(long long)mm * N + nn] = acc[j][i];
        }
    }
}
#endif
