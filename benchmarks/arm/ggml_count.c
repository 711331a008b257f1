/*
 * llama.cpp's (ggml's) matrix products, one graph per counted segment, for
 * benchmarks/arm_count.py.
 *
 *   ggml_count TYPE COLS REPACK
 *
 * TYPE is a GGML type id (3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K). Weights of random blocks are
 * placed in the CPU backend's CPU_REPACK buffer (REPACK=1: interleaved at load, as llama-server
 * does for the types and CPUs ggml-cpu/repack.cpp handles) or in the plain CPU buffer
 * (REPACK=0). Each segment is a graph of one ggml_mul_mat(W[TYPE, COLS x rows],
 * X[f32, COLS x tokens]) computed by the CPU backend on one thread. Before each graph the
 * program calls lmcount_mark(), which the log parser uses to split the dynamic instruction
 * count into segments; everything before the first mark (set-up, a warm-up graph) is not
 * counted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include "count_common.h"

static uint16_t half(float f) { return ggml_fp32_to_fp16(f); }

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s TYPE COLS REPACK\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = (enum ggml_type)atoi(argv[1]);
    const int64_t cols = atoll(argv[2]);
    const int repack = atoi(argv[3]);

    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, 1);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
    if (repack) {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        ggml_backend_dev_get_extra_bufts_t extra = (ggml_backend_dev_get_extra_bufts_t)
            ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        buft = NULL;
        for (ggml_backend_buffer_type_t *p = extra ? extra(dev) : NULL; p && *p; p++)
            if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) buft = *p;
        if (buft == NULL) {
            fprintf(stderr, "no CPU_REPACK buffer type\n");
            return 1;
        }
    }

    /* the weights: one matrix per distinct row count */
    int64_t most_rows, most_tok;
    segments_max(&most_rows, &most_tok);
    struct ggml_init_params wp = {2 * NSEG * ggml_tensor_overhead(), NULL, true};
    struct ggml_context *cw = ggml_init(wp);
    struct ggml_tensor *w[NSEG];
    int fresh[NSEG];
    for (int s = 0; s < NSEG; s++) {
        w[s] = NULL;
        for (int t = 0; t < s; t++)
            if (SEGMENTS[t][0] == SEGMENTS[s][0]) w[s] = w[t];
        fresh[s] = w[s] == NULL;
        if (fresh[s]) w[s] = ggml_new_tensor_2d(cw, type, cols, SEGMENTS[s][0]);
    }
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(cw, buft);
    uint8_t *raw = malloc((size_t)(most_rows * ggml_row_size(type, cols)));
    random_blocks(type, raw, most_rows * cols / ggml_blck_size(type),
                  (int64_t)ggml_type_size(type), half);
    for (int s = 0; s < NSEG; s++) /* set_tensor interleaves the rows in CPU_REPACK */
        if (fresh[s]) ggml_backend_tensor_set(w[s], raw, 0, ggml_nbytes(w[s]));

    /* the activations and the graphs */
    struct ggml_init_params gp = {4 * NSEG * ggml_tensor_overhead() + NSEG * ggml_graph_overhead(),
                                  NULL, true};
    struct ggml_context *cg = ggml_init(gp);
    struct ggml_cgraph *graph[NSEG];
    struct ggml_tensor *x[NSEG];
    for (int s = 0; s < NSEG; s++) {
        x[s] = ggml_new_tensor_2d(cg, GGML_TYPE_F32, cols, SEGMENTS[s][1]);
        graph[s] = ggml_new_graph(cg);
        ggml_build_forward_expand(graph[s], ggml_mul_mat(cg, w[s], x[s]));
    }
    ggml_backend_buffer_t gbuf = ggml_backend_alloc_ctx_tensors(cg, be);
    float *xs = malloc(sizeof(float) * (size_t)(most_tok * cols));
    for (int64_t i = 0; i < most_tok * cols; i++) xs[i] = uniform();
    for (int s = 0; s < NSEG; s++) ggml_backend_tensor_set(x[s], xs, 0, ggml_nbytes(x[s]));

    printf("type %s cols %lld buffer %s\n", ggml_type_name(type), (long long)cols,
           ggml_backend_buft_name(buft));
    /* warm-up: any lazy initialisation happens outside the counted segments */
    int rc = ggml_backend_graph_compute(be, graph[0]) != GGML_STATUS_SUCCESS;
    for (int s = 0; s < NSEG; s++) {
        lmcount_mark(s);
        rc |= ggml_backend_graph_compute(be, graph[s]) != GGML_STATUS_SUCCESS;
    }
    lmcount_mark(NSEG);
    float y0;
    ggml_backend_tensor_get(ggml_graph_node(graph[0], -1), &y0, 0, sizeof y0);
    printf("rc %d y0 %g\n", rc, (double)y0);
    ggml_backend_buffer_free(gbuf);
    ggml_backend_buffer_free(wbuf);
    ggml_free(cg);
    ggml_free(cw);
    ggml_backend_free(be);
    free(raw);
    free(xs);
    return rc;
}
