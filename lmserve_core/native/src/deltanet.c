/*
 * The gated DeltaNet mixer (lm_deltanet, lmserve/types.h): linear attention whose memory is
 * a recurrent state per sequence instead of K/V rows.
 *
 * A chunk's rows go through the input products together; then each sequence's rows run its
 * causal convolution from the inputs its state kept, and the delta rule token by token,
 * every (sequence, value head) pair on its own thread; the gated output norm and the output
 * product run over the whole chunk again. The state a sequence keeps in its cache layer:
 * the convolution's last conv_kernel - 1 inputs (conv_kernel - 1, conv_dim), then the
 * (head_k, head_v) matrix of every value head.
 */
#include <math.h>

#include "lm_internal.h"

#define DN_MAX_HEAD 1024   /* widest key / value head */
#define DN_MAX_KERNEL 64   /* widest convolution */

static int64_t dn_conv_dim(const lm_deltanet *d) {
    return 2 * (int64_t)d->n_k_head * d->head_k + (int64_t)d->n_v_head * d->head_v;
}

/* f32 values of the state one sequence keeps for the layer. */
static int64_t dn_state_size(const lm_deltanet *d) {
    return (int64_t)(d->conv_kernel - 1) * dn_conv_dim(d) +
           (int64_t)d->n_v_head * d->head_k * d->head_v;
}

static float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static float dn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* x[0..n) scaled to unit L2 norm: x / sqrt(sum x^2 + eps), times `scale`. */
static void dn_l2norm(float *x, int64_t n, float eps, float scale) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float inv = 1.0f / sqrtf((float)ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv * scale;
}

/* The key head value head j reads. */
static int dn_key_head(const lm_deltanet *d, int j) {
    return d->head_map == LM_HEADS_GROUPED ? j / (d->n_v_head / d->n_k_head) : j % d->n_k_head;
}

/* Rows [0, m) of one sequence's channels (m, conv_dim) in place: the causal depthwise
 * convolution over the inputs `held` kept ((K - 1) rows before them), then SiLU; `held`
 * then keeps the last K - 1 inputs, and so does each snapshot planned inside the rows.
 * win is scratch of (K - 1 + m) rows. */
static void dn_conv(const lm_deltanet *d, const lm_seq *sq, int layer, float *held, float *rows,
                    int64_t m, float *win) {
    const int64_t C = dn_conv_dim(d);
    const int K = d->conv_kernel;
    memcpy(win, held, sizeof(float) * (size_t)((K - 1) * C));
    memcpy(win + (K - 1) * C, rows, sizeof(float) * (size_t)(m * C));
    for (int64_t t = 0; t < m; t++) {
        float *out = rows + t * C;
        for (int64_t c = 0; c < C; c++) {
            const float *w = d->conv + c * K;
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += w[k] * win[(t + k) * C + c];
            out[c] = acc / (1.0f + expf(-acc)); /* silu */
        }
    }
    memcpy(held, win + m * C, sizeof(float) * (size_t)((K - 1) * C));
    for (int64_t t = 1; t < m; t++) { /* a checkpoint after t rows: the inputs before it */
        float *kept = lm_cache_snapshot_layer(sq->cache, sq->pos + t, layer);
        if (kept != NULL) memcpy(kept, win + t * C, sizeof(float) * (size_t)((K - 1) * C));
    }
}

typedef struct {
    const lm_deltanet *d;
    const lm_seq *seqs;
    int layer;
    const int64_t *row0;   /* (n_seqs) first row of each sequence in the chunk */
    int n_pairs;           /* n_seqs * n_v_head */
    const float *qkv;      /* (ntok, conv_dim) convolved, q and k normed */
    const float *g;        /* (ntok, n_v_head) log of the decay */
    const float *beta;     /* (ntok, n_v_head) */
    float *o;              /* (ntok, n_v_head * head_v) */
} dn_job;

/* The delta rule over one sequence's rows for one value head. */
static void dn_head(const dn_job *j, int s, int h) {
    const lm_deltanet *d = j->d;
    const lm_kernels *kt = lm_kernels_active();
    const int64_t C = dn_conv_dim(d), KD = (int64_t)d->n_k_head * d->head_k;
    const int64_t VD = (int64_t)d->n_v_head * d->head_v;
    const int hk = d->head_k, hv = d->head_v, kh = dn_key_head(d, h);
    const lm_seq *sq = &j->seqs[s];
    float *state = lm_cache_layer_state(sq->cache, j->layer);
    float *S = state + (int64_t)(d->conv_kernel - 1) * C + (int64_t)h * hk * hv;
    float kv[DN_MAX_HEAD];
    for (int64_t r = j->row0[s]; r < j->row0[s] + sq->ntok; r++) {
        const float *q = j->qkv + r * C + (int64_t)kh * hk;
        const float *k = q + KD;
        const float *v = j->qkv + r * C + 2 * KD + (int64_t)h * hv;
        const float decay = expf(j->g[r * d->n_v_head + h]);
        const float beta = j->beta[r * d->n_v_head + h];
        float *o = j->o + r * VD + (int64_t)h * hv;
        memset(kv, 0, sizeof(float) * (size_t)hv);
        for (int i = 0; i < hk; i++) { /* S *= decay; kv = S^T k */
            kt->scale_axpy_f32(S + (int64_t)i * hv, decay, k[i], kv, hv);
        }
        for (int c = 0; c < hv; c++) kv[c] = (v[c] - kv[c]) * beta;
        memset(o, 0, sizeof(float) * (size_t)hv);
        for (int i = 0; i < hk; i++) { /* S += k (x) kv; o = S^T q */
            kt->axpy2_f32(S + (int64_t)i * hv, k[i], kv, q[i], o, hv);
        }
        const int64_t end = sq->pos + (r - j->row0[s]) + 1; /* positions read so far */
        float *kept = end < sq->pos + sq->ntok ? lm_cache_snapshot_layer(sq->cache, end, j->layer)
                                               : NULL;
        if (kept != NULL) {
            float *dst = kept + (S - state);
            memcpy(dst, S, sizeof(float) * (size_t)hk * (size_t)hv);
        }
    }
}

static void dn_run(void *ctx, int ith, int nth) {
    const dn_job *j = ctx;
    const int lo = (int)((int64_t)j->n_pairs * ith / nth);
    const int hi = (int)((int64_t)j->n_pairs * (ith + 1) / nth);
    for (int p = lo; p < hi; p++) dn_head(j, p / j->d->n_v_head, p % j->d->n_v_head);
}

int lm_deltanet_check(const lm_base *b, const lm_deltanet *d, int layer) {
    if (d->n_k_head <= 0 || d->n_v_head <= 0 || d->n_v_head % d->n_k_head != 0 ||
        d->n_v_head > 4096 || d->head_k <= 0 || d->head_k > DN_MAX_HEAD ||
        d->head_v <= 0 || d->head_v > DN_MAX_HEAD || d->conv_kernel < 1 ||
        d->conv_kernel > DN_MAX_KERNEL || !(d->norm_eps >= 0.0f) ||
        (d->head_map != LM_HEADS_TILED && d->head_map != LM_HEADS_GROUPED) || d->conv == NULL ||
        d->a == NULL || d->dt_bias == NULL || d->norm == NULL)
        return LM_EINVAL;
    const int64_t D = b->n_embd, VD = (int64_t)d->n_v_head * d->head_v;
    if (lm_row_bytes(d->wqkv.type, D) <= 0 || d->wqkv.data == NULL || d->wz.data == NULL ||
        lm_row_bytes(d->wz.type, D) <= 0 || d->wo.data == NULL || lm_row_bytes(d->wo.type, VD) <= 0)
        return LM_ETYPE;
    if (d->wba.data != NULL) {
        if (lm_row_bytes(d->wba.type, D) <= 0) return LM_ETYPE;
    } else if (d->wa.data == NULL || d->wb.data == NULL || lm_row_bytes(d->wa.type, D) <= 0 ||
               lm_row_bytes(d->wb.type, D) <= 0) {
        return LM_ETYPE;
    }
    if (layer >= 0 && layer < b->n_layer) {
        const lm_cache_layer *g = &b->cache_layers[layer];
        if (g->state != dn_state_size(d)) return LM_EMISMATCH;
    }
    return LM_OK;
}

int lm_deltanet_mixer(lm_base *b, const lm_deltanet *d, int layer, const float *x, int64_t ntok,
                      float *y) {
    if (b == NULL || d == NULL || x == NULL || y == NULL || layer < 0 || layer >= b->n_layer ||
        ntok < 0 || ntok > b->n_batch || b->seqs == NULL)
        return LM_EINVAL;
    LM_TRY(lm_deltanet_check(b, d, layer));
    if (ntok == 0) return LM_OK;
    const int64_t D = b->n_embd, C = dn_conv_dim(d), KD = (int64_t)d->n_k_head * d->head_k;
    const int64_t VD = (int64_t)d->n_v_head * d->head_v, NV = d->n_v_head;
    const int K = d->conv_kernel;
    int64_t longest = 0;
    for (int s = 0; s < b->n_seqs; s++) longest = b->seqs[s].ntok > longest ? b->seqs[s].ntok : longest;
    float *qkv, *z, *ba, *g, *beta, *o, *win, *row0_f;
    float **bufs[] = {&qkv, &z, &ba, &g, &beta, &o, &win, &row0_f};
    const int64_t lens[] = {ntok * C, ntok * VD, ntok * 2 * NV, ntok * NV, ntok * NV,
                            ntok * VD, (K - 1 + longest) * C, 2 * (int64_t)b->n_seqs};
    LM_TRY(carve(b, 8, bufs, lens));
    int64_t *row0 = (int64_t *)(void *)row0_f;
    lm_pool *pool = b->pool;

    /* the input products; beta and alpha side by side per row: [beta (NV), alpha (NV)] */
    if (d->wba.data != NULL) {
        const lm_mm mms[3] = {{d->wqkv, C, D, x, qkv}, {d->wz, VD, D, x, z},
                              {d->wba, 2 * NV, D, x, ba}};
        LM_TRY(lm_matmuls(pool, mms, 3, ntok));
        /* per key head: its r beta rows then its r alpha rows */
        const int r = d->n_v_head / d->n_k_head;
        float row[2 * 4096];
        for (int64_t t = 0; t < ntok; t++) {
            float *bt = ba + t * 2 * NV;
            memcpy(row, bt, sizeof(float) * (size_t)(2 * NV));
            for (int gk = 0; gk < d->n_k_head; gk++)
                for (int i = 0; i < r; i++) {
                    bt[gk * r + i] = row[gk * 2 * r + i];
                    bt[NV + gk * r + i] = row[gk * 2 * r + r + i];
                }
        }
    } else {
        /* beta and alpha of every row land in two (ntok, NV) blocks, moved next */
        const lm_mm mms[4] = {{d->wqkv, C, D, x, qkv}, {d->wz, VD, D, x, z},
                              {d->wb, NV, D, x, g}, {d->wa, NV, D, x, beta}};
        LM_TRY(lm_matmuls(pool, mms, 4, ntok));
        for (int64_t t = 0; t < ntok; t++) {
            memcpy(ba + t * 2 * NV, g + t * NV, sizeof(float) * (size_t)NV);
            memcpy(ba + t * 2 * NV + NV, beta + t * NV, sizeof(float) * (size_t)NV);
        }
    }
    for (int64_t t = 0; t < ntok; t++) {
        const float *bt = ba + t * 2 * NV;
        for (int h = 0; h < NV; h++) {
            beta[t * NV + h] = dn_sigmoid(bt[h]);
            g[t * NV + h] = d->a[h] * dn_softplus(bt[NV + h] + d->dt_bias[h]);
        }
    }

    /* each sequence's convolution from its kept inputs; then q, k to unit norm (q also
     * scaled by 1 / sqrt(head_k)) */
    int64_t at = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const lm_seq *sq = &b->seqs[s];
        float *state = lm_cache_layer_state(sq->cache, layer);
        if (state == NULL || at + sq->ntok > ntok) return LM_EMISMATCH;
        row0[s] = at;
        dn_conv(d, sq, layer, state, qkv + at * C, sq->ntok, win);
        at += sq->ntok;
    }
    if (at != ntok) return LM_EINVAL;
    const float qscale = 1.0f / sqrtf((float)d->head_k);
    for (int64_t t = 0; t < ntok; t++) {
        for (int h = 0; h < d->n_k_head; h++) {
            dn_l2norm(qkv + t * C + (int64_t)h * d->head_k, d->head_k, d->norm_eps, qscale);
            dn_l2norm(qkv + t * C + KD + (int64_t)h * d->head_k, d->head_k, d->norm_eps, 1.0f);
        }
    }

    /* the delta rule: every (sequence, value head) pair on its own */
    dn_job job = {d, b->seqs, layer, row0, b->n_seqs * d->n_v_head, qkv, g, beta, o};
    lm_pool_run(ntok * NV * d->head_k * d->head_v >= 16384 ? pool : NULL, dn_run, &job);

    /* the gated output norm, then the output product */
    for (int64_t t = 0; t < ntok; t++) {
        for (int h = 0; h < NV; h++) {
            float *oh = o + t * VD + (int64_t)h * d->head_v;
            lm_rmsnorm(oh, oh, d->norm, d->head_v, d->norm_eps);
        }
    }
    LM_TRY(lm_glu_rows(pool, o, z, o, ntok * VD, LM_ACT_SILU));
    return lm_matmul(pool, d->wo.type, d->wo.data, D, VD, o, ntok, y);
}

lm_cache_layer lm_deltanet_geometry(const lm_deltanet *d) {
    return (lm_cache_layer){0, 0, 0, 0, dn_state_size(d)};
}

#undef DN_MAX_HEAD
#undef DN_MAX_KERNEL
