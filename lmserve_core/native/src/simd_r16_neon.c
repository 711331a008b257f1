/*
 * NEON instances of the interleaved layouts' integer products (r16_kernels.h over
 * vec_neon.h): one for CPUs with the dot products (FEAT_DotProd: Graviton 2, Ampere Altra,
 * Raspberry Pi 5, Apple M1), one for those with the int8 matrix multiplies too (FEAT_I8MM:
 * Graviton 3 and 4, Apple M2 and later). Compiled with per-function target attributes;
 * dispatch.c installs each only when the CPU reports the feature.
 */
#include <math.h>
#include <stdlib.h>

#include "lm_internal.h"

#if LM_HAVE_NEON
#define V_I8MM 0
#include "vec_neon.h"
#include "r16_kernels.h"
#include "vec_end.h"
#undef V_I8MM

#define V_I8MM 1
#include "vec_neon.h"
#include "r16_kernels.h"
#include "vec_end.h"
#undef V_I8MM
#endif
