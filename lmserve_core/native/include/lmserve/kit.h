/*
 * The family kit, as a family's forward pass sees it.
 *
 * A family module includes this header (never lmserve/kernels.h): every lm_* function below
 * calls the core's compiled kernels through the table the core hands over at load, so the
 * kernels exist once per process whatever the number of families. The module's main
 * translation unit defines LM_KIT_MAIN before including it (lmserve_core.native's
 * family_ffibuilder does), which defines the table pointer and lm_kit_bind.
 *
 * What a family writes: its config and weight structs (llama2.c style, a shape comment on
 * every pointer) and a build function that maps them onto the kit:
 *   - a pre-norm decoder (llama, qwen3, qwen35, gemma3, gemma4) fills the blocks of an
 *     lm_decoder_model between lm_decoder_new and lm_decoder_finish and runs on the kit's own
 *     chunk loop; what its blocks do is data (lm_block: the mixer, per-layer heads, windows
 *     and RoPE, shared caches, the feed-forward's kind and norms), and a step of its own
 *     between the blocks is a hook of the decoder (lm_decoder: begin_chunk, after_block);
 *   - anything else fills an lm_base (lm_base_init) with its own forward_chunk, made of the
 *     layer helpers (lm_embed, lm_self_attention, lm_glu_ffn, lm_moe_ffn, lm_logits) and the
 *     threaded row ops; a router of its own feeds lm_moe_experts (its routing by
 *     lm_moe_route).
 * Sizes are int64_t element counts; every function returns LM_OK or a negative status;
 * nothing exits or prints.
 */
#ifndef LMSERVE_KIT_H
#define LMSERVE_KIT_H

#include "lmserve/api.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const lm_kit *lm_kit_api;

#define LM_KIT_WRAP_INT(ret, name, params, args)                                                  \
    static inline ret name params { return lm_kit_api->name args; }
#define LM_KIT_WRAP_VOID(name, params, args)                                                       \
    static inline void name params { lm_kit_api->name args; }
LM_KIT_INT(LM_KIT_WRAP_INT)
LM_KIT_VOID(LM_KIT_WRAP_VOID)
#undef LM_KIT_WRAP_INT
#undef LM_KIT_WRAP_VOID

/* Return from the enclosing function when a kit call fails. */
#define LM_TRY(call)                                                                               \
    do {                                                                                           \
        const int lm_rc_ = (call);                                                                 \
        if (lm_rc_ != LM_OK) return lm_rc_;                                                        \
    } while (0)

/* The feed-forward half of a block whose layer table L uses the standard field names
 * (ffn_gate / ffn_up / ffn_down; ffn_gate_inp and ffn_{gate,up,gate_up,down}_exps): a SiLU
 * MLP of width n_ff when n_expert is 0, else n_expert SiLU experts of width n_ff behind a
 * softmax router, the top n_used renormalised to sum to 1 and times `scale` (Qwen's). */
#define LM_SILU_MLP(b, L, n_ff_, n_expert_, n_used_, scale_)                                       \
    do {                                                                                           \
        if ((n_expert_) == 0) {                                                                    \
            (b)->ffn = (lm_ffn){(L)->ffn_gate, (L)->ffn_up, (L)->ffn_down, (n_ff_), LM_ACT_SILU}; \
        } else {                                                                                   \
            (b)->moe = (lm_moe){.router = (L)->ffn_gate_inp,                                       \
                                .gate_exps = (L)->ffn_gate_exps,                                   \
                                .up_exps = (L)->ffn_up_exps,                                       \
                                .gate_up_exps = (L)->ffn_gate_up_exps,                             \
                                .down_exps = (L)->ffn_down_exps,                                   \
                                .n_expert = (n_expert_),                                           \
                                .n_used = (n_used_),                                               \
                                .n_ff = (n_ff_),                                                   \
                                .gating = LM_GATING_SOFTMAX,                                       \
                                .norm_weights = 1,                                                 \
                                .weights_scale = (scale_),                                         \
                                .act = LM_ACT_SILU};                                               \
        }                                                                                          \
    } while (0)

/* 1 when m is a matrix of a type the kernels decode with rows of `cols` elements. */
static inline int lm_matrix_ok(lm_matrix m, int64_t cols) {
    return m.data != NULL && lm_row_bytes(m.type, cols) > 0;
}

#ifdef LM_KIT_MAIN
const lm_kit *lm_kit_api = NULL;

/* Take the core's table (lmserve_core.native.kernels.kit_table()); LM_EABI when the core was
 * built with another kit ABI than this module. */
int lm_kit_bind(const void *table) {
    const lm_kit *k = (const lm_kit *)table;
    if (k == NULL || k->abi != LM_KIT_ABI || k->size < sizeof(lm_kit)) return LM_EABI;
    lm_kit_api = k;
    return LM_OK;
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_KIT_H */
