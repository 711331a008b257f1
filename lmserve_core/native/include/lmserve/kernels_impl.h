/*
 * The whole kernel library as one translation unit: the source of the core's cffi module
 * (lmserve_core._kernels), compiled once. Family modules never include it: they reach the
 * kernels through lmserve/kit.h.
 */
#ifndef LMSERVE_KERNELS_IMPL_H
#define LMSERVE_KERNELS_IMPL_H

#include "../../src/types.c"
#include "../../src/dotq.c"
#include "../../src/dispatch.c"
#include "../../src/simd_avx2.c"
#include "../../src/simd_avx512.c"
#include "../../src/rows16.c"
#include "../../src/simd_r16.c"
#include "../../src/simd_r16_avx2.c"
#include "../../src/simd_r16_neon.c"
#include "../../src/matmul.c"
#include "../../src/ops.c"
#include "../../src/attention.c"
#include "../../src/pool.c"
#include "../../src/cache.c"
#include "../../src/kit.c"
#include "../../src/deltanet.c"
#include "../../src/api.c"

#endif /* LMSERVE_KERNELS_IMPL_H */
