/*
 * The kernels' products on every path this CPU runs, against the portable path, without
 * Python: built with the whole kernel library for another architecture and run under an
 * emulator (tests/test_kernels_arm.py), or natively.
 *
 * For each interleaved type and each SIMD path: matrices of random blocks, repacked, times
 * 1 .. 70 tokens on 1 .. 3 threads; every output must have the bits the portable products
 * give that token alone. Prints one line per failure, then "N passed, M failed"; exits 1 on
 * any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmserve/kernels.h"
#include "lmserve/kernels_impl.h"

#include "rng.h"

/* Random blocks with sane f16 scales (random scale bits would include NaNs). */
static void random_rows(int type, uint8_t *w, int64_t rows, int64_t cols) {
    const int64_t nb = rows * cols / lm_type_block_elems(type), bb = lm_type_block_bytes(type);
    for (int64_t i = 0; i < nb * bb; i++) w[i] = (uint8_t)next();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * bb;
        const lm_half d = lm_float_to_half(0.001f + 0.02f * (uniform() + 1.0f));
        const lm_half m = lm_float_to_half(0.01f * uniform());
        switch (type) {
        case LM_Q4_1:
        case LM_Q4_K:
            memcpy(blk + 2, &m, 2);
            /* fallthrough */
        case LM_Q4_0:
        case LM_Q8_0:
            memcpy(blk, &d, 2);
            break;
        case LM_Q6_K:
            memcpy(blk + 208, &d, 2);
            break;
        default:
            break;
        }
    }
}

static int g_passed, g_failed;

static void check(int ok, const char *what, int isa, int ntok, int threads) {
    if (ok) {
        g_passed++;
        return;
    }
    g_failed++;
    printf("FAILED %s isa=%d ntok=%d threads=%d\n", what, isa, ntok, threads);
}

static void check_type(int type, int64_t rows, int64_t cols) {
    const int r16 = 64 + type;
    const int64_t rb = lm_row_bytes(type, cols);
    const int most = 70;
    uint8_t *raw = malloc((size_t)(rows * rb)), *packed = malloc((size_t)(rows * rb));
    float *x = malloc(sizeof(float) * (size_t)(most * cols));
    float *want = malloc(sizeof(float) * (size_t)(most * rows));
    float *got = malloc(sizeof(float) * (size_t)(most * rows));
    random_rows(type, raw, rows, cols);
    if (lm_repack_r16(type, raw, r16, packed, rows, cols) != LM_OK) {
        check(0, "repack", 0, 0, 0);
        return;
    }
    /* quarters up to 16 (and -40 a group's extreme): each group's float sum, which mins
     * multiply, is exact in any order, so every ISA's sums are the portable ones */
    for (int64_t i = 0; i < most * cols; i++)
        x[i] = i % 64 == 0 ? -40.0f : (float)((int)(next() % 129) - 64) * 0.25f;
    lm_isa_select(LM_ISA_PORTABLE);
    for (int t = 0; t < most; t++) /* each token alone, the portable products */
        lm_matmul(NULL, r16, packed, rows, cols, x + t * cols, 1, want + t * rows);
    static const int ntoks[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 31, 32, 33, 45, 70};
    for (int isa = 1; isa <= LM_ISA_NEON_I8MM; isa++) {
        if (!lm_isa_available(isa)) continue;
        lm_isa_select(isa);
        char what[64];
        snprintf(what, sizeof what, "type %d: a layout chosen", type);
        check(lm_r16_for(type) == r16, what, isa, 0, 0);
        for (int threads = 1; threads <= 3; threads++) {
            lm_pool *pool = lm_pool_new(threads);
            for (size_t i = 0; i < sizeof ntoks / sizeof *ntoks; i++) {
                const int ntok = ntoks[i];
                memset(got, 0xFF, sizeof(float) * (size_t)(ntok * rows));
                const int rc = lm_matmul(pool, r16, packed, rows, cols, x, ntok, got);
                /* with integer prefill every token count has the bits of a token alone */
                const int exact = ntok < 32 || lm_int_products_active(r16, ntok);
                snprintf(what, sizeof what, "type %d products", type);
                check(rc == LM_OK && (!exact || memcmp(got, want, sizeof(float) *
                                                                      (size_t)(ntok * rows)) == 0),
                      what, isa, ntok, threads);
            }
            lm_pool_free(pool);
        }
    }
    lm_isa_select(lm_isa_best());
    free(raw), free(packed), free(x), free(want), free(got);
}

int main(void) {
    lm_decode_precision_select(LM_DECODE_I16);
    lm_prefill_precision_select(LM_PREFILL_I16);
    printf("best path %d, available:", lm_isa_best());
    for (int isa = 0; isa <= LM_ISA_NEON_I8MM; isa++)
        if (lm_isa_available(isa)) printf(" %d", isa);
    printf("\n");
    check_type(LM_Q4_0, 48, 320);
    check_type(LM_Q4_1, 48, 320);
    check_type(LM_Q8_0, 48, 320);
    check_type(LM_Q4_K, 48, 512);
    check_type(LM_Q6_K, 48, 1024);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed != 0;
}
