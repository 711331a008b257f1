/* avx2 kernels (filled in below). */
#include "lm_internal.h"

#if LM_HAVE_X86
void lm_kernels_avx2(lm_kernels *k) {
    (void)k;
}
#endif
