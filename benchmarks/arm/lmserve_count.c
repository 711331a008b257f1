/*
 * lmserve's matrix products, one call per counted segment, for benchmarks/arm_count.py.
 *
 *   lmserve_count TYPE COLS ISA
 *
 * TYPE is a GGML type id (3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K), ISA an lmserve path (3 NEON
 * dotprod, 4 NEON i8mm). Random blocks are repacked to the interleaved layout lmserve uses at
 * load time (lm_r16_for), int16 decode and prefill are selected, and lm_matmul runs on one
 * thread (no pool) for each (rows, tokens) of SEGMENTS. Before each product the program calls
 * lmcount_mark(), which the log parser uses to split the dynamic instruction count into
 * segments; everything before the first mark (set-up, a warm-up product) is not counted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmserve/kernels.h"
#include "lmserve/kernels_impl.h"

#include "count_common.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s TYPE COLS ISA\n", argv[0]);
        return 2;
    }
    const int type = atoi(argv[1]), isa = atoi(argv[3]);
    const int64_t cols = atoll(argv[2]);
    if (lm_isa_select(isa) != LM_OK) {
        fprintf(stderr, "ISA %d not available\n", isa);
        return 1;
    }
    lm_decode_precision_select(LM_DECODE_I16);
    lm_prefill_precision_select(LM_PREFILL_I16);
    const int r16 = lm_r16_for(type);
    if (r16 == 0) {
        fprintf(stderr, "type %d: no interleaved layout on ISA %d\n", type, isa);
        return 1;
    }
    int64_t most_rows, most_tok;
    segments_max(&most_rows, &most_tok);
    const int64_t rb = lm_row_bytes(type, cols);
    uint8_t *raw = malloc((size_t)(most_rows * rb));
    float *x = malloc(sizeof(float) * (size_t)(most_tok * cols));
    float *y = malloc(sizeof(float) * (size_t)(most_tok * most_rows));
    uint8_t *packed = malloc((size_t)(most_rows * rb));
    random_blocks(type, raw, most_rows * cols / lm_type_block_elems(type),
                  lm_type_block_bytes(type), lm_float_to_half);
    for (int64_t i = 0; i < most_tok * cols; i++) x[i] = uniform();
    /* groups of 16 rows are contiguous: the first R rows of the packed matrix are an R-row one */
    if (lm_repack_r16(type, raw, r16, packed, most_rows, cols) != LM_OK) return 1;
    printf("type %d cols %lld isa %d layout %d:", type, (long long)cols, lm_isa_active(), r16);
    for (int s = 0; s < NSEG; s++)
        printf(" %dx%d%s", SEGMENTS[s][0], SEGMENTS[s][1],
               lm_int_products_active(r16, SEGMENTS[s][1]) ? "(int)" : "(f32)");
    printf("\n");
    /* warm-up: any lazy initialisation happens outside the counted segments */
    if (lm_matmul(NULL, r16, packed, SEGMENTS[0][0], cols, x, 1, y) != LM_OK) return 1;
    int rc = LM_OK;
    for (int s = 0; s < NSEG; s++) {
        lmcount_mark(s);
        rc |= lm_matmul(NULL, r16, packed, SEGMENTS[s][0], cols, x, SEGMENTS[s][1], y);
    }
    lmcount_mark(NSEG);
    printf("rc %d y0 %g\n", rc, (double)y[0]);
    return rc != LM_OK;
}
