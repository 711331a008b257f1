/*
 * Runtime ISA selection and the row-level entry points (dequantize, dot, get_rows).
 */
#include <pthread.h>
#include <stdatomic.h>

#include "lm_internal.h"

float lm_f16_table[1 << 16];

#define LM_NISA 5
static lm_kernels g_tables[LM_NISA];
static int g_avail[LM_NISA];
static int g_best = LM_ISA_PORTABLE;
static _Atomic int g_active = LM_ISA_PORTABLE;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if LM_HAVE_NEON && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#elif LM_HAVE_NEON && defined(__APPLE__)
#include <sys/sysctl.h>
static int apple_has(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v != 0;
}
#endif

/* Which paths this CPU runs: g_avail[isa], from the CPU's own report. */
static void detect(void) {
    g_avail[LM_ISA_PORTABLE] = 1;
#if LM_HAVE_X86
    __builtin_cpu_init();
    /* F16C has no __builtin_cpu_supports name on older compilers; every AVX2 CPU has it. */
    g_avail[LM_ISA_AVX2] = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    g_avail[LM_ISA_AVX512] = g_avail[LM_ISA_AVX2] && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
#elif LM_HAVE_NEON && defined(__linux__)
    g_avail[LM_ISA_NEON_DOTPROD] = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    g_avail[LM_ISA_NEON_I8MM] =
        g_avail[LM_ISA_NEON_DOTPROD] && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#elif LM_HAVE_NEON && defined(__APPLE__)
    g_avail[LM_ISA_NEON_DOTPROD] = apple_has("hw.optional.arm.FEAT_DotProd");
    g_avail[LM_ISA_NEON_I8MM] =
        g_avail[LM_ISA_NEON_DOTPROD] && apple_has("hw.optional.arm.FEAT_I8MM");
#endif
    for (int isa = 0; isa < LM_NISA; isa++) {
        if (g_avail[isa]) g_best = isa; /* on each architecture, later paths do more */
    }
}

static void init_tables(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) {
        lm_f16_table[h] = lm_half_to_float((lm_half)h);
    }
    lm_kernels_portable(&g_tables[LM_ISA_PORTABLE]);
    for (int isa = 1; isa < LM_NISA; isa++) g_tables[isa] = g_tables[LM_ISA_PORTABLE];
    detect();
#if LM_HAVE_X86
    if (g_avail[LM_ISA_AVX2]) {
        lm_kernels_avx2(&g_tables[LM_ISA_AVX2]);
        r16_kernels_avx2(&g_tables[LM_ISA_AVX2]);
    }
    if (g_avail[LM_ISA_AVX512]) {
        /* entries the AVX-512 file does not define keep their AVX2 kernels */
        g_tables[LM_ISA_AVX512] = g_tables[LM_ISA_AVX2];
        lm_kernels_avx512(&g_tables[LM_ISA_AVX512]);
    }
#endif
#if LM_HAVE_NEON
    if (g_avail[LM_ISA_NEON_DOTPROD]) r16_kernels_dotprod(&g_tables[LM_ISA_NEON_DOTPROD]);
    if (g_avail[LM_ISA_NEON_I8MM]) r16_kernels_i8mm(&g_tables[LM_ISA_NEON_I8MM]);
#endif
    atomic_store(&g_active, g_best);
}

static void ensure_init(void) {
    pthread_once(&g_once, init_tables);
}

int lm_isa_best(void) {
    ensure_init();
    return g_best;
}

int lm_isa_active(void) {
    ensure_init();
    return atomic_load_explicit(&g_active, memory_order_relaxed);
}

int lm_isa_available(int isa) {
    ensure_init();
    return isa >= 0 && isa < LM_NISA && g_avail[isa];
}

int lm_isa_select(int isa) {
    ensure_init();
    if (isa < LM_ISA_PORTABLE || isa >= LM_NISA) {
        return LM_EINVAL;
    }
    if (!g_avail[isa]) {
        return LM_EISA;
    }
    atomic_store(&g_active, isa);
    return LM_OK;
}

const lm_kernels *lm_kernels_active(void) {
    ensure_init();
    return &g_tables[atomic_load_explicit(&g_active, memory_order_relaxed)];
}

/* ------------------------------------------------------------------ rows */
/* An interleaved type's rows are not contiguous: only whole matrices of it are read. */
static int check_row(int type, const void *p, int64_t n) {
    if (lm_type_block_elems(type) <= 0 || lm_r16_base(type) >= 0) {
        return LM_ETYPE;
    }
    if (p == NULL || lm_row_bytes(type, n) < 0) {
        return LM_EINVAL;
    }
    return LM_OK;
}

int lm_dequantize_row(int type, const void *src, float *dst, int64_t n) {
    int rc = check_row(type, src, n);
    if (rc != LM_OK) {
        return rc;
    }
    if (dst == NULL) {
        return LM_EINVAL;
    }
    if (n > 0) {
        lm_kernels_active()->dequant[type](src, dst, n);
    }
    return LM_OK;
}

int lm_convert_row(int from, const void *src, int to, void *dst, int64_t n) {
    int rc = check_row(from, src, n);
    if (rc != LM_OK) {
        return rc;
    }
    if (from != LM_Q5_0 || to != LM_Q8_0) {
        return LM_ETYPE;
    }
    if (dst == NULL) {
        return LM_EINVAL;
    }
    const block_q5_0 *s = src;
    block_q8_0 *d = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        uint32_t qh;
        memcpy(&qh, s[i].qh, sizeof qh);
        d[i].d = s[i].d;
        for (int j = 0; j < 16; j++) {
            d[i].qs[j] = (int8_t)(((s[i].qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16);
            d[i].qs[j + 16] = (int8_t)(((s[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16);
        }
    }
    return LM_OK;
}

int lm_vec_dot(int type, const void *row, const float *x, int64_t n, float *out) {
    int rc = check_row(type, row, n);
    if (rc != LM_OK) {
        return rc;
    }
    if (x == NULL || out == NULL) {
        return LM_EINVAL;
    }
    *out = n > 0 ? lm_kernels_active()->dot[type](row, x, n) : 0.0f;
    return LM_OK;
}

int lm_get_rows(int type, const void *table, int64_t n_rows, int64_t cols, const int32_t *ids,
                int64_t n_ids, float *out) {
    if (lm_type_block_elems(type) <= 0) {
        return LM_ETYPE;
    }
    if (table == NULL || lm_row_bytes(type, cols) < 0) {
        return LM_EINVAL;
    }
    if (n_rows < 0 || n_ids < 0 || (n_ids > 0 && (ids == NULL || out == NULL))) {
        return LM_EINVAL;
    }
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= n_rows) {
            return LM_EINVAL;
        }
    }
    const lm_kernels *k = lm_kernels_active();
    const int64_t rb = lm_row_bytes(type, cols);
    if (lm_r16_base(type) >= 0) {
        if (n_rows % R16 != 0) {
            return LM_EINVAL;
        }
        for (int64_t i = 0; i < n_ids && cols > 0; i++) {
            const int64_t g = ids[i] / R16;
            k->deq_r16[type]((const uint8_t *)table + g * R16 * rb, cols, (int)(ids[i] % R16),
                             out + i * cols);
        }
        return LM_OK;
    }
    for (int64_t i = 0; i < n_ids && cols > 0; i++) {
        k->dequant[type]((const uint8_t *)table + ids[i] * rb, out + i * cols, cols);
    }
    return LM_OK;
}
