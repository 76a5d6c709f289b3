// GGUF matrix-vector products on 8-bit activations (llama.cpp's block_q8_1: int8 per 32 with a
// scale xd and the scaled sum xs), written for streaming the weights at memory speed.
//
// Why not Triton here: the Triton GEMV (triton/gguf_q8.py) spends its time in L1, not DRAM (ncu:
// L1/TEX 88% busy, DRAM 26%, on Q4_K 14336x4096), because the layout Triton picks reloads each
// activation word for every weight row and reads block headers with scalar loads a weight chunk at a
// time.  Here the work is laid out by hand:
//   - a "piece" is the weights one thread decodes from one 16-byte load of a row's codes (Q4_K: 32
//     weights); consecutive threads take consecutive pieces, so a warp's loads are contiguous;
//   - a block of NT threads computes R rows: each thread loads its piece's activations once
//     (16-byte loads, plus their scales and sums) and reuses them from registers for the R rows;
//   - weights are loaded with an L1 no-allocate hint (read once), so the activations stay in L1;
//   - per thread one float accumulator a row, reduced by warp shuffles and shared memory at the end.
// Measured on the H200 at Llama-3.1-8B's shapes, weights read from memory: 1.1-2.7x the Triton kernel,
// up to 3.25 TB/s for Q4_K (28672x4096) and 3.7 for Q6_K's output layer (results/h200-cuda-gemv-*.txt).
// The packed row layout is ``triton/gguf.py``'s pack_gguf: every block's body (codes), then every
// block's header (scales), 16-byte aligned.
//
// The same source compiles as host C++ (tests/test_cuda_gguf.py): the decoders (``*_act``,
// ``*_load``, ``*_dot``) are then checked on the CPU against gguf's dequantization, without a GPU.

#if defined(__CUDACC__)
#define DEV __device__ __forceinline__
#else
#include <string.h>
#define DEV static inline
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;

struct W4 { u32 x, y, z, w; };

// ---- loads and integer helpers -------------------------------------------------------------

DEV W4 ld_stream(const u8* p) {  // 16 bytes of weights, read once: no L1 allocation
#if defined(__CUDA_ARCH__)
    W4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
#else
    W4 r; memcpy(&r, p, 16); return r;
#endif
}

struct W2 { u32 x, y; };

DEV W2 ld_stream8(const u8* p) {  // 8 bytes of weights, read once (the types whose pieces are 8 bytes)
#if defined(__CUDA_ARCH__)
    W2 r;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
#else
    W2 r; memcpy(&r, p, 8); return r;
#endif
}

DEV W4 ld16(const void* p) {  // 16 bytes of activations (cached: every row's thread reads them)
#if defined(__CUDA_ARCH__)
    uint4 v = __ldg((const uint4*)p);
    W4 r = {v.x, v.y, v.z, v.w};
    return r;
#else
    W4 r; memcpy(&r, p, 16); return r;
#endif
}

template <typename T> DEV u32 ld_field(const u8* p) {  // a header's field of type T (aligned to its size)
#if defined(__CUDA_ARCH__)
    return __ldg((const T*)p);
#else
    T v; memcpy(&v, p, sizeof(T)); return v;
#endif
}
#define ld_u16 ld_field<unsigned short>
#define ld_u32 ld_field<unsigned int>

DEV float ldf(const float* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    return *p;
#endif
}

DEV int dp4a(u32 a, u32 b, int c) {  // c + the dot product of a's and b's four signed bytes
#if defined(__CUDA_ARCH__)
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#else
    for (int i = 0; i < 4; i++) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
#endif
}

DEV float bits_float(u32 b) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    float f; memcpy(&f, &b, 4); return f;
#endif
}

DEV u32 byte_perm(u32 x, u32 y, u32 s) {  // bytes of (y:x) picked by the low 3 bits of s's nibbles
#if defined(__CUDA_ARCH__)
    return __byte_perm(x, y, s);
#else
    unsigned long long v = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (u32)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
#endif
}

DEV float half_to_float(u32 h) {  // the fp16 in the low 16 bits of h
#if defined(__CUDA_ARCH__)
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
#else
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 0x3FF, bits;
    if (e == 0) {
        if (m == 0) { bits = sign; }
        else {  // subnormal: renormalise
            e = 113;
            while (!(m & 0x400)) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3FF) << 13);
        }
    } else if (e == 31) { bits = sign | 0x7F800000u | (m << 13); }
    else { bits = sign | ((e + 112) << 23) | (m << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

// ---- one decoder per type: a piece's activations (*_act: loaded once, reused for every row), the
// row's bytes of a piece (*_load) and their dot product with the activations (*_dot; no loads, so
// the kernel issues every row's loads before the first product).  ``xq`` / ``xd`` / ``xs``: the
// activation row; ``body`` / ``hdr``: the block's codes and header in the packed row; ``sub``: the
// piece's index in its block.

// Q8_0: blocks of 32: body 32 int8 codes, header fp16 d.  A piece: 16 codes.
#define Q8_0_BLOCK 32
#define Q8_0_BODY 32
#define Q8_0_HDR 2
#define Q8_0_PIECES 2
struct ActQ8_0 { W4 x; float d; };
struct RawQ8_0 { W4 q; u32 d; };
DEV void q8_0_act(ActQ8_0& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    a.x = ld16(xq + 32 * blk + 16 * sub);
    a.d = ldf(xd + blk);
}
DEV void q8_0_load(RawQ8_0& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.d = ld_u16(hdr);
}
DEV float q8_0_dot(const RawQ8_0& w, const ActQ8_0& a, int sub, const u32* tab) {
    int s = dp4a(w.q.x, a.x.x, 0);
    s = dp4a(w.q.y, a.x.y, s);
    s = dp4a(w.q.z, a.x.z, s);
    s = dp4a(w.q.w, a.x.w, s);
    return half_to_float(w.d) * a.d * (float)s;
}

// Q4_K: blocks of 256 in 8 sub-blocks of 32; body 4 x 32 bytes, byte j of the p-th 32 holding
// weight j of sub-block 2p (low nibble) and of 2p + 1 (high); header fp16 d, fp16 dmin, 12 bytes of
// 6-bit scales and mins.  Piece (p, h) = sub 2p + h: bytes 16h.. of the p-th 32, i.e. weights
// 16h .. 16h + 15 of sub-blocks 2p and 2p + 1.  w = d * sc * q - dmin * m.
#define Q4_K_BLOCK 256
#define Q4_K_BODY 128
#define Q4_K_HDR 16
#define Q4_K_PIECES 8
struct ActQ4_K { W4 lo, hi; float dlo, dhi, slo, shi; };
struct RawQ4_K { W4 q, h; };
DEV void q45_k_act(ActQ4_K& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    int p = sub >> 1, h = sub & 1;
    const i8* x = xq + 256 * blk + 64 * p + 16 * h;
    a.lo = ld16(x);
    a.hi = ld16(x + 32);
    int g = 8 * blk + 2 * p;
    a.dlo = ldf(xd + g);
    a.dhi = ldf(xd + g + 1);
    // the minimum's term takes the sub-block's whole sum: added by the piece with h = 0 only
    float keep = h ? 0.0f : 1.0f;
    a.slo = keep * ldf(xs + g);
    a.shi = keep * ldf(xs + g + 1);
}
#define q4_k_act q45_k_act
DEV void q4_k_load(RawQ4_K& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.h = ld16(hdr);
}

// The scales and mins of sub-blocks 2p and 2p + 1 (llama.cpp's vec_dot_q4_K_q8_1 reading), from
// header words hy = bytes 4-7, hz = 8-11, hw = 12-15: (sc_lo | sc_hi << 8, m_lo | m_hi << 8).
// Branch-free: p differs between the lanes of a warp.
DEV void k4_scales(u32 hy, u32 hz, u32 hw, int p, u32& sc, u32& mn) {
    int sh = 16 * (p & 1);
    u32 y = (hy >> sh) & 0xFFFF, z = (hz >> sh) & 0xFFFF, w = (hw >> sh) & 0xFFFF;
    u32 sc_hi = (w & 0x0F0F) | ((y & 0xC0C0) >> 2), mn_hi = ((w >> 4) & 0x0F0F) | ((z & 0xC0C0) >> 2);
    sc = p < 2 ? y & 0x3F3F : sc_hi;
    mn = p < 2 ? z & 0x3F3F : mn_hi;
}

DEV float k4_combine(W4 hd, int p, int lo, int hi, const ActQ4_K& a) {
    u32 sc, mn;
    k4_scales(hd.y, hd.z, hd.w, p, sc, mn);
    float d = half_to_float(hd.x), dmin = half_to_float(hd.x >> 16);
    return d * ((float)(sc & 0xFF) * a.dlo * (float)lo + (float)(sc >> 8) * a.dhi * (float)hi)
         - dmin * ((float)(mn & 0xFF) * a.slo + (float)(mn >> 8) * a.shi);
}

DEV float q4_k_dot(const RawQ4_K& w, const ActQ4_K& a, int sub, const u32* tab) {
    const u32 m = 0x0F0F0F0F;
    int lo = dp4a(w.q.x & m, a.lo.x, 0);
    lo = dp4a(w.q.y & m, a.lo.y, lo);
    lo = dp4a(w.q.z & m, a.lo.z, lo);
    lo = dp4a(w.q.w & m, a.lo.w, lo);
    int hi = dp4a((w.q.x >> 4) & m, a.hi.x, 0);
    hi = dp4a((w.q.y >> 4) & m, a.hi.y, hi);
    hi = dp4a((w.q.z >> 4) & m, a.hi.z, hi);
    hi = dp4a((w.q.w >> 4) & m, a.hi.w, hi);
    return k4_combine(w.h, sub >> 1, lo, hi, a);
}

// Q5_K: Q4_K's header and pieces; body 32 bytes of fifth bits (bit s of byte j for weight j of
// sub-block s), then Q4_K's 128 bytes of nibbles.
#define Q5_K_BLOCK 256
#define Q5_K_BODY 160
#define Q5_K_HDR 16
#define Q5_K_PIECES 8
#define q5_k_act q45_k_act
typedef ActQ4_K ActQ5_K;
struct RawQ5_K { W4 q, qh, h; };
DEV void q5_k_load(RawQ5_K& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 32 + 16 * sub);
    w.qh = ld_stream(body + 16 * (sub & 1));
    w.h = ld16(hdr);
}

DEV u32 fifth(u32 qh, int s) { return ((qh >> s) & 0x01010101) << 4; }

DEV float q5_k_dot(const RawQ5_K& w, const ActQ4_K& a, int sub, const u32* tab) {
    const u32 m = 0x0F0F0F0F;
    int s0 = sub & ~1, s1 = s0 + 1;  // sub-blocks 2p and 2p + 1
    int lo = dp4a((w.q.x & m) | fifth(w.qh.x, s0), a.lo.x, 0);
    lo = dp4a((w.q.y & m) | fifth(w.qh.y, s0), a.lo.y, lo);
    lo = dp4a((w.q.z & m) | fifth(w.qh.z, s0), a.lo.z, lo);
    lo = dp4a((w.q.w & m) | fifth(w.qh.w, s0), a.lo.w, lo);
    int hi = dp4a(((w.q.x >> 4) & m) | fifth(w.qh.x, s1), a.hi.x, 0);
    hi = dp4a(((w.q.y >> 4) & m) | fifth(w.qh.y, s1), a.hi.y, hi);
    hi = dp4a(((w.q.z >> 4) & m) | fifth(w.qh.z, s1), a.hi.z, hi);
    hi = dp4a(((w.q.w >> 4) & m) | fifth(w.qh.w, s1), a.hi.w, hi);
    return k4_combine(w.h, sub >> 1, lo, hi, a);
}

// Types in sub-blocks of 16 (Q6_K, Q2_K): a piece (n, i) covers weights 32j + 16i + l (j = 0..3,
// l = 0..15) of half n of a 256-block (sub = 2n + i); its activations are four groups of 16, with
// their sums (for the types' offsets) and their 32-blocks' scales.
struct ActG16 { W4 x[4]; int sum[4]; float d[4]; };
DEV int dot4(W4 v, W4 x, int acc) {
    return dp4a(v.w, x.w, dp4a(v.z, x.z, dp4a(v.y, x.y, dp4a(v.x, x.x, acc))));
}
DEV void g16_act(ActG16& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    int n = sub >> 1, i = sub & 1;
    const i8* p = xq + 256 * blk + 128 * n + 16 * i;
    const W4 ones = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    for (int j = 0; j < 4; j++) {
        a.x[j] = ld16(p + 32 * j);
        a.sum[j] = dot4(a.x[j], ones, 0);
        a.d[j] = ldf(xd + 8 * blk + 4 * n + j);
    }
}

// Q6_K: blocks of 256 in two halves of 128; body ql (128 bytes: 64 a half), qh (64: 32 a half);
// header 16 int8 scales (one per 16 weights), fp16 d.  In half n, byte l of ql / ql + 32 / qh holds
// weights l, l + 32, l + 64, l + 96: q = ql nibble | 2 bits of qh << 4, w = d * sc * (q - 32).
// Piece (n, i) = sub 2n + i: l = 16i .. 16i + 15, so 64 weights in 4 groups of 16 (j = 0..3:
// weights 32j + l of the half, scale 8n + i + 2j); three 16-byte loads.
#define Q6_K_BLOCK 256
#define Q6_K_BODY 192
#define Q6_K_HDR 18
#define Q6_K_PIECES 4
typedef struct ActG16 ActQ6_K;
#define q6_k_act g16_act
struct RawQ6_K { W4 qa, qb, qc; u32 sc[4], d; };
DEV void q6_k_load(RawQ6_K& w, const u8* body, const u8* hdr, int sub) {
    int n = sub >> 1, i = sub & 1;
    w.qa = ld_stream(body + 64 * n + 16 * i);
    w.qb = ld_stream(body + 64 * n + 32 + 16 * i);
    w.qc = ld_stream(body + 128 + 32 * n + 16 * i);
    // scales 8n + i + 2j: byte i of the 16-bit words at 8n + 2j (the header is 2-byte aligned)
    for (int j = 0; j < 4; j++) w.sc[j] = ld_u16(hdr + 8 * n + 2 * j);
    w.d = ld_u16(hdr + 16);
}

DEV int q6_group(W4 ql, W4 qh, int lo_shift, int qh_shift, W4 x, int sum) {
    const u32 m = 0x0F0F0F0F, m2 = 0x30303030;
    int s = dp4a(((ql.x >> lo_shift) & m) | (((qh.x >> qh_shift) << 4) & m2), x.x, 0);
    s = dp4a(((ql.y >> lo_shift) & m) | (((qh.y >> qh_shift) << 4) & m2), x.y, s);
    s = dp4a(((ql.z >> lo_shift) & m) | (((qh.z >> qh_shift) << 4) & m2), x.z, s);
    s = dp4a(((ql.w >> lo_shift) & m) | (((qh.w >> qh_shift) << 4) & m2), x.w, s);
    return s - 32 * sum;
}

DEV float q6_k_dot(const RawQ6_K& w, const ActQ6_K& a, int sub, const u32* tab) {
    int sh = 8 * (sub & 1);
    float r = (float)(int)(i8)(w.sc[0] >> sh) * a.d[0] * (float)q6_group(w.qa, w.qc, 0, 0, a.x[0], a.sum[0])
            + (float)(int)(i8)(w.sc[1] >> sh) * a.d[1] * (float)q6_group(w.qb, w.qc, 0, 2, a.x[1], a.sum[1])
            + (float)(int)(i8)(w.sc[2] >> sh) * a.d[2] * (float)q6_group(w.qa, w.qc, 4, 4, a.x[2], a.sum[2])
            + (float)(int)(i8)(w.sc[3] >> sh) * a.d[3] * (float)q6_group(w.qb, w.qc, 4, 6, a.x[3], a.sum[3]);
    return half_to_float(w.d) * r;
}

// The 32-weight types.  Pieces are whole blocks: 16 bytes of nibbles, weight j in the low nibble of
// byte j and 16 + j in the high one; the activations' two halves as two 16-byte words.
struct ActQ32 { W4 lo, hi; float d, s; };
DEV void q32_act(ActQ32& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    a.lo = ld16(xq + 32 * blk);
    a.hi = ld16(xq + 32 * blk + 16);
    a.d = ldf(xd + blk);
    a.s = ldf(xs + blk);
}
DEV int nibbles_dot(W4 q, const ActQ32& a) {  // the 32 codes (0..15) against the activations
    const u32 m = 0x0F0F0F0F;
    W4 lo = {q.x & m, q.y & m, q.z & m, q.w & m}, hi = {(q.x >> 4) & m, (q.y >> 4) & m, (q.z >> 4) & m, (q.w >> 4) & m};
    return dot4(hi, a.hi, dot4(lo, a.lo, 0));
}

// Q4_0: header fp16 d; w = d * (q - 8).
#define Q4_0_BLOCK 32
#define Q4_0_BODY 16
#define Q4_0_HDR 2
#define Q4_0_PIECES 1
#define q4_0_act q32_act
typedef ActQ32 ActQ4_0;
struct RawQ4_0 { W4 q; u32 h; };
DEV void q4_0_load(RawQ4_0& w, const u8* body, const u8* hdr, int sub) { w.q = ld_stream(body); w.h = ld_u16(hdr); }
DEV float q4_0_dot(const RawQ4_0& w, const ActQ32& a, int sub, const u32* tab) {
    return half_to_float(w.h) * (a.d * (float)nibbles_dot(w.q, a) - 8.0f * a.s);
}

// Q4_1: header fp16 d, fp16 m; w = d * q + m.
#define Q4_1_BLOCK 32
#define Q4_1_BODY 16
#define Q4_1_HDR 4
#define Q4_1_PIECES 1
#define q4_1_act q32_act
typedef ActQ32 ActQ4_1;
typedef RawQ4_0 RawQ4_1;
DEV void q4_1_load(RawQ4_1& w, const u8* body, const u8* hdr, int sub) { w.q = ld_stream(body); w.h = ld_u32(hdr); }
DEV float q4_1_dot(const RawQ4_1& w, const ActQ32& a, int sub, const u32* tab) {
    return half_to_float(w.h) * a.d * (float)nibbles_dot(w.q, a) + half_to_float(w.h >> 16) * a.s;
}

// Q5_0 / Q5_1: Q4_0 / Q4_1 with a fifth bit per weight (bit j of the 32-bit qh for weight j) after
// the header's fp16 fields: Q5_0 d (then qh, 2-byte aligned), w = d * (q - 16); Q5_1 d, m (qh
// 4-byte aligned), w = d * q + m.
DEV u32 spread4(u32 bits) {  // bits 0-3 as bit 4 of bytes 0-3
    return (((bits & 15) * 0x00204081) & 0x01010101) << 4;
}
DEV int q5_dot(W4 q, u32 qh, const ActQ32& a) {
    const u32 m = 0x0F0F0F0F;
    W4 lo = {(q.x & m) | spread4(qh), (q.y & m) | spread4(qh >> 4), (q.z & m) | spread4(qh >> 8),
             (q.w & m) | spread4(qh >> 12)};
    W4 hi = {((q.x >> 4) & m) | spread4(qh >> 16), ((q.y >> 4) & m) | spread4(qh >> 20),
             ((q.z >> 4) & m) | spread4(qh >> 24), ((q.w >> 4) & m) | spread4(qh >> 28)};
    return dot4(hi, a.hi, dot4(lo, a.lo, 0));
}
#define Q5_0_BLOCK 32
#define Q5_0_BODY 16
#define Q5_0_HDR 6
#define Q5_0_PIECES 1
#define q5_0_act q32_act
typedef ActQ32 ActQ5_0;
struct RawQ5_0 { W4 q; u32 d, qh; };
DEV void q5_0_load(RawQ5_0& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body);
    w.d = ld_u16(hdr);
    w.qh = ld_u16(hdr + 2) | (ld_u16(hdr + 4) << 16);
}
DEV float q5_0_dot(const RawQ5_0& w, const ActQ32& a, int sub, const u32* tab) {
    return half_to_float(w.d) * (a.d * (float)q5_dot(w.q, w.qh, a) - 16.0f * a.s);
}
#define Q5_1_BLOCK 32
#define Q5_1_BODY 16
#define Q5_1_HDR 8
#define Q5_1_PIECES 1
#define q5_1_act q32_act
typedef ActQ32 ActQ5_1;
typedef RawQ5_0 RawQ5_1;
DEV void q5_1_load(RawQ5_1& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body);
    w.d = ld_u32(hdr);
    w.qh = ld_u32(hdr + 4);
}
DEV float q5_1_dot(const RawQ5_1& w, const ActQ32& a, int sub, const u32* tab) {
    return half_to_float(w.d) * a.d * (float)q5_dot(w.q, w.qh, a) + half_to_float(w.d >> 16) * a.s;
}

// Tables of 16 int8 values looked up by 4-bit codes (IQ4_NL / IQ4_XS, and MXFP4's E2M1 values
// doubled), four words each: byte permutes pick a code's value by its low 3 bits from the first
// and the last eight values, a third by its bit 3, two more put the bytes in order
// (llama.cpp's get_int_from_table_16).  Returns the low nibbles' values (lo) and the high ones'.
#define IQ4_TABLE 0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u
#define MXFP4_TABLE 0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu
DEV void table16(u32 q, u32 t0, u32 t1, u32 t2, u32 t3, u32& lo, u32& hi) {
    u32 idx = q & 0x77777777, pick = 0x32103210 | ((q & 0x88888888) >> 1), tmp[2];
    for (int i = 0; i < 2; i++) {
        u32 sh = 16 * i;
        tmp[i] = byte_perm(byte_perm(t0, t1, idx >> sh), byte_perm(t2, t3, idx >> sh), pick >> sh);
    }
    lo = byte_perm(tmp[0], tmp[1], 0x6420);
    hi = byte_perm(tmp[0], tmp[1], 0x7531);
}
DEV int table_dot(W4 q, W4 xlo, W4 xhi, u32 t0, u32 t1, u32 t2, u32 t3) {
    W4 lo, hi;
    table16(q.x, t0, t1, t2, t3, lo.x, hi.x);
    table16(q.y, t0, t1, t2, t3, lo.y, hi.y);
    table16(q.z, t0, t1, t2, t3, lo.z, hi.z);
    table16(q.w, t0, t1, t2, t3, lo.w, hi.w);
    return dot4(hi, xhi, dot4(lo, xlo, 0));
}

// IQ4_NL: header fp16 d; w = d * table[q].
#define IQ4_NL_BLOCK 32
#define IQ4_NL_BODY 16
#define IQ4_NL_HDR 2
#define IQ4_NL_PIECES 1
#define iq4_nl_act q32_act
typedef ActQ32 ActIQ4_NL;
typedef RawQ4_0 RawIQ4_NL;
#define iq4_nl_load q4_0_load
DEV float iq4_nl_dot(const RawIQ4_NL& w, const ActQ32& a, int sub, const u32* tab) {
    return half_to_float(w.h) * a.d * (float)table_dot(w.q, a.lo, a.hi, IQ4_TABLE);
}

// MXFP4: header the E8M0 exponent byte e; w = 2^(e - 127) * E2M1[q] = 2^(e - 128) * table[q].
#define MXFP4_BLOCK 32
#define MXFP4_BODY 16
#define MXFP4_HDR 1
#define MXFP4_PIECES 1
#define mxfp4_act q32_act
typedef ActQ32 ActMXFP4;
typedef RawQ4_0 RawMXFP4;
DEV void mxfp4_load(RawMXFP4& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body);
    w.h = ld_field<unsigned char>(hdr);
}
DEV float mxfp4_dot(const RawMXFP4& w, const ActQ32& a, int sub, const u32* tab) {
    float d = bits_float(w.h < 2 ? 0x00200000u << w.h : (w.h - 1) << 23);  // 2^(e - 128)
    return d * a.d * (float)table_dot(w.q, a.lo, a.hi, MXFP4_TABLE);
}

// IQ4_XS: blocks of 256 in 8 sub-blocks of 32 as IQ4_NL's (16 bytes each, a piece); header fp16 d,
// 16 bits of the sub-blocks' scale high 2 bits, 4 bytes of their low 4 bits; w = d * (ls - 32) * table[q].
#define IQ4_XS_BLOCK 256
#define IQ4_XS_BODY 128
#define IQ4_XS_HDR 8
#define IQ4_XS_PIECES 8
struct ActIQ4_XS { W4 lo, hi; float d; };
struct RawIQ4_XS { W4 q; u32 h0, h1; };
DEV void iq4_xs_act(ActIQ4_XS& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    a.lo = ld16(xq + 256 * blk + 32 * sub);
    a.hi = ld16(xq + 256 * blk + 32 * sub + 16);
    a.d = ldf(xd + 8 * blk + sub);
}
DEV void iq4_xs_load(RawIQ4_XS& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.h0 = ld_u32(hdr);
    w.h1 = ld_u32(hdr + 4);
}
DEV float iq4_xs_dot(const RawIQ4_XS& w, const ActIQ4_XS& a, int sub, const u32* tab) {
    int ls = (int)(((w.h1 >> (4 * sub)) & 15) | (((w.h0 >> (16 + 2 * sub)) & 3) << 4)) - 32;
    return half_to_float(w.h0) * (float)ls * a.d * (float)table_dot(w.q, a.lo, a.hi, IQ4_TABLE);
}

// Q2_K: blocks of 256 in two halves of 128; body 64 bytes of 2-bit codes (32 a half), header 16
// bytes of 4-bit scale | 4-bit min << 4 (one per 16 weights), fp16 d, fp16 dmin.  In half n, bits
// 2j of byte l of the half's 32 hold weight 32j + l; w = d * sc * q - dmin * mn.  Piece (n, i) = sub
// 2n + i: bytes 16i .. 16i + 15 of half n, i.e. weights 32j + 16i + l of the half (j = 0..3), scales
// 8n + 2j + i.
#define Q2_K_BLOCK 256
#define Q2_K_BODY 64
#define Q2_K_HDR 20
#define Q2_K_PIECES 4
typedef struct ActG16 ActQ2_K;
struct RawQ2_K { W4 q; u32 s0, s1, dd; };
#define q2_k_act g16_act
DEV void q2_k_load(RawQ2_K& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.s0 = ld_u32(hdr + 8 * (sub >> 1));
    w.s1 = ld_u32(hdr + 8 * (sub >> 1) + 4);
    w.dd = ld_u32(hdr + 16);
}
DEV float q2_k_dot(const RawQ2_K& w, const ActQ2_K& a, int sub, const u32* tab) {
    const u32 m = 0x03030303;
    int i = sub & 1;
    float sc_sum = 0.0f, mn_sum = 0.0f;
    for (int j = 0; j < 4; j++) {
        W4 v = {(w.q.x >> (2 * j)) & m, (w.q.y >> (2 * j)) & m, (w.q.z >> (2 * j)) & m, (w.q.w >> (2 * j)) & m};
        u32 sm = ((j < 2 ? w.s0 : w.s1) >> (8 * (2 * (j & 1) + i))) & 0xFF;  // scale byte 2j + i of the half
        sc_sum += a.d[j] * (float)(sm & 15) * (float)dot4(v, a.x[j], 0);
        mn_sum += a.d[j] * (float)(sm >> 4) * (float)a.sum[j];
    }
    return half_to_float(w.dd) * sc_sum - half_to_float(w.dd >> 16) * mn_sum;
}

// Q3_K: Q2_K's 2-bit codes (same halves and pieces) after 32 bytes of high bits (bit 4n + j of byte l
// for weight 32j + l of half n; the code is 4 lower where it is clear); header 12 bytes of 6-bit
// scales (low nibbles in bytes 0-7, high 2 bits in bytes 8-11), fp16 d; w = d * (sc - 32) * q.
// Scale s = 8n + 2j + i of piece (n, i): low nibble 4n of byte 2j + i, high bits 2(2n + j / 2) of
// byte 8 + (2j + i) % 4.  The header is 14 bytes: 16-bit loads only.
#define Q3_K_BLOCK 256
#define Q3_K_BODY 96
#define Q3_K_HDR 14
#define Q3_K_PIECES 4
typedef struct ActG16 ActQ3_K;
struct RawQ3_K { W4 q, hm; u32 lo[4], hi[2], d; };
#define q3_k_act g16_act
DEV void q3_k_load(RawQ3_K& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 32 + 16 * sub);
    w.hm = ld_stream(body + 16 * (sub & 1));
    for (int j = 0; j < 4; j++) w.lo[j] = ld_u16(hdr + 2 * j);
    w.hi[0] = ld_u16(hdr + 8);
    w.hi[1] = ld_u16(hdr + 10);
    w.d = ld_u16(hdr + 12);
}
DEV float q3_k_dot(const RawQ3_K& w, const ActQ3_K& a, int sub, const u32* tab) {
    const u32 m = 0x03030303, one = 0x01010101;
    int n = sub >> 1, i = sub & 1;
    float r = 0.0f;
    for (int j = 0; j < 4; j++) {
        int b = 4 * n + j;
        W4 v = {((w.q.x >> (2 * j)) & m) | (((w.hm.x >> b) & one) << 2), ((w.q.y >> (2 * j)) & m) | (((w.hm.y >> b) & one) << 2),
                ((w.q.z >> (2 * j)) & m) | (((w.hm.z >> b) & one) << 2), ((w.q.w >> (2 * j)) & m) | (((w.hm.w >> b) & one) << 2)};
        int sc = (int)(((w.lo[j] >> (8 * i + 4 * n)) & 15) | (((w.hi[j & 1] >> (8 * i + 2 * (2 * n + (j >> 1)))) & 3) << 4)) - 32;
        r += a.d[j] * (float)sc * (float)(dot4(v, a.x[j], 0) - 4 * a.sum[j]);
    }
    return half_to_float(w.d) * r;
}

// IQ2_XXS: blocks of 256 in 8 groups of 32; body 8 bytes a group: 4 grid indices (a byte each, 8
// weights of the 256-entry grid each), then a word of 4 x 7 sign bits (llama.cpp's ksigns index:
// the eighth sign is the parity) and a 4-bit scale; header fp16 d.  w = d * (0.5 + s) / 4 *
// grid * sign.  A piece: two groups (one 16-byte load).  The grid (2 KB) is staged in shared memory.
#define IQ2_XXS_BLOCK 256
#define IQ2_XXS_BODY 64
#define IQ2_XXS_HDR 2
#define IQ2_XXS_PIECES 4
#define IQ2_XXS_LUT 512  // the grid's words (8 bytes an entry), after the table's 128 ksigns words
struct ActIQ2_XXS { W4 x[4]; float d[2]; };
struct RawIQ2_XXS { W4 q; u32 h; };
DEV void iq2_xxs_act(ActIQ2_XXS& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    const i8* p = xq + 256 * blk + 64 * sub;
    for (int j = 0; j < 4; j++) a.x[j] = ld16(p + 16 * j);
    a.d[0] = ldf(xd + 8 * blk + 2 * sub);
    a.d[1] = ldf(xd + 8 * blk + 2 * sub + 1);
}
DEV void iq2_xxs_load(RawIQ2_XXS& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.h = ld_u16(hdr);
}
// An entry's 8 signs as two values whose bits 0-3 are the signs of its first and last four weights
// (lo < 128, hi < 64: spread() moves bits 0-3 to the bytes without carries from the bits above).
struct Signs { u32 lo, hi; };
DEV Signs sign_byte(u32 b) { return {b & 127, b >> 4}; }  // bit j: weight j's sign (IQ2_S, IQ3_S)
DEV Signs ksigns(u32 s7) {  // 7 sign bits, the eighth their parity (llama.cpp's ksigns): popc's bit 0 as hi's bit 3
#if defined(__CUDA_ARCH__)
    u32 n = __popc(s7);
#else
    u32 n = __builtin_popcount(s7);
#endif
    return {s7, (s7 >> 4) + (n << 3)};
}
DEV u32 spread(u32 v) { return (v * 0x00204081u) & 0x01010101u; }  // bits 0-3 of v as bit 0 of bytes 0-3
DEV int signed_entry(u32 g0, u32 g1, Signs sg, W4 x, int half, int acc) {
    // an entry's 8 grid bytes (g0, g1), negated where their sign is set, against its 8 activations
    // (words 2 * half, 2 * half + 1 of x): (g ^ 0xFF) + 1 is -g (grid bytes > 0)
    u32 s0 = spread(sg.lo), s1 = spread(sg.hi);
    u32 x0 = half ? x.z : x.x, x1 = half ? x.w : x.y;
    return dp4a((g1 ^ (s1 * 0xFF)) + s1, x1, dp4a((g0 ^ (s0 * 0xFF)) + s0, x0, acc));
}
DEV float iq2_xxs_dot(const RawIQ2_XXS& w, const ActIQ2_XXS& a, int sub, const u32* grid) {
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        u32 idx = g ? w.q.z : w.q.x, aux = g ? w.q.w : w.q.y;
        int s = 0;
        for (int e = 0; e < 4; e++) {
            u32 k = (idx >> (8 * e)) & 0xFF;
            s = signed_entry(grid[2 * k], grid[2 * k + 1], ksigns((aux >> (7 * e)) & 127), a.x[2 * g + e / 2], e & 1, s);
        }
        r += a.d[g] * (0.5f + (float)(aux >> 28)) * (float)s;
    }
    return 0.25f * half_to_float(w.h) * r;
}

// The other lattice types.  A piece is two groups of 32 (64 weights, IQ2_XXS's activations); grid
// entries of 8 bytes (IQ2_XS, IQ2_S, IQ1_S, IQ1_M: two table words) or 4 (IQ3_XXS, IQ3_S: one word,
// two entries per 8 weights).  Sub-scales of 16 weights (IQ2_XS, IQ2_S, IQ1_M) are summed in integers
// as odd multiples: (0.5 + s) / 4 = (2s + 1) / 8.
typedef ActIQ2_XXS ActL64;
#define lattice64_act iq2_xxs_act
DEV u32 byte_of(u32 v, int i) { return (v >> (8 * i)) & 0xFF; }

// IQ2_XS: body 16 bits an entry (9-bit index into 512 entries, 7 sign bits as IQ2_XXS's); header fp16
// d, 8 bytes of two 4-bit scales a group.  w = d * (0.5 + s) / 4 * grid * sign.
#define IQ2_XS_BLOCK 256
#define IQ2_XS_BODY 64
#define IQ2_XS_HDR 10
#define IQ2_XS_PIECES 4
#define IQ2_XS_LUT 1024
typedef ActL64 ActIQ2_XS;
#define iq2_xs_act lattice64_act
struct RawIQ2_XS { W4 q; u32 d, sc; };
DEV void iq2_xs_load(RawIQ2_XS& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.d = ld_u16(hdr);
    w.sc = ld_u16(hdr + 2 + 2 * sub);
}
// Two groups of 32 of 8-byte grid entries with a 4-bit sub-scale a 16 (IQ2_XS, IQ2_S): ``entry(g, l, k, sg)``
// gives entry l of group g's grid index and signs.
template <typename Entry>
DEV float iq2_groups(Entry entry, u32 sc, float d, const ActL64& a, const u32* grid) {
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        int t = 0;
        for (int h = 0; h < 2; h++) {  // entries 2h, 2h + 1 of the group: one sub-scale
            int s = 0;
            for (int e = 0; e < 2; e++) {
                u32 k;
                Signs sg;
                entry(g, 2 * h + e, k, sg);
                s = signed_entry(grid[2 * k], grid[2 * k + 1], sg, a.x[2 * g + h], e, s);
            }
            t += (2 * (int)((sc >> (8 * g + 4 * h)) & 15) + 1) * s;
        }
        r += a.d[g] * (float)t;
    }
    return 0.125f * d * r;
}
DEV float iq2_xs_dot(const RawIQ2_XS& w, const ActL64& a, int sub, const u32* grid) {
    const u32 words[4] = {w.q.x, w.q.y, w.q.z, w.q.w};
    return iq2_groups([&](int g, int l, u32& k, Signs& sg) {
        u32 c = (words[2 * g + (l >> 1)] >> (16 * (l & 1))) & 0xFFFF;
        k = c & 511;
        sg = ksigns(c >> 9);
    }, w.sc, half_to_float(w.d), a, grid);
}

// IQ2_S: body 32 bytes of index low bytes, then 32 sign bytes (an entry's 8 signs); header fp16 d,
// 8 bytes of index high bits (2 an entry), 8 bytes of scales as IQ2_XS's.  1024 entries.  A piece
// reads 8 bytes of each.
#define IQ2_S_BLOCK 256
#define IQ2_S_BODY 64
#define IQ2_S_HDR 18
#define IQ2_S_PIECES 4
#define IQ2_S_LUT 2048
typedef ActL64 ActIQ2_S;
#define iq2_s_act lattice64_act
struct RawIQ2_S { W2 q, s; u32 d, qh, sc; };
DEV void iq2_s_load(RawIQ2_S& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream8(body + 8 * sub);
    w.s = ld_stream8(body + 32 + 8 * sub);
    w.d = ld_u16(hdr);
    w.qh = ld_u16(hdr + 2 + 2 * sub);
    w.sc = ld_u16(hdr + 10 + 2 * sub);
}
DEV float iq2_s_dot(const RawIQ2_S& w, const ActL64& a, int sub, const u32* grid) {
    return iq2_groups([&](int g, int l, u32& k, Signs& sg) {
        u32 idx = g ? w.q.y : w.q.x, signs = g ? w.s.y : w.s.x;
        k = byte_of(idx, l) | (((byte_of(w.qh, g) >> (2 * l)) & 3) << 8);
        sg = sign_byte(byte_of(signs, l));
    }, w.sc, half_to_float(w.d), a, grid);
}

// IQ3_XXS: body 64 index bytes (256 entries of 4 weights), then a word a group of 4 x 7 sign bits
// (ksigns, per 8 weights) and a 4-bit scale; header fp16 d.  w = d * (0.5 + s) / 2 * grid * sign.
#define IQ3_XXS_BLOCK 256
#define IQ3_XXS_BODY 96
#define IQ3_XXS_HDR 2
#define IQ3_XXS_PIECES 4
#define IQ3_XXS_LUT 256
typedef ActL64 ActIQ3_XXS;
#define iq3_xxs_act lattice64_act
struct RawIQ3_XXS { W4 q; W2 s; u32 d; };
DEV void iq3_xxs_load(RawIQ3_XXS& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream(body + 16 * sub);
    w.s = ld_stream8(body + 64 + 8 * sub);
    w.d = ld_u16(hdr);
}
DEV float iq3_xxs_dot(const RawIQ3_XXS& w, const ActL64& a, int sub, const u32* grid) {
    const u32 words[4] = {w.q.x, w.q.y, w.q.z, w.q.w};
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        u32 aux = g ? w.s.y : w.s.x;
        int t = 0;
        for (int l = 0; l < 4; l++) {  // 8 weights: index bytes 2l, 2l + 1 of the group's 8
            u32 v = words[2 * g + (l >> 1)] >> (16 * (l & 1));
            t = signed_entry(grid[v & 0xFF], grid[(v >> 8) & 0xFF], ksigns((aux >> (7 * l)) & 127),
                             a.x[2 * g + (l >> 1)], l & 1, t);
        }
        r += a.d[g] * (float)((2 * (int)(aux >> 28) + 1) * t);
    }
    return 0.25f * half_to_float(w.d) * r;
}

// IQ3_S: body 64 index low bytes (512 entries of 4 weights); header fp16 d, 8 bytes of index high bits
// (bit i of byte g for entry i of group g), 32 sign bytes (per 8 weights), 4 bytes of two 4-bit scales;
// w = d * (1 + 2s) * grid * sign.  The header is 46 bytes: 16-bit loads.
#define IQ3_S_BLOCK 256
#define IQ3_S_BODY 64
#define IQ3_S_HDR 46
#define IQ3_S_PIECES 4
#define IQ3_S_LUT 512
typedef ActL64 ActIQ3_S;
#define iq3_s_act lattice64_act
struct RawIQ3_S { W4 q; u32 d, qh, s0, s1, sc; };
DEV void iq3_s_load(RawIQ3_S& w, const u8* body, const u8* hdr, int sub) {
    const u8* s = hdr + 10 + 8 * sub;
    w.q = ld_stream(body + 16 * sub);
    w.d = ld_u16(hdr);
    w.qh = ld_u16(hdr + 2 + 2 * sub);
    w.s0 = ld_u16(s) | (ld_u16(s + 2) << 16);
    w.s1 = ld_u16(s + 4) | (ld_u16(s + 6) << 16);
    w.sc = ld_field<unsigned char>(hdr + 42 + sub);
}
DEV float iq3_s_dot(const RawIQ3_S& w, const ActL64& a, int sub, const u32* grid) {
    const u32 words[4] = {w.q.x, w.q.y, w.q.z, w.q.w};
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        u32 qh = byte_of(w.qh, g), signs = g ? w.s1 : w.s0;
        int t = 0;
        for (int l = 0; l < 4; l++) {
            u32 v = words[2 * g + (l >> 1)] >> (16 * (l & 1));
            u32 k0 = (v & 0xFF) | (((qh >> (2 * l)) & 1) << 8), k1 = ((v >> 8) & 0xFF) | (((qh >> (2 * l + 1)) & 1) << 8);
            t = signed_entry(grid[k0], grid[k1], sign_byte(byte_of(signs, l)), a.x[2 * g + (l >> 1)], l & 1, t);
        }
        r += a.d[g] * (float)((2 * (int)((w.sc >> (4 * g)) & 15) + 1) * t);
    }
    return half_to_float(w.d) * r;
}

// IQ1_S / IQ1_M: 2048 entries of 8 values -1..1 (in the table as 0..2: minus the activations' sum),
// plus a delta of +-1/8 an entry's group: with the sums of 8 activations, 8 * w . x is an integer
// 8 * grid' . x + (8 * delta - 8) * sum, delta - 1 = -7/8 or -9/8.
struct ActIQ1 { W4 x[4]; float d[2]; int sum[8]; };  // sum[4g + l]: activations 32g + 8l ..
DEV void iq1_act(ActIQ1& a, const i8* xq, const float* xd, const float* xs, int blk, int sub) {
    const i8* p = xq + 256 * blk + 64 * sub;
    for (int j = 0; j < 4; j++) {
        a.x[j] = ld16(p + 16 * j);
        a.sum[2 * j] = dp4a(a.x[j].y, 0x01010101u, dp4a(a.x[j].x, 0x01010101u, 0));
        a.sum[2 * j + 1] = dp4a(a.x[j].w, 0x01010101u, dp4a(a.x[j].z, 0x01010101u, 0));
    }
    a.d[0] = ldf(xd + 8 * blk + 2 * sub);
    a.d[1] = ldf(xd + 8 * blk + 2 * sub + 1);
}
DEV int entry_dot(u32 g0, u32 g1, W4 x, int half, int acc) {
    return dp4a(g1, half ? x.w : x.y, dp4a(g0, half ? x.z : x.x, acc));
}
DEV int iq1_term(const u32* grid, u32 k, bool negative, const ActIQ1& a, int g, int l) {  // 8 * w . x / dl
    return 8 * entry_dot(grid[2 * k], grid[2 * k + 1], a.x[2 * g + (l >> 1)], l & 1, 0)
         + (negative ? -9 : -7) * a.sum[4 * g + l];
}

// IQ1_S: body 32 index low bytes; header fp16 d, a 16-bit word a group: index high bits (3 an entry),
// a 3-bit scale (bits 12-14) and the delta's sign (bit 15).  w = d * (2s + 1) * (grid + delta).
#define IQ1_S_BLOCK 256
#define IQ1_S_BODY 32
#define IQ1_S_HDR 18
#define IQ1_S_PIECES 4
#define IQ1_S_LUT 4096
typedef ActIQ1 ActIQ1_S;
#define iq1_s_act iq1_act
struct RawIQ1_S { W2 q; u32 d, qh; };
DEV void iq1_s_load(RawIQ1_S& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream8(body + 8 * sub);
    w.d = ld_u16(hdr);
    w.qh = ld_u16(hdr + 2 + 4 * sub) | (ld_u16(hdr + 4 + 4 * sub) << 16);
}
DEV float iq1_s_dot(const RawIQ1_S& w, const ActIQ1& a, int sub, const u32* grid) {
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        u32 qh = (w.qh >> (16 * g)) & 0xFFFF, idx = g ? w.q.y : w.q.x;
        int t = 0;
        for (int l = 0; l < 4; l++)
            t += iq1_term(grid, byte_of(idx, l) | (((qh >> (3 * l)) & 7) << 8), qh & 0x8000, a, g, l);
        r += a.d[g] * (float)((2 * (int)((qh >> 12) & 7) + 1) * t);
    }
    return 0.125f * half_to_float(w.d) * r;
}

// IQ1_M: body 32 index low bytes; header 16 bytes of a nibble an entry (index high bits, the delta's
// sign as bit 3), then 4 16-bit words of 3-bit scales (one per 16 weights) whose top nibbles make the
// fp16 d.  w = d * (2s + 1) * (grid + delta).
#define IQ1_M_BLOCK 256
#define IQ1_M_BODY 32
#define IQ1_M_HDR 24
#define IQ1_M_PIECES 4
#define IQ1_M_LUT 4096
typedef ActIQ1 ActIQ1_M;
#define iq1_m_act iq1_act
struct RawIQ1_M { W2 q; u32 qh, s0, s1; };
DEV void iq1_m_load(RawIQ1_M& w, const u8* body, const u8* hdr, int sub) {
    w.q = ld_stream8(body + 8 * sub);
    w.qh = ld_u32(hdr + 4 * sub);
    w.s0 = ld_u32(hdr + 16);
    w.s1 = ld_u32(hdr + 20);
}
DEV float iq1_m_dot(const RawIQ1_M& w, const ActIQ1& a, int sub, const u32* grid) {
    u32 d = ((w.s0 >> 12) & 0xF) | ((w.s0 >> 24) & 0xF0) | ((w.s1 >> 4) & 0xF00) | ((w.s1 >> 16) & 0xF000);
    u32 sw = ((sub < 2 ? w.s0 : w.s1) >> (16 * (sub & 1))) & 0xFFFF;  // the scales of groups 2sub, 2sub + 1
    float r = 0.0f;
    for (int g = 0; g < 2; g++) {
        u32 qh = (w.qh >> (16 * g)) & 0xFFFF, idx = g ? w.q.y : w.q.x;
        int t = 0;
        for (int h = 0; h < 2; h++) {
            int th = 0;
            for (int e = 0; e < 2; e++) {
                int l = 2 * h + e;
                u32 nib = (qh >> (4 * l)) & 15;
                th += iq1_term(grid, byte_of(idx, l) | ((nib & 7) << 8), nib & 8, a, g, l);
            }
            t += (2 * (int)((sw >> (6 * g + 3 * h)) & 7) + 1) * th;
        }
        r += a.d[g] * (float)t;
    }
    return 0.125f * half_to_float(d) * r;
}

// ---- the kernel ------------------------------------------------------------------------------
// Compiled once per (TYPE, R, NT, OUT, GROUPED) by defines: TYPE is a decoder's prefix (q4_k),
// ACT / RAW its structs, BODY / HDR / PIECES its geometry, LUT the words of its table (0: none).
// Grid (at most ceil(N / R), M).
// y[m, n] (row stride stride_y) = x[m] . W[n] for n in this block's R rows; GROUPED: row n of matrix
// ids[m] of a stack of matrices of N rows, activation row m / x_div (mixture-of-experts pairs).

#if defined(__CUDACC__) && defined(TYPE)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

DEV void store_out(float* y, float v) { *y = v; }
DEV void store_out(unsigned short* y, float v) {
#if OUT_BF16
    u32 b = __float_as_uint(v);
    b += 0x7FFF + ((b >> 16) & 1);  // round to nearest even (no NaN reaches here from finite inputs)
    *y = (unsigned short)(b >> 16);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    *y = h;
#endif
}

// __launch_bounds__(NT, 1): with the default, ptxas sank each row's loads next to their products (fewer
// registers, one row's loads in flight at a time); with it every row's loads issue first.
extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL(
        const u8* __restrict__ w, const i8* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, OUT_T* __restrict__ y, const long long* __restrict__ ids,
        const u32* __restrict__ lut, int N, int row_bytes, int hdr_start, int n_blocks, int x_div,
        int stride_xq, int stride_xd, int stride_y) {
#if LUT
    __shared__ u32 tab[LUT];  // a lattice type's grid (lut from word 128 on: triton/gguf.py's value_table)
    for (int i = threadIdx.x; i < LUT; i += NT) tab[i] = lut[128 + i];
    __syncthreads();
#else
    const u32* tab = lut;
#endif
    const int m = blockIdx.y;
    long long base = 0;
    int xm = m;
#if GROUPED
    base = ids[m] * (long long)N;
    xm = m / x_div;
#endif
    xq += (long long)xm * stride_xq;
    xd += (long long)xm * stride_xd;
    xs += (long long)xm * stride_xd;
    const int n_pieces = n_blocks * PIECES, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float part[NT / 32][R];
    // tiles of R rows: one a block, or (for the types with a staged table: fewer blocks, so fewer
    // copies of the table) strided over the blocks
    for (int n0 = blockIdx.x * R; n0 < N; n0 += gridDim.x * R) {
        const u8* rows[R];
#pragma unroll
        for (int r = 0; r < R; r++)  // rows past N read row N - 1 and are not stored
            rows[r] = w + (base + n0 + (n0 + r < N ? r : N - 1 - n0)) * (long long)row_bytes;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.0f;
        for (int pc = threadIdx.x; pc < n_pieces; pc += NT) {
            const int blk = pc / PIECES, sub = pc % PIECES;
            RAW raw[R];
#pragma unroll
            for (int r = 0; r < R; r++)
                CAT(TYPE, _load)(raw[r], rows[r] + BODY * blk, rows[r] + hdr_start + HDR * blk, sub);
            ACT a;
            CAT(TYPE, _act)(a, xq, xd, xs, blk, sub);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += CAT(TYPE, _dot)(raw[r], a, sub, tab);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = acc[r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
            if (lane == 0) part[warp][r] = v;
        }
        __syncthreads();
        if (threadIdx.x < R && n0 + threadIdx.x < N) {
            float v = 0.0f;
#pragma unroll
            for (int i = 0; i < NT / 32; i++) v += part[i][threadIdx.x];
            store_out(y + (long long)m * stride_y + n0 + threadIdx.x, v);
        }
        __syncthreads();  // part is written again by the next tile
    }
}
#endif
