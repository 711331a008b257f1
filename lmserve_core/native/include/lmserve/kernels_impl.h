/*
 * The whole kernel library as one translation unit. Include it once, in the C source of a
 * module that embeds the kernels (after kernels.h), instead of listing the files of
 * lmserve_core.native.get_sources(); compile with lmserve_core.native.compile_args().
 */
#ifndef LMSERVE_KERNELS_IMPL_H
#define LMSERVE_KERNELS_IMPL_H

#include "../../src/types.c"
#include "../../src/dispatch.c"
#include "../../src/simd_avx2.c"
#include "../../src/simd_avx512.c"
#include "../../src/matmul.c"
#include "../../src/ops.c"
#include "../../src/attention.c"
#include "../../src/pool.c"

#endif /* LMSERVE_KERNELS_IMPL_H */
