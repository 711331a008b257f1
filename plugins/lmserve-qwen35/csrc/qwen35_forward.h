/*
 * Forward pass of Qwen3.5 (GGUF architecture qwen35), Qwen3.5-MoE (qwen35moe) and Qwen3-Next
 * (qwen3next) over the lmserve kit.
 *
 * Hybrid decoders: most layers mix tokens with a gated DeltaNet (a recurrent state per
 * sequence, lm_deltanet), every full_attention_interval-th with gated attention (query and
 * gate per head, per-head q/k RMS norms, partial NEOX RoPE). The feed-forward is a SiLU MLP
 * (qwen35) or a softmax top-k router over experts plus a shared expert behind a sigmoid gate
 * (qwen35moe, qwen3next).
 *
 * The region between the cdef markers is also the cffi declaration of this module: plain C
 * declarations only (no preprocessor lines). lm_* types come from lmserve/types.h.
 */
#ifndef LMSERVE_QWEN35_FORWARD_H
#define LMSERVE_QWEN35_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct qwen35_config {
    lm_dims dims;            /* head_dim: attention.key_length; n_ff: the MLP's width, or one
                                expert's */
    int n_expert;            /* 0: a dense MLP in every layer */
    int n_expert_used;
    float expert_weights_scale;
    int64_t n_ff_shexp;      /* the shared expert's width; 0: none */
    int ssm_conv_kernel;     /* ssm.conv_kernel */
    int ssm_n_k_head;        /* ssm.group_count */
    int ssm_n_v_head;        /* ssm.time_step_rank */
    int ssm_head_k;          /* ssm.state_size */
    int ssm_head_v;          /* ssm.inner_size / ssm.time_step_rank */
    int ssm_head_map;        /* enum lm_head_map: how the file orders the value heads */
} qwen35_config;

/* A DeltaNet layer's own tensors (the kit's lm_layer_tensors hold the rest of every layer:
 * attn_norm and the feed-forward; attention layers' attention). */
typedef struct qwen35_deltanet {
    int recurrent;              /* 1: a DeltaNet layer; 0: gated attention (nothing here) */
    lm_matrix wqkv;             /* (2 n_k_head head_k + n_v_head head_v, n_embd) */
    lm_matrix wgate;            /* (n_v_head * head_v, n_embd) */
    lm_matrix wbeta;            /* (n_v_head, n_embd) qwen35 */
    lm_matrix walpha;           /* (n_v_head, n_embd) qwen35 */
    lm_matrix wba;              /* (2 n_v_head, n_embd) qwen3next; data NULL otherwise */
    lm_matrix ssm_out;          /* (n_embd, n_v_head * head_v) */
    const float *ssm_conv;      /* (conv_dim, conv_kernel) */
    const float *ssm_a;         /* (n_v_head) -exp(A_log) */
    const float *ssm_dt;        /* (n_v_head) */
    const float *ssm_norm;      /* (head_v) */
} qwen35_deltanet;

/* The weights are the kit's lm_decoder_tensors (lmserve/types.h) and a qwen35_deltanet per
 * layer: attention layers are gated (wq: (n_head * 2 * head_dim, n_embd), per head its query
 * rows then its gate rows) with per-head q and k norms; ffn_norm is the file's
 * post_attention_norm; the feed-forward a SiLU MLP or SiLU experts with a gated shared
 * expert; rope: NEOX pairs over the first n_rot dims of a head. Borrows the weights (the
 * mapped tensors and the rope frequencies must outlive the model; the layer arrays are read
 * during the call); *out is the model's lm_base, freed by lm_model_free. */
int qwen35_build(const qwen35_config *config, const lm_decoder_tensors *weights,
                 const qwen35_deltanet *delta, int n_threads, int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_QWEN35_FORWARD_H */
