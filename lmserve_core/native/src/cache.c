/*
 * Caches: per layer, rows of keys and rows of values in f16 or f32, and a recurrent state in
 * f32, in one lazily committed mapping (an 8k-position cache costs only the rows a
 * conversation reaches). A layer has a row per position of the context, or a ring of fewer
 * rows (a sliding-window layer: position p in row p % rows, the last `rows` positions written
 * are resident), or no rows at all (a recurrent layer: its state stands for every position
 * written so far, and cannot be cut back to a shorter prefix).
 */
#include <stdlib.h>

#include "lm_internal.h"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define LM_HAVE_MMAP 1
#endif

struct lm_cache {
    int n_layer;
    int64_t n_ctx;
    int type;      /* LM_F16 or LM_F32 */
    size_t esize;  /* bytes per element */
    lm_cache_layer *layers; /* (n_layer) */
    int64_t *rows; /* (n_layer) rows of the layer: n_ctx, or its ring when smaller */
    size_t *k_off; /* (n_layer) byte offset of the layer's K rows */
    size_t *v_off; /* (n_layer) byte offset of the layer's V rows */
    size_t *s_off; /* (n_layer) byte offset of the layer's recurrent state */
    int64_t n_state; /* f32 values of every layer's state */
    uint8_t *mem;
    size_t bytes;
    /* states kept while chunks are read (lm_cache_plan_snapshots) */
    int n_snap;
    int64_t snap_pos[LM_MAX_SNAPSHOTS];
    float *snap_buf; /* (n_snap, n_state) */
};

/* ============================================================================ memory */

static void *lazy_zeroed(size_t bytes) {
#ifdef LM_HAVE_MMAP
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
#else
    return calloc(1, bytes);
#endif
}

static void lazy_free(void *p, size_t bytes) {
    if (p == NULL) return;
#ifdef LM_HAVE_MMAP
    munmap(p, bytes);
#else
    (void)bytes;
    free(p);
#endif
}

/* ============================================================================ geometry */

static int64_t kdim(const lm_cache_layer *l) { return (int64_t)l->n_kv_head * l->head_dim_k; }
static int64_t vdim(const lm_cache_layer *l) { return (int64_t)l->n_kv_head * l->head_dim_v; }

static size_t type_size(int type) {
    return type == LM_F16 ? 2 : type == LM_F32 ? 4 : 0;
}

static int layers_ok(int n_layer, const lm_cache_layer *layers) {
    if (n_layer <= 0 || layers == NULL) return 0;
    for (int l = 0; l < n_layer; l++) {
        const lm_cache_layer *g = &layers[l];
        const int rows = g->n_kv_head != 0 || g->head_dim_k != 0 || g->head_dim_v != 0;
        if (g->state < 0 || g->state > ((int64_t)1 << 36) || (!rows && g->state == 0) ||
            (!rows && g->ring != 0))
            return 0;
        if (rows && (g->n_kv_head <= 0 || g->head_dim_k <= 0 || g->head_dim_v <= 0 ||
                     g->n_kv_head > (1 << 16) || g->head_dim_k > (1 << 16) ||
                     g->head_dim_v > (1 << 16) || g->ring < 0 || g->ring > ((int64_t)1 << 40)))
            return 0;
    }
    return 1;
}

static int64_t states_total(int n_layer, const lm_cache_layer *layers) {
    int64_t total = 0;
    for (int l = 0; l < n_layer; l++) total += layers[l].state;
    return total;
}

static int64_t rows_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Rows a layer keeps in a cache of n_ctx positions. */
static int64_t layer_rows(const lm_cache_layer *l, int64_t n_ctx) {
    return l->ring > 0 && l->ring < n_ctx ? l->ring : n_ctx;
}

int64_t lm_cache_bytes_per_pos(int n_layer, const lm_cache_layer *layers, int type) {
    const size_t es = type_size(type);
    if (es == 0 || !layers_ok(n_layer, layers)) return LM_EINVAL;
    int64_t total = 0;
    for (int l = 0; l < n_layer; l++)
        if (layers[l].ring == 0) total += (kdim(&layers[l]) + vdim(&layers[l])) * (int64_t)es;
    return total;
}

int64_t lm_cache_bytes(int n_layer, const lm_cache_layer *layers, int64_t n_ctx, int type) {
    const size_t es = type_size(type);
    if (es == 0 || !layers_ok(n_layer, layers) || n_ctx <= 0 || n_ctx > ((int64_t)1 << 40))
        return LM_EINVAL;
    int64_t total = states_total(n_layer, layers) * (int64_t)sizeof(float);
    for (int l = 0; l < n_layer; l++) {
        const int64_t row = (kdim(&layers[l]) + vdim(&layers[l])) * (int64_t)es;
        const int64_t rows = layer_rows(&layers[l], n_ctx);
        if (row > 0 && rows > (((int64_t)1 << 40) - total) / row) return LM_EINVAL;
        total += rows * row;
    }
    return total;
}

/* ============================================================================ lifecycle */

int lm_cache_new(int n_layer, const lm_cache_layer *layers, int64_t n_ctx, int type,
                 lm_cache **out) {
    if (out == NULL) return LM_EINVAL;
    *out = NULL;
    if (lm_cache_bytes(n_layer, layers, n_ctx, type) <= 0) return LM_EINVAL;
    lm_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return LM_ENOMEM;
    c->n_layer = n_layer;
    c->n_ctx = n_ctx;
    c->type = type;
    c->esize = type_size(type);
    c->layers = malloc(sizeof *c->layers * (size_t)n_layer);
    c->k_off = malloc(sizeof *c->k_off * (size_t)n_layer);
    c->v_off = malloc(sizeof *c->v_off * (size_t)n_layer);
    c->s_off = malloc(sizeof *c->s_off * (size_t)n_layer);
    c->rows = malloc(sizeof *c->rows * (size_t)n_layer);
    if (c->layers == NULL || c->k_off == NULL || c->v_off == NULL || c->s_off == NULL ||
        c->rows == NULL) {
        lm_cache_free(c);
        return LM_ENOMEM;
    }
    /* the states first (all of them together: a snapshot is one copy), then the rows */
    size_t off = 0;
    for (int l = 0; l < n_layer; l++) {
        c->s_off[l] = off;
        off += (size_t)layers[l].state * sizeof(float);
    }
    c->n_state = states_total(n_layer, layers);
    off = (off + 63) & ~(size_t)63;
    for (int l = 0; l < n_layer; l++) {
        c->layers[l] = layers[l];
        c->rows[l] = layer_rows(&layers[l], n_ctx);
        c->k_off[l] = off;
        off += (size_t)c->rows[l] * (size_t)kdim(&layers[l]) * c->esize;
        c->v_off[l] = off;
        off += (size_t)c->rows[l] * (size_t)vdim(&layers[l]) * c->esize;
    }
    c->bytes = off;
    c->mem = lazy_zeroed(off);
    if (c->mem == NULL) {
        lm_cache_free(c);
        return LM_ENOMEM;
    }
    *out = c;
    return LM_OK;
}

void lm_cache_free(lm_cache *cache) {
    if (cache == NULL) return;
    lazy_free(cache->mem, cache->bytes);
    free(cache->layers);
    free(cache->k_off);
    free(cache->v_off);
    free(cache->s_off);
    free(cache->rows);
    free(cache);
}

int64_t lm_cache_n_ctx(const lm_cache *cache) { return cache == NULL ? 0 : cache->n_ctx; }

int lm_cache_type(const lm_cache *cache) { return cache == NULL ? LM_EINVAL : cache->type; }

/* 1 when the cache was made for this geometry. */
int lm_cache_matches(const lm_cache *cache, int n_layer, const lm_cache_layer *layers) {
    if (cache == NULL || layers == NULL || cache->n_layer != n_layer) return 0;
    for (int l = 0; l < n_layer; l++) {
        const lm_cache_layer *a = &cache->layers[l], *b = &layers[l];
        if (a->n_kv_head != b->n_kv_head || a->head_dim_k != b->head_dim_k ||
            a->head_dim_v != b->head_dim_v || a->ring != b->ring || a->state != b->state)
            return 0;
    }
    return 1;
}

/* ============================================================================ rows */

int lm_cache_copy(const lm_cache *src, lm_cache *dst, int64_t n) {
    if (src == NULL || dst == NULL || n < 0 || n > src->n_ctx || n > dst->n_ctx)
        return LM_EINVAL;
    if (src->type != dst->type || !lm_cache_matches(dst, src->n_layer, src->layers))
        return LM_EMISMATCH;
    for (int l = 0; l < src->n_layer; l++)
        if (src->rows[l] != dst->rows[l] && (src->rows[l] < n || dst->rows[l] < n))
            return LM_EMISMATCH; /* rings of different sizes place positions apart */
    if (src == dst || n == 0) return LM_OK;
    /* the states stand for src's last position written: the caller copies n == that */
    memcpy(dst->mem, src->mem, (size_t)src->n_state * sizeof(float));
    for (int l = 0; l < src->n_layer; l++) {
        /* a ring's rows in place: dst then holds what src held at the positions it keeps */
        const int64_t rows = rows_min(n, src->rows[l]);
        const size_t kb = (size_t)rows * (size_t)kdim(&src->layers[l]) * src->esize;
        const size_t vb = (size_t)rows * (size_t)vdim(&src->layers[l]) * src->esize;
        memcpy(dst->mem + dst->k_off[l], src->mem + src->k_off[l], kb);
        memcpy(dst->mem + dst->v_off[l], src->mem + src->v_off[l], vb);
    }
    return LM_OK;
}

static int rows_ok(const lm_cache *c, int layer, int64_t pos0, int64_t ntok) {
    return c != NULL && layer >= 0 && layer < c->n_layer && pos0 >= 0 && ntok >= 0 &&
           pos0 <= c->n_ctx - ntok;
}

static void store_row(const lm_cache *c, uint8_t *dst, const float *src, int64_t n) {
    if (c->type == LM_F16) {
        lm_kernels_active()->f32_to_f16(src, (uint16_t *)dst, n);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* The rows of positions pos0 .. pos0 + ntok - 1 of a layer as at most two runs of rows
 * (a ring wraps): run i is `len[i]` rows from row `row[i]`, holding positions from pos[i]. */
typedef struct {
    int64_t row[2], len[2], pos[2];
} row_runs;

static row_runs runs_of(const lm_cache *c, int layer, int64_t pos0, int64_t ntok) {
    const int64_t rows = c->rows[layer];
    row_runs r = {{0, 0}, {0, 0}, {0, 0}};
    if (ntok > rows) { /* only the last `rows` positions stay */
        pos0 += ntok - rows;
        ntok = rows;
    }
    r.row[0] = pos0 % rows;
    r.pos[0] = pos0;
    r.len[0] = rows_min(ntok, rows - r.row[0]);
    r.pos[1] = pos0 + r.len[0];
    r.len[1] = ntok - r.len[0];
    return r;
}

int lm_cache_write(lm_cache *cache, int layer, int64_t pos0, int64_t ntok, const float *k,
                   const float *v) {
    if (!rows_ok(cache, layer, pos0, ntok) || (ntok > 0 && (k == NULL || v == NULL)))
        return LM_EINVAL;
    const int64_t kd = kdim(&cache->layers[layer]), vd = vdim(&cache->layers[layer]);
    const row_runs r = runs_of(cache, layer, pos0, ntok);
    for (int i = 0; i < 2; i++) {
        const int64_t at = r.pos[i] - pos0;
        uint8_t *kc = cache->mem + cache->k_off[layer] + (size_t)(r.row[i] * kd) * cache->esize;
        uint8_t *vc = cache->mem + cache->v_off[layer] + (size_t)(r.row[i] * vd) * cache->esize;
        store_row(cache, kc, k + at * kd, r.len[i] * kd);
        store_row(cache, vc, v + at * vd, r.len[i] * vd);
    }
    return LM_OK;
}

int lm_cache_read(const lm_cache *cache, int layer, int64_t pos0, int64_t ntok, float *k,
                  float *v) {
    if (!rows_ok(cache, layer, pos0, ntok) || (ntok > 0 && (k == NULL || v == NULL)) ||
        ntok > cache->rows[layer])
        return LM_EINVAL;
    const int64_t kd = kdim(&cache->layers[layer]), vd = vdim(&cache->layers[layer]);
    const row_runs r = runs_of(cache, layer, pos0, ntok);
    const lm_kernels *kt = lm_kernels_active();
    for (int i = 0; i < 2; i++) {
        if (r.len[i] == 0) continue;
        const int64_t at = r.pos[i] - pos0;
        const uint8_t *kc =
            cache->mem + cache->k_off[layer] + (size_t)(r.row[i] * kd) * cache->esize;
        const uint8_t *vc =
            cache->mem + cache->v_off[layer] + (size_t)(r.row[i] * vd) * cache->esize;
        kt->dequant[cache->type](kc, k + at * kd, r.len[i] * kd);
        kt->dequant[cache->type](vc, v + at * vd, r.len[i] * vd);
    }
    return LM_OK;
}

/* ============================================================================ state */

int64_t lm_cache_state_bytes(const lm_cache *cache, int64_t n) {
    if (cache == NULL || n < 0 || n > cache->n_ctx) return LM_EINVAL;
    int64_t total = cache->n_state * (int64_t)sizeof(float);
    for (int l = 0; l < cache->n_layer; l++)
        total += rows_min(n, cache->rows[l]) * (kdim(&cache->layers[l]) + vdim(&cache->layers[l])) *
                 (int64_t)cache->esize;
    return total;
}

/* Visit the recurrent states, then each layer's K then V rows [0, min(n, rows)) in the
 * state's order: a ring's rows as they lie, so a state loads into a cache of the same
 * geometry. */
static int state_copy(const lm_cache *cache, int64_t n, uint8_t *buf, int64_t buf_bytes,
                      int save) {
    const int64_t need = lm_cache_state_bytes(cache, n);
    if (need < 0 || buf == NULL || buf_bytes < need) return LM_EINVAL;
    size_t at = (size_t)cache->n_state * sizeof(float);
    if (save) {
        memcpy(buf, cache->mem, at);
    } else {
        memcpy(cache->mem, buf, at);
    }
    for (int l = 0; l < cache->n_layer; l++) {
        const int64_t rows = rows_min(n, cache->rows[l]);
        const size_t kb = (size_t)rows * (size_t)kdim(&cache->layers[l]) * cache->esize;
        const size_t vb = (size_t)rows * (size_t)vdim(&cache->layers[l]) * cache->esize;
        uint8_t *kc = cache->mem + cache->k_off[l], *vc = cache->mem + cache->v_off[l];
        if (save) {
            memcpy(buf + at, kc, kb);
            memcpy(buf + at + kb, vc, vb);
        } else {
            memcpy(kc, buf + at, kb);
            memcpy(vc, buf + at + kb, vb);
        }
        at += kb + vb;
    }
    return LM_OK;
}

int lm_cache_save(const lm_cache *cache, int64_t n, void *buf, int64_t buf_bytes) {
    return state_copy(cache, n, buf, buf_bytes, 1);
}

int lm_cache_load(lm_cache *cache, int64_t n, const void *buf, int64_t buf_bytes) {
    return state_copy(cache, n, (uint8_t *)(uintptr_t)buf, buf_bytes, 0);
}

/* ============================================================================ recurrent state */

float *lm_cache_layer_state(lm_cache *cache, int layer) {
    if (cache == NULL || layer < 0 || layer >= cache->n_layer || cache->layers[layer].state == 0)
        return NULL;
    return (float *)(void *)(cache->mem + cache->s_off[layer]);
}

int64_t lm_cache_recurrent_bytes(const lm_cache *cache) {
    return cache == NULL ? LM_EINVAL : cache->n_state * (int64_t)sizeof(float);
}

int lm_cache_recurrent_save(const lm_cache *cache, void *buf, int64_t buf_bytes) {
    const int64_t need = lm_cache_recurrent_bytes(cache);
    if (need < 0 || (need > 0 && buf == NULL) || buf_bytes < need) return LM_EINVAL;
    memcpy(buf, cache->mem, (size_t)need);
    return LM_OK;
}

int lm_cache_recurrent_load(lm_cache *cache, const void *buf, int64_t buf_bytes) {
    const int64_t need = lm_cache_recurrent_bytes(cache);
    if (need < 0 || (need > 0 && buf == NULL) || buf_bytes != need) return LM_EINVAL;
    memcpy(cache->mem, buf, (size_t)need);
    return LM_OK;
}

int lm_cache_plan_snapshots(lm_cache *cache, const int64_t *pos, int n, void *buf,
                            int64_t buf_bytes) {
    if (cache == NULL || n < 0 || n > LM_MAX_SNAPSHOTS) return LM_EINVAL;
    if (n > 0 && (pos == NULL || buf == NULL || cache->n_state == 0 ||
                  buf_bytes != (int64_t)n * cache->n_state * (int64_t)sizeof(float)))
        return LM_EINVAL;
    for (int i = 0; i < n; i++)
        if (pos[i] < 1) return LM_EINVAL;
    cache->n_snap = n;
    for (int i = 0; i < n; i++) cache->snap_pos[i] = pos[i];
    cache->snap_buf = n > 0 ? buf : NULL;
    return LM_OK;
}

float *lm_cache_snapshot_layer(lm_cache *cache, int64_t end, int layer) {
    if (cache == NULL || cache->n_snap == 0 || layer < 0 || layer >= cache->n_layer ||
        cache->layers[layer].state == 0)
        return NULL;
    for (int i = 0; i < cache->n_snap; i++)
        if (cache->snap_pos[i] == end)
            return (float *)(void *)((uint8_t *)(cache->snap_buf + (int64_t)i * cache->n_state) +
                                     cache->s_off[layer]);
    return NULL;
}

void lm_cache_snapshot_seam(lm_cache *cache, int64_t end) {
    for (int i = 0; cache != NULL && i < cache->n_snap; i++)
        if (cache->snap_pos[i] == end)
            memcpy(cache->snap_buf + (int64_t)i * cache->n_state, cache->mem,
                   (size_t)cache->n_state * sizeof(float));
}

int lm_cache_recurrent_reset(lm_cache *cache) {
    if (cache == NULL) return LM_EINVAL;
    memset(cache->mem, 0, (size_t)cache->n_state * sizeof(float));
    return LM_OK;
}

int lm_cache_recurrent_copy(const lm_cache *src, lm_cache *dst) {
    if (src == NULL || dst == NULL) return LM_EINVAL;
    if (src->type != dst->type || !lm_cache_matches(dst, src->n_layer, src->layers))
        return LM_EMISMATCH;
    if (src != dst) memcpy(dst->mem, src->mem, (size_t)src->n_state * sizeof(float));
    return LM_OK;
}

/* ============================================================================ attention */

/* Checks that one layer's cache holds what a chunk attends to; *ring_out: its ring (0: a row
 * for every position). */
static int cached_rows(const lm_cache *cache, int layer, int64_t pos0, int64_t ntok,
                       int64_t window, int64_t *ring_out) {
    if (!rows_ok(cache, layer, pos0, ntok)) return LM_EINVAL;
    const lm_cache_layer *g = &cache->layers[layer];
    if (g->n_kv_head <= 0 || g->head_dim_k != g->head_dim_v) return LM_EINVAL;
    const int64_t rows = cache->rows[layer];
    const int64_t ring = rows < cache->n_ctx ? rows : 0;
    /* a ring must still hold every key the chunk's first query sees after the chunk's own
     * rows were written: its window, and the chunk */
    if (ring > 0 && pos0 + ntok > ring && (window <= 0 || window + ntok - 1 > ring))
        return LM_EINVAL;
    *ring_out = ring;
    return LM_OK;
}

int lm_attention_cached_bias(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                             float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                             int64_t window, float softcap, const float *bias,
                             int64_t bias_extent) {
    int64_t ring;
    LM_TRY(cached_rows(cache, layer, pos0, ntok, window, &ring));
    const lm_cache_layer *g = &cache->layers[layer];
    return lm_attention_typed_bias(pool, q, cache->mem + cache->k_off[layer],
                                   cache->mem + cache->v_off[layer], cache->type, kdim(g), ring,
                                   out, ntok, pos0, n_head, g->n_kv_head, g->head_dim_k, scale,
                                   window, softcap, bias, bias_extent);
}

int lm_attention_cached_span(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                             float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                             int64_t window, float softcap, int bidir) {
    int64_t ring;
    LM_TRY(cached_rows(cache, layer, pos0, ntok, window, &ring));
    const lm_cache_layer *g = &cache->layers[layer];
    return lm_attention_span(pool, q, cache->mem + cache->k_off[layer],
                             cache->mem + cache->v_off[layer], cache->type, kdim(g), ring, out,
                             ntok, pos0, n_head, g->n_kv_head, g->head_dim_k, scale, window,
                             softcap, bidir);
}

int lm_attention_cached(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                        float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                        int64_t window, float softcap) {
    return lm_attention_cached_span(pool, q, cache, layer, out, ntok, pos0, n_head, scale,
                                    window, softcap, 0);
}
