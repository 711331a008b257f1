/*
 * Causal grouped-query attention over an f32 or f16 KV cache, two-pass (stable) softmax.
 *
 * Few query tokens (decode): work items are (token, kv head, chunk of keys). An item scores
 * its chunk for every query head of the group while the chunk's keys sit in L1, then sums
 * its values the same way, leaving per-chunk (max, sum, output) partials that a second pass
 * merges (the split-softmax of flash decoding). Chunks keep both threads busy even with a
 * single kv head.
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
    int n_head, n_kv_head, head_dim;
    float scale, softcap;
    /* decode path */
    int64_t chunk;  /* keys per chunk */
    int64_t n_kc;   /* chunks per (token, kv head) */
    float *scores;  /* per thread: group x chunk */
    float *part;    /* (token, head, chunk) x (head_dim outputs, max, sum) */
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

/* Widest head a ring's wrapped value run sums into on the stack. */
#define LM_ATTN_HEAD_DIM_MAX 1024

/* Below this many query tokens the per-(token, head) path is used. */
#define ATTN_TILED_MIN_TOKENS 8

static inline int64_t window_lo(const attn_ctx *c, int64_t pos) {
    return c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
}

/* Element idx of a K or V cache as f32. */
static inline float kv_at(const attn_ctx *c, const uint8_t *base, int64_t idx) {
    return c->kv_type == LM_F16 ? lm_f16((const lm_half *)base + idx)
                                : ((const float *)base)[idx];
}

static inline const uint8_t *kv_row(const attn_ctx *c, const uint8_t *base, int64_t idx) {
    return base + idx * (c->kv_type == LM_F16 ? 2 : 4);
}

/* The cache row of key position pos. */
static inline int64_t key_row(const attn_ctx *c, int64_t pos) {
    return c->ring > 0 ? pos % c->ring : pos;
}

/* Scores of n keys from position j0 for one query (s[0 .. n)), the keys in at most two runs
 * of rows when a ring wraps; the maximum score. */
static float chunk_scores(const attn_ctx *c, const float *qv, int kvh, int64_t j0, int64_t n,
                          float *s) {
    const lm_kernels *k = c->k;
    float mx = -INFINITY;
    for (int64_t done = 0; done < n;) {
        const int64_t row = key_row(c, j0 + done);
        const int64_t len = c->ring > 0 && c->ring - row < n - done ? c->ring - row : n - done;
        const uint8_t *kb = kv_row(c, c->kc, row * c->kv_stride + (int64_t)kvh * c->head_dim);
        const float m =
            c->kv_type == LM_F16
                ? k->qk_scores_f16(qv, (const uint16_t *)kb, c->kv_stride, len, c->head_dim,
                                   c->scale, s + done)
                : k->qk_scores(qv, (const float *)kb, c->kv_stride, len, c->head_dim, c->scale,
                               s + done);
        mx = m > mx ? m : mx;
        done += len;
    }
    return mx;
}

/* out = sum_j p[j] v[j] over the n values from position j0 (at most two runs of rows). */
static void chunk_values(const attn_ctx *c, const float *p, int kvh, int64_t j0, int64_t n,
                         float *out) {
    const lm_kernels *k = c->k;
    const int hd = c->head_dim;
    float tmp[LM_ATTN_HEAD_DIM_MAX];
    for (int64_t done = 0; done < n;) {
        const int64_t row = key_row(c, j0 + done);
        const int64_t len = c->ring > 0 && c->ring - row < n - done ? c->ring - row : n - done;
        const uint8_t *vb = kv_row(c, c->vc, row * c->kv_stride + (int64_t)kvh * hd);
        float *o = done == 0 ? out : tmp;
        if (c->kv_type == LM_F16) {
            k->pv_sum_f16(p + done, (const uint16_t *)vb, c->kv_stride, len, hd, o);
        } else {
            k->pv_sum(p + done, (const float *)vb, c->kv_stride, len, hd, o);
        }
        if (done > 0) k->axpy_f32(out, 1.0f, tmp, hd);
        done += len;
    }
}

static void attn_chunk_task(void *arg, int task, int n_tasks, int thread) {
    const attn_ctx *c = arg;
    const lm_kernels *k = c->k;
    const int hd = c->head_dim;
    const int group = c->n_head / c->n_kv_head;
    float *sc = c->scores + (size_t)thread * (size_t)group * (size_t)c->chunk;
    const int64_t items = c->ntok * c->n_kv_head * c->n_kc;
    const int64_t i0 = items * task / n_tasks, i1 = items * (task + 1) / n_tasks;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / (c->n_kv_head * c->n_kc);
        const int kvh = (int)(it / c->n_kc % c->n_kv_head);
        const int64_t kc = it % c->n_kc;
        const int64_t pos = c->pos0 + t;
        const int64_t j0 = window_lo(c, pos) + kc * c->chunk;
        const int64_t n = pos - j0 + 1 < c->chunk ? pos - j0 + 1 : c->chunk;
        float *part0 = c->part + ((t * c->n_head + (int64_t)kvh * group) * c->n_kc + kc) * (hd + 2);
        const int64_t part_stride = c->n_kc * (hd + 2); /* next head of the group */
        if (n <= 0) { /* this token sees fewer chunks */
            for (int g = 0; g < group; g++) {
                part0[g * part_stride + hd] = -INFINITY;
                part0[g * part_stride + hd + 1] = 0.0f;
            }
            continue;
        }
        /* all heads of the group score the chunk first (its keys stay in L1) ... */
        for (int g = 0; g < group; g++) {
            const float *qv = c->q + (t * c->n_head + (int64_t)kvh * group + g) * hd;
            float *s = sc + (int64_t)g * c->chunk;
            float mx = chunk_scores(c, qv, kvh, j0, n, s);
            if (c->softcap > 0.0f) {
                mx = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    s[j] = c->softcap * tanhf(s[j] / c->softcap);
                    mx = s[j] > mx ? s[j] : mx;
                }
            }
            float *part = part0 + g * part_stride;
            part[hd] = mx;
            part[hd + 1] = k->exp_sum(s, n, mx);
        }
        /* ... then sum the values the same way */
        for (int g = 0; g < group; g++) {
            chunk_values(c, sc + (int64_t)g * c->chunk, kvh, j0, n, part0 + g * part_stride);
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
static void attn_pack_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const attn_ctx *c = arg;
    const int mr = c->mr, hd = c->head_dim;
    const int64_t kv_stride = c->kv_stride;
    const int h = c->h;
    const int64_t i0 = c->n_kp * task / n_tasks, i1 = c->n_kp * (task + 1) / n_tasks;
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
                pos[j] = c->pos0 + t;
                lo[j] = c->window > 0 && pos[j] - c->window + 1 > 0 ? pos[j] - c->window + 1 : 0;
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
            for (int64_t i = a; i <= b; i++) {
                float sv = srow[i] * c->scale;
                if (c->softcap > 0.0f) {
                    sv = c->softcap * tanhf(sv / c->softcap);
                }
                srow[i] = sv;
                mx = sv > mx ? sv : mx;
            }
            const float inv = 1.0f / k->exp_sum(srow + a, b - a + 1, mx);
            for (int64_t i = 0; i < span; i++) {
                pt[i * nr + j] = i >= a && i <= b ? srow[i] * inv : 0.0f;
            }
        }
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

/* Attention over K and V rows of kv_type with a row stride of kv_stride elements. */
int lm_attention_typed(lm_pool *pool, const float *q, const void *k, const void *v, int kv_type,
                       int64_t kv_stride, int64_t ring, float *out, int64_t ntok, int64_t pos0,
                       int n_head, int n_kv_head, int head_dim, float scale, int64_t window,
                       float softcap) {
    if (ntok < 0 || pos0 < 0 || n_head <= 0 || n_kv_head <= 0 || head_dim <= 0 || ring < 0 ||
        (ring > 0 && head_dim > LM_ATTN_HEAD_DIM_MAX) ||
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
        .n_head = n_head,
        .n_kv_head = n_kv_head,
        .head_dim = head_dim,
        .scale = scale,
        .softcap = softcap,
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
    c.n_kc = (pos_last - window_lo(&c, pos_last) + 1 + c.chunk - 1) / c.chunk;
    const size_t sbytes = ((size_t)nth * group * c.chunk * sizeof(float) + 63) & ~(size_t)63;
    const size_t pbytes = (size_t)(ntok * n_head * c.n_kc) * (head_dim + 2) * sizeof(float);
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, sbytes + pbytes)
                               : lm_aligned_alloc(sbytes + pbytes);
    if (mem == NULL) {
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return LM_ENOMEM;
    }
    c.scores = (float *)mem;
    c.part = (float *)(mem + sbytes);
    const int64_t items = ntok * n_kv_head * c.n_kc;
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

int lm_attention(lm_pool *pool, const float *q, const float *k, const float *v, float *out,
                 int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                 float scale, int64_t window, float softcap) {
    return lm_attention_typed(pool, q, k, v, LM_F32, (int64_t)n_kv_head * head_dim, 0, out, ntok,
                              pos0, n_head, n_kv_head, head_dim, scale, window, softcap);
}

#undef ATTN_TILED_MIN_TOKENS
#undef LM_ATTN_HEAD_DIM_MAX
