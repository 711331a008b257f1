/*
 * Every entry of the x86 kernel tables on fixed random inputs, without Python.
 *
 *   check_kernels_x86 dump   one line per output: path, case, FNV-1a hash of its bytes (a
 *                            change that must keep every bit diffs two dumps)
 *   check_kernels_x86        the AVX-512 table against the AVX2 one (and dequantization
 *                            against the portable path): bit for bit where the kernels
 *                            promise it, else within float rounding; "N passed, M failed",
 *                            exit status 1 on a failure, 2 without an AVX-512 path
 *
 * Built natively, or with AVX-512 emulated by SIMDe on a CPU without it (-include
 * simde_avx512.h): tests/test_kernels_avx512_emulated.py.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmserve/kernels.h"
#include "lmserve/kernels_impl.h"

#include "rng.h"

static void fill(float *x, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * 0.5f * (uniform() + 1.0f);
}

/* Random blocks with sane f16 scales and mins: byte offsets of the d (and m) fields. */
static void random_rows(int type, uint8_t *w, int64_t n) {
    const int64_t nb = n / lm_type_block_elems(type), bb = lm_type_block_bytes(type);
    if (type == LM_F32 || type == LM_F16 || type == LM_BF16) {
        for (int64_t i = 0; i < n; i++) {
            const float v = uniform();
            if (type == LM_F32) memcpy(w + 4 * i, &v, 4);
            if (type == LM_F16) {
                const lm_half h = lm_float_to_half(v);
                memcpy(w + 2 * i, &h, 2);
            }
            if (type == LM_BF16) {
                uint32_t u;
                memcpy(&u, &v, 4);
                const uint16_t h = (uint16_t)(u >> 16);
                memcpy(w + 2 * i, &h, 2);
            }
        }
        return;
    }
    for (int64_t i = 0; i < nb * bb; i++) w[i] = (uint8_t)next();
    int d = 0, m = -1;
    switch (type) {
    case LM_Q4_1:
    case LM_Q5_1:
    case LM_Q4_K:
    case LM_Q5_K: m = 2; break;
    case LM_Q6_K: d = 208; break;
    default: break;
    }
    for (int64_t b = 0; b < nb; b++) {
        const lm_half hd = lm_float_to_half(0.001f + 0.02f * (uniform() + 1.0f));
        const lm_half hm = lm_float_to_half(0.01f * uniform());
        memcpy(w + b * bb + d, &hd, 2);
        if (m >= 0) memcpy(w + b * bb + m, &hm, 2);
    }
}

/* ------------------------------------------------------------------ outputs */
/* EXACT: the AVX2 bits; CLOSE: within float rounding of them (a different order of the
 * sums, an FMA in a tail, another exp); PORTABLE_EXACT: the portable path's bits */
enum { EXACT, CLOSE, PORTABLE_EXACT };

typedef struct {
    char name[112];
    int kind;
    size_t bytes;
    float tol; /* CLOSE: |got - want| <= tol * max(1, max |want|) */
    unsigned char *data;
} output;

/* by path (portable, AVX2, AVX-512): a table without a kernel records no output for it */
static output g_out[3][12000];
static int g_nout[3], g_path;

/* Record `bytes` at p as output `name` of the running path; outputs of one name are
 * numbered in their order. */
static void rec(const char *name, int kind, float tol, const void *p, size_t bytes) {
    if (g_nout[g_path] == (int)(sizeof g_out[0] / sizeof g_out[0][0])) {
        printf("too many outputs\n");
        exit(2);
    }
    output *o = &g_out[g_path][g_nout[g_path]];
    int seq = 0;
    for (int i = g_nout[g_path] - 1; i >= 0; i--) {
        const char *prev = g_out[g_path][i].name;
        if (strncmp(prev, name, strlen(name)) != 0 || prev[strlen(name)] != ' ') break;
        seq++;
    }
    snprintf(o->name, sizeof o->name, "%s #%d", name, seq);
    o->kind = kind;
    o->tol = tol;
    o->bytes = bytes;
    o->data = malloc(bytes ? bytes : 1);
    memcpy(o->data, p, bytes);
    g_nout[g_path]++;
}

static const output *find(int path, const char *name) {
    for (int i = 0; i < g_nout[path]; i++)
        if (strcmp(g_out[path][i].name, name) == 0) return &g_out[path][i];
    return NULL;
}

/* ------------------------------------------------------------------ cases */
static const int BLOCK_TYPES[] = {LM_Q4_0, LM_Q4_1, LM_Q5_0, LM_Q5_1, LM_Q8_0, LM_Q4_K,
                                  LM_Q5_K, LM_Q6_K, LM_Q2_0, LM_Q2_0_128};
static const int ELEM_TYPES[] = {LM_F32, LM_F16, LM_BF16};

/* dequantize (the portable bits) and dot (within rounding) of a row of n elements */
static void run_row(const lm_kernels *k, int type, const uint8_t *w, const float *x, int64_t n,
                    float tol) {
    char nm[96];
    float *y = malloc(sizeof(float) * n);
    k->dequant[type](w, y, n);
    snprintf(nm, sizeof nm, "dequant type=%d n=%lld", type, (long long)n);
    rec(nm, PORTABLE_EXACT, 0, y, sizeof(float) * n);
    const float d = k->dot[type](w, x, n);
    snprintf(nm, sizeof nm, "dot type=%d n=%lld", type, (long long)n);
    rec(nm, CLOSE, tol, &d, sizeof d);
    free(y);
}

static void run_rows(const lm_kernels *k) {
    char nm[96];
    const int mults[] = {1, 2, 3, 5, 7, 8, 13};
    for (size_t ti = 0; ti < sizeof BLOCK_TYPES / sizeof *BLOCK_TYPES; ti++) {
        const int type = BLOCK_TYPES[ti];
        const int64_t qk = lm_type_block_elems(type);
        for (size_t mi = 0; mi < sizeof mults / sizeof *mults; mi++) {
            const int64_t n = qk * mults[mi];
            if (n % 32) continue;
            g_rng = 0x9E3779B97F4A7C15ull + (uint64_t)(type * 131 + mults[mi]);
            uint8_t *w = malloc((size_t)lm_row_bytes(type, n));
            random_rows(type, w, n);
            float *x = malloc(sizeof(float) * (size_t)(8 * n));
            fill(x, 8 * n, -1.0f, 1.0f);
            run_row(k, type, w, x, n, 1e-4f);
            for (int nt = 1; nt <= 8 && k->dotn[type]; nt++) {
                float out[8];
                k->dotn[type](w, x, n, n, nt, out, 1);
                snprintf(nm, sizeof nm, "dotn type=%d n=%lld nt=%d", type, (long long)n, nt);
                rec(nm, CLOSE, 1e-4f, out, sizeof(float) * nt);
            }
            if (k->dotq[type]) {
                int16_t *q = malloc(sizeof(int16_t) * 8 * n);
                int16_t *q4 = malloc(sizeof(int16_t) * 8 * LM_QUAD_COLS(n));
                float *ds = malloc(sizeof(float) * 8 * (n / 16));
                for (int t = 0; t < 8; t++) k->quant_x16(x + t * n, n, q + t * n, ds + t * (n / 16));
                snprintf(nm, sizeof nm, "quant_x16 type=%d n=%lld", type, (long long)n);
                rec(nm, EXACT, 0, q, sizeof(int16_t) * 8 * n);
                lm_xq xq = {q, ds, n, NULL, NULL};
                if (k->quads_x16) {
                    for (int t = 0; t < 8; t++)
                        k->quads_x16(q + t * n, n, q4 + t * LM_QUAD_COLS(n));
                    xq.q4 = q4;
                }
                for (int nt = 1; nt <= 8; nt++) {
                    float out[8];
                    k->dotq[type](w, &xq, 0, nt, out, 1);
                    snprintf(nm, sizeof nm, "dotq type=%d n=%lld nt=%d", type, (long long)n, nt);
                    rec(nm, CLOSE, 1e-4f, out, sizeof(float) * nt);
                }
                free(q), free(q4), free(ds);
            }
            free(w), free(x);
        }
    }
    const int64_t ns[] = {8, 16, 17, 37, 64, 100, 1024};
    for (size_t ti = 0; ti < 3; ti++) {
        const int type = ELEM_TYPES[ti];
        for (size_t i = 0; i < sizeof ns / sizeof *ns; i++) {
            const int64_t n = ns[i];
            g_rng = 0x51ED27F1ull + (uint64_t)(type * 977 + n);
            uint8_t *w = malloc((size_t)(4 * n));
            float *x = malloc(sizeof(float) * n);
            random_rows(type, w, n);
            fill(x, n, -1.0f, 1.0f);
            run_row(k, type, w, x, n, 1e-5f);
            free(w), free(x);
        }
    }
}

static void run_vectors(const lm_kernels *k) {
    char nm[96];
    const int64_t ns[] = {1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++) {
        const int64_t n = ns[i];
        float a[1000], b[1000], c[1000], e[1000];
        g_rng = 0xC0FFEEull + (uint64_t)n;
        fill(a, n, -2.0f, 2.0f);
        fill(b, n, -2.0f, 2.0f);
        fill(c, n, -2.0f, 2.0f);
        const float d = k->dot_f32(a, b, n);
        snprintf(nm, sizeof nm, "dot_f32 n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-5f, &d, sizeof d);
        memcpy(e, a, sizeof(float) * n);
        k->axpy_f32(e, 0.75f, b, n);
        snprintf(nm, sizeof nm, "axpy_f32 n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, e, sizeof(float) * n);
        float y[1000], z[1000];
        memcpy(y, a, sizeof(float) * n), memcpy(z, c, sizeof(float) * n);
        k->scale_axpy_f32(y, 0.3f, -1.25f, z, n);
        snprintf(nm, sizeof nm, "scale_axpy_f32 n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, y, sizeof(float) * n);
        rec(nm, CLOSE, 1e-6f, z, sizeof(float) * n);
        memcpy(y, a, sizeof(float) * n), memcpy(z, c, sizeof(float) * n);
        k->axpy2_f32(y, 0.3f, b, -1.25f, z, n);
        snprintf(nm, sizeof nm, "axpy2_f32 n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, y, sizeof(float) * n);
        rec(nm, CLOSE, 1e-6f, z, sizeof(float) * n);
        memcpy(y, a, sizeof(float) * n);
        k->scale_f32(y, 1.7f, n);
        snprintf(nm, sizeof nm, "scale_f32 n=%lld", (long long)n);
        rec(nm, EXACT, 0, y, sizeof(float) * n);
        memcpy(y, a, sizeof(float) * n);
        const float mx = k->scale_max(y, 1.3f, n);
        snprintf(nm, sizeof nm, "scale_max n=%lld", (long long)n);
        rec(nm, EXACT, 0, y, sizeof(float) * n);
        rec(nm, EXACT, 0, &mx, sizeof mx);
        fill(y, n, -100.0f, 10.0f);
        const float s = k->exp_sum(y, n, 3.0f);
        snprintf(nm, sizeof nm, "exp_sum n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, y, sizeof(float) * n);
        rec(nm, CLOSE, 1e-6f, &s, sizeof s);
        fill(y, n, -12.0f, 12.0f);
        k->silu_mul(z, y, b, n);
        snprintf(nm, sizeof nm, "silu_mul n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, z, sizeof(float) * n);
        k->gelu_mul(z, y, b, n);
        snprintf(nm, sizeof nm, "gelu_mul n=%lld", (long long)n);
        rec(nm, CLOSE, 1e-6f, z, sizeof(float) * n);
        uint16_t h[1000];
        fill(y, n, -70000.0f, 70000.0f);
        k->f32_to_f16(y, h, n);
        snprintf(nm, sizeof nm, "f32_to_f16 n=%lld", (long long)n);
        rec(nm, EXACT, 0, h, sizeof(uint16_t) * n);
        k->f16_to_f32(h, z, n);
        snprintf(nm, sizeof nm, "f16_to_f32 n=%lld", (long long)n);
        rec(nm, EXACT, 0, z, sizeof(float) * n);
    }
}

/* A 32 x 12 block of GEMM outputs, each an FMA chain over k in order: every table's tile
 * (8 x 4, 16 x 6 or 32 x 12) covers it whole, so every output has one set of bits. The
 * AVX-512 panel and token-panel packings against the callers' loops they replace. */
static void run_gemm(const lm_kernels *k) {
    char nm[96];
    const int mr = k->mr, nr = k->nr;
    for (int kk = 1; kk <= 65; kk += 32) {
        g_rng = 0xABCDEFull + (uint64_t)kk;
        static float A[65][32], B[65][12], o[12][32];
        float *a = aligned_alloc(64, sizeof(float) * 32 * 65), *b = malloc(sizeof(float) * 12 * 65);
        float *c = malloc(sizeof(float) * 32 * 12);
        for (int p = 0; p < kk; p++) {
            fill(A[p], 32, -1.0f, 1.0f);
            fill(B[p], 12, -1.0f, 1.0f);
        }
        for (int r0 = 0; r0 < 32; r0 += mr) {
            for (int t0 = 0; t0 < 12; t0 += nr) {
                for (int p = 0; p < kk; p++) {
                    for (int i = 0; i < mr; i++) a[p * mr + i] = A[p][r0 + i];
                    for (int t = 0; t < nr; t++) b[p * nr + t] = B[p][t0 + t];
                }
                k->gemm(a, b, kk, c);
                for (int t = 0; t < nr; t++)
                    for (int i = 0; i < mr; i++) o[t0 + t][r0 + i] = c[t * mr + i];
            }
        }
        snprintf(nm, sizeof nm, "gemm k=%d", kk);
        rec(nm, EXACT, 0, o, sizeof o);
        free(a), free(b), free(c);
    }
    /* 32 rows (a multiple of every table's mr) of 37 columns into k-major panels, and up to
     * 12 rows (a multiple of nr) of 37 values into token panels: recorded read back in row
     * order, which every table's layout gives alike */
    enum { COLS = 37, ROWS = 32, TOK = 12 };
    static float tile[ROWS * COLS], pan[COLS * ROWS], tok[COLS * TOK], back[ROWS * COLS];
    g_rng = 0xFEEDull;
    fill(tile, ROWS * COLS, -1.0f, 1.0f);
    for (int h = 0; h < ROWS; h += mr) {
        float *dst = pan + h * COLS;
        if (k->panel) {
            k->panel(tile + h * COLS, COLS, dst);
        } else {
            for (int kc = 0; kc < COLS; kc++)
                for (int i = 0; i < mr; i++) dst[kc * mr + i] = tile[(h + i) * COLS + kc];
        }
    }
    for (int h = 0; h < ROWS; h += mr)
        for (int kc = 0; kc < COLS; kc++)
            for (int i = 0; i < mr; i++) back[(h + i) * COLS + kc] = pan[h * COLS + kc * mr + i];
    rec("panel", EXACT, 0, back, sizeof back);
    for (int rows = 1; rows <= TOK; rows++) {
        for (int j0 = 0; j0 < TOK; j0 += nr) {
            float *dst = tok + j0 * COLS;
            const int left = rows - j0 < 0 ? 0 : rows - j0 > nr ? nr : rows - j0;
            if (k->pack_nr) {
                k->pack_nr(tile + j0 * COLS, COLS, left, COLS, dst);
            } else {
                for (int i = 0; i < COLS; i++)
                    for (int j = 0; j < nr; j++)
                        dst[i * nr + j] = j < left ? tile[(j0 + j) * COLS + i] : 0.0f;
            }
        }
        for (int j0 = 0; j0 < TOK; j0 += nr)
            for (int i = 0; i < COLS; i++)
                for (int j = 0; j < nr; j++) back[(j0 + j) * COLS + i] = tok[j0 * COLS + i * nr + j];
        snprintf(nm, sizeof nm, "pack_nr rows=%d", rows);
        rec(nm, EXACT, 0, back, sizeof(float) * TOK * COLS);
    }
}

static void run_attention(const lm_kernels *k) {
    char nm[96];
    const int hds[] = {4, 12, 64, 72, 80, 128};
    const int64_t keys[] = {1, 3, 4, 9, 37, 100};
    for (size_t hi = 0; hi < sizeof hds / sizeof *hds; hi++) {
        const int hd = hds[hi];
        const int64_t ks = 2 * hd; /* two kv heads per position */
        for (size_t ni = 0; ni < sizeof keys / sizeof *keys; ni++) {
            const int64_t n = keys[ni];
            g_rng = 0x1234567ull + (uint64_t)(hd * 1000 + n);
            float *kf = malloc(sizeof(float) * n * ks), *vf = malloc(sizeof(float) * n * ks);
            uint16_t *kh = malloc(2 * n * ks), *vh = malloc(2 * n * ks);
            fill(kf, n * ks, -1.0f, 1.0f);
            fill(vf, n * ks, -1.0f, 1.0f);
            for (int64_t i = 0; i < n * ks; i++) { /* f16 rows, and their exact f32 values */
                kh[i] = lm_float_to_half(kf[i]), vh[i] = lm_float_to_half(vf[i]);
                kf[i] = lm_half_to_float(kh[i]), vf[i] = lm_half_to_float(vh[i]);
            }
            float q[7][128], p[7][100], s[7][100], out[7][128], mx[7];
            for (int t = 0; t < 7; t++) {
                fill(q[t], hd, -1.0f, 1.0f);
                fill(p[t], n, 0.0f, 1.0f);
            }
            if (k->qk_scores) {
                float m1 = k->qk_scores(q[0], kf, ks, n, hd, 0.125f, s[0]);
                snprintf(nm, sizeof nm, "qk_scores hd=%d n=%lld", hd, (long long)n);
                rec(nm, EXACT, 0, s[0], sizeof(float) * n);
                rec(nm, EXACT, 0, &m1, sizeof m1);
                m1 = k->qk_scores_f16(q[0], kh, ks, n, hd, 0.125f, s[0]);
                snprintf(nm, sizeof nm, "qk_scores_f16 hd=%d n=%lld", hd, (long long)n);
                rec(nm, EXACT, 0, s[0], sizeof(float) * n);
                rec(nm, EXACT, 0, &m1, sizeof m1);
                k->pv_sum(p[0], vf, ks, n, hd, out[0]);
                snprintf(nm, sizeof nm, "pv_sum hd=%d n=%lld", hd, (long long)n);
                rec(nm, EXACT, 0, out[0], sizeof(float) * hd);
                k->pv_sum_f16(p[0], vh, ks, n, hd, out[0]);
                snprintf(nm, sizeof nm, "pv_sum_f16 hd=%d n=%lld", hd, (long long)n);
                rec(nm, EXACT, 0, out[0], sizeof(float) * hd);
            }
            const float *qp[7], *pp[7];
            float *sp[7], *op[7];
            for (int t = 0; t < 7; t++) qp[t] = q[t], pp[t] = p[t], sp[t] = s[t], op[t] = out[t];
            for (int half = 0; half <= 1; half++) {
                for (int nq = 1; nq <= 7 && k->qk_scores_n; nq++) {
                    k->qk_scores_n(qp, nq, half ? (const void *)kh : kf, half, ks, n, hd, 0.125f,
                                   sp, mx);
                    snprintf(nm, sizeof nm, "qk_scores_n hd=%d n=%lld half=%d nq=%d", hd,
                             (long long)n, half, nq);
                    for (int t = 0; t < nq; t++) rec(nm, EXACT, 0, s[t], sizeof(float) * n);
                    rec(nm, EXACT, 0, mx, sizeof(float) * nq);
                    k->pv_sum_n(pp, nq, half ? (const void *)vh : vf, half, ks, n, hd, op);
                    snprintf(nm, sizeof nm, "pv_sum_n hd=%d n=%lld half=%d nq=%d", hd,
                             (long long)n, half, nq);
                    for (int t = 0; t < nq; t++) rec(nm, EXACT, 0, out[t], sizeof(float) * hd);
                }
            }
            free(kf), free(vf), free(kh), free(vh);
        }
    }
}

static void run_all(int isa) {
    lm_isa_select(isa);
    const lm_kernels *k = lm_kernels_active();
    run_rows(k);
    run_vectors(k);
    run_gemm(k);
    run_attention(k);
}

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static int close_enough(const output *o, const unsigned char *got, const unsigned char *want) {
    if (memcmp(got, want, o->bytes) == 0) return 1;
    if (o->kind != CLOSE) return 0;
    const float *g = (const float *)got, *w = (const float *)want;
    const size_t n = o->bytes / sizeof(float);
    float scale = 1.0f;
    for (size_t i = 0; i < n; i++) scale = fabsf(w[i]) > scale ? fabsf(w[i]) : scale;
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(g[i] - w[i]) <= o->tol * scale)) return 0;
    return 1;
}

int main(int argc, char **argv) {
    const int dump = argc > 1 && strcmp(argv[1], "dump") == 0;
    const int paths[3] = {LM_ISA_PORTABLE, LM_ISA_AVX2, LM_ISA_AVX512};
    int npaths = 0;
    for (int i = 0; i < 3 && lm_isa_available(paths[i]); i++, npaths++) {
        g_path = i;
        run_all(paths[i]);
    }
    if (dump) {
        for (int p = 0; p < npaths; p++)
            for (int i = 0; i < g_nout[p]; i++)
                printf("path=%d %s %016llx\n", paths[p], g_out[p][i].name,
                       (unsigned long long)fnv(g_out[p][i].data, g_out[p][i].bytes));
        return 0;
    }
    if (npaths < 3) {
        printf("no AVX-512 path on this CPU\n");
        return 2;
    }
    int passed = 0, failed = 0;
    for (int i = 0; i < g_nout[2]; i++) {
        const output *o = &g_out[2][i];
        const int ref = o->kind == PORTABLE_EXACT ? 0 : 1;
        const output *want = find(ref, o->name);
        if (want != NULL && want->bytes == o->bytes && close_enough(o, o->data, want->data)) {
            passed++;
        } else {
            failed++;
            printf("FAILED %s (against path %d)\n", o->name, paths[ref]);
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
