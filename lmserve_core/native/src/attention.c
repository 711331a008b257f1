/*
 * Causal grouped-query attention over an f32 or f16 KV cache, two-pass (stable) softmax.
 *
 * Few query tokens (decode): work items are (chunk of keys, kv head, group of tokens), the
 * chunks on a grid of absolute positions. An item scores its chunk for every token and query
 * head of the group while the chunk's keys sit in L1, then sums its values the same way,
 * leaving per-chunk (max, sum, output) partials that a second pass merges (the split-softmax
 * of flash decoding). The queries that see the same keys of a chunk (the heads of a kv
 * head's group, and the tokens of a verify pass or a small prefill chunk before its last
 * chunk) are scored and summed together, each row read (and widened from f16) once for
 * several of them. A query's scores and sums get the same float operations whichever
 * queries it goes with, and its partials depend only on its own position, so a token
 * computed with others gets the bits it gets alone. Chunks keep both threads busy even
 * with a single kv head.
 * Many query tokens (prefill): tiled on the matmul micro-kernel. Each kv head's keys and
 * values are packed once into the GEMM's k-major panels; query rows (token, head of the
 * group) are taken `nr` at a time, S = Q K^T and O = P V then run at GEMM speed.
 */
#include <math.h>
#include <stdatomic.h>

#include "lm_internal.h"

typedef struct {
    const lm_kernels *k;
    const float *q;
    const uint8_t *kc, *vc; /* rows of kv_stride elements of kv_type */
    int kv_type;            /* LM_F32 or LM_F16 */
    int64_t kv_stride;
    int64_t ring;           /* > 0: position p in row p % ring */
    float *out;
    int64_t ntok, pos0, window, n_ctx;
    int bidir;              /* every query sees the chunk's keys (and the window of pos0) */
    int n_head, n_kv_head, head_dim;
    float scale, softcap;
    const float *bias;      /* (ntok, n_head, bias_extent) added to the scaled scores by
                               distance (query position - key position); NULL: none */
    int64_t bias_extent;
    /* decode path */
    int64_t chunk;     /* keys per chunk; chunk c holds positions [c * chunk, c * chunk + chunk) */
    int64_t kc0;       /* first chunk any token sees */
    int64_t n_kc;      /* chunks from kc0 */
    int64_t n_tg;      /* token groups per (kv head, chunk) */
    int64_t tg_max;    /* most tokens in a group */
    float *scratch;    /* per thread: a run's sum, the scores */
    size_t scratch_sz; /* floats per thread */
    float *part;       /* (token, head, chunk) x (head_dim outputs, max, sum) */
    /* tiled path */
    int mr, nr, n_chunks;  /* GEMM tile, head_dim / mr rounded up */
    int64_t first;         /* first key any query may see (earlier ones: outside the window) */
    int64_t key0;          /* first packed key: first rounded down to a tile */
    int64_t n_kp;          /* key panels of mr keys from key0 */
    int64_t n_rows;        /* query rows per kv head: ntok * group */
    int64_t n_qp;          /* query panels per kv head */
    int h;                 /* the kv head being worked on (one at a time: bounded scratch) */
    float *kpack;          /* n_kp x (head_dim x mr) of head h */
    float *vpack;          /* n_chunks x (n_kp * mr x mr) of head h */
    uint8_t *per_thread;   /* Q panel, scores, P^T, output tile */
    size_t per_thread_sz;
} attn_ctx;

/* Below this many query tokens the chunk path is used: with the rows of a chunk shared by
 * its tokens it stays ahead of packing every key for the GEMM up to about 16 tokens. */
#define ATTN_TILED_MIN_TOKENS 16
_Static_assert(LM_DECODE_MAX_ROWS < ATTN_TILED_MIN_TOKENS,
               "decode's rows must stay on the per-token path");

static inline int64_t window_lo(const attn_ctx *c, int64_t pos) {
    return c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
}

/* Element idx of a K or V cache as f32. */
static inline float kv_at(const attn_ctx *c, const uint8_t *base, int64_t idx) {
    return c->kv_type == LM_F16 ? lm_f16((const lm_half *)base + idx)
                                : ((const float *)base)[idx];
}

/* The cache row of key position pos. */
static inline int64_t key_row(const attn_ctx *c, int64_t pos) {
    return c->ring > 0 ? pos % c->ring : pos;
}

/* Index of head kvh's first element in the row of position pos. */
static inline int64_t row_index(const attn_ctx *c, int kvh, int64_t pos) {
    return key_row(c, pos) * c->kv_stride + (int64_t)kvh * c->head_dim;
}

/* The last key position token t sees, and the position its window starts from: its own,
 * or with bidir the chunk's last and first (every query sees the same keys). */
static inline int64_t query_hi(const attn_ctx *c, int64_t t) {
    return c->bidir ? c->pos0 + c->ntok - 1 : c->pos0 + t;
}
static inline int64_t query_lo(const attn_ctx *c, int64_t t) {
    return window_lo(c, c->bidir ? c->pos0 : c->pos0 + t);
}

/* Positions token t sees in chunk c0 .. c0 + chunk - 1 (empty when *lo > *hi). */
static inline void token_keys(const attn_ctx *c, int64_t t, int64_t c0, int64_t *lo,
                              int64_t *hi) {
    const int64_t pos = query_hi(c, t), wl = query_lo(c, t);
    *lo = wl > c0 ? wl : c0;
    *hi = pos < c0 + c->chunk - 1 ? pos : c0 + c->chunk - 1;
}

/* Adds the distance bias of query (token t, head hq) to its scores s of positions j0 ..
 * j0 + n - 1 (distances past the extent take none); the largest of them. */
static float add_distance_bias(const attn_ctx *c, int64_t t, int hq, int64_t j0, int64_t n,
                               float *s) {
    const float *bq = c->bias + (t * c->n_head + hq) * c->bias_extent;
    const int64_t pos = c->pos0 + t;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const int64_t d = pos - (j0 + j);
        if (d >= 0 && d < c->bias_extent) s[j] += bq[d];
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

/* Where an item reads its rows: the K or V cache, kv head kvh. */
typedef struct {
    const uint8_t *base;
    int kvh;
} kv_src;

/* The rows of positions j0 .. j0 + n - 1 run by run: a ring wraps at most once in a chunk. */
static inline int64_t run_len(const attn_ctx *c, int64_t pos, int64_t left) {
    const int64_t row = key_row(c, pos);
    return c->ring > 0 && c->ring - row < left ? c->ring - row : left;
}

static float run_scores(const attn_ctx *c, const kv_src *src, const float *qv, int64_t pos,
                        int64_t len, float *s) {
    const int hd = c->head_dim;
    const int64_t idx = row_index(c, src->kvh, pos);
    return c->kv_type == LM_F16
               ? c->k->qk_scores_f16(qv, (const uint16_t *)src->base + idx, c->kv_stride, len,
                                     hd, c->scale, s)
               : c->k->qk_scores(qv, (const float *)src->base + idx, c->kv_stride, len, hd,
                                 c->scale, s);
}

static void run_values(const attn_ctx *c, const kv_src *src, const float *p, int64_t pos,
                       int64_t len, float *out) {
    const int hd = c->head_dim;
    const int64_t idx = row_index(c, src->kvh, pos);
    if (c->kv_type == LM_F16) {
        c->k->pv_sum_f16(p, (const uint16_t *)src->base + idx, c->kv_stride, len, hd, out);
    } else {
        c->k->pv_sum(p, (const float *)src->base + idx, c->kv_stride, len, hd, out);
    }
}

/* Scores of positions j0 .. j0 + n - 1 for one query into s; the largest. */
static float chunk_scores(const attn_ctx *c, const kv_src *src, const float *qv, int64_t j0,
                          int64_t n, float *s) {
    float mx = -INFINITY;
    for (int64_t done = 0; done < n;) {
        const int64_t len = run_len(c, j0 + done, n - done);
        const float m = run_scores(c, src, qv, j0 + done, len, s + done);
        mx = m > mx ? m : mx;
        done += len;
    }
    return mx;
}

/* out = sum_j p[j] v[j] over positions j0 .. j0 + n - 1; tmp holds a second run's sum. */
static void chunk_values(const attn_ctx *c, const kv_src *src, const float *p, int64_t j0,
                         int64_t n, float *out, float *tmp) {
    for (int64_t done = 0; done < n;) {
        const int64_t len = run_len(c, j0 + done, n - done);
        run_values(c, src, p + done, j0 + done, len, done == 0 ? out : tmp);
        if (done > 0) c->k->axpy_f32(out, 1.0f, tmp, c->head_dim);
        done += len;
    }
}

/* Most queries scored or summed together: the heads of a group, of the tokens that see the
 * same keys of a chunk. */
#define SET_MAX 32

/* chunk_scores for nq queries that see the same positions: each row read once for several
 * of them, each query with the bits chunk_scores gives it. */
static void chunk_scores_n(const attn_ctx *c, const kv_src *src, const float *const *q, int nq,
                           int64_t j0, int64_t n, float *const *s, float *mx) {
    const lm_kernels *k = c->k;
    if (k->qk_scores_n == NULL) {
        for (int i = 0; i < nq; i++) mx[i] = chunk_scores(c, src, q[i], j0, n, s[i]);
        return;
    }
    const int hd = c->head_dim;
    for (int i = 0; i < nq; i++) mx[i] = -INFINITY;
    for (int64_t done = 0; done < n;) {
        const int64_t pos = j0 + done, len = run_len(c, pos, n - done);
        float m[SET_MAX], *sd[SET_MAX];
        for (int i = 0; i < nq; i++) sd[i] = s[i] + done;
        const int64_t idx = row_index(c, src->kvh, pos);
        const int half = c->kv_type == LM_F16;
        k->qk_scores_n(q, nq, src->base + idx * (half ? 2 : 4), half, c->kv_stride, len, hd,
                       c->scale, sd, m);
        for (int i = 0; i < nq; i++) mx[i] = m[i] > mx[i] ? m[i] : mx[i];
        done += len;
    }
}

/* chunk_values for nq queries that see the same positions. */
static void chunk_values_n(const attn_ctx *c, const kv_src *src, const float *const *p, int nq,
                           int64_t j0, int64_t n, float *const *out, float *tmp) {
    const lm_kernels *k = c->k;
    if (k->pv_sum_n == NULL || run_len(c, j0, n) < n) { /* (a ring's wrap: one by one) */
        for (int i = 0; i < nq; i++) chunk_values(c, src, p[i], j0, n, out[i], tmp);
        return;
    }
    const int64_t idx = row_index(c, src->kvh, j0);
    const int half = c->kv_type == LM_F16;
    k->pv_sum_n(p, nq, src->base + idx * (half ? 2 : 4), half, c->kv_stride, n, c->head_dim,
                out);
}

/* The first token after t (up to t1) that does not see positions lo .. hi of chunk c0. */
static int64_t same_keys_end(const attn_ctx *c, int64_t t, int64_t t1, int64_t c0, int64_t lo,
                             int64_t hi) {
    int64_t te = t + 1, l2, h2;
    for (; te < t1; te++) {
        token_keys(c, te, c0, &l2, &h2);
        if (l2 != lo || h2 != hi) break;
    }
    return te;
}

/* The partials of token t, chunk kc, for the first head of kv head kvh's group (the next
 * heads follow n_kc * (head_dim + 2) apart). */
static inline float *group_part(const attn_ctx *c, int64_t t, int kvh, int64_t kc) {
    const int64_t head = t * c->n_head + (int64_t)kvh * (c->n_head / c->n_kv_head);
    return c->part + (head * c->n_kc + kc) * (c->head_dim + 2);
}

static void attn_chunk_task(void *arg, int task, int n_tasks, int thread) {
    const attn_ctx *c = arg;
    const lm_kernels *k = c->k;
    const int hd = c->head_dim;
    const int group = c->n_head / c->n_kv_head;
    float *tmp = c->scratch + (size_t)thread * c->scratch_sz;
    float *sc = tmp + hd; /* (token of the item, head of the group) x chunk */
    const int64_t part_stride = c->n_kc * (hd + 2); /* next head of the group */
    const int64_t items = c->n_kv_head * c->n_kc * c->n_tg;
    const int64_t i0 = items * task / n_tasks, i1 = items * (task + 1) / n_tasks;
    for (int64_t it = i0; it < i1; it++) {
        /* chunk-major: a cache row holds every kv head of its position, so the heads of
         * one chunk run back to back */
        const int64_t kc = it / (c->n_kv_head * c->n_tg), tg = it % c->n_tg;
        const int kvh = (int)(it / c->n_tg % c->n_kv_head);
        const int64_t t0 = c->ntok * tg / c->n_tg, t1 = c->ntok * (tg + 1) / c->n_tg;
        const int64_t c0 = (c->kc0 + kc) * c->chunk;
        /* the positions any token of the item sees (window_lo grows with the position) */
        int64_t a, b, lo, hi;
        token_keys(c, t0, c0, &a, &hi);
        token_keys(c, t1 - 1, c0, &lo, &b);
        kv_src src = {c->kc, kvh};
        /* the queries of tokens that see the same keys of the chunk (all but the last chunk
         * of a pass's tokens) go together, so that each row is read once for several */
        for (int64_t t = t0, te; t < t1; t = te) {
            token_keys(c, t, c0, &lo, &hi);
            const int64_t n = hi - lo + 1;
            te = same_keys_end(c, t, t1, c0, lo, hi);
            const int64_t total = (te - t) * group;
            for (int64_t f0 = 0; f0 < total; f0 += SET_MAX) {
                const int nq = (int)(total - f0 < SET_MAX ? total - f0 : SET_MAX);
                const float *qs[SET_MAX];
                float *ss[SET_MAX], mx[SET_MAX];
                for (int i = 0; i < nq; i++) {
                    const int64_t u = t + (f0 + i) / group, g = (f0 + i) % group;
                    qs[i] = c->q + (u * c->n_head + (int64_t)kvh * group + g) * hd;
                    ss[i] = sc + ((u - t0) * group + g) * c->chunk;
                }
                if (n > 0) {
                    chunk_scores_n(c, &src, qs, nq, lo, n, ss, mx);
                }
                for (int i = 0; i < nq; i++) {
                    const int64_t u = t + (f0 + i) / group, g = (f0 + i) % group;
                    float *part = group_part(c, u, kvh, kc) + g * part_stride;
                    if (n <= 0) { /* this token sees none of the chunk */
                        part[hd] = -INFINITY;
                        part[hd + 1] = 0.0f;
                        continue;
                    }
                    float *sq = ss[i], m = mx[i];
                    if (c->bias != NULL)
                        m = add_distance_bias(c, u, kvh * group + (int)g, lo, n, sq);
                    if (c->softcap > 0.0f) {
                        m = -INFINITY;
                        for (int64_t j = 0; j < n; j++) {
                            sq[j] = c->softcap * tanhf(sq[j] / c->softcap);
                            m = sq[j] > m ? sq[j] : m;
                        }
                    }
                    part[hd] = m;
                    part[hd + 1] = k->exp_sum(sq, n, m);
                }
            }
        }
        if (a > b) {
            continue;
        }
        /* ... then the values the same way */
        src.base = c->vc;
        for (int64_t t = t0, te; t < t1; t = te) {
            token_keys(c, t, c0, &lo, &hi);
            te = same_keys_end(c, t, t1, c0, lo, hi);
            const int64_t total = hi >= lo ? (te - t) * group : 0;
            for (int64_t f0 = 0; f0 < total; f0 += SET_MAX) {
                const int nq = (int)(total - f0 < SET_MAX ? total - f0 : SET_MAX);
                const float *ps[SET_MAX];
                float *os[SET_MAX];
                for (int i = 0; i < nq; i++) {
                    const int64_t u = t + (f0 + i) / group, g = (f0 + i) % group;
                    ps[i] = sc + ((u - t0) * group + g) * c->chunk;
                    os[i] = group_part(c, u, kvh, kc) + g * part_stride;
                }
                chunk_values_n(c, &src, ps, nq, lo, hi - lo + 1, os, tmp);
            }
        }
    }
}

static void attn_merge_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const attn_ctx *c = arg;
    const lm_kernels *k = c->k;
    const int hd = c->head_dim;
    const int64_t items = c->ntok * c->n_head;
    const int64_t i0 = items * task / n_tasks, i1 = items * (task + 1) / n_tasks;
    for (int64_t it = i0; it < i1; it++) {
        const float *part = c->part + it * c->n_kc * (hd + 2);
        float *o = c->out + it * hd;
        float mx = -INFINITY;
        for (int64_t kc = 0; kc < c->n_kc; kc++) {
            const float m = part[kc * (hd + 2) + hd];
            mx = m > mx ? m : mx;
        }
        float sum = 0.0f;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int64_t kc = 0; kc < c->n_kc; kc++) {
            const float *pc = part + kc * (hd + 2);
            if (pc[hd + 1] > 0.0f) {
                const float w = expf(pc[hd] - mx);
                sum += w * pc[hd + 1];
                k->axpy_f32(o, w, pc, hd);
            }
        }
        k->scale_f32(o, 1.0f / sum, hd);
    }
}

/* ------------------------------------------------------------------ tiled path */
/* Key panels up to this head size are built from rows converted on the stack. */
#define ATTN_PACK_ROWS_HD 256

/* Row `key` of the kv head's keys or values (base) as floats into dst[0..hd), zero when the
 * key is not live. */
static void pack_row(const attn_ctx *c, const uint8_t *base, int64_t key, float *dst) {
    const int hd = c->head_dim;
    if (key < c->first || key >= c->n_ctx) {
        memset(dst, 0, (size_t)hd * sizeof(float));
        return;
    }
    const int64_t src = key_row(c, key) * c->kv_stride + (int64_t)c->h * hd;
    if (c->kv_type == LM_F16) {
        c->k->f16_to_f32((const uint16_t *)base + src, dst, hd);
    } else {
        memcpy(dst, (const float *)base + src, (size_t)hd * sizeof(float));
    }
}

static void attn_pack_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const attn_ctx *c = arg;
    const int mr = c->mr, hd = c->head_dim;
    const int64_t kv_stride = c->kv_stride;
    const int h = c->h;
    const int64_t i0 = c->n_kp * task / n_tasks, i1 = c->n_kp * (task + 1) / n_tasks;
    if (c->k->panel != NULL && hd <= ATTN_PACK_ROWS_HD && mr <= 32) {
        /* whole rows converted at once; the keys transposed by the ISA's panel kernel, the
         * values copied in chunks of mr */
        float rows[32 * ATTN_PACK_ROWS_HD];
        for (int64_t kp = i0; kp < i1; kp++) {
            const int64_t key0 = c->key0 + kp * mr;
            for (int r = 0; r < mr; r++) pack_row(c, c->kc, key0 + r, rows + (int64_t)r * hd);
            c->k->panel(rows, hd, c->kpack + kp * (int64_t)hd * mr);
            for (int r = 0; r < mr; r++) pack_row(c, c->vc, key0 + r, rows + (int64_t)r * hd);
            for (int ch = 0; ch < c->n_chunks; ch++) {
                float *vd = c->vpack + (int64_t)ch * c->n_kp * mr * mr + kp * mr * mr;
                const int w = hd - ch * mr < mr ? hd - ch * mr : mr;
                for (int r = 0; r < mr; r++) {
                    memcpy(vd + r * mr, rows + (int64_t)r * hd + ch * mr, (size_t)w * sizeof(float));
                    if (w < mr) memset(vd + r * mr + w, 0, (size_t)(mr - w) * sizeof(float));
                }
            }
        }
        return;
    }
    for (int64_t kp = i0; kp < i1; kp++) {
        float *kd = c->kpack + kp * (int64_t)hd * mr;
        for (int r = 0; r < mr; r++) {
            const int64_t key = c->key0 + kp * mr + r;
            const int live = key >= c->first && key < c->n_ctx;
            const int64_t src = key_row(c, key) * kv_stride + (int64_t)h * hd;
            for (int d = 0; d < hd; d++) {
                kd[(int64_t)d * mr + r] = live ? kv_at(c, c->kc, src + d) : 0.0f;
            }
        }
        for (int ch = 0; ch < c->n_chunks; ch++) {
            float *vd = c->vpack + (int64_t)ch * c->n_kp * mr * mr + kp * mr * mr;
            for (int r = 0; r < mr; r++) {
                const int64_t key = c->key0 + kp * mr + r;
                const int live = key >= c->first && key < c->n_ctx;
                const int64_t src = key_row(c, live ? key : 0) * kv_stride + (int64_t)h * hd +
                                    ch * mr;
                for (int d = 0; d < mr; d++) {
                    const int dd = ch * mr + d;
                    vd[r * mr + d] = live && dd < hd ? kv_at(c, c->vc, src + d) : 0.0f;
                }
            }
        }
    }
}

static void attn_tiled_task(void *arg, int task, int n_tasks, int thread) {
    const attn_ctx *c = arg;
    const lm_kernels *k = c->k;
    const int mr = c->mr, nr = c->nr, hd = c->head_dim;
    const int group = c->n_head / c->n_kv_head;
    float *qp = (float *)(c->per_thread + (size_t)thread * c->per_thread_sz);
    float *cbuf = qp + (size_t)hd * nr;
    float *sbuf = cbuf + (size_t)mr * nr;      /* nr x n_kp * mr */
    float *pt = sbuf + (size_t)nr * c->n_kp * mr; /* n_kp * mr x nr */
    const int64_t span_max = c->n_kp * mr;
    const int h = c->h;
    const int64_t i0 = c->n_qp * task / n_tasks, i1 = c->n_qp * (task + 1) / n_tasks;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t row0 = it * nr;
        const int nrows = (int)(c->n_rows - row0 < nr ? c->n_rows - row0 : nr);
        int64_t pos[64] = {0}, lo[64] = {0}; /* nr <= 64 */
        /* Q panel: qp[d * nr + j] for query row j = (token, head in group) */
        for (int j = 0; j < nr; j++) {
            if (j < nrows) {
                const int64_t t = (row0 + j) / group;
                const int hq = h * group + (int)((row0 + j) % group);
                const float *src = c->q + (t * c->n_head + hq) * hd;
                pos[j] = query_hi(c, t);
                lo[j] = query_lo(c, t);
                for (int d = 0; d < hd; d++) {
                    qp[(int64_t)d * nr + j] = src[d];
                }
            } else {
                pos[j] = pos[nrows - 1];
                lo[j] = lo[nrows - 1];
                for (int d = 0; d < hd; d++) {
                    qp[(int64_t)d * nr + j] = 0.0f;
                }
            }
        }
        /* rows are in token order: the first has the lowest bound, the last the highest */
        const int64_t kp0 = (lo[0] - c->key0) / mr, kp1 = (pos[nrows - 1] - c->key0) / mr;
        const int64_t kbase = c->key0 + kp0 * mr, span = (kp1 - kp0 + 1) * mr;
        for (int64_t kp = kp0; kp <= kp1; kp++) {
            k->gemm(c->kpack + kp * (int64_t)hd * mr, qp, hd, cbuf);
            for (int j = 0; j < nr; j++) {
                memcpy(sbuf + j * span_max + (kp - kp0) * mr, cbuf + j * mr,
                       (size_t)mr * sizeof(float));
            }
        }
        /* masked, scaled, capped softmax of each row; P^T into pt[key * nr + j] */
        for (int j = 0; j < nr; j++) {
            float *srow = sbuf + j * span_max;
            const int64_t a = lo[j] - kbase, b = pos[j] - kbase; /* valid [a, b] */
            float mx = -INFINITY;
            const int64_t jr = row0 + (j < nrows ? j : nrows - 1); /* padding: the last */
            const float *bq = c->bias == NULL ? NULL
                              : c->bias + ((jr / group) * c->n_head + h * group + jr % group) *
                                              c->bias_extent;
            if (bq == NULL && c->softcap <= 0.0f) { /* scaled only: one vector pass */
                mx = k->scale_max(srow + a, c->scale, b - a + 1);
            } else {
                for (int64_t i = a; i <= b; i++) {
                    float sv = srow[i] * c->scale;
                    const int64_t d = pos[j] - (kbase + i);
                    if (bq != NULL && d >= 0 && d < c->bias_extent) sv += bq[d];
                    if (c->softcap > 0.0f) {
                        sv = c->softcap * tanhf(sv / c->softcap);
                    }
                    srow[i] = sv;
                    mx = sv > mx ? sv : mx;
                }
            }
            const float inv = 1.0f / k->exp_sum(srow + a, b - a + 1, mx);
            if (k->pack_nr != NULL) { /* the row in place, transposed below with the others */
                memset(srow, 0, (size_t)a * sizeof(float));
                k->scale_f32(srow + a, inv, b - a + 1);
                memset(srow + b + 1, 0, (size_t)(span - b - 1) * sizeof(float));
                continue;
            }
            for (int64_t i = 0; i < span; i++) {
                pt[i * nr + j] = i >= a && i <= b ? srow[i] * inv : 0.0f;
            }
        }
        if (k->pack_nr != NULL) k->pack_nr(sbuf, span_max, nr, span, pt);
        /* O = P V, one head_dim chunk of mr at a time */
        for (int ch = 0; ch < c->n_chunks; ch++) {
            const float *vp = c->vpack + (int64_t)ch * c->n_kp * mr * mr;
            k->gemm(vp + kp0 * mr * mr, pt, span, cbuf);
            const int w = hd - ch * mr < mr ? hd - ch * mr : mr;
            for (int j = 0; j < nrows; j++) {
                const int64_t t = (row0 + j) / group;
                const int hq = h * group + (int)((row0 + j) % group);
                memcpy(c->out + (t * c->n_head + hq) * hd + ch * mr, cbuf + j * mr,
                       (size_t)w * sizeof(float));
            }
        }
    }
}

static int attn_tiled(lm_pool *acq, attn_ctx *c) {
    const int nth = lm_pool_size(acq);
    const int mr = c->k->mr, nr = c->k->nr;
    c->mr = mr;
    c->nr = nr;
    c->n_chunks = (c->head_dim + mr - 1) / mr;
    c->first = c->window > 0 && c->pos0 - c->window + 1 > 0 ? c->pos0 - c->window + 1 : 0;
    c->key0 = c->first / mr * mr;
    c->n_kp = (c->n_ctx - c->key0 + mr - 1) / mr;
    c->n_rows = c->ntok * (c->n_head / c->n_kv_head);
    c->n_qp = (c->n_rows + nr - 1) / nr;
    const size_t kbytes = (size_t)c->n_kp * c->head_dim * mr * sizeof(float);
    const size_t vbytes = (size_t)c->n_chunks * c->n_kp * mr * mr * sizeof(float);
    c->per_thread_sz = (((size_t)c->head_dim * nr + (size_t)mr * nr +
                         2 * (size_t)nr * c->n_kp * mr) * sizeof(float) + 63) & ~(size_t)63;
    const size_t total = kbytes + vbytes + c->per_thread_sz * (size_t)nth;
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, total) : lm_aligned_alloc(total);
    if (mem == NULL) {
        return LM_ENOMEM;
    }
    c->kpack = (float *)mem;
    c->vpack = (float *)(mem + kbytes);
    c->per_thread = mem + kbytes + vbytes;
    /* one kv head at a time: the packed keys and values of a 32k context are 34 MB per
     * head, not 34 MB times the number of heads */
    for (c->h = 0; c->h < c->n_kv_head; c->h++) {
        if (acq != NULL) {
            lm_pool_run_tasks(acq, attn_pack_task, c,
                              (int)(c->n_kp < 4 * nth ? c->n_kp : 4 * nth));
            lm_pool_run_tasks(acq, attn_tiled_task, c, (int)(c->n_qp < 0xFFFF ? c->n_qp : 0xFFFF));
        } else {
            attn_pack_task(c, 0, 1, 0);
            attn_tiled_task(c, 0, 1, 0);
        }
    }
    if (acq == NULL) {
        lm_aligned_free(mem);
    }
    return LM_OK;
}

/* Attention over K and V rows of kv_type with a row stride of kv_stride elements. bias
 * (ntok, n_head, bias_extent): added to the scaled scores by distance (NULL, 0: none); bidir:
 * every query sees every key of the chunk (and those of the window before its first
 * position). A distance bias is causal: the two are not taken together. */
static int attention_kv_rows(lm_pool *pool, const float *q, const void *k, const void *v,
                             int kv_type, int64_t kv_stride, int64_t ring, float *out,
                             int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                             float scale, int64_t window, float softcap, const float *bias,
                             int64_t bias_extent, int bidir) {
    if ((bias != NULL) != (bias_extent > 0) || (bias != NULL && bidir)) return LM_EINVAL;
    if (ntok < 0 || pos0 < 0 || n_head <= 0 || n_kv_head <= 0 || head_dim <= 0 || ring < 0 ||
        n_head % n_kv_head != 0 || window < 0 || !(softcap >= 0.0f) ||
        (kv_type != LM_F32 && kv_type != LM_F16) || kv_stride < (int64_t)n_kv_head * head_dim) {
        return LM_EINVAL;
    }
    if (ntok == 0) {
        return LM_OK;
    }
    if (q == NULL || k == NULL || v == NULL || out == NULL) {
        return LM_EINVAL;
    }
    attn_ctx c = {
        .k = lm_kernels_active(),
        .q = q,
        .kc = k,
        .vc = v,
        .kv_type = kv_type,
        .kv_stride = kv_stride,
        .ring = ring,
        .out = out,
        .ntok = ntok,
        .pos0 = pos0,
        .window = window,
        .n_ctx = pos0 + ntok,
        .bidir = bidir != 0,
        .n_head = n_head,
        .n_kv_head = n_kv_head,
        .head_dim = head_dim,
        .scale = scale,
        .softcap = softcap,
        .bias = bias,
        .bias_extent = bias_extent,
    };
    lm_pool *acq = lm_pool_acquire(pool) ? pool : NULL;
    if (ntok >= ATTN_TILED_MIN_TOKENS && c.k->nr <= 64) {
        const int rc = attn_tiled(acq, &c);
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return rc;
    }
    const int nth = lm_pool_size(acq);
    const int group = n_head / n_kv_head;
    /* a chunk's keys (or values) fill about half of a 48 KiB L1 */
    c.chunk = 24576 / ((int64_t)head_dim * 4);
    c.chunk = c.chunk < 16 ? 16 : c.chunk > 256 ? 256 : c.chunk;
    const int64_t pos_last = pos0 + ntok - 1;
    c.kc0 = window_lo(&c, pos0) / c.chunk;
    c.n_kc = pos_last / c.chunk - c.kc0 + 1;
    /* split the tokens when there are too few (kv head, chunk) pairs to share out */
    const int64_t pairs = n_kv_head * c.n_kc;
    c.n_tg = (4 * nth + pairs - 1) / pairs;
    c.n_tg = c.n_tg < 1 ? 1 : c.n_tg > ntok ? ntok : c.n_tg;
    c.tg_max = (ntok + c.n_tg - 1) / c.n_tg;
    c.scratch_sz =
        ((size_t)c.chunk * ((size_t)c.tg_max * group) + head_dim + 15) & ~(size_t)15;
    const size_t sbytes = (size_t)nth * c.scratch_sz * sizeof(float);
    const size_t pbytes = (size_t)(ntok * n_head * c.n_kc) * (head_dim + 2) * sizeof(float);
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, sbytes + pbytes)
                               : lm_aligned_alloc(sbytes + pbytes);
    if (mem == NULL) {
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return LM_ENOMEM;
    }
    c.scratch = (float *)mem;
    c.part = (float *)(mem + sbytes);
    const int64_t items = pairs * c.n_tg;
    if (acq != NULL) {
        lm_pool_run_tasks(acq, attn_chunk_task, &c, (int)(items < 0xFFFF ? items : 0xFFFF));
        const int64_t heads = ntok * n_head;
        lm_pool_run_tasks(acq, attn_merge_task, &c, (int)(heads < 4 * nth ? heads : 4 * nth));
        lm_pool_release(acq);
    } else {
        attn_chunk_task(&c, 0, 1, 0);
        attn_merge_task(&c, 0, 1, 0);
        lm_aligned_free(mem);
    }
    return LM_OK;
}

int lm_attention_typed(lm_pool *pool, const float *q, const void *k, const void *v, int kv_type,
                       int64_t kv_stride, int64_t ring, float *out, int64_t ntok, int64_t pos0,
                       int n_head, int n_kv_head, int head_dim, float scale, int64_t window,
                       float softcap) {
    return attention_kv_rows(pool, q, k, v, kv_type, kv_stride, ring, out, ntok, pos0, n_head,
                             n_kv_head, head_dim, scale, window, softcap, NULL, 0, 0);
}

int lm_attention_span(lm_pool *pool, const float *q, const void *k, const void *v, int kv_type,
                      int64_t kv_stride, int64_t ring, float *out, int64_t ntok, int64_t pos0,
                      int n_head, int n_kv_head, int head_dim, float scale, int64_t window,
                      float softcap, int bidir) {
    return attention_kv_rows(pool, q, k, v, kv_type, kv_stride, ring, out, ntok, pos0, n_head,
                             n_kv_head, head_dim, scale, window, softcap, NULL, 0, bidir);
}

int lm_attention_typed_bias(lm_pool *pool, const float *q, const void *k, const void *v,
                            int kv_type, int64_t kv_stride, int64_t ring, float *out,
                            int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                            float scale, int64_t window, float softcap, const float *bias,
                            int64_t bias_extent) {
    return attention_kv_rows(pool, q, k, v, kv_type, kv_stride, ring, out, ntok, pos0, n_head,
                             n_kv_head, head_dim, scale, window, softcap, bias, bias_extent, 0);
}

int lm_attention(lm_pool *pool, const float *q, const float *k, const float *v, float *out,
                 int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                 float scale, int64_t window, float softcap) {
    return lm_attention_typed(pool, q, k, v, LM_F32, (int64_t)n_kv_head * head_dim, 0, out, ntok,
                              pos0, n_head, n_kv_head, head_dim, scale, window, softcap);
}

#undef ATTN_TILED_MIN_TOKENS
