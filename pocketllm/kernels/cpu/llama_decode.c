/* A decode-only step of the Llama family's decoder layers in one call, for the CPU fast path.
 *
 * At batch 1 a small model's matmuls take a few microseconds each, and the Python around them
 * (module calls, argument checks, one ctypes call per op) costs as much again: SmolLM2-135M
 * spent 3 of its 7 ms a token outside the matmuls. Here the layers run the same kernels as the
 * modules do on this path (gguf_gemm*.c, layer_ops.c), in the modules' order, without leaving C:
 *
 *   residual = x (layer 0) or x + residual; h = rms_norm(residual)
 *   qkv = h Wqkv (+ b); q and k heads RMS-normalized where the layer has q/k norms (Qwen3);
 *   rotary, cache write and attention (cpu_decode_attention); x = o Wo (+ b)
 *   residual = x + residual; h = rms_norm(residual)
 *   x = act(h Wgate) * (h Wup), then x Wdown (+ b); or, in a mixture-of-experts layer, each row's
 *   experts chosen by the router (softmax, top k, renormalized; or DeepSeek's routing) and their
 *   outputs summed, with the shared experts' (moe_block)
 *
 * DeepSeek's layers attend through their latent (mla_attention) in place of qkv and the attention.
 *
 * The model's final norm and the output layer stay with the caller. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gguf_gemm(int type, const uint8_t *const *W, int64_t N, int64_t K, const float *X, int64_t B, float *Y,
              int nthreads);
int gguf_gemm_int8(int type, const uint8_t *const *W, int64_t N, int64_t K, const float *X, int64_t B, float *Y,
                   int passes, int nthreads);
int gguf_gemm_x8(int type, const uint8_t *Wp, int64_t N, int64_t K, const float *X, int64_t B, float *Y,
                 int passes, int nthreads);
int cpu_rms_norm(const float *x, float *res, const float *w, float *y, int64_t rows, int64_t dim, float eps,
                 int nthreads);
int cpu_decode_attention(float *qkv, int64_t q_stride, void *k_cache, void *v_cache, float *k_scales,
                         float *v_scales, int64_t bs, int64_t hkv, int64_t d, int64_t hq, const int64_t *tables,
                         int64_t width, const int64_t *lens, int64_t n, float scale, int64_t window, float softcap,
                         const float *sinks, float *out, const int64_t *slots, const int64_t *pos,
                         const float *cos_t, const float *sin_t, int nthreads);
int cpu_gated_act(const float *gate_up, int64_t T, int64_t I, int act, float *out, int nthreads);
int cpu_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t row_stride, const int64_t *pos, const float *cos_t,
               const float *sin_t);
int gguf_heads_gemm_int8(int type, const uint8_t *const *W, int64_t H, int64_t N, int64_t K, const float *X,
                         int64_t B, float *Y, int passes, int nthreads);
int cpu_clamped_swiglu(const float *gate_up, int64_t T, int64_t I, float alpha, float limit, float *out,
                       int nthreads);

/* The structures mirror llama_decode.py's ctypes ones. */
typedef struct {
    int32_t type, passes, interleaved; /* passes: 8-bit activation passes; interleaved: gguf_repack_x8 */
    const void *w;                     /* the row pointer table, or the interleaved bytes */
    const float *bias;                 /* [n] or NULL */
    int64_t n;                         /* output columns of this part */
} ld_part;

typedef struct {
    int64_t nparts, n, k; /* parts side by side: n = their sum */
    ld_part part[3];
    /* LoRA adapters' slots (pocketllm/layers/lora.py), or NULL: A [slots * lora_width, k], B^T [slots * lora_width, n] */
    const float *lora_a, *lora_bt;
    int64_t lora_width;
} ld_proj;

typedef struct {
    int64_t experts, top_k;
    int32_t renormalize;           /* the top k's weights scaled to sum to 1 */
    const float *router;           /* [experts, hidden] float32 */
    const ld_proj *gate_up, *down; /* each expert's projections (the shared experts one more entry, last) */
    int64_t most;                  /* the widest expert's intermediate features */
    /* DeepSeek's routing (models/deepseek.py); a softmax over all experts, the top k, is 0, NULL, 1, 1, 1.0 */
    int32_t sigmoid;               /* scores: sigmoid of the logits, not their softmax */
    const float *bias;             /* added to the scores that choose, not to the weights (V3), or NULL */
    int64_t groups, top_groups;    /* the top k within the top_groups best of `groups` groups */
    float scaling;                 /* routed_scaling_factor */
    int64_t shared;                /* the shared experts' entry in gate_up / down, or -1 */
} ld_moe;

/* DeepSeek's multi-head latent attention (models/deepseek.py, LatentAttention): the query (through its
 * low-rank bottleneck where q_rank) and the latent [c | k_pe] projected, W_UK and W_UV the file's own
 * quantized heads (QuantizedHeads); the cache one latent head of rank + rope values a token. */
typedef struct {
    int64_t rank, rope, nope, v_dim, q_rank;
    int32_t interleaved;      /* the rotary dimensions rotate interleaved pairs */
    int32_t passes;           /* the heads' 8-bit activation passes */
    ld_proj q, q_b, kv_a;     /* q: q_proj, or q_a_proj where q_rank (then q_b: q_b_proj); kv_a: [c | k_pe] */
    const float *q_norm, *kv_norm;
    int32_t k_type, v_type;   /* attn_k_b [H * rank rows of nope], attn_v_b [H * v_dim rows of rank] */
    const void *k_rows, *v_rows;
} ld_mla;

typedef struct {
    const float *in_norm, *post_norm; /* RMSNorm scales */
    const float *q_norm, *k_norm;     /* per-head RMSNorm scales of the queries and keys, or NULL */
    ld_proj qkv, o, gate_up, down;
    void *k_cache, *v_cache;   /* floats, or int8 with the scales (an 8-bit cache) */
    float *k_scales, *v_scales; /* [slots, kv_heads], or NULL */
    int64_t window;
    float softcap;
    const ld_moe *moe; /* a mixture of experts in place of gate_up and down, or NULL */
    const ld_mla *mla; /* latent attention in place of qkv and o's attention (o stays o_proj), or NULL */
} ld_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int32_t act; /* 0: SiLU, 1: GELU (tanh) */
    const float *cos, *sin;
    const ld_layer *layers;
} ld_model;

static int run_part(const ld_part *p, int64_t k, const float *x, int64_t t, float *y, int nthreads) {
    int rc;
    if (p->interleaved) rc = gguf_gemm_x8(p->type, p->w, p->n, k, x, t, y, p->passes, nthreads);
    else if (p->passes) rc = gguf_gemm_int8(p->type, p->w, p->n, k, x, t, y, p->passes, nthreads);
    else rc = gguf_gemm(p->type, p->w, p->n, k, x, t, y, nthreads);
    if (rc == 0 && p->bias)
        for (int64_t r = 0; r < t; r++)
            for (int64_t i = 0; i < p->n; i++) y[r * p->n + i] += p->bias[i];
    return rc;
}

/* y [t, n] = x [t, k] through the projection's parts; `tmp` holds a part's [t, n_part] where
 * it cannot be written in place (several parts and several tokens). */
static int project(const ld_proj *p, const float *x, int64_t t, float *y, float *tmp, int nthreads) {
    if (p->nparts == 1) return run_part(&p->part[0], p->k, x, t, y, nthreads);
    int64_t col = 0;
    for (int64_t i = 0; i < p->nparts; i++) {
        const ld_part *q = &p->part[i];
        int rc = run_part(q, p->k, x, t, t == 1 ? y + col : tmp, nthreads);
        if (rc) return rc;
        if (t > 1)
            for (int64_t r = 0; r < t; r++) memcpy(y + r * p->n + col, tmp + r * q->n, (size_t)q->n * sizeof(float));
        col += q->n;
    }
    return 0;
}

/* y [t, n] += each row's LoRA product (x A_s^T) B_s^T, s = slot[row] (-1: no adapter), in float32.
 * A slot's columns are `lora_width` = nparts * r: part q's output columns read only its own r of them
 * (B is zero elsewhere), so those are all that is added: r rows of B^T, each scaled by its x A^T value
 * and added to the part's outputs (contiguous). */
static void lora_add(const ld_proj *p, const float *x, int64_t t, float *y, const int64_t *slot, int nthreads) {
    const int64_t w = p->lora_width, k = p->k, n = p->n, r = w / p->nparts;
    float *xa = malloc((size_t)(t * w) * sizeof(float));
    if (!xa) return;
    #pragma omp parallel num_threads(nthreads) if (t * w * (k + n / p->nparts) >= 262144)
    {
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < t * w; e++) {
            const int64_t row = e / w, j = e % w;
            if (slot[row] < 0) continue;
            const float *a = p->lora_a + (slot[row] * w + j) * k, *xr = x + row * k;
            float acc = 0.0f;
            #pragma omp simd reduction(+ : acc)
            for (int64_t c = 0; c < k; c++) acc += a[c] * xr[c];
            xa[e] = acc;
        }
        /* each (row, part) adds its r scaled rows of B^T to the part's outputs */
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < t * p->nparts; e++) {
            const int64_t row = e / p->nparts, q = e % p->nparts;
            if (slot[row] < 0) continue;
            int64_t lo = 0;
            for (int64_t i = 0; i < q; i++) lo += p->part[i].n;
            const int64_t hi = lo + p->part[q].n, col = slot[row] * w + q * r;
            float *yr = y + row * n;
            for (int64_t j = 0; j < r; j++) {
                const float c = xa[row * w + q * r + j], *bt = p->lora_bt + (col + j) * n;
                if (c == 0.0f) continue;
                #pragma omp simd
                for (int64_t i = lo; i < hi; i++) yr[i] += c * bt[i];
            }
        }
    }
    free(xa);
}

/* project(), then the LoRA adapters' products where the step has adapter rows */
static int project_lora(const ld_proj *p, const float *x, int64_t t, float *y, float *tmp, const int64_t *slots,
                        int nthreads) {
    int rc = project(p, x, t, y, tmp, nthreads);
    if (rc == 0 && slots && p->lora_a) lora_add(p, x, t, y, slots, nthreads);
    return rc;
}

int moe_decode_experts(const ld_proj *gate_up, const ld_proj *down, int64_t k, const int64_t *ids, const float *w,
                       const float *x, int64_t most, int act, float alpha, float limit, float *out, int nthreads);

/* One row's experts from its router logits p [E] (overwritten by its scores), as the block routes them: the
 * softmax (or sigmoid) of the logits; choices by score plus bias, within the top_groups best groups (a group
 * ranked by its best choice, by its best two with a sigmoid) where there are groups; the top k, the largest
 * first (the lower id first among equals); their scores as weights, renormalized where the model says so,
 * times the scaling. choice [E] and taken [E]: scratch. */
static void route_row(const ld_moe *M, float *p, float *choice, unsigned char *taken, int64_t *ids, float *w) {
    const int64_t E = M->experts, k = M->top_k;
    if (M->sigmoid) {
        for (int64_t e = 0; e < E; e++) p[e] = 1.f / (1.f + expf(-p[e]));
    } else {
        float mx = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
    }
    for (int64_t e = 0; e < E; e++) choice[e] = p[e] + (M->bias ? M->bias[e] : 0.f), taken[e] = 0;
    if (M->groups > 1) {  /* taken[e]: 1 chosen, 2 its group is out */
        const int64_t G = M->groups, per = E / G;
        float score[64];
        for (int64_t g = 0; g < G; g++) {
            float a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++)
                if (choice[e] > a) b = a, a = choice[e];
                else if (choice[e] > b) b = choice[e];
            score[g] = M->sigmoid ? a + b : a;
        }
        unsigned char kept[64] = {0};
        for (int64_t j = 0; j < M->top_groups; j++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!kept[g] && (best < 0 || score[g] > score[best])) best = g;
            kept[best] = 1;
        }
        for (int64_t e = 0; e < E; e++) taken[e] = kept[e / per] ? 0 : 2;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
        ids[j] = best, w[j] = p[best], sum += p[best], taken[best] = 1;
    }
    for (int64_t j = 0; j < k; j++) w[j] = (M->renormalize ? w[j] / sum : w[j]) * M->scaling;
}

/* A mixture-of-experts block over t rows, as SparseMoE (or DeepseekMoE) routes and runs it: each row's router
 * logits in float32, routed by route_row. One row's experts then run in turn in one moe_decode_experts call
 * (the block's one-token path), the shared experts last with weight 1; several rows are grouped by expert (its
 * sorted path): each chosen expert runs once over its rows, in ascending id, and adds each row's weighted
 * output; then the shared experts over every row. */
static int moe_block(const ld_moe *M, const float *hs, int64_t t, int64_t h, int act, float *out, int nthreads) {
    const int64_t E = M->experts, k = M->top_k, most = M->most, wide = 2 * most > h ? 2 * most : h;
    const int64_t kk = k + (M->shared >= 0);  /* a row's entries: its experts, then the shared ones */
    if (M->groups > 64 || (M->groups > 1 && E % M->groups)) return -3;  /* (_moe builds none such) */
    float *p = malloc((size_t)(2 * E) * sizeof(float)), *w = malloc((size_t)(t * kk) * sizeof(float));
    int64_t *ids = malloc((size_t)(t * kk) * sizeof(int64_t));
    unsigned char *taken = malloc((size_t)E);
    int rc = p && w && ids && taken ? 0 : -2;
    for (int64_t r = 0; r < t && rc == 0; r++) {
        const float *x = hs + r * h;
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (E * h >= 262144)
        for (int64_t e = 0; e < E; e++) {
            const float *we = M->router + e * h;
            float s = 0.f;
            #pragma omp simd reduction(+ : s)
            for (int64_t c = 0; c < h; c++) s += we[c] * x[c];
            p[e] = s;
        }
        route_row(M, p, p + E, taken, ids + r * kk, w + r * kk);
        if (M->shared >= 0) ids[r * kk + k] = M->shared, w[r * kk + k] = 1.f;
    }
    if (rc == 0 && t == 1)
        rc = moe_decode_experts(M->gate_up, M->down, kk, ids, w, hs, most, act, 0.f, 0.f, out, nthreads);
    else if (rc == 0) {
        float *xs = malloc((size_t)(t * h) * sizeof(float)), *gu = malloc((size_t)(t * 2 * most) * sizeof(float));
        float *a = malloc((size_t)(t * most) * sizeof(float)), *y = malloc((size_t)(t * h) * sizeof(float));
        float *tmp = malloc((size_t)(t * wide) * sizeof(float)), *rw = malloc((size_t)t * sizeof(float));
        int64_t *rows = malloc((size_t)t * sizeof(int64_t));
        rc = xs && gu && a && y && tmp && rw && rows ? 0 : -2;
        if (rc == 0) memset(out, 0, (size_t)(t * h) * sizeof(float));
        /* the routed experts in ascending id, then the shared ones (every row, weight 1) */
        for (int64_t e = 0; e < E + (M->shared >= 0) && rc == 0; e++) {
            const int64_t id = e < E ? e : M->shared;
            int64_t n = 0;
            for (int64_t r = 0; r < t; r++)
                for (int64_t j = 0; j < kk; j++)
                    if (ids[r * kk + j] == id) rows[n] = r, rw[n++] = w[r * kk + j];
            if (n == 0) continue;
            const int64_t inter = M->down[id].k;
            for (int64_t i = 0; i < n; i++) memcpy(xs + i * h, hs + rows[i] * h, (size_t)h * sizeof(float));
            if ((rc = project(&M->gate_up[id], xs, n, gu, tmp, nthreads))) break;
            cpu_gated_act(gu, n, inter, act, a, nthreads);
            if ((rc = project(&M->down[id], a, n, y, tmp, nthreads))) break;
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < h; c++) out[rows[i] * h + c] += rw[i] * y[i * h + c];
        }
        free(xs); free(gu); free(a); free(y); free(tmp); free(rw); free(rows);
    }
    free(p); free(w); free(ids); free(taken);
    return rc;
}

/* A head's rotary part src [P] into dst, rotated at position *pos by layer_ops' rotation (rotate-half layout;
 * interleaved pairs (x0, x1), (x2, x3), ... de-interleaved first, as LatentAttention does). */
static void rotate_pe(const float *src, float *dst, int64_t P, int interleaved, const int64_t *pos, const float *cos_t,
                      const float *sin_t) {
    if (interleaved)
        for (int64_t i = 0; i < P / 2; i++) dst[i] = src[2 * i], dst[P / 2 + i] = src[2 * i + 1];
    else
        memcpy(dst, src, (size_t)P * sizeof(float));
    cpu_rotary(dst, 1, 1, P, P, pos, cos_t, sin_t);
}

/* Latent attention of t decode rows (LatentAttention.forward with the quantized heads): normed [t, hidden] ->
 * attn [t, H * v_dim], o_proj's input. qkv [t, (H + 2) D] (D = rank + rope) holds each row's absorbed queries,
 * then its latent as the key and the value of the one cached head; attn [t, H D] first takes the attention's
 * output. */
static int mla_attention(const ld_model *m, const ld_layer *L, const float *normed, int64_t t, const int64_t *pos,
                         const int64_t *slots, const int64_t *tables, int64_t width, const int64_t *lens,
                         float *qkv, float *attn, float *tmp, int nthreads) {
    const ld_mla *A = L->mla;
    const int64_t H = m->heads, R = A->rank, P = A->rope, N = A->nope, V = A->v_dim, D = R + P, qw = H * (N + P);
    const int64_t in_w = N > R ? N : R, out_w = R > V ? R : V;
    float *q = malloc((size_t)(t * qw) * sizeof(float)), *kv = malloc((size_t)(t * D) * sizeof(float));
    float *hin = malloc((size_t)(H * t * in_w) * sizeof(float)), *hout = malloc((size_t)(H * t * out_w) * sizeof(float));
    float *qa = A->q_rank ? malloc((size_t)(t * A->q_rank) * sizeof(float)) : NULL;
    int rc = q && kv && hin && hout && (qa || !A->q_rank) ? 0 : -2;
    if (rc == 0 && A->q_rank) {
        if ((rc = project(&A->q, normed, t, qa, tmp, nthreads)) == 0) {
            cpu_rms_norm(qa, NULL, A->q_norm, qa, t, A->q_rank, m->eps, nthreads);
            rc = project(&A->q_b, qa, t, q, tmp, nthreads);
        }
    } else if (rc == 0) {
        rc = project(&A->q, normed, t, q, tmp, nthreads);
    }
    if (rc == 0) rc = project(&A->kv_a, normed, t, kv, tmp, nthreads);
    if (rc == 0) {
        for (int64_t r = 0; r < t; r++) {
            float *row = qkv + r * (H + 2) * D, *k = row + H * D;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + r * qw + h * (N + P);
                memcpy(hin + (h * t + r) * N, qh, (size_t)N * sizeof(float));
                rotate_pe(qh + N, row + h * D + R, P, A->interleaved, pos + r, m->cos, m->sin);
            }
            cpu_rms_norm(kv + r * D, NULL, A->kv_norm, k, 1, R, m->eps, 1);
            rotate_pe(kv + r * D + R, k + R, P, A->interleaved, pos + r, m->cos, m->sin);
            memcpy(k + D, k, (size_t)D * sizeof(float));
        }
        /* W_UK absorbed into the queries: each head's q_nope [t, N] -> [t, R] */
        rc = gguf_heads_gemm_int8(A->k_type, A->k_rows, H, R, N, hin, t, hout, A->passes, nthreads);
    }
    if (rc == 0) {
        for (int64_t r = 0; r < t; r++)
            for (int64_t h = 0; h < H; h++)
                memcpy(qkv + r * (H + 2) * D + h * D, hout + (h * t + r) * R, (size_t)R * sizeof(float));
        rc = cpu_decode_attention(qkv, (H + 2) * D, L->k_cache, L->v_cache, L->k_scales, L->v_scales, m->block_size,
                                  1, D, H, tables, width, lens, t, m->scale, L->window, L->softcap, NULL, attn, slots,
                                  pos, NULL, NULL, nthreads);
    }
    if (rc == 0) {  /* W_UV on the weighted latents (their first R values): [t, R] -> [t, V] a head */
        for (int64_t r = 0; r < t; r++)
            for (int64_t h = 0; h < H; h++)
                memcpy(hin + (h * t + r) * R, attn + (r * H + h) * D, (size_t)R * sizeof(float));
        rc = gguf_heads_gemm_int8(A->v_type, A->v_rows, H, V, R, hin, t, hout, A->passes, nthreads);
    }
    if (rc == 0)
        for (int64_t r = 0; r < t; r++)
            for (int64_t h = 0; h < H; h++)
                memcpy(attn + (r * H + h) * V, hout + (h * t + r) * V, (size_t)V * sizeof(float));
    free(q); free(kv); free(hin); free(hout); free(qa);
    return rc;
}

/* x [t, hidden]: the embedded tokens in, the last layer's output out; residual [t, hidden]: the
 * residual stream out. pos, slots, lens [t]; tables [t, width] (the decode rows' block tables).
 * lora_slots [t]: each row's LoRA adapter slot (-1: none), or NULL when no row has one. */
int llama_decode(const ld_model *m, float *x, float *residual, int64_t t, const int64_t *pos, const int64_t *slots,
                 const int64_t *tables, int64_t width, const int64_t *lens, const int64_t *lora_slots,
                 int nthreads) {
    const int64_t h = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads, inter = m->intermediate;
    const int64_t qkv_w = (hq + 2 * hkv) * d;
    int64_t widest = qkv_w > 2 * inter ? qkv_w : 2 * inter;
    float *normed = malloc((size_t)(t * h) * sizeof(float)), *qkv = malloc((size_t)(t * qkv_w) * sizeof(float));
    float *attn = malloc((size_t)(t * hq * d) * sizeof(float)), *gate_up = malloc((size_t)(t * 2 * inter) * sizeof(float));
    float *act = malloc((size_t)(t * inter) * sizeof(float)), *tmp = malloc((size_t)(t * widest) * sizeof(float));
    int rc = normed && qkv && attn && gate_up && act && tmp ? 0 : -2;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const ld_layer *L = &m->layers[l];
        if (l == 0) {
            memcpy(residual, x, (size_t)(t * h) * sizeof(float));
            cpu_rms_norm(residual, NULL, L->in_norm, normed, t, h, m->eps, nthreads);
        } else {
            cpu_rms_norm(x, residual, L->in_norm, normed, t, h, m->eps, nthreads);
        }
        if (L->mla) {
            if ((rc = mla_attention(m, L, normed, t, pos, slots, tables, width, lens, qkv, attn, tmp, nthreads)))
                break;
        } else {
            if ((rc = project_lora(&L->qkv, normed, t, qkv, tmp, lora_slots, nthreads))) break;
            if (L->q_norm)  /* in place, head by head: a token's query heads, then its key heads */
                for (int64_t r = 0; r < t; r++) {
                    cpu_rms_norm(qkv + r * qkv_w, NULL, L->q_norm, qkv + r * qkv_w, hq, d, m->eps, 1);
                    cpu_rms_norm(qkv + r * qkv_w + hq * d, NULL, L->k_norm, qkv + r * qkv_w + hq * d, hkv, d, m->eps, 1);
                }
            if ((rc = cpu_decode_attention(qkv, qkv_w, L->k_cache, L->v_cache, L->k_scales, L->v_scales, m->block_size,
                                           hkv, d, hq, tables,
                                           width, lens, t, m->scale, L->window, L->softcap, NULL, attn, slots, pos,
                                           m->cos, m->sin, nthreads)))
                break;
        }
        if ((rc = project_lora(&L->o, attn, t, x, tmp, lora_slots, nthreads))) break;
        cpu_rms_norm(x, residual, L->post_norm, normed, t, h, m->eps, nthreads);
        if (L->moe) {
            rc = moe_block(L->moe, normed, t, h, m->act, x, nthreads);
            continue;
        }
        if ((rc = project_lora(&L->gate_up, normed, t, gate_up, tmp, lora_slots, nthreads))) break;
        cpu_gated_act(gate_up, t, inter, m->act, act, nthreads);
        rc = project_lora(&L->down, act, t, x, tmp, lora_slots, nthreads);
    }
    free(normed); free(qkv); free(attn); free(gate_up); free(act); free(tmp);
    return rc;
}


/* One token's selected experts of a mixture-of-experts block: out [h] = sum over j of
 * w[j] * down_e(act(gate_up_e(x))), e = ids[j], in j's order, as the module path runs them (the
 * same kernels: one call instead of a Python loop of module calls). gate_up / down: every expert's
 * projections (DeepSeek's shared experts one more entry, of their own width, taken last with weight 1);
 * most: the widest intermediate among them; act 0 SiLU, 1 GELU (tanh), 3 gpt-oss's clamped SwiGLU
 * (alpha, limit). */
int moe_decode_experts(const ld_proj *gate_up, const ld_proj *down, int64_t k, const int64_t *ids, const float *w,
                       const float *x, int64_t most, int act, float alpha, float limit, float *out, int nthreads) {
    const int64_t h = down[0].n;
    float *gu = malloc((size_t)(2 * most) * sizeof(float)), *a = malloc((size_t)most * sizeof(float));
    float *y = malloc((size_t)h * sizeof(float));
    int rc = gu && a && y ? 0 : -2;
    memset(out, 0, (size_t)h * sizeof(float));
    for (int64_t j = 0; j < k && rc == 0; j++) {
        const int64_t e = ids[j], inter = down[e].k;
        if (inter > most || gate_up[e].n != 2 * inter) { rc = -3; break; }
        if ((rc = project(&gate_up[e], x, 1, gu, NULL, nthreads))) break;
        rc = act == 3 ? cpu_clamped_swiglu(gu, 1, inter, alpha, limit, a, nthreads)
                      : cpu_gated_act(gu, 1, inter, act, a, nthreads);
        if (rc || (rc = project(&down[e], a, 1, y, NULL, nthreads))) break;
        for (int64_t i = 0; i < h; i++) out[i] += w[j] * y[i];
    }
    free(gu); free(a); free(y);
    return rc;
}
