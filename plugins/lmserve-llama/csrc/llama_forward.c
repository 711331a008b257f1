/*
 * Forward pass of the llama architecture over the shared lmserve kernels.
 *
 * Per layer:  x += wo · attention(rope(wq · norm(x)), rope(wk · norm(x)), wv · norm(x))
 *             x += w_down · (silu(w_gate · norm(x)) * (w_up · norm(x)))
 * Prompts go through in chunks of n_batch tokens so every weight matrix is read once per
 * chunk; decode is the same path with one token.
 */
#include "llama_forward.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "lmserve/kernels.h"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define LLAMA_HAVE_MMAP 1
#endif

/* ============================================================================ structs */

struct llama_model {
    llama_config cfg;
    llama_weights w;
    lm_pool *pool;
    /* scratch for n_batch tokens */
    float *x;    /* (n_batch, n_embd) residual stream */
    float *xb;   /* (n_batch, n_embd) normed input / projection output */
    float *q;    /* (n_batch, n_head * head_dim) */
    float *att;  /* (n_batch, n_head * head_dim) attention output */
    float *hb;   /* (n_batch, n_ff) gate, then silu(gate) * up */
    float *hb2;  /* (n_batch, n_ff) up */
};

struct llama_cache {
    int n_layer;
    int64_t n_ctx;
    int64_t kv_dim;   /* n_kv_head * head_dim: one row */
    float *k;         /* (n_layer, n_ctx, kv_dim) */
    float *v;         /* (n_layer, n_ctx, kv_dim) */
    size_t bytes;     /* of each of k and v */
};

/* ============================================================================ helpers */

static int64_t q_dim(const llama_config *c) { return (int64_t)c->n_head * c->head_dim; }
static int64_t kv_dim(const llama_config *c) { return (int64_t)c->n_kv_head * c->head_dim; }

static int matrix_ok(const llama_matrix *m, int64_t cols) {
    return m->data != NULL && lm_row_bytes(m->type, cols) > 0;
}

/* Zeroed memory whose pages commit on first write: an 8k-position cache costs only the
 * rows a conversation reaches. */
static void *lazy_zeroed(size_t bytes) {
#ifdef LLAMA_HAVE_MMAP
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
#else
    return calloc(1, bytes);
#endif
}

static void lazy_free(void *p, size_t bytes) {
    if (p == NULL) return;
#ifdef LLAMA_HAVE_MMAP
    munmap(p, bytes);
#else
    (void)bytes;
    free(p);
#endif
}

/* ============================================================================ parallel leaf ops
 * The leaf kernels are single-threaded; these spread them over the pool by token. */

typedef struct rope_task {
    const llama_config *cfg;
    float *q;      /* (ntok, n_head * head_dim) */
    float *k;      /* (ntok, n_kv_head * head_dim) */
    int64_t ntok;
    int64_t pos0;
} rope_task;

static void rope_run(void *ctx, int ith, int nth) {
    const rope_task *t = ctx;
    const llama_config *c = t->cfg;
    for (int64_t i = ith; i < t->ntok; i += nth) {
        lm_rope(t->q + i * q_dim(c), c->n_head, c->head_dim, c->n_rot, t->pos0 + i,
                c->rope_freq_base, c->rope_freq_scale, LM_ROPE_NORMAL);
        lm_rope(t->k + i * kv_dim(c), c->n_kv_head, c->head_dim, c->n_rot, t->pos0 + i,
                c->rope_freq_base, c->rope_freq_scale, LM_ROPE_NORMAL);
    }
}

typedef struct rmsnorm_task {
    float *out;          /* (ntok, n) */
    const float *x;      /* (ntok, n) */
    const float *weight; /* (n) */
    int64_t n;
    int64_t ntok;
    float eps;
} rmsnorm_task;

static void rmsnorm_run(void *ctx, int ith, int nth) {
    const rmsnorm_task *t = ctx;
    for (int64_t i = ith; i < t->ntok; i += nth)
        lm_rmsnorm(t->out + i * t->n, t->x + i * t->n, t->weight, t->n, t->eps);
}

typedef struct silu_task {
    float *gate;       /* (count) in: gate, out: silu(gate) * up */
    const float *up;   /* (count) */
    int64_t count;
} silu_task;

static void silu_run(void *ctx, int ith, int nth) {
    const silu_task *t = ctx;
    int64_t per = (t->count + nth - 1) / nth;
    int64_t lo = per * ith;
    int64_t hi = lo + per < t->count ? lo + per : t->count;
    if (lo < hi) lm_silu_mul(t->gate + lo, t->gate + lo, t->up + lo, hi - lo);
}

static void rmsnorm_tokens(lm_pool *pool, float *out, const float *x, const float *weight,
                           int64_t n, int64_t ntok, float eps) {
    rmsnorm_task t = {out, x, weight, n, ntok, eps};
    lm_pool_run(ntok > 1 ? pool : NULL, rmsnorm_run, &t);
}

/* ============================================================================ one-token projections
 * Decode (one token) spends much of its time waking the pool, so the independent matrices
 * that read the same input go through one dispatch, each thread taking a slice of every
 * matrix's rows. Each output row is one dot product either way: the result is the same as
 * separate lm_matmul calls. */
#define MULTI_MAX 3

typedef struct multi_task {
    int n;
    const llama_matrix *w[MULTI_MAX];
    int64_t rows[MULTI_MAX];
    float *y[MULTI_MAX];     /* (rows[i]) */
    const float *x;          /* (cols) */
    int64_t cols;
    _Atomic int status;
} multi_task;

static void multi_run(void *ctx, int ith, int nth) {
    multi_task *t = ctx;
    for (int i = 0; i < t->n; i++) {
        const int64_t lo = t->rows[i] * ith / nth, hi = t->rows[i] * (ith + 1) / nth;
        if (lo == hi) continue;
        const uint8_t *w = (const uint8_t *)t->w[i]->data;
        const int64_t rb = lm_row_bytes(t->w[i]->type, t->cols);
        int rc = lm_matmul(NULL, t->w[i]->type, w + lo * rb, hi - lo, t->cols, t->x, 1,
                           t->y[i] + lo);
        if (rc != LM_OK) atomic_store(&t->status, rc);
    }
}

/* y_i = W_i · x for up to MULTI_MAX matrices of `cols` columns and one token. */
static int matmul_one_token(lm_pool *pool, int n, const llama_matrix *const *w,
                            const int64_t *rows, float *const *y, const float *x, int64_t cols) {
    multi_task t = {.n = n, .x = x, .cols = cols};
    for (int i = 0; i < n; i++) {
        t.w[i] = w[i];
        t.rows[i] = rows[i];
        t.y[i] = y[i];
    }
    atomic_init(&t.status, LM_OK);
    lm_pool_run(pool, multi_run, &t);
    return atomic_load(&t.status);
}

/* ============================================================================ model lifecycle */

int llama_model_build(const llama_config *config, const llama_weights *weights,
                      int n_threads, llama_model **out) {
    if (config == NULL || weights == NULL || out == NULL) return LLAMA_EINVAL;
    *out = NULL;
    const llama_config *c = config;
    if (c->n_layer <= 0 || c->n_embd <= 0 || c->n_ff <= 0 || c->n_head <= 0 ||
        c->n_kv_head <= 0 || c->n_head % c->n_kv_head != 0 || c->head_dim <= 0 ||
        c->head_dim % 2 != 0 || c->n_rot <= 0 || c->n_rot > c->head_dim || c->n_rot % 2 != 0 ||
        c->n_vocab <= 0 || c->n_batch <= 0 || weights->layers == NULL ||
        weights->output_norm == NULL)
        return LLAMA_EINVAL;
    if (!matrix_ok(&weights->token_embd, c->n_embd) || !matrix_ok(&weights->output, c->n_embd))
        return LLAMA_ETYPE;
    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &weights->layers[l];
        if (L->attn_norm == NULL || L->ffn_norm == NULL) return LLAMA_EINVAL;
        if (!matrix_ok(&L->wq, c->n_embd) || !matrix_ok(&L->wk, c->n_embd) ||
            !matrix_ok(&L->wv, c->n_embd) || !matrix_ok(&L->wo, q_dim(c)) ||
            !matrix_ok(&L->w_gate, c->n_embd) || !matrix_ok(&L->w_up, c->n_embd) ||
            !matrix_ok(&L->w_down, c->n_ff))
            return LLAMA_ETYPE;
    }

    llama_model *m = calloc(1, sizeof *m);
    if (m == NULL) return LLAMA_ENOMEM;
    m->cfg = *c;
    m->w = *weights;
    const int64_t B = c->n_batch;
    m->x = malloc(sizeof(float) * B * c->n_embd);
    m->xb = malloc(sizeof(float) * B * c->n_embd);
    m->q = malloc(sizeof(float) * B * q_dim(c));
    m->att = malloc(sizeof(float) * B * q_dim(c));
    m->hb = malloc(sizeof(float) * B * c->n_ff);
    m->hb2 = malloc(sizeof(float) * B * c->n_ff);
    m->pool = lm_pool_new(n_threads);
    if (!m->x || !m->xb || !m->q || !m->att || !m->hb || !m->hb2 || !m->pool) {
        llama_model_free(m);
        return LLAMA_ENOMEM;
    }
    *out = m;
    return LLAMA_OK;
}

void llama_model_free(llama_model *model) {
    if (model == NULL) return;
    lm_pool_free(model->pool);
    free(model->x);
    free(model->xb);
    free(model->q);
    free(model->att);
    free(model->hb);
    free(model->hb2);
    free(model);
}

int llama_model_threads(const llama_model *model) {
    return model == NULL ? 0 : lm_pool_size(model->pool);
}

/* ============================================================================ cache lifecycle */

int llama_cache_build(const llama_model *model, int64_t n_ctx, llama_cache **out) {
    if (model == NULL || out == NULL || n_ctx <= 0) return LLAMA_EINVAL;
    *out = NULL;
    llama_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return LLAMA_ENOMEM;
    c->n_layer = model->cfg.n_layer;
    c->n_ctx = n_ctx;
    c->kv_dim = kv_dim(&model->cfg);
    c->bytes = sizeof(float) * (size_t)c->n_layer * (size_t)n_ctx * (size_t)c->kv_dim;
    c->k = lazy_zeroed(c->bytes);
    c->v = lazy_zeroed(c->bytes);
    if (c->k == NULL || c->v == NULL) {
        llama_cache_free(c);
        return LLAMA_ENOMEM;
    }
    *out = c;
    return LLAMA_OK;
}

void llama_cache_free(llama_cache *cache) {
    if (cache == NULL) return;
    lazy_free(cache->k, cache->bytes);
    lazy_free(cache->v, cache->bytes);
    free(cache);
}

int64_t llama_cache_n_ctx(const llama_cache *cache) { return cache == NULL ? 0 : cache->n_ctx; }

int llama_cache_copy_rows(const llama_cache *src, llama_cache *dst, int64_t n) {
    if (src == NULL || dst == NULL || n < 0 || n > src->n_ctx || n > dst->n_ctx)
        return LLAMA_EINVAL;
    if (src->n_layer != dst->n_layer || src->kv_dim != dst->kv_dim) return LLAMA_EMISMATCH;
    if (src == dst || n == 0) return LLAMA_OK;
    const size_t row = sizeof(float) * (size_t)src->kv_dim;
    for (int l = 0; l < src->n_layer; l++) {
        memcpy(dst->k + (int64_t)l * dst->n_ctx * dst->kv_dim,
               src->k + (int64_t)l * src->n_ctx * src->kv_dim, row * (size_t)n);
        memcpy(dst->v + (int64_t)l * dst->n_ctx * dst->kv_dim,
               src->v + (int64_t)l * src->n_ctx * src->kv_dim, row * (size_t)n);
    }
    return LLAMA_OK;
}

/* ============================================================================ forward */

/* One chunk of at most n_batch tokens at positions pos0.. ; logits for the chunk's rows
 * [first_logit, ntok) go to logits (n_vocab floats per row). */
static int forward_chunk(llama_model *m, llama_cache *cache, const int32_t *tokens,
                         int64_t ntok, int64_t pos0, float *logits, int64_t first_logit) {
    const llama_config *c = &m->cfg;
    const int64_t D = c->n_embd, QD = q_dim(c), KVD = kv_dim(c), FF = c->n_ff;
    lm_pool *pool = m->pool;
    int rc;

    rc = lm_get_rows(m->w.token_embd.type, m->w.token_embd.data, c->n_vocab, D, tokens, ntok,
                     m->x);
    if (rc != LM_OK) return rc;

    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &m->w.layers[l];
        float *kc = cache->k + (int64_t)l * cache->n_ctx * KVD; /* (n_ctx, kv_dim) */
        float *vc = cache->v + (int64_t)l * cache->n_ctx * KVD; /* (n_ctx, kv_dim) */
        float *k_new = kc + pos0 * KVD;                         /* (ntok, kv_dim) */
        float *v_new = vc + pos0 * KVD;                         /* (ntok, kv_dim) */

        /* ---- attention: K and V land straight in their cache rows */
        rmsnorm_tokens(pool, m->xb, m->x, L->attn_norm, D, ntok, c->rms_eps);
        if (ntok == 1) {
            const llama_matrix *w[3] = {&L->wq, &L->wk, &L->wv};
            const int64_t rows[3] = {QD, KVD, KVD};
            float *y[3] = {m->q, k_new, v_new};
            if ((rc = matmul_one_token(pool, 3, w, rows, y, m->xb, D))) return rc;
        } else if ((rc = lm_matmul(pool, L->wq.type, L->wq.data, QD, D, m->xb, ntok, m->q)) ||
                   (rc = lm_matmul(pool, L->wk.type, L->wk.data, KVD, D, m->xb, ntok, k_new)) ||
                   (rc = lm_matmul(pool, L->wv.type, L->wv.data, KVD, D, m->xb, ntok, v_new))) {
            return rc;
        }
        rope_task rt = {c, m->q, k_new, ntok, pos0};
        lm_pool_run(ntok > 1 ? pool : NULL, rope_run, &rt);
        rc = lm_attention(pool, m->q, kc, vc, m->att, ntok, pos0, c->n_head, c->n_kv_head,
                          c->head_dim, 1.0f / sqrtf((float)c->head_dim), 0, 0.0f);
        if (rc != LM_OK) return rc;
        if ((rc = lm_matmul(pool, L->wo.type, L->wo.data, D, QD, m->att, ntok, m->xb)))
            return rc;
        lm_add(m->x, m->x, m->xb, ntok * D);

        /* ---- feed-forward */
        rmsnorm_tokens(pool, m->xb, m->x, L->ffn_norm, D, ntok, c->rms_eps);
        if (ntok == 1) {
            const llama_matrix *w[2] = {&L->w_gate, &L->w_up};
            const int64_t rows[2] = {FF, FF};
            float *y[2] = {m->hb, m->hb2};
            if ((rc = matmul_one_token(pool, 2, w, rows, y, m->xb, D))) return rc;
        } else if ((rc = lm_matmul(pool, L->w_gate.type, L->w_gate.data, FF, D, m->xb, ntok,
                                   m->hb)) ||
                   (rc = lm_matmul(pool, L->w_up.type, L->w_up.data, FF, D, m->xb, ntok,
                                   m->hb2))) {
            return rc;
        }
        silu_task st = {m->hb, m->hb2, ntok * FF};
        lm_pool_run(ntok > 1 ? pool : NULL, silu_run, &st);
        if ((rc = lm_matmul(pool, L->w_down.type, L->w_down.data, D, FF, m->hb, ntok, m->xb)))
            return rc;
        lm_add(m->x, m->x, m->xb, ntok * D);
    }

    /* ---- output head, only for the rows the caller wants */
    const int64_t nout = ntok - first_logit;
    if (nout <= 0) return LLAMA_OK;
    rmsnorm_tokens(pool, m->xb, m->x + first_logit * D, m->w.output_norm, D, nout, c->rms_eps);
    return lm_matmul(pool, m->w.output.type, m->w.output.data, c->n_vocab, D, m->xb, nout,
                     logits);
}

int llama_forward(llama_model *model, llama_cache *cache, const int32_t *tokens,
                  int64_t ntok, int64_t pos, float *logits, int all_logits) {
    if (model == NULL || cache == NULL || tokens == NULL || logits == NULL || ntok <= 0 ||
        pos < 0 || pos > cache->n_ctx - ntok)
        return LLAMA_EINVAL;
    if (cache->n_layer != model->cfg.n_layer || cache->kv_dim != kv_dim(&model->cfg))
        return LLAMA_EMISMATCH;
    for (int64_t i = 0; i < ntok; i++)
        if (tokens[i] < 0 || tokens[i] >= model->cfg.n_vocab) return LLAMA_EINVAL;

    const int64_t B = model->cfg.n_batch, V = model->cfg.n_vocab;
    for (int64_t done = 0; done < ntok; done += B) {
        const int64_t n = ntok - done < B ? ntok - done : B;
        const int last = done + n == ntok;
        float *out;
        int64_t first;
        if (all_logits) {
            out = logits + done * V;
            first = 0;
        } else {
            out = logits;
            first = last ? n - 1 : n; /* earlier chunks need no logits */
        }
        int rc = forward_chunk(model, cache, tokens + done, n, pos + done, out, first);
        if (rc != LLAMA_OK) return rc;
    }
    return LLAMA_OK;
}
