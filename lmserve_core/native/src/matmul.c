/*
 * lm_matmul: y (ntok x rows) = x (ntok x cols) . W^T, W quantized row-major.
 *
 * Few tokens (decode): memory-bound, so each weight row is streamed once through the fused
 * decode+dot kernel, each decoded block serving up to 8 tokens; rows are split into a few
 * chunks per thread, claimed dynamically so a descheduled thread does not stall the call.
 * Many tokens (prefill): compute-bound. The tokens are packed once into k-major panels of
 * `nr` tokens; each thread then decodes `mr` weight rows at a time into a small k-major
 * panel (never the whole matrix) and runs an mr x nr register-tiled f32 micro-kernel over
 * every token panel, so each decoded weight is reused ntok times.
 */
#include <stdlib.h>

#include "lm_internal.h"


typedef struct {
    const lm_kernels *k;
    int type;
    const uint8_t *w;
    int64_t rows, cols, ntok, row_bytes;
    const float *x;
    const lm_xq *xq; /* dot path: x quantized (NULL: f32 products) */
    float *y;
    /* GEMM path */
    float *xpack;      /* ceil(ntok / nr) panels of cols x nr */
    uint8_t *scratch;  /* per-thread: mr x cols panel, mr x cols rows, output tile */
    size_t per_thread; /* bytes of scratch per thread */
} mm_ctx;

static inline void split(int64_t n, int task, int n_tasks, int64_t *lo, int64_t *hi) {
    *lo = n * task / n_tasks;
    *hi = n * (task + 1) / n_tasks;
}

/* Run a job on the acquired pool, or inline when there is none. */
static void run_job(lm_pool *acquired, lm_job_fn fn, void *ctx, int64_t n_tasks) {
    if (n_tasks > 0xFFFF) {
        n_tasks = 0xFFFF;
    }
    if (acquired != NULL) {
        lm_pool_run_tasks(acquired, fn, ctx, (int)n_tasks);
    } else {
        for (int t = 0; t < n_tasks; t++) {
            fn(ctx, t, (int)n_tasks, 0);
        }
    }
}

static int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

/* ------------------------------------------------------------------ decode path */
/* Rows [r0, r1) of an interleaved matrix, both rounded down to whole groups of 16 (so the
 * ranges of a split stay a partition). With xq, the integer products; else each row decoded
 * a few blocks at a time and multiplied in f32. */
static void dot_rows_r16(const lm_kernels *k, int type, const uint8_t *w, int64_t r0,
                         int64_t r1, int64_t rows, int64_t cols, const float *x, const lm_xq *xq,
                         int64_t ntok, float *y) {
    const int64_t rb = lm_row_bytes(type, cols), g0 = r0 / R16, g1 = r1 / R16;
    if (g1 <= g0) {
        return;
    }
    if (xq != NULL) {
        /* Many tokens: a tile of row groups (up to 256 KiB of weights) meets a block of tokens
         * (up to 512 KiB of int16 activations) while both stay in the L2 cache; the passes of
         * r16_tokens tokens are the same as without the tiling, so are the outputs. */
        const int64_t tile = R16 * rb, step = k->r16_tokens;
        const int64_t gs = tile >= (256 << 10) ? 1 : (256 << 10) / tile;
        const int64_t ts = ntok < LM_GEMM_MIN_TOKENS || cols * 2 * step >= (512 << 10)
                               ? step
                               : (512 << 10) / (cols * 2) / step * step;
        for (int64_t tb = 0; tb < ntok; tb += ts) {
            const int64_t te = ntok - tb < ts ? ntok : tb + ts;
            for (int64_t g = g0; g < g1; g += gs) {
                const int64_t ng = g1 - g < gs ? g1 - g : gs;
                for (int64_t t = tb; t < te; t += step) {
                    const int64_t nt = te - t < step ? te - t : step;
                    k->dotq_r16[type](w + g * tile, ng, xq, t, (int)nt, y + t * rows + g * R16,
                                      rows);
                }
            }
        }
        return;
    }
    enum { PIECE = 256 }; /* elements of a row decoded at a time */
    const int64_t bb = lm_type_block_bytes(type), be = lm_type_block_elems(type);
    float part[PIECE];
    if (k->panel_r16[type] != NULL) {
        /* the 16 rows of a piece decoded at once (the panel holds deq_r16's values), then
         * each row's products as below, piece after piece: the same sums */
        float panel[PIECE * R16], rows16[R16][PIECE];
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *group = w + g * R16 * rb;
            for (int64_t t = 0; t < ntok; t++) {
                for (int n = 0; n < R16; n++) y[t * rows + g * R16 + n] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < cols; c0 += PIECE) {
                const int64_t len = cols - c0 < PIECE ? cols - c0 : PIECE;
                k->panel_r16[type](group + (c0 / be) * R16 * bb, len, panel, R16);
                for (int64_t e = 0; e < len; e++) {
                    for (int n = 0; n < R16; n++) rows16[n][e] = panel[e * R16 + n];
                }
                for (int n = 0; n < R16; n++) {
                    for (int64_t t = 0; t < ntok; t++) {
                        y[t * rows + g * R16 + n] += k->dot_f32(rows16[n], x + t * cols + c0, len);
                    }
                }
            }
        }
        return;
    }
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *group = w + g * R16 * rb;
        for (int n = 0; n < R16; n++) {
            for (int64_t t = 0; t < ntok; t++) {
                y[t * rows + g * R16 + n] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < cols; c0 += PIECE) {
                const int64_t len = cols - c0 < PIECE ? cols - c0 : PIECE;
                /* columns [c0, c0 + len) of a group are a group of len columns */
                k->deq_r16[type](group + (c0 / be) * R16 * bb, len, n, part);
                for (int64_t t = 0; t < ntok; t++) {
                    y[t * rows + g * R16 + n] += k->dot_f32(part, x + t * cols + c0, len);
                }
            }
        }
    }
}

void lm_matmul_dot_rows(const lm_kernels *k, int type, const uint8_t *w, int64_t r0, int64_t r1,
                        int64_t rows, int64_t cols, const float *x, const lm_xq *xq,
                        int64_t ntok, float *y) {
    if (lm_r16_base(type) >= 0) {
        dot_rows_r16(k, type, w, r0, r1, rows, cols, x, xq, ntok, y);
        return;
    }
    lm_dot_fn dot = k->dot[type];
    lm_dotq_fn dotq = xq != NULL ? k->dotq[type] : NULL;
    lm_dotn_fn dotn = k->dotn[type];
    /* software prefetch ~2 KiB ahead: one thread's stream alone does not keep enough
     * reads in flight to approach the memory bandwidth */
    const int64_t rb = lm_row_bytes(type, cols);
    const int64_t ahead = rb >= 2048 ? rb : 2048 - 2048 % rb + rb;
    const uint8_t *end = w + r1 * rb;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        for (const uint8_t *p = row + ahead; p < row + ahead + rb && p < end; p += 64) {
            __builtin_prefetch(p, 0, 3);
        }
        if (dotq != NULL) {
            for (int64_t t = 0; t < ntok; t += LM_DOTQ_TOKENS) {
                const int64_t nt = ntok - t < LM_DOTQ_TOKENS ? ntok - t : LM_DOTQ_TOKENS;
                dotq(row, xq, t, (int)nt, y + t * rows + r, rows);
            }
        } else if (ntok == 1 || dotn == NULL) {
            for (int64_t t = 0; t < ntok; t++) {
                y[t * rows + r] = dot(row, x + t * cols, cols);
            }
        } else {
            for (int64_t t = 0; t < ntok; t += 8) {
                const int nt = (int)(ntok - t < 8 ? ntok - t : 8);
                dotn(row, x + t * cols, cols, cols, nt, y + t * rows + r, rows);
            }
        }
    }
}

static void mm_dot_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const mm_ctx *c = arg;
    int64_t r0, r1;
    split(c->rows, task, n_tasks, &r0, &r1);
    lm_matmul_dot_rows(c->k, c->type, c->w, r0, r1, c->rows, c->cols, c->x, c->xq, c->ntok,
                       c->y);
}

typedef struct {
    const lm_kernels *k;
    const float *x;
    int64_t ntok;
    lm_xq *xq;
} quant_ctx;

static void quant_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const quant_ctx *c = arg;
    int64_t t0, t1;
    split(c->ntok, task, n_tasks, &t0, &t1);
    lm_xq_fill(c->k, c->x, t0, t1, c->xq);
}

void lm_quantize_acts_on(lm_pool *acquired, const lm_kernels *k, const float *x, int64_t ntok,
                         int64_t cols, void *mem, lm_xq *xq) {
    lm_xq_layout(k, ntok, cols, mem, xq);
    quant_ctx c = {k, x, ntok, xq};
    const int nth = lm_pool_size(acquired);
    run_job(ntok < LM_GEMM_MIN_TOKENS ? NULL : acquired, quant_task, &c,
            ntok < LM_GEMM_MIN_TOKENS || nth == 1 ? 1 : min64(ntok, 4 * nth));
}

/* ------------------------------------------------------------------ GEMM path */
static void mm_pack_x_task(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const mm_ctx *c = arg;
    const int nr = c->k->nr;
    const int64_t K = c->cols;
    const int64_t npanels = (c->ntok + nr - 1) / nr;
    int64_t p0, p1;
    split(npanels, task, n_tasks, &p0, &p1);
    for (int64_t p = p0; p < p1; p++) {
        float *dst = c->xpack + p * K * nr;
        if (c->k->pack_nr != NULL) {
            const int64_t left = c->ntok - p * nr;
            c->k->pack_nr(c->x + p * nr * K, K, (int)(left < nr ? left : nr), K, dst);
            continue;
        }
        for (int t = 0; t < nr; t++) {
            int64_t tok = p * nr + t;
            if (tok < c->ntok) {
                const float *src = c->x + tok * K;
                for (int64_t k = 0; k < K; k++) {
                    dst[k * nr + t] = src[k];
                }
            } else {
                for (int64_t k = 0; k < K; k++) {
                    dst[k * nr + t] = 0.0f;
                }
            }
        }
    }
}

/* Decode weight rows r0 .. r0+nrows into the k-major panel a[k * mr + i] (rows past nrows
 * are zero). An interleaved matrix's groups of 16 rows go straight into the panel where the
 * ISA has a kernel for it; other rows are decoded row-major into `tile` first, then
 * transposed (in column chunks small enough that the panel lines being written stay in L1,
 * when the ISA has no transposition of its own). */
static void mm_pack_a(const mm_ctx *c, int64_t r0, int nrows, float *tile, float *a) {
    const lm_kernels *k = c->k;
    const int mr = k->mr;
    const int64_t K = c->cols;
    if (lm_r16_base(c->type) >= 0 && k->panel_r16[c->type] != NULL && mr % R16 == 0 &&
        K % QK == 0) {
        for (int g = 0; g < nrows / R16; g++) {
            k->panel_r16[c->type](c->w + (r0 / R16 + g) * R16 * c->row_bytes, K, a + g * R16,
                                  mr);
        }
        if (nrows < mr) {
            for (int64_t kk = 0; kk < K; kk++) {
                memset(a + kk * mr + nrows, 0, (size_t)(mr - nrows) * sizeof(float));
            }
        }
        return;
    }
    for (int i = 0; i < nrows; i++) {
        const int64_t r = r0 + i;
        if (lm_r16_base(c->type) >= 0) {
            k->deq_r16[c->type](c->w + (r / R16) * R16 * c->row_bytes, K, (int)(r % R16),
                                tile + (int64_t)i * K);
        } else {
            k->dequant[c->type](c->w + r * c->row_bytes, tile + (int64_t)i * K, K);
        }
    }
    if (nrows < mr) {
        memset(tile + (int64_t)nrows * K, 0, (size_t)(mr - nrows) * (size_t)K * sizeof(float));
    }
    if (k->panel != NULL) {
        k->panel(tile, K, a);
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        const int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
        for (int i = 0; i < mr; i++) {
            const float *src = tile + (int64_t)i * K;
            for (int64_t kk = k0; kk < k1; kk++) {
                a[kk * mr + i] = src[kk];
            }
        }
    }
}

/* Row panel rp of a product: its weights decoded once, then every token panel. */
static void mm_gemm_panel(const mm_ctx *c, int64_t rp, int thread) {
    const lm_kernels *k = c->k;
    const int mr = k->mr, nr = k->nr;
    const int64_t K = c->cols;
    float *apanel = (float *)(c->scratch + (size_t)thread * c->per_thread);
    float *tile = apanel + (size_t)mr * K;
    float *cbuf = tile + (size_t)mr * K; /* nr x mr tile */
    const int64_t ntp = (c->ntok + nr - 1) / nr;
    const int64_t r0 = rp * mr;
    const int nrows = (int)(c->rows - r0 < mr ? c->rows - r0 : mr);
    mm_pack_a(c, r0, nrows, tile, apanel);
    for (int64_t tp = 0; tp < ntp; tp++) {
        k->gemm(apanel, c->xpack + tp * K * nr, K, cbuf);
        const int64_t t0 = tp * nr;
        const int ntk = (int)(c->ntok - t0 < nr ? c->ntok - t0 : nr);
        for (int t = 0; t < ntk; t++) {
            memcpy(c->y + (t0 + t) * c->rows + r0, cbuf + t * mr, (size_t)nrows * sizeof(float));
        }
    }
}

static void mm_gemm_task(void *arg, int task, int n_tasks, int thread) {
    const mm_ctx *c = arg;
    const int64_t nrp = (c->rows + c->k->mr - 1) / c->k->mr;
    int64_t p0, p1;
    split(nrp, task, n_tasks, &p0, &p1);
    for (int64_t rp = p0; rp < p1; rp++) {
        mm_gemm_panel(c, rp, thread);
    }
}

/* Several products of one input: task t is row panel t of their concatenated panels. */
typedef struct {
    const mm_ctx *cs;
    int n;
    const int64_t *first; /* first[i]: the first panel of product i; first[n]: all of them */
} mm_group;

static void mm_group_task(void *arg, int task, int n_tasks, int thread) {
    (void)n_tasks;
    const mm_group *g = arg;
    int i = 0;
    while (task >= g->first[i + 1]) {
        i++;
    }
    mm_gemm_panel(&g->cs[i], task - g->first[i], thread);
}

static size_t align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

int lm_matmul(lm_pool *pool, int type, const void *w, int64_t rows, int64_t cols,
              const float *x, int64_t ntok, float *y) {
    if (lm_type_block_elems(type) <= 0) {
        return LM_ETYPE;
    }
    const int64_t rb = lm_row_bytes(type, cols);
    if (rb < 0 || rows < 0 || ntok < 0 || (lm_r16_base(type) >= 0 && rows % R16 != 0)) {
        return LM_EINVAL;
    }
    if (rows == 0 || ntok == 0) {
        return LM_OK;
    }
    if (w == NULL || x == NULL || y == NULL) {
        return LM_EINVAL;
    }
    if (cols == 0) {
        memset(y, 0, (size_t)(rows * ntok) * sizeof(float));
        return LM_OK;
    }
    mm_ctx c = {
        .k = lm_kernels_active(),
        .type = type,
        .w = w,
        .rows = rows,
        .cols = cols,
        .ntok = ntok,
        .row_bytes = rb,
        .x = x,
        .y = y,
    };
    lm_pool *acq = lm_pool_acquire(pool) ? pool : NULL;
    const int nth = lm_pool_size(acq);

    const int ints = lm_int_products(c.k, type, ntok);
    if (ntok < LM_GEMM_MIN_TOKENS || ints) {
        lm_xq xq;
        void *own = NULL;
        if (ints) {
            const size_t bytes = lm_xq_bytes(ntok, cols);
            void *mem = acq != NULL ? lm_pool_scratch(acq, bytes) : (own = lm_aligned_alloc(bytes));
            if (mem == NULL) {
                if (acq != NULL) {
                    lm_pool_release(acq);
                }
                return LM_ENOMEM;
            }
            lm_quantize_acts_on(acq, c.k, x, ntok, cols, mem, &xq);
            c.xq = &xq;
        }
        /* a few row chunks per thread balance the load when a thread runs late */
        run_job(acq, mm_dot_task, &c, nth == 1 ? 1 : min64((rows + 15) / 16, 8 * nth));
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        lm_aligned_free(own);
        return LM_OK;
    }

    const int mr = c.k->mr, nr = c.k->nr;
    const int64_t n_xpanels = (ntok + nr - 1) / nr;
    const size_t xbytes =
        align64((size_t)n_xpanels * (size_t)nr * (size_t)cols * sizeof(float));
    c.per_thread = align64((2 * (size_t)mr * (size_t)cols + (size_t)mr * nr) * sizeof(float));
    const size_t total = xbytes + c.per_thread * (size_t)nth;
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, total) : lm_aligned_alloc(total);
    if (mem == NULL) {
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return LM_ENOMEM;
    }
    c.xpack = (float *)mem;
    c.scratch = mem + xbytes;
    run_job(acq, mm_pack_x_task, &c, nth == 1 ? 1 : min64(n_xpanels, 4 * nth));
    /* one task per panel of weight rows */
    run_job(acq, mm_gemm_task, &c, nth == 1 ? 1 : (rows + mr - 1) / mr);
    if (acq != NULL) {
        lm_pool_release(acq);
    } else {
        lm_aligned_free(mem);
    }
    return LM_OK;
}

/* Products of many tokens sharing one input x (ntok, cols) (q, k and v; gate and up): x is
 * packed once and every product's row panels run in one dispatch. */
int lm_matmul_group(lm_pool *pool, const lm_mm *mms, int n, int64_t ntok) {
    enum { MAX_GROUP = 4 };
    if (n < 1 || n > MAX_GROUP || mms == NULL || ntok < LM_GEMM_MIN_TOKENS) {
        return LM_EINVAL;
    }
    const int64_t cols = mms[0].cols;
    const float *x = mms[0].x;
    mm_ctx cs[MAX_GROUP];
    int64_t first[MAX_GROUP + 1] = {0};
    const lm_kernels *k = lm_kernels_active();
    for (int i = 0; i < n; i++) {
        const lm_mm *m = &mms[i];
        const int64_t rb = lm_row_bytes(m->w.type, cols);
        if (lm_type_block_elems(m->w.type) <= 0) {
            return LM_ETYPE;
        }
        if (m->x != x || m->cols != cols || rb < 0 || m->rows <= 0 || cols <= 0 ||
            m->w.data == NULL || m->y == NULL ||
            (lm_r16_base(m->w.type) >= 0 && m->rows % R16 != 0)) {
            return LM_EINVAL;
        }
        cs[i] = (mm_ctx){.k = k, .type = m->w.type, .w = m->w.data, .rows = m->rows,
                         .cols = cols, .ntok = ntok, .row_bytes = rb, .x = x, .y = m->y};
        first[i + 1] = first[i] + (m->rows + k->mr - 1) / k->mr;
    }
    if (first[n] > 0xFFFF) { /* a task a panel: more than a dispatch takes */
        for (int i = 0; i < n; i++) {
            LM_TRY(lm_matmul(pool, mms[i].w.type, mms[i].w.data, mms[i].rows, cols, x, ntok,
                             mms[i].y));
        }
        return LM_OK;
    }
    lm_pool *acq = lm_pool_acquire(pool) ? pool : NULL;
    const int nth = lm_pool_size(acq);
    const int mr = k->mr, nr = k->nr;
    const int64_t n_xpanels = (ntok + nr - 1) / nr;
    const size_t xbytes = align64((size_t)n_xpanels * (size_t)nr * (size_t)cols * sizeof(float));
    const size_t per_thread = align64((2 * (size_t)mr * (size_t)cols + (size_t)mr * nr) *
                                      sizeof(float));
    const size_t total = xbytes + per_thread * (size_t)nth;
    uint8_t *mem = acq != NULL ? lm_pool_scratch(acq, total) : lm_aligned_alloc(total);
    if (mem == NULL) {
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return LM_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        cs[i].xpack = (float *)mem;
        cs[i].scratch = mem + xbytes;
        cs[i].per_thread = per_thread;
    }
    run_job(acq, mm_pack_x_task, &cs[0], nth == 1 ? 1 : min64(n_xpanels, 4 * nth));
    mm_group g = {cs, n, first};
    run_job(acq, mm_group_task, &g, first[n]);
    if (acq != NULL) {
        lm_pool_release(acq);
    } else {
        lm_aligned_free(mem);
    }
    return LM_OK;
}
