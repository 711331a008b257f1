/*
 * Leaf ops of a forward pass, one thread each: norms, rotary embedding, activations.
 */
#include <math.h>

#include "lm_internal.h"

void lm_rmsnorm(float *out, const float *x, const float *weight, int64_t n, float eps) {
    if (n <= 0) {
        return;
    }
    /* double accumulation: n is small and the mean of squares then rounds once */
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) {
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
    /* one cos/sin per frequency, shared by all heads; the angle is formed in float like the
     * float32 references (inv_freq, then pos * inv_freq), the cos/sin taken in double */
    float cs[512], sn[512];
    const float p = (float)pos * freq_scale;
    for (int i0 = 0; i0 < half; i0 += 512) {
        const int cnt = half - i0 < 512 ? half - i0 : 512;
        for (int i = 0; i < cnt; i++) {
            const float inv_freq =
                1.0f / powf(freq_base, (float)(2 * (i0 + i)) / (float)n_rot);
            const double theta = (double)(p * inv_freq);
            cs[i] = (float)cos(theta);
            sn[i] = (float)sin(theta);
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

void lm_softmax(float *x, int64_t n) {
    if (n <= 0) {
        return;
    }
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) {
        x[i] *= inv;
    }
}

void lm_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void lm_gelu_mul(float *out, const float *gate, const float *up, int64_t n) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * up[i];
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
