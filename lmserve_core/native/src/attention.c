/*
 * Causal grouped-query attention over an f32 KV cache. Two-pass softmax per (token, head):
 * scores into a per-thread buffer, max-subtracted exp, then the weighted sum of values.
 */
#include <math.h>
#include <stdatomic.h>

#include "lm_internal.h"

typedef struct {
    const lm_kernels *k;
    const float *q, *kc, *vc;
    float *out;
    int64_t ntok, pos0, window, n_ctx;
    int n_head, n_kv_head, head_dim;
    float scale, softcap;
    float *scores; /* nth x n_ctx */
} attn_ctx;

static void attn_task(void *arg, int task, int n_tasks, int thread) {
    const attn_ctx *c = arg;
    const lm_kernels *k = c->k;
    const int hd = c->head_dim;
    const int group = c->n_head / c->n_kv_head;
    const int64_t kv_stride = (int64_t)c->n_kv_head * hd;
    float *sc = c->scores + (size_t)thread * (size_t)c->n_ctx;
    const int64_t items = c->ntok * c->n_head;
    const int64_t i0 = items * task / n_tasks, i1 = items * (task + 1) / n_tasks;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / c->n_head;
        const int h = (int)(it % c->n_head);
        const int kvh = h / group;
        const int64_t pos = c->pos0 + t;
        const int64_t lo = c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
        const int64_t n = pos - lo + 1;
        const float *qv = c->q + it * hd;
        const float *kb = c->kc + lo * kv_stride + (int64_t)kvh * hd;
        const float *vb = c->vc + lo * kv_stride + (int64_t)kvh * hd;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float s = k->dot_f32(qv, kb + j * kv_stride, hd) * c->scale;
            if (c->softcap > 0.0f) {
                s = c->softcap * tanhf(s / c->softcap);
            }
            sc[j] = s;
            mx = s > mx ? s : mx;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sc[j] = expf(sc[j] - mx);
            sum += sc[j];
        }
        float *o = c->out + it * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int64_t j = 0; j < n; j++) {
            k->axpy_f32(o, sc[j], vb + j * kv_stride, hd);
        }
        k->scale_f32(o, 1.0f / sum, hd);
    }
}

int lm_attention(lm_pool *pool, const float *q, const float *k, const float *v, float *out,
                 int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                 float scale, int64_t window, float softcap) {
    if (ntok < 0 || pos0 < 0 || n_head <= 0 || n_kv_head <= 0 || head_dim <= 0 ||
        n_head % n_kv_head != 0 || window < 0 || !(softcap >= 0.0f)) {
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
    const int nth = lm_pool_size(acq);
    const size_t bytes = (size_t)nth * (size_t)c.n_ctx * sizeof(float);
    c.scores = acq != NULL ? lm_pool_scratch(acq, bytes) : lm_aligned_alloc(bytes);
    if (c.scores == NULL) {
        if (acq != NULL) {
            lm_pool_release(acq);
        }
        return LM_ENOMEM;
    }
    if (acq != NULL) {
        const int64_t items = ntok * n_head;
        const int64_t n_tasks = items < 8 * nth ? items : 8 * nth;
        lm_pool_run_tasks(acq, attn_task, &c, (int)n_tasks);
        lm_pool_release(acq);
    } else {
        attn_task(&c, 0, 1, 0);
        lm_aligned_free(c.scores);
    }
    return LM_OK;
}
