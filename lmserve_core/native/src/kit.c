/*
 * The family kit: what every forward pass shares, compiled once in the core.
 *
 *   threaded row ops   rmsnorm (per token or per head), RoPE, gated activations, products
 *                      of several matrices in one pool dispatch
 *   model base         pool, residual buffers, layer-helper scratch, the chunk driver
 *   layer helpers      embedding, self-attention over a KV cache, gated feed-forward,
 *                      mixture of experts, output head
 *   decoders           the pre-norm block and the chunk loop over a table of blocks
 *
 * A family's own C is its weight table mapped onto blocks (and, for a step the blocks do not
 * have, the decoder's hooks); anything else strings the layer helpers together.
 */
#include <math.h>
#include <stdlib.h>

#include "lm_internal.h"

/* Below this many elements a row op runs on the calling thread: waking the pool costs
 * more than the work. */
#define ROW_OP_MIN_ELEMS 16384
#define ROPE_PAIRS_MAX 512 /* cos / sin of one position computed at a time */

static int64_t kit_min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void split_range(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi) {
    *lo = n * ith / nth;
    *hi = n * (ith + 1) / nth;
}

/* ============================================================================ row ops */

typedef struct {
    float *out;
    const float *x, *w;
    int64_t rows, n;
    float eps;
} rmsnorm_job;

static void rmsnorm_run(void *ctx, int ith, int nth) {
    const rmsnorm_job *j = ctx;
    int64_t lo, hi;
    split_range(j->rows, ith, nth, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        lm_rmsnorm(j->out + r * j->n, j->x + r * j->n, j->w, j->n, j->eps);
    }
}

int lm_rmsnorm_rows(lm_pool *pool, float *out, const float *x, const float *w, int64_t rows,
                    int64_t n, float eps) {
    if (rows < 0 || n <= 0 || !(eps >= 0.0f) || (rows > 0 && (out == NULL || x == NULL)))
        return LM_EINVAL;
    rmsnorm_job j = {out, x, w, rows, n, eps};
    lm_pool_run(rows > 1 && rows * n >= ROW_OP_MIN_ELEMS ? pool : NULL, rmsnorm_run, &j);
    return LM_OK;
}

typedef struct {
    float *x;
    int64_t ntok, pos0;
    int n_heads, head_dim;
    const lm_rotary *r;
} rope_job;

static void rope_token(const rope_job *j, int64_t t) {
    const lm_rotary *r = j->r;
    const int half = r->n_rot / 2;
    float cs[ROPE_PAIRS_MAX], sn[ROPE_PAIRS_MAX];
    /* the angle is formed in float like the float32 references: pos * inv_freq */
    const float p = (float)(j->pos0 + t);
    float *xt = j->x + t * (int64_t)j->n_heads * j->head_dim;
    for (int i0 = 0; i0 < half; i0 += ROPE_PAIRS_MAX) {
        const int cnt = half - i0 < ROPE_PAIRS_MAX ? half - i0 : ROPE_PAIRS_MAX;
        for (int i = 0; i < cnt; i++) {
            const float theta = p * r->inv_freq[i0 + i];
            cs[i] = cosf(theta) * r->mscale;
            sn[i] = sinf(theta) * r->mscale;
        }
        for (int h = 0; h < j->n_heads; h++) {
            float *v = xt + (int64_t)h * j->head_dim;
            for (int i = 0; i < cnt; i++) {
                const int a = r->mode == LM_ROPE_NEOX ? i0 + i : 2 * (i0 + i);
                const int b = r->mode == LM_ROPE_NEOX ? i0 + i + half : a + 1;
                const float x0 = v[a], x1 = v[b];
                v[a] = x0 * cs[i] - x1 * sn[i];
                v[b] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
}

static void rope_run(void *ctx, int ith, int nth) {
    const rope_job *j = ctx;
    for (int64_t t = ith; t < j->ntok; t += nth) rope_token(j, t);
}

int lm_rope_rows(lm_pool *pool, float *x, int64_t ntok, int n_heads, int head_dim, int64_t pos0,
                 const lm_rotary *rope) {
    if (rope == NULL || ntok < 0 || pos0 < 0 || n_heads <= 0 || head_dim <= 0 ||
        rope->n_rot < 0 || rope->n_rot > head_dim || rope->n_rot % 2 != 0 ||
        (rope->mode != LM_ROPE_NORMAL && rope->mode != LM_ROPE_NEOX) ||
        (rope->n_rot > 0 && rope->inv_freq == NULL) || (ntok > 0 && x == NULL))
        return LM_EINVAL;
    if (rope->n_rot == 0 || ntok == 0) return LM_OK;
    rope_job j = {x, ntok, pos0, n_heads, head_dim, rope};
    lm_pool_run(ntok > 1 ? pool : NULL, rope_run, &j);
    return LM_OK;
}

typedef struct {
    float *out;
    const float *gate, *up;
    int64_t n;
    int act;
} glu_job;

/* act(x) of one value: relu2 everywhere, SiLU and GELU (tanh) of an ungated feed-forward
 * (the gated ones run the vector kernels) */
static float act_one(float x, int act) {
    if (act == LM_ACT_RELU2) return x > 0.0f ? x * x : 0.0f;
    if (act == LM_ACT_GELU_TANH)
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return x / (1.0f + expf(-x));
}

static void glu_run(void *ctx, int ith, int nth) {
    const glu_job *j = ctx;
    int64_t lo, hi;
    split_range(j->n, ith, nth, &lo, &hi);
    lo &= ~(int64_t)15; /* vector-aligned slices: same rounding whatever the split */
    hi = ith == nth - 1 ? j->n : hi & ~(int64_t)15;
    if (lo >= hi) return;
    if (j->up == NULL || j->act == LM_ACT_RELU2) {
        for (int64_t i = lo; i < hi; i++)
            j->out[i] = act_one(j->gate[i], j->act) * (j->up != NULL ? j->up[i] : 1.0f);
    } else if (j->act == LM_ACT_GELU_TANH) {
        lm_gelu_mul(j->out + lo, j->gate + lo, j->up + lo, hi - lo);
    } else {
        lm_silu_mul(j->out + lo, j->gate + lo, j->up + lo, hi - lo);
    }
}

int lm_glu_rows(lm_pool *pool, float *out, const float *gate, const float *up, int64_t n,
                int act) {
    if (n < 0 || (act != LM_ACT_SILU && act != LM_ACT_GELU_TANH && act != LM_ACT_RELU2) ||
        (n > 0 && (out == NULL || gate == NULL)))
        return LM_EINVAL;
    glu_job j = {out, gate, up, n, act};
    lm_pool_run(n >= ROW_OP_MIN_ELEMS ? pool : NULL, glu_run, &j);
    return LM_OK;
}

int lm_add_rows(float *y, const float *x, int64_t n) {
    if (n < 0 || (n > 0 && (y == NULL || x == NULL))) return LM_EINVAL;
    lm_add(y, y, x, n);
    return LM_OK;
}

int lm_scale_rows(float *x, float s, int64_t n) {
    if (n < 0 || (n > 0 && x == NULL)) return LM_EINVAL;
    lm_scale(x, s, n);
    return LM_OK;
}

int lm_softcap_rows(float *x, int64_t n, float cap) {
    if (n < 0 || !(cap > 0.0f) || (n > 0 && x == NULL)) return LM_EINVAL;
    for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
    return LM_OK;
}

/* ============================================================================ product groups */

typedef struct {
    const lm_kernels *k;
    const lm_mm *mms;
    const lm_xq *const *xqs; /* per product: its x quantized, or NULL (f32 products) */
    int n;
    int64_t ntok;
    int64_t total; /* rows of all products */
} mms_ctx;

/* Task t covers a slice of the concatenated rows of every product. */
static void mms_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const mms_ctx *c = arg;
    int64_t lo, hi;
    split_range(c->total, task, n_tasks, &lo, &hi);
    int64_t base = 0;
    for (int i = 0; i < c->n && lo < hi; i++) {
        const lm_mm *m = &c->mms[i];
        const int64_t end = base + m->rows;
        if (lo < end) {
            const int64_t r1 = hi < end ? hi : end;
            lm_matmul_dot_rows(c->k, m->w.type, m->w.data, lo - base, r1 - base, m->rows,
                               m->cols, m->x, c->xqs[i], c->ntok, m->y);
            lo = r1;
        }
        base = end;
    }
}

int lm_matmuls(lm_pool *pool, const lm_mm *mms, int n, int64_t ntok) {
    if (n < 0 || ntok < 0 || (n > 0 && mms == NULL)) return LM_EINVAL;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        const lm_mm *m = &mms[i];
        if (lm_type_block_elems(m->w.type) <= 0) return LM_ETYPE;
        if (m->rows < 0 || lm_row_bytes(m->w.type, m->cols) <= 0 ||
            (m->rows > 0 && (m->w.data == NULL || m->x == NULL || m->y == NULL)) ||
            (lm_r16_base(m->w.type) >= 0 && m->rows % R16 != 0))
            return LM_EINVAL;
        total += m->rows;
    }
    if (total == 0 || ntok == 0) return LM_OK;
    const lm_kernels *k = lm_kernels_active();
    /* the precisions are read once, so the choices, the sizing and the quantizing agree */
    const int dec = lm_decode_precision_active(), pre = lm_prefill_precision_active();
#define USES_INTS(m) ((m).rows > 0 && lm_int_products_at(k, (m).w.type, ntok, dec, pre))
    int ints = 0; /* products on int16 activations */
    for (int i = 0; i < n; i++) ints += USES_INTS(mms[i]);
    if (ntok >= LM_GEMM_MIN_TOKENS && ints > 0 && ints < n) { /* each its own path */
        for (int i = 0; i < n; i++) {
            const lm_mm *m = &mms[i];
            LM_TRY(lm_matmul(pool, m->w.type, m->w.data, m->rows, m->cols, m->x, ntok, m->y));
        }
        return LM_OK;
    }
    if (ntok >= LM_GEMM_MIN_TOKENS && ints == 0) {
        int shared = n <= 4;
        for (int i = 1; i < n; i++) shared &= mms[i].x == mms[0].x && mms[i].cols == mms[0].cols;
        for (int i = 0; i < n; i++) shared &= mms[i].rows > 0 && mms[i].cols > 0;
        if (shared) return lm_matmul_group(pool, mms, n, ntok);
        for (int i = 0; i < n; i++) {
            const lm_mm *m = &mms[i];
            LM_TRY(lm_matmul(pool, m->w.type, m->w.data, m->rows, m->cols, m->x, ntok,
                                      m->y));
        }
        return LM_OK;
    }
    /* the integer path quantizes each distinct input once (q, k and v share theirs) */
    size_t bytes = ((size_t)n * (sizeof(lm_xq) + sizeof(lm_xq *)) + 63) & ~(size_t)63;
    for (int i = 0; i < n; i++) {
        if (USES_INTS(mms[i])) bytes += lm_xq_bytes(ntok, mms[i].cols);
    }
    lm_pool *acq = lm_pool_acquire(pool) ? pool : NULL;
    void *own = NULL;
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, bytes) : (own = lm_aligned_alloc(bytes));
    if (mem == NULL) {
        if (acq != NULL) lm_pool_release(acq);
        return LM_ENOMEM;
    }
    lm_xq *xq = (lm_xq *)mem;
    const lm_xq **xqs = (const lm_xq **)(xq + n);
    uint8_t *at = mem + (((size_t)n * (sizeof(lm_xq) + sizeof(lm_xq *)) + 63) & ~(size_t)63);
    for (int i = 0; i < n; i++) {
        xqs[i] = NULL;
        if (!USES_INTS(mms[i])) continue;
        for (int j = 0; j < i && xqs[i] == NULL; j++) {
            if (xqs[j] != NULL && mms[j].x == mms[i].x && mms[j].cols == mms[i].cols) xqs[i] = xqs[j];
        }
        if (xqs[i] == NULL) {
            lm_quantize_acts_on(acq, k, mms[i].x, ntok, mms[i].cols, at, &xq[i]);
            at += lm_xq_bytes(ntok, mms[i].cols);
            xqs[i] = &xq[i];
        }
    }
    mms_ctx c = {k, mms, xqs, n, ntok, total};
    if (acq == NULL) {
        mms_task(&c, 0, 1, 0);
        lm_aligned_free(own);
        return LM_OK;
    }
    /* a few slices per thread balance the load when a thread runs late */
    lm_pool_run_tasks(acq, mms_task, &c, (int)kit_min64((total + 15) / 16, 8 * lm_pool_size(acq)));
    lm_pool_release(acq);
    return LM_OK;
#undef USES_INTS
}

/* ============================================================================ model base */

/* ---------------------------------------------------------------------------- the arena */

/* Each allocation is one aligned block: a 64-byte header holding the link to the block
 * before, then the caller's bytes (so they keep the 64-byte alignment). */
#define ARENA_HEADER 64

void *lm_base_alloc(lm_base *b, size_t bytes) {
    if (b == NULL || bytes > SIZE_MAX - ARENA_HEADER) return NULL;
    uint8_t *block = lm_aligned_alloc(ARENA_HEADER + bytes);
    if (block == NULL) return NULL;
    memset(block, 0, ARENA_HEADER + bytes);
    memcpy(block, &b->arena.last, sizeof(void *));
    b->arena.last = block;
    b->arena.bytes += bytes;
    return block + ARENA_HEADER;
}

/* Frees every block of the arena, the latest first; the arena may lie in one of them. */
static void arena_free(lm_arena *a) {
    void *block = a->last;
    a->last = NULL;
    a->bytes = 0;
    while (block != NULL) {
        void *before;
        memcpy(&before, block, sizeof(void *));
        lm_aligned_free(block);
        block = before;
    }
}

int lm_model_new(size_t bytes, lm_base **out) {
    if (out == NULL || bytes < sizeof(lm_base)) return LM_EINVAL;
    *out = NULL;
    lm_base tmp;
    memset(&tmp, 0, sizeof tmp);
    lm_base *b = lm_base_alloc(&tmp, bytes);
    if (b == NULL) return LM_ENOMEM;
    b->arena = tmp.arena; /* the struct is the arena's first block */
    *out = b;
    return LM_OK;
}

/* The kit's buffers of the base (not its arena). */
static void base_release(lm_base *b) {
    lm_pool_free(b->pool);
    lm_aligned_free(b->x);
    lm_aligned_free(b->xb);
    lm_aligned_free(b->xs);
    lm_aligned_free(b->tmp);
    b->pool = NULL;
    b->x = b->xb = b->xs = NULL;
    b->tmp = NULL;
    b->tmp_bytes = 0;
}

int lm_base_init(lm_base *b, int n_threads, int64_t n_batch, int64_t n_vocab, int64_t n_embd,
                 int n_layer, const lm_cache_layer *layers, lm_chunk_fn forward_chunk,
                 void (*free_model)(void *)) {
    if (b == NULL) return LM_EINVAL;
    const lm_arena arena = b->arena;
    memset(b, 0, sizeof *b);
    b->arena = arena;
    if (n_batch <= 0 || n_batch > (1 << 20) || n_vocab <= 0 || n_embd <= 0 ||
        n_embd > (1 << 20) || n_layer <= 0 || forward_chunk == NULL ||
        lm_cache_bytes(n_layer, layers, 1, LM_F32) <= 0)
        return LM_EINVAL;
    b->n_batch = n_batch;
    b->n_vocab = n_vocab;
    b->n_embd = n_embd;
    b->n_layer = n_layer;
    b->cache_layers = layers;
    b->forward_chunk = forward_chunk;
    b->free_model = free_model;
    const size_t bytes = sizeof(float) * (size_t)n_batch * (size_t)n_embd;
    b->x = lm_aligned_alloc(bytes);
    b->xb = lm_aligned_alloc(bytes);
    b->pool = lm_pool_new(n_threads);
    if (b->x == NULL || b->xb == NULL || b->pool == NULL) {
        base_release(b);
        return LM_ENOMEM;
    }
    return LM_OK;
}

void lm_base_free(lm_base *b) {
    if (b == NULL) return;
    base_release(b);
    arena_free(&b->arena); /* last: b itself may lie in it */
}

/* The scratch grown to at least `bytes`, its first `keep` bytes kept (those it has: a keep
 * rounded up past its end has nothing there to keep). */
static void *tmp_grow(lm_base *b, size_t bytes, size_t keep) {
    if (bytes > b->tmp_bytes) {
        void *p = lm_aligned_alloc(bytes);
        if (p == NULL) return NULL;
        if (keep > b->tmp_bytes) keep = b->tmp_bytes;
        if (keep > 0) memcpy(p, b->tmp, keep);
        lm_aligned_free(b->tmp);
        b->tmp = p;
        b->tmp_bytes = bytes;
    }
    return b->tmp;
}

void *lm_base_tmp(lm_base *b, size_t bytes) { return b == NULL ? NULL : tmp_grow(b, bytes, 0); }

int lm_base_threads(const lm_base *b) { return b == NULL ? 0 : lm_pool_size(b->pool); }

void lm_model_free(lm_base *b) {
    if (b == NULL) return;
    if (b->free_model != NULL) {
        b->free_model(b);
    } else {
        lm_base_free(b);
    }
}

/* Carve 64-byte aligned float arrays of the given lengths out of the base's scratch, after
 * its first `keep` bytes (a multiple of 64, kept). */
static int carve_after(lm_base *b, size_t keep, int n, float **out[], const int64_t *lens) {
    size_t total = keep;
    for (int i = 0; i < n; i++) total += ((size_t)lens[i] * sizeof(float) + 63) & ~(size_t)63;
    uint8_t *mem = tmp_grow(b, total, keep);
    if (mem == NULL) return LM_ENOMEM;
    mem += keep;
    for (int i = 0; i < n; i++) {
        *out[i] = (float *)mem;
        mem += ((size_t)lens[i] * sizeof(float) + 63) & ~(size_t)63;
    }
    return LM_OK;
}

static int carve(lm_base *b, int n, float **out[], const int64_t *lens) {
    return carve_after(b, 0, n, out, lens);
}

/* ============================================================================ layer helpers */

int lm_embed(lm_base *b, lm_matrix table, const int32_t *tokens, int64_t ntok) {
    if (b == NULL || ntok < 0 || ntok > b->n_batch) return LM_EINVAL;
    return lm_get_rows(table.type, table.data, b->n_vocab, b->n_embd, tokens, ntok, b->x);
}

static void add_bias(float *y, const float *bias, int64_t ntok, int64_t n) {
    if (bias == NULL) return;
    for (int64_t t = 0; t < ntok; t++) lm_add(y + t * n, y + t * n, bias, n);
}

int lm_attend(lm_base *b, const lm_attn *a, int layer, int src, float *q, float *k,
              const float *v, int64_t r0, int64_t n, float *att) {
    if (b == NULL || a == NULL || q == NULL || att == NULL || (k != NULL && v == NULL) ||
        layer < 0 || layer >= b->n_layer || src < 0 || src > layer || r0 < 0 || n < 0 ||
        r0 + n > b->n_batch || b->seqs == NULL)
        return LM_EINVAL;
    const lm_cache_layer *g = &b->cache_layers[src];
    const lm_cache_layer *w = &b->cache_layers[layer];
    if (a->n_head <= 0 || a->n_kv_head <= 0 || a->n_head % a->n_kv_head != 0 ||
        a->n_kv_head != g->n_kv_head || a->head_dim != g->head_dim_k ||
        a->head_dim != g->head_dim_v ||
        (k != NULL && (a->n_kv_head != w->n_kv_head || a->head_dim != w->head_dim_k ||
                       a->head_dim != w->head_dim_v)))
        return LM_EMISMATCH;
    const int64_t QD = (int64_t)a->n_head * a->head_dim;
    const int64_t KVD = (int64_t)a->n_kv_head * a->head_dim;
    lm_pool *pool = b->pool;
    int64_t row0 = 0;
    for (int s = 0; s < b->n_seqs && row0 < r0 + n; s++) {
        const lm_seq *sq = &b->seqs[s];
        const int64_t lo = row0 > r0 ? row0 : r0;
        const int64_t hi = kit_min64(row0 + sq->ntok, r0 + n);
        row0 += sq->ntok;
        if (lo >= hi) continue;
        const int64_t m = hi - lo, off = lo - r0;
        const int64_t pos = sq->pos + (lo - (row0 - sq->ntok));
        float *qs = q + off * QD;
        if (a->rope != NULL) {
            LM_TRY(lm_rope_rows(pool, qs, m, a->n_head, a->head_dim, pos, a->rope));
            if (k != NULL)
                LM_TRY(lm_rope_rows(pool, k + off * KVD, m, a->n_kv_head, a->head_dim, pos,
                                    a->rope));
        }
        if (k != NULL)
            LM_TRY(lm_cache_write(sq->cache, layer, pos, m, k + off * KVD, v + off * KVD));
        LM_TRY(lm_attention_cached_span(pool, qs, sq->cache, src, att + off * QD, m, pos,
                                        a->n_head, a->scale, a->window, a->softcap,
                                        sq->bidirectional));
    }
    return row0 >= r0 + n ? LM_OK : LM_EINVAL;
}

/* v (n, n_kv_head * head_dim) += each kv head's gate times its part of the rows `extra`
 * (lm_attn.v_extra), the gates read from x (n, D), the block's normed input. */
static void value_residual(const lm_attn *a, const float *x, const float *extra, int64_t n,
                           int64_t D, float *v) {
    const int64_t HD = a->head_dim, KVD = (int64_t)a->n_kv_head * HD;
    for (int64_t t = 0; t < n; t++) {
        const float *xt = x + t * D, *et = extra + t * a->v_extra_stride;
        for (int h = 0; h < a->n_kv_head; h++) {
            float g = 1.0f;
            if (a->v_gate != NULL) {
                const float *w = a->v_gate + (int64_t)h * a->v_gate_cols;
                float dot = 0.0f;
                for (int c = 0; c < a->v_gate_cols; c++) dot += w[c] * xt[c];
                g = a->v_gate_scale / (1.0f + expf(-dot));
            }
            lm_kernels_active()->axpy_f32(v + t * KVD + h * HD, g, et + h * HD, HD);
        }
    }
}

/* y (n, n_embd) = self-attention of normed x (n, n_embd), rows [r0, r0 + n) of the chunk. */
static int attention_rows(lm_base *b, const lm_attn *a, int layer, const float *x, int64_t r0,
                          int64_t n, float *y) {
    if (b == NULL || a == NULL || x == NULL || y == NULL || layer < 0 || layer >= b->n_layer ||
        r0 < 0 || n < 0 || r0 + n > b->n_batch || a->kv_shared < 0 || a->kv_shared > layer)
        return LM_EINVAL;
    const int src = layer - a->kv_shared, own = a->kv_shared == 0;
    const lm_cache_layer *g = &b->cache_layers[src];
    if (a->n_head <= 0 || a->n_kv_head != g->n_kv_head || a->head_dim != g->head_dim_k ||
        a->head_dim != g->head_dim_v || a->n_head % a->n_kv_head != 0)
        return LM_EMISMATCH;
    if (n == 0) return LM_OK;
    const int64_t D = b->n_embd, QD = (int64_t)a->n_head * a->head_dim;
    const int64_t KVD = (int64_t)a->n_kv_head * a->head_dim;
    float *q, *k, *v, *att, *qg;
    float **bufs[] = {&q, &k, &v, &att, &qg};
    const int64_t lens[] = {n * QD, own ? n * KVD : 0, own ? n * KVD : 0, n * QD,
                            a->gated ? 2 * n * QD : 0};
    LM_TRY(carve(b, 5, bufs, lens));
    lm_pool *pool = b->pool;

    lm_mm mms[3];
    int n_mm = 0;
    mms[n_mm++] = (lm_mm){a->wq, a->gated ? 2 * QD : QD, D, x, a->gated ? qg : q};
    if (own) {
        mms[n_mm++] = (lm_mm){a->wk, KVD, D, x, k};
        if (a->wv.data != NULL) mms[n_mm++] = (lm_mm){a->wv, KVD, D, x, v};
    }
    LM_TRY(lm_matmuls(pool, mms, n_mm, n));
    if (a->gated) {
        /* each head's query rows then its gate rows: queries into q, the gates packed at the
         * front of qg (each moves to a lower or equal address) */
        const size_t hb = sizeof(float) * (size_t)a->head_dim;
        for (int64_t t = 0; t < n; t++)
            for (int h = 0; h < a->n_head; h++) {
                const float *from = qg + t * 2 * QD + (int64_t)2 * h * a->head_dim;
                memcpy(q + t * QD + (int64_t)h * a->head_dim, from, hb);
                memmove(qg + t * QD + (int64_t)h * a->head_dim, from + a->head_dim, hb);
            }
    }
    add_bias(q, a->bq, n, QD);
    if (own) {
        add_bias(k, a->bk, n, KVD);
        if (a->wv.data == NULL) memcpy(v, k, sizeof(float) * (size_t)(n * KVD));
        add_bias(v, a->bv, n, KVD);
        if (a->v_extra != NULL) value_residual(a, x, a->v_extra + r0 * a->v_extra_stride, n, D, v);
    }
    if (a->q_norm != NULL)
        LM_TRY(lm_rmsnorm_rows(pool, q, q, a->q_norm, n * a->n_head, a->head_dim, a->norm_eps));
    if (own && a->k_norm != NULL)
        LM_TRY(lm_rmsnorm_rows(pool, k, k, a->k_norm, n * a->n_kv_head, a->head_dim,
                               a->norm_eps));
    if (own && a->v_norm)
        LM_TRY(lm_rmsnorm_rows(pool, v, v, NULL, n * a->n_kv_head, a->head_dim, a->norm_eps));
    LM_TRY(lm_attend(b, a, layer, src, q, own ? k : NULL, own ? v : NULL, r0, n, att));
    if (a->gated)
        for (int64_t i = 0; i < n * QD; i++) att[i] *= 1.0f / (1.0f + expf(-qg[i]));
    return lm_matmul(pool, a->wo.type, a->wo.data, D, QD, att, n, y);
}

int lm_self_attention(lm_base *b, const lm_attn *a, int layer, const float *x, int64_t ntok,
                      float *y) {
    return attention_rows(b, a, layer, x, 0, ntok, y);
}

int lm_glu_ffn(lm_base *b, const lm_ffn *f, const float *x, int64_t ntok, float *y) {
    if (b == NULL || f == NULL || x == NULL || y == NULL || ntok < 0 || ntok > b->n_batch ||
        f->n_ff <= 0)
        return LM_EINVAL;
    if (ntok == 0) return LM_OK;
    const int64_t D = b->n_embd, FF = f->n_ff;
    const int gated = f->gate.data != NULL;
    float *hb, *hb2;
    float **bufs[] = {&hb, &hb2};
    const int64_t lens[] = {ntok * FF, gated ? ntok * FF : 0};
    LM_TRY(carve(b, 2, bufs, lens));
    if (gated) {
        const lm_mm gu[2] = {{f->gate, FF, D, x, hb}, {f->up, FF, D, x, hb2}};
        LM_TRY(lm_matmuls(b->pool, gu, 2, ntok));
    } else {
        const lm_mm up = {f->up, FF, D, x, hb};
        LM_TRY(lm_matmuls(b->pool, &up, 1, ntok));
    }
    LM_TRY(lm_glu_rows(b->pool, hb, hb, gated ? hb2 : NULL, ntok * FF, f->act));
    return lm_matmul(b->pool, f->down.type, f->down.data, D, FF, hb, ntok, y);
}

/* ---------------------------------------------------------------------------- experts */

/* Chosen experts and their weights for one token's router logits (overwritten). */
int lm_moe_route(const lm_moe *m, float *logits, int32_t *ids, float *w) {
    if (m == NULL || logits == NULL || ids == NULL || w == NULL || m->n_used <= 0 ||
        m->n_used > m->n_expert)
        return LM_EINVAL;
    const int E = m->n_expert, K = m->n_used;
    if (m->gating == LM_GATING_SIGMOID) {
        for (int e = 0; e < E; e++) logits[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else {
        lm_softmax(logits, E);
    }
    /* top-k by selection: E is at most a few hundred; ties keep the lower index */
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[k] = best;
        w[k] = logits[best];
    }
    if (m->norm_weights) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum += w[k];
        for (int k = 0; k < K; k++) w[k] /= sum;
    }
    if (m->weights_scale != 1.0f) {
        for (int k = 0; k < K; k++) w[k] *= m->weights_scale;
    }
    if (m->expert_scale != NULL) {
        for (int k = 0; k < K; k++) w[k] *= m->expert_scale[ids[k]];
    }
    return LM_OK;
}

lm_matrix lm_matrix_rows(lm_matrix m, int64_t row0, int64_t cols) {
    const lm_matrix none = {NULL, m.type};
    const int64_t rb = lm_row_bytes(m.type, cols);
    if (m.data == NULL || row0 < 0 || rb < 0 || (lm_r16_base(m.type) >= 0 && row0 % R16 != 0))
        return none;
    const lm_matrix out = {(const uint8_t *)m.data + (size_t)row0 * (size_t)rb, m.type};
    return out;
}

#define rows_from lm_matrix_rows

/* The gate (half 0) or up (half 1) matrix (n_ff, n_embd) of expert e. */
static lm_matrix expert_in(const lm_moe *m, int e, int half, int64_t D) {
    const int64_t FF = m->n_ff;
    if (m->gate_up_exps.data != NULL)
        return rows_from(m->gate_up_exps, (int64_t)e * 2 * FF + half * FF, D);
    return rows_from(half ? m->up_exps : m->gate_exps, (int64_t)e * FF, D);
}

/* Bytes from the start of the base's scratch to the end of p[0, bytes), 0 when p is not in
 * the scratch. */
static size_t tmp_reach(const lm_base *b, const void *p, size_t bytes) {
    const uintptr_t lo = (uintptr_t)b->tmp, at = (uintptr_t)p;
    if (b->tmp == NULL || p == NULL || at < lo || at >= lo + b->tmp_bytes) return 0;
    return (size_t)(at - lo) + bytes;
}

/* p, when it pointed into the first `keep` bytes of a scratch at `old` since moved to `now`,
 * at its place there. */
static void *tmp_follow(const void *p, uintptr_t old, size_t keep, uint8_t *now) {
    const uintptr_t at = (uintptr_t)p;
    if (p == NULL || at < old || at >= old + keep) return (void *)p;
    return now + (at - old);
}

/* Most experts one dispatch per stage takes at decode. */
#define MOE_BATCHED 64

int lm_moe_experts(lm_base *b, const lm_moe *m, const float *x, int64_t ntok, const int32_t *ids,
                   const float *w, float *y) {
    if (b == NULL || m == NULL || x == NULL || ids == NULL || w == NULL || y == NULL ||
        ntok < 0 || ntok > b->n_batch || m->n_expert <= 0 || m->n_used <= 0 ||
        m->n_used > m->n_expert || m->n_expert > 4096 || m->n_ff <= 0 ||
        m->down_exps.data == NULL ||
        (m->gate_up_exps.data == NULL && (m->gate_exps.data == NULL || m->up_exps.data == NULL)))
        return LM_EINVAL;
    if (ntok == 0) return LM_OK;
    const int64_t D = b->n_embd, FF = m->n_ff;
    const int E = m->n_expert, K = m->n_used;
    const int64_t NK = ntok * K; /* (token, choice) pairs */
    for (int64_t i = 0; i < NK; i++)
        if (ids[i] < 0 || ids[i] >= E) return LM_EINVAL;

    /* The caller's arrays may lie in the scratch (its routing, carved before this call):
     * the experts' scratch goes after them, and they move with it when it grows. */
    size_t keep = tmp_reach(b, ids, sizeof(int32_t) * (size_t)NK);
    const size_t reach[] = {tmp_reach(b, w, sizeof(float) * (size_t)NK),
                            tmp_reach(b, x, sizeof(float) * (size_t)(ntok * D)),
                            tmp_reach(b, y, sizeof(float) * (size_t)(ntok * D))};
    for (int i = 0; i < 3; i++) keep = reach[i] > keep ? reach[i] : keep;
    keep = (keep + 63) & ~(size_t)63;
    float *xe, *he, *he2, *oe, *order_f, *start_f;
    float **bufs[] = {&xe, &he, &he2, &oe, &order_f, &start_f};
    const int64_t lens[] = {NK * D, NK * FF, NK * FF, NK * D, NK, E + 1};
    const uintptr_t old = (uintptr_t)b->tmp;
    LM_TRY(carve_after(b, keep, 6, bufs, lens));
    if ((uintptr_t)b->tmp != old && keep > 0) {
        ids = tmp_follow(ids, old, keep, b->tmp);
        w = tmp_follow(w, old, keep, b->tmp);
        x = tmp_follow(x, old, keep, b->tmp);
        y = tmp_follow(y, old, keep, b->tmp);
    }
    int32_t *order = (int32_t *)order_f, *start = (int32_t *)start_f;
    lm_pool *pool = b->pool;

    /* Group the pairs by expert: order[] lists pair indices expert by expert, so each
     * chosen expert's matrices are read once for all of its tokens. */
    memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < NK; i++) start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < NK; i++) order[start[ids[i]]++] = (int32_t)i;
    for (int e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int64_t r = 0; r < NK; r++) {
        memcpy(xe + r * D, x + (order[r] / K) * D, sizeof(float) * (size_t)D);
    }

    /* gate and up of every chosen expert, then down. With few rows per expert (decode) all
     * experts go through one pool dispatch per stage. */
    int64_t max_rows = 0;
    for (int e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        max_rows = n > max_rows ? n : max_rows;
    }
    if (max_rows == 1 && NK <= MOE_BATCHED) {
        lm_mm gu[2 * MOE_BATCHED], dn[MOE_BATCHED];
        int n_gu = 0, n_dn = 0;
        for (int e = 0; e < E; e++) {
            const int64_t r = start[e];
            if (start[e + 1] == r) continue;
            gu[n_gu++] = (lm_mm){expert_in(m, e, 0, D), FF, D, xe + r * D, he + r * FF};
            gu[n_gu++] = (lm_mm){expert_in(m, e, 1, D), FF, D, xe + r * D, he2 + r * FF};
            dn[n_dn++] = (lm_mm){rows_from(m->down_exps, (int64_t)e * D, FF), D, FF,
                                 he + r * FF, oe + r * D};
        }
        LM_TRY(lm_matmuls(pool, gu, n_gu, 1));
        LM_TRY(lm_glu_rows(pool, he, he, he2, NK * FF, m->act));
        LM_TRY(lm_matmuls(pool, dn, n_dn, 1));
    } else {
        for (int e = 0; e < E; e++) {
            const int64_t r = start[e], n = start[e + 1] - r;
            if (n == 0) continue;
            const lm_mm gu[2] = {
                {expert_in(m, e, 0, D), FF, D, xe + r * D, he + r * FF},
                {expert_in(m, e, 1, D), FF, D, xe + r * D, he2 + r * FF},
            };
            LM_TRY(lm_matmuls(pool, gu, 2, n));
        }
        LM_TRY(lm_glu_rows(pool, he, he, he2, NK * FF, m->act));
        for (int e = 0; e < E; e++) {
            const int64_t r = start[e], n = start[e + 1] - r;
            if (n == 0) continue;
            const lm_matrix down = rows_from(m->down_exps, (int64_t)e * D, FF);
            LM_TRY(lm_matmul(pool, down.type, down.data, D, FF, he + r * FF, n, oe + r * D));
        }
    }

    /* y[t] = sum over its choices of weight * expert output (x is no longer read: y may
     * alias it) */
    memset(y, 0, sizeof(float) * (size_t)(ntok * D));
    for (int64_t r = 0; r < NK; r++) {
        const int32_t i = order[r];
        lm_kernels_active()->axpy_f32(y + (i / K) * D, w[i], oe + r * D, D);
    }
    return LM_OK;
}

/* y (ntok, n_embd) = the experts over x (ntok, n_embd), rows [r0, r0 + ntok) of the chunk
 * (where their routing is traced). */
static int moe_rows(lm_base *b, const lm_moe *m, int layer, const float *x, int64_t r0,
                    int64_t ntok, float *y) {
    if (b == NULL || m == NULL || x == NULL || y == NULL || r0 < 0 || ntok < 0 ||
        r0 + ntok > b->n_batch || m->n_expert <= 0 || m->n_used <= 0 ||
        m->n_used > m->n_expert || m->n_expert > 4096 || m->n_ff <= 0 || layer < 0 ||
        layer >= b->n_layer)
        return LM_EINVAL;
    if (ntok == 0) return LM_OK;
    const int64_t D = b->n_embd;
    const int E = m->n_expert, K = m->n_used;
    const int64_t NK = ntok * K; /* (token, choice) pairs */
    /* the routing first in the scratch: lm_moe_experts keeps it and reuses the rest */
    float *wts, *ids_f, *r, *logits;
    float **bufs[] = {&wts, &ids_f, &r, &logits};
    const int64_t lens[] = {NK, NK, m->router_norm != NULL ? ntok * D : 0, ntok * E};
    LM_TRY(carve(b, 4, bufs, lens));
    int32_t *ids = (int32_t *)ids_f;
    lm_pool *pool = b->pool;

    const float *in = x;
    if (m->router_norm != NULL) {
        LM_TRY(lm_rmsnorm_rows(pool, r, x, m->router_norm, ntok, D, m->norm_eps));
        if (m->router_scale != 0.0f && m->router_scale != 1.0f)
            LM_TRY(lm_scale_rows(r, m->router_scale, ntok * D));
        in = r;
    }
    LM_TRY(lm_matmul(pool, m->router.type, m->router.data, E, D, in, ntok, logits));
    for (int64_t t = 0; t < ntok; t++)
        LM_TRY(lm_moe_route(m, logits + t * E, ids + t * K, wts + t * K));
    lm_trace *tr = b->trace;
    if (tr != NULL && tr->n_used == K && b->trace_row + r0 + ntok <= tr->cap) {
        const size_t at =
            ((size_t)layer * (size_t)tr->cap + (size_t)(b->trace_row + r0)) * (size_t)K;
        memcpy(tr->ids + at, ids, sizeof(int32_t) * (size_t)NK);
        memcpy(tr->weights + at, wts, sizeof(float) * (size_t)NK);
    }
    if (m->norm == NULL) return lm_moe_experts(b, m, x, ntok, ids, wts, y);
    /* the experts' input, into y (x is no longer read) */
    LM_TRY(lm_rmsnorm_rows(pool, y, x, m->norm, ntok, D, m->norm_eps));
    return lm_moe_experts(b, m, y, ntok, ids, wts, y);
}

int lm_moe_ffn(lm_base *b, const lm_moe *m, int layer, const float *x, int64_t ntok, float *y) {
    return moe_rows(b, m, layer, x, 0, ntok, y);
}

int lm_logits(lm_base *b, const float *norm, float eps, lm_matrix out, const float *x, int64_t n,
              float softcap, float *logits) {
    if (b == NULL || x == NULL || (logits == NULL && b->hidden == NULL) || n < 0 ||
        n > b->n_batch || softcap < 0.0f)
        return LM_EINVAL;
    if (n == 0) return LM_OK;
    const int64_t D = b->n_embd;
    LM_TRY(lm_rmsnorm_rows(b->pool, b->xb, x, norm, n, D, eps));
    if (b->hidden != NULL) memcpy(b->hidden, b->xb, sizeof(float) * (size_t)(n * D));
    if (logits == NULL) return LM_OK; /* the hidden states alone (embeddings) */
    LM_TRY(lm_matmul(b->pool, out.type, out.data, b->n_vocab, D, b->xb, n, logits));
    if (softcap > 0.0f) LM_TRY(lm_softcap_rows(logits, n * b->n_vocab, softcap));
    return LM_OK;
}

/* ============================================================================ decoders */

/* The feed-forward half of a block over rows [r0, r0 + n): x (their residual) in, xb (the
 * ffn_norm'ed rows) in and out. */
static int block_ffn(lm_base *b, const lm_block *blk, int layer, int64_t r0, int64_t n,
                     const float *x, float *xb) {
    const int64_t D = b->n_embd;
    const float eps = blk->norm_eps;
    if (blk->moe.n_expert <= 0) return lm_glu_ffn(b, &blk->ffn, xb, n, xb);
    const int shared = blk->shexp.n_ff > 0;
    if (!shared && !blk->ffn_parallel) return moe_rows(b, &blk->moe, layer, xb, r0, n, xb);
    if (b->xs == NULL) return LM_EINVAL;
    float *xs = b->xs + r0 * D; /* the second branch's rows */
    if (blk->ffn_parallel) {
        /* the dense ffn over xb, the experts over the residual, each normed */
        LM_TRY(lm_glu_ffn(b, &blk->ffn, xb, n, xb));
        LM_TRY(lm_rmsnorm_rows(b->pool, xb, xb, blk->post_dense_norm, n, D, eps));
        LM_TRY(moe_rows(b, &blk->moe, layer, x, r0, n, xs));
        LM_TRY(lm_rmsnorm_rows(b->pool, xs, xs, blk->post_moe_norm, n, D, eps));
        return lm_add_rows(xb, xs, n * D);
    }
    /* a shared expert beside the routed ones, maybe gated */
    float *gs = b->xs + b->n_batch * D + r0;
    const int gated = blk->shexp_gate.data != NULL;
    if (gated)
        LM_TRY(lm_matmul(b->pool, blk->shexp_gate.type, blk->shexp_gate.data, 1, D, xb, n, gs));
    LM_TRY(lm_glu_ffn(b, &blk->shexp, xb, n, xs));
    LM_TRY(moe_rows(b, &blk->moe, layer, xb, r0, n, xb));
    for (int64_t t = 0; t < n; t++) {
        const float w = gated ? 1.0f / (1.0f + expf(-gs[t])) : 1.0f;
        lm_kernels_active()->axpy_f32(xb + t * D, w, xs + t * D, D);
    }
    return LM_OK;
}

int lm_decoder_block(lm_base *b, const lm_block *blk, int layer, int64_t r0, int64_t n) {
    if (b == NULL || blk == NULL || r0 < 0 || n < 0 || r0 + n > b->n_batch) return LM_EINVAL;
    const int64_t D = b->n_embd;
    const float eps = blk->norm_eps;
    float *x = b->x + r0 * D, *xb = b->xb + r0 * D;
    LM_TRY(lm_rmsnorm_rows(b->pool, xb, x, blk->attn_norm, n, D, eps));
    if (blk->mixer == LM_MIXER_DELTANET) {
        if (r0 != 0) return LM_EINVAL; /* a recurrent state runs through every row */
        LM_TRY(lm_deltanet_mixer(b, &blk->delta, layer, xb, n, xb));
    } else {
        LM_TRY(attention_rows(b, &blk->attn, layer, xb, r0, n, xb));
    }
    if (blk->post_attn_norm != NULL)
        LM_TRY(lm_rmsnorm_rows(b->pool, xb, xb, blk->post_attn_norm, n, D, eps));
    LM_TRY(lm_add_rows(x, xb, n * D));
    LM_TRY(lm_rmsnorm_rows(b->pool, xb, x, blk->ffn_norm, n, D, eps));
    LM_TRY(block_ffn(b, blk, layer, r0, n, x, xb));
    if (blk->post_ffn_norm != NULL)
        LM_TRY(lm_rmsnorm_rows(b->pool, xb, xb, blk->post_ffn_norm, n, D, eps));
    return lm_add_rows(x, xb, n * D);
}

/* 1 when the block writes no cache: attention over an earlier layer's. */
static int block_quiet(const lm_block *blk) {
    return blk->mixer == LM_MIXER_ATTENTION && blk->attn.kv_shared > 0;
}

int lm_decoder_chunk(lm_base *b, const lm_decoder *d, const int32_t *tokens, int64_t ntok,
                     float *logits, int64_t first_logit) {
    if (b == NULL || d == NULL || first_logit < 0 || first_logit > ntok) return LM_EINVAL;
    const int64_t D = b->n_embd;
    LM_TRY(lm_embed(b, d->token_embd, tokens, ntok));
    if (d->embd_scale != 0.0f) LM_TRY(lm_scale_rows(b->x, d->embd_scale, ntok * D));
    for (int h = 0; h < d->n_hooks; h++) {
        const lm_hook *k = &d->hooks[h];
        if (k->begin_chunk != NULL) LM_TRY(k->begin_chunk(k->ctx, b, tokens, ntok));
    }
    /* the trailing blocks that write no cache need only the rows with logits */
    int quiet = b->n_layer;
    while (quiet > 0 && block_quiet(&d->blocks[quiet - 1])) quiet--;
    for (int l = 0; l < b->n_layer; l++) {
        const lm_block *blk = &d->blocks[l];
        const int64_t r0 = l >= quiet ? first_logit : 0, n = ntok - r0;
        if (r0 > 0 && n == 0) continue;
        LM_TRY(lm_decoder_block(b, blk, l, r0, n));
        for (int h = d->n_hooks - 1; h >= 0; h--) { /* nested: the first added runs last */
            const lm_hook *k = &d->hooks[h];
            if (k->after_block != NULL) LM_TRY(k->after_block(k->ctx, b, l, r0, n));
        }
        if (blk->out_scale != NULL)
            LM_TRY(lm_scale_rows(b->x + r0 * D, blk->out_scale[0], n * D));
    }
    return lm_logits(b, d->output_norm, d->norm_eps, d->output, b->x + first_logit * D,
                     ntok - first_logit, d->logit_softcap, logits);
}

static int matrix_ok(lm_matrix m, int64_t cols) {
    return m.data != NULL && lm_row_bytes(m.type, cols) > 0;
}

static int attn_ok(const lm_block *blocks, int l, int64_t D) {
    const lm_attn *a = &blocks[l].attn;
    const int64_t qd = (int64_t)a->n_head * a->head_dim;
    if (a->n_head <= 0 || a->n_kv_head <= 0 || a->n_head % a->n_kv_head != 0 ||
        a->head_dim <= 0 || !(a->norm_eps >= 0.0f) || a->window < 0 || !(a->softcap >= 0.0f) ||
        (a->v_norm != 0 && a->v_norm != 1) || a->kv_shared < 0 || a->kv_shared > l)
        return LM_EINVAL;
    if (a->rope != NULL && (a->rope->n_rot > a->head_dim || a->rope->n_rot % 2 != 0))
        return LM_EINVAL;
    if (a->gated != 0 && (a->gated != 1 || a->bq != NULL)) return LM_EINVAL;
    if (a->v_extra != NULL &&
        (a->kv_shared != 0 || a->v_extra_stride < (int64_t)a->n_kv_head * a->head_dim ||
         (a->v_gate != NULL && (a->v_gate_cols <= 0 || a->v_gate_cols > D)) ||
         !isfinite(a->v_gate_scale)))
        return LM_EINVAL;
    if (!matrix_ok(a->wq, D) || !matrix_ok(a->wo, qd)) return LM_ETYPE;
    if (a->kv_shared > 0) {
        /* the source: an attention layer with keys and values of its own, of these heads */
        const lm_block *src = &blocks[l - a->kv_shared];
        const lm_attn *s = &src->attn;
        if (src->mixer != LM_MIXER_ATTENTION || s->kv_shared != 0 ||
            s->n_kv_head != a->n_kv_head || s->head_dim != a->head_dim || s->window != a->window)
            return LM_EINVAL;
        return LM_OK;
    }
    if (!matrix_ok(a->wk, D) || (a->wv.data != NULL && !matrix_ok(a->wv, D))) return LM_ETYPE;
    return LM_OK;
}

static int ffn_ok(const lm_ffn *f, int64_t D) {
    if (f->n_ff <= 0 || f->act < LM_ACT_SILU || f->act > LM_ACT_RELU2) return LM_EINVAL;
    if ((f->gate.data != NULL && !matrix_ok(f->gate, D)) || !matrix_ok(f->up, D) ||
        !matrix_ok(f->down, f->n_ff))
        return LM_ETYPE;
    return LM_OK;
}

static int block_ffn_ok(const lm_block *blk, int64_t D) {
    if (blk->moe.n_expert <= 0) {
        /* a router or a parallel block without experts is a table gone wrong */
        if (blk->moe.n_expert < 0 || blk->moe.router.data != NULL || blk->ffn_parallel)
            return LM_EINVAL;
        return ffn_ok(&blk->ffn, D);
    }
    const lm_moe *m = &blk->moe;
    if (m->n_used <= 0 || m->n_used > m->n_expert || m->n_ff <= 0 ||
        blk->shexp.n_ff < 0 || !(m->norm_eps >= 0.0f) || !isfinite(m->router_scale) ||
        (blk->ffn_parallel != 0 && blk->ffn_parallel != 1))
        return LM_EINVAL;
    if (blk->ffn_parallel) {
        if (blk->shexp.n_ff > 0 || blk->post_dense_norm == NULL || blk->post_moe_norm == NULL)
            return LM_EINVAL;
        LM_TRY(ffn_ok(&blk->ffn, D));
    }
    if (blk->shexp.n_ff > 0) {
        LM_TRY(ffn_ok(&blk->shexp, D));
        if (blk->shexp_gate.data != NULL && !matrix_ok(blk->shexp_gate, D)) return LM_ETYPE;
    }
    const int fused = m->gate_up_exps.data != NULL;
    if (!matrix_ok(m->router, D) || !matrix_ok(m->down_exps, m->n_ff) ||
        (fused && !matrix_ok(m->gate_up_exps, D)) ||
        (!fused && (!matrix_ok(m->gate_exps, D) || !matrix_ok(m->up_exps, D))))
        return LM_ETYPE;
    return LM_OK;
}

int lm_decoder_check(const lm_base *b, const lm_decoder *d) {
    if (b == NULL || d == NULL || d->blocks == NULL ||
        !isfinite(d->embd_scale) || !(d->logit_softcap >= 0.0f) || d->n_hooks < 0 ||
        d->n_hooks > (int)(sizeof d->hooks / sizeof d->hooks[0]))
        return LM_EINVAL;
    const int64_t D = b->n_embd;
    if (!matrix_ok(d->token_embd, D) || !matrix_ok(d->output, D)) return LM_ETYPE;
    for (int l = 0; l < b->n_layer; l++) {
        const lm_block *blk = &d->blocks[l];
        if (!(blk->norm_eps >= 0.0f) ||
            (blk->mixer != LM_MIXER_ATTENTION && blk->mixer != LM_MIXER_DELTANET) ||
            (blk->out_scale != NULL && !isfinite(blk->out_scale[0])))
            return LM_EINVAL;
        if (blk->mixer == LM_MIXER_DELTANET) {
            LM_TRY(lm_deltanet_check(b, &blk->delta, l));
        } else {
            LM_TRY(attn_ok(d->blocks, l, D));
        }
        LM_TRY(block_ffn_ok(blk, D));
    }
    return LM_OK;
}

/* ---------------------------------------------------------------------------- whole models */

/* The hooks' contexts, the last added first, then the base and its arena (the model, its
 * blocks and geometry). */
static void decoder_model_free(void *self) {
    lm_decoder_model *m = self;
    for (int h = m->dec.n_hooks - 1; h >= 0; h--) {
        const lm_hook *k = &m->dec.hooks[h];
        if (k->free != NULL) k->free(k->ctx);
    }
    m->dec.n_hooks = 0;
    lm_base_free(&m->base);
}

static int decoder_model_chunk(void *self, const int32_t *tokens, int64_t ntok, float *logits,
                               int64_t first_logit) {
    lm_decoder_model *m = self;
    return lm_decoder_chunk(&m->base, &m->dec, tokens, ntok, logits, first_logit);
}

int lm_decoder_new(int n_layer, lm_decoder_model **out) {
    if (out == NULL || n_layer <= 0 || n_layer > 4096) return LM_EINVAL;
    *out = NULL;
    lm_base *b;
    LM_TRY(lm_model_new(sizeof(lm_decoder_model), &b));
    lm_decoder_model *m = (lm_decoder_model *)b;
    /* lm_model_free and lm_decoder_hook_ctx work before lm_decoder_finish */
    b->free_model = decoder_model_free;
    b->forward_chunk = decoder_model_chunk;
    m->n_layer = n_layer;
    m->blocks = lm_base_alloc(b, (size_t)n_layer * sizeof *m->blocks);
    m->geometry = lm_base_alloc(b, (size_t)n_layer * sizeof *m->geometry);
    if (m->blocks == NULL || m->geometry == NULL) {
        decoder_model_free(m);
        return LM_ENOMEM;
    }
    m->dec.blocks = m->blocks;
    *out = m;
    return LM_OK;
}

int lm_decoder_add_hook(lm_decoder_model *m, const lm_hook *hook) {
    if (hook == NULL) return LM_EINVAL;
    const int room = (int)(sizeof m->dec.hooks / sizeof m->dec.hooks[0]);
    if (m == NULL || m->dec.n_hooks < 0 || m->dec.n_hooks >= room ||
        (hook->begin_chunk == NULL && hook->after_block == NULL)) {
        if (hook->free != NULL) hook->free(hook->ctx); /* the model's from the call on */
        return LM_EINVAL;
    }
    m->dec.hooks[m->dec.n_hooks++] = *hook;
    return LM_OK;
}

void *lm_decoder_hook_ctx(lm_base *b, lm_begin_chunk_fn begin_chunk,
                          lm_after_block_fn after_block) {
    if (b == NULL || b->forward_chunk != decoder_model_chunk) return NULL;
    const lm_decoder *d = &((lm_decoder_model *)b)->dec;
    for (int h = 0; h < d->n_hooks; h++) {
        const lm_hook *k = &d->hooks[h];
        if (k->begin_chunk == begin_chunk && k->after_block == after_block) return k->ctx;
    }
    return NULL;
}

/* A float buffer of `n` values, 64-byte aligned, into *out; LM_ENOMEM when it fails. */
static int alloc_floats(float **out, int64_t n) {
    *out = lm_aligned_alloc(sizeof(float) * (size_t)n);
    return *out != NULL ? LM_OK : LM_ENOMEM;
}

int lm_decoder_finish(lm_decoder_model *m, int n_threads, int64_t n_batch, int64_t n_vocab,
                      int64_t n_embd, lm_base **out) {
    if (m == NULL) return LM_EINVAL;
    int status = out != NULL ? LM_OK : LM_EINVAL;
    int side = 0; /* a block with a second feed-forward branch: b->xs */
    for (int l = 0; status == LM_OK && l < m->n_layer; l++) {
        const lm_block *blk = &m->blocks[l];
        const lm_attn *a = &blk->attn;
        side |= blk->moe.n_expert > 0 && (blk->shexp.n_ff > 0 || blk->ffn_parallel);
        if (blk->mixer == LM_MIXER_DELTANET) {
            m->geometry[l] = lm_deltanet_geometry(&blk->delta);
            continue;
        }
        /* a sliding window keeps its window and one chunk's rows (written before attention) */
        const int64_t ring = a->window > 0 ? a->window + n_batch : 0;
        /* a layer reading another's cache keeps a token row: its geometry (and ring) only has
         * to match from cache to cache */
        m->geometry[l] = a->kv_shared == 0
                             ? (lm_cache_layer){a->n_kv_head, a->head_dim, a->head_dim, ring, 0}
                             : (lm_cache_layer){1, 1, 1, ring, 0};
    }
    m->dec.blocks = m->blocks;
    if (status == LM_OK) {
        status = lm_base_init(&m->base, n_threads, n_batch, n_vocab, n_embd, m->n_layer,
                              m->geometry, decoder_model_chunk, decoder_model_free);
    }
    if (status == LM_OK && side) status = alloc_floats(&m->base.xs, n_batch * (n_embd + 1));
    if (status == LM_OK) status = lm_decoder_check(&m->base, &m->dec);
    if (status != LM_OK) {
        decoder_model_free(m);
        return status;
    }
    *out = &m->base;
    return LM_OK;
}

/* ============================================================================ chunk driver */

/* Runs one chunk of the sequences in seqs; the base's table points at them meanwhile. */
static int run_chunk(lm_base *b, const lm_seq *seqs, int n_seqs, const int32_t *tokens,
                     int64_t ntok, float *logits, int64_t first_logit) {
    b->seqs = seqs;
    b->n_seqs = n_seqs;
    const int status = b->forward_chunk(b, tokens, ntok, logits, first_logit);
    b->seqs = NULL;
    b->n_seqs = 0;
    return status;
}

static int check_tokens(const lm_base *b, const int32_t *tokens, int64_t ntok) {
    for (int64_t i = 0; i < ntok; i++)
        if (tokens[i] < 0 || tokens[i] >= b->n_vocab) return LM_EINVAL;
    return LM_OK;
}

int lm_forward(lm_base *b, lm_cache *cache, const int32_t *tokens, int64_t ntok, int64_t pos,
               float *logits, int all_logits) {
    if (b == NULL || cache == NULL || tokens == NULL || logits == NULL || ntok <= 0 || pos < 0 ||
        pos > lm_cache_n_ctx(cache) - ntok)
        return LM_EINVAL;
    if (!lm_cache_matches(cache, b->n_layer, b->cache_layers)) return LM_EMISMATCH;
    LM_TRY(check_tokens(b, tokens, ntok));
    if (pos == 0) LM_TRY(lm_cache_recurrent_reset(cache)); /* the state before position 0 */
    const int64_t B = b->n_batch, V = b->n_vocab;
    for (int64_t done = 0; done < ntok; done += B) {
        const int64_t n = ntok - done < B ? ntok - done : B;
        const int last = done + n == ntok;
        float *out = all_logits ? logits + done * V : logits;
        /* earlier chunks need no logits unless all are asked for */
        const int64_t first = all_logits ? 0 : last ? n - 1 : n;
        const lm_seq seq = {cache, pos + done, n, 0};
        b->trace_row = done;
        LM_TRY(run_chunk(b, &seq, 1, tokens + done, n, out, first));
        if (!last) lm_cache_snapshot_seam(cache, pos + done + n);
    }
    return LM_OK;
}

int lm_forward_bidirectional(lm_base *b, lm_cache *cache, const int32_t *tokens, int64_t ntok,
                             int64_t pos, float *logits) {
    if (b == NULL || cache == NULL || tokens == NULL || logits == NULL || ntok <= 0 ||
        ntok > b->n_batch || pos < 0 || pos > lm_cache_n_ctx(cache) - ntok)
        return LM_EINVAL;
    if (!lm_cache_matches(cache, b->n_layer, b->cache_layers)) return LM_EMISMATCH;
    for (int l = 0; l < b->n_layer; l++)
        if (b->cache_layers[l].state > 0) return LM_EINVAL; /* a recurrence has no both ways */
    LM_TRY(check_tokens(b, tokens, ntok));
    const lm_seq seq = {cache, pos, ntok, 1};
    b->trace_row = 0;
    return run_chunk(b, &seq, 1, tokens, ntok, logits, 0);
}

int lm_forward_batch(lm_base *b, int n_seqs, lm_cache *const *caches, const int32_t *tokens,
                     const int64_t *ntoks, const int64_t *pos, float *logits) {
    /* every sequence has a row, so there are at most n_batch of them */
    if (b == NULL || n_seqs <= 0 || n_seqs > b->n_batch || caches == NULL || tokens == NULL ||
        ntoks == NULL || pos == NULL)
        return LM_EINVAL;
    /* no logits: the hidden states alone, from a pass that ends in the kit's lm_logits */
    if (logits == NULL && (b->hidden == NULL || b->forward_chunk != decoder_model_chunk))
        return LM_EINVAL;
    lm_seq *table = malloc(sizeof *table * (size_t)n_seqs);
    if (table == NULL) return LM_ENOMEM;
    int status = LM_OK;
    int64_t total = 0;
    for (int i = 0; status == LM_OK && i < n_seqs; i++) {
        lm_cache *c = caches[i];
        if (c == NULL || ntoks[i] <= 0 || ntoks[i] > b->n_batch || pos[i] < 0 ||
            pos[i] > lm_cache_n_ctx(c) - ntoks[i]) {
            status = LM_EINVAL;
            break;
        }
        if (!lm_cache_matches(c, b->n_layer, b->cache_layers)) status = LM_EMISMATCH;
        for (int j = 0; j < i; j++)
            if (caches[j] == c) status = LM_EINVAL; /* one sequence per cache */
        table[i] = (lm_seq){c, pos[i], ntoks[i], 0};
        total += ntoks[i];
    }
    if (status == LM_OK && total > b->n_batch) status = LM_EINVAL;
    if (status == LM_OK) status = check_tokens(b, tokens, total);
    for (int i = 0; status == LM_OK && i < n_seqs; i++)
        if (pos[i] == 0) status = lm_cache_recurrent_reset(caches[i]);
    if (status == LM_OK) {
        b->trace_row = 0;
        status = run_chunk(b, table, n_seqs, tokens, total, logits, 0);
    }
    free(table);
    return status;
}

#undef ROW_OP_MIN_ELEMS
#undef ARENA_HEADER
#undef ROPE_PAIRS_MAX
