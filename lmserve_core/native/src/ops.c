/*
 * Leaf ops of a forward pass, one thread each: norms, rotary embedding, activations.
 */
#include <math.h>

#include "lm_internal.h"

void lm_rmsnorm(float *out, const float *x, const float *weight, int64_t n, float eps) {
    if (n <= 0) {
        return;
    }
    /* double accumulation (each square is exact in a double; the mean of squares rounds to
     * float once), in eight partial sums added in a fixed order: the same bits on every
     * path, without one chain of dependent additions the length of the row */
    double part[8] = {0.0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; l++) {
            part[l] += (double)x[i + l] * (double)x[i + l];
        }
    }
    double ss = ((part[0] + part[1]) + (part[2] + part[3])) +
                ((part[4] + part[5]) + (part[6] + part[7]));
    for (; i < n; i++) {
        ss += (double)x[i] * (double)x[i];
    }
    const float mean = (float)(ss / (double)n);
    const float inv = 1.0f / sqrtf(mean + eps);
    if (weight != NULL) {
        for (int64_t i = 0; i < n; i++) {
            out[i] = (x[i] * inv) * weight[i];
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            out[i] = x[i] * inv;
        }
    }
}

/* 1 / base^(2i / n_rot) for the last (base, n_rot) a thread used: a forward pass calls
 * lm_rope with the same pair for every token and layer. */
#define ROPE_CACHE 256
static _Thread_local struct {
    float base;
    int n_rot;
    float inv_freq[ROPE_CACHE];
} rope_cache;

static float rope_inv_freq(float base, int n_rot, int i) {
    return 1.0f / powf(base, (float)(2 * i) / (float)n_rot);
}

void lm_rope(float *x, int n_heads, int head_dim, int n_rot, int64_t pos, float freq_base,
             float freq_scale, int mode) {
    if (n_rot > head_dim) {
        n_rot = head_dim;
    }
    n_rot &= ~1;
    if (n_rot <= 0 || n_heads <= 0) {
        return;
    }
    const int half = n_rot / 2;
    const int cached = half <= ROPE_CACHE;
    if (cached && (rope_cache.n_rot != n_rot || rope_cache.base != freq_base)) {
        for (int i = 0; i < half; i++) {
            rope_cache.inv_freq[i] = rope_inv_freq(freq_base, n_rot, i);
        }
        rope_cache.base = freq_base;
        rope_cache.n_rot = n_rot;
    }
    /* the angle is formed in float like the float32 references (inv_freq, then
     * pos * inv_freq); one cos/sin per frequency, shared by all heads */
    float cs[128], sn[128];
    const float p = (float)pos * freq_scale;
    for (int i0 = 0; i0 < half; i0 += 128) {
        const int cnt = half - i0 < 128 ? half - i0 : 128;
        for (int i = 0; i < cnt; i++) {
            const float inv =
                cached ? rope_cache.inv_freq[i0 + i] : rope_inv_freq(freq_base, n_rot, i0 + i);
            const float theta = p * inv;
            cs[i] = cosf(theta);
            sn[i] = sinf(theta);
        }
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (int64_t)h * head_dim;
            for (int i = 0; i < cnt; i++) {
                const int a = mode == LM_ROPE_NEOX ? i0 + i : 2 * (i0 + i);
                const int b = mode == LM_ROPE_NEOX ? i0 + i + half : a + 1;
                const float x0 = v[a], x1 = v[b];
                v[a] = x0 * cs[i] - x1 * sn[i];
                v[b] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
}

#undef ROPE_CACHE

void lm_softmax(float *x, int64_t n) {
    if (n <= 0) {
        return;
    }
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
    }
    const lm_kernels *k = lm_kernels_active();
    k->scale_f32(x, 1.0f / k->exp_sum(x, n, mx), n);
}

void lm_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    if (n > 0) {
        lm_kernels_active()->silu_mul(out, gate, up, n);
    }
}

void lm_gelu_mul(float *out, const float *gate, const float *up, int64_t n) {
    if (n > 0) {
        lm_kernels_active()->gelu_mul(out, gate, up, n);
    }
}

void lm_add(float *out, const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = a[i] + b[i];
    }
}

void lm_scale(float *x, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        x[i] *= s;
    }
}
