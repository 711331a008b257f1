/*
 * The table of kit functions handed to family modules (lmserve/api.h, lmserve/kit.h).
 */
#include "lm_internal.h"

#define LM_KIT_SET_INT(ret, name, params, args) .name = name,
#define LM_KIT_SET_VOID(name, params, args) .name = name,
static const lm_kit g_kit = {
    .abi = LM_KIT_ABI,
    .size = sizeof(lm_kit),
    LM_KIT_INT(LM_KIT_SET_INT) LM_KIT_VOID(LM_KIT_SET_VOID)
};
#undef LM_KIT_SET_INT
#undef LM_KIT_SET_VOID

const void *lm_kit_table(void) {
    return &g_kit;
}
