/*
 * AVX2 instance of the interleaved layouts' integer products (r16_kernels.h over
 * vec_avx2.h). Compiled with per-function target attributes: dispatch.c installs it only
 * when the CPU has AVX2, FMA and F16C.
 */
#include <math.h>
#include <stdlib.h>

#include "lm_internal.h"

#if LM_HAVE_X86
#include "vec_avx2.h"
#include "r16_kernels.h"
#include "vec_end.h"
#endif
