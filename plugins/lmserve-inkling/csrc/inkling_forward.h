/*
 * Forward pass of Inkling (Thinking Machines' text model, ``inkling`` GGUFs) over the lmserve
 * kit.
 *
 * Per layer (no RoPE; position enters through a learned relative bias and the convolutions):
 *   h = rmsnorm(x) * attn_norm
 *   q = qnorm(wq . h)   k = knorm(sconv_k(wk . h))   v = sconv_v(wv . h)   r = wr . h
 *   bias[t, head, d] = r[t, head] . rel_proj[:, d]      d < extent (sliding layers: the window)
 *   x += sconv_attn(wo . attention(q, k, v, scale 1 / head_dim, + bias by distance))
 *   h = rmsnorm(x) * ffn_norm
 *   x += sconv_mlp(gscale * mlp(h))        the first n_dense layers: a SiLU-gated MLP
 *                                          then: top-k of sigmoid(router) + bias, weights
 *                                          softmax(logsigmoid(chosen and shared logits))
 *                                          * route_scale over the routed and shared experts
 * where sconv(y) = y + causal depthwise conv of y (kernel conv_kernel, state across calls).
 * The embeddings are RMS-normed (token_embd_norm); the logits are output(norm(x)) /
 * logit_scale_denom, for the unpadded vocabulary only.
 *
 * Numerics: activations f32 throughout, the convolutions and the router in f32 as the
 * reference does.
 *
 * The region between the cdef markers is also the cffi declaration of this module.
 */
#ifndef LMSERVE_INKLING_FORWARD_H
#define LMSERVE_INKLING_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct inkling_config {
    lm_dims dims;            /* n_kv_head: unused (per layer); n_ff: the dense layers' width */
    int n_dense;             /* leading dense layers */
    int window;              /* of the sliding layers */
    int rel_extent;          /* bias extent of the global layers */
    int rel_extent_swa;      /* of the sliding layers */
    int d_rel;
    int conv_kernel;         /* >= 2 */
    int n_expert;
    int n_expert_used;
    int n_shared;
    int n_ff_exp;
    float route_scale;
    float logit_scale;       /* 1 / logit_scale_denom */
    int n_vocab_unpadded;    /* the model's vocabulary: tokens and logits below it (the
                                tables' padded rows past it are unused) */
    int log_n_floor;         /* > 0: global layers scale q and the bias by
                                1 + log_alpha * log(max((pos + 1) / floor, 1)) */
    float log_alpha;
} inkling_config;

typedef struct inkling_layer {
    int swa;                   /* 1: a sliding-window layer */
    int n_kv_head;
    const float *attn_norm;    /* (n_embd) */
    lm_matrix wq;              /* (n_head * head_dim, n_embd) */
    lm_matrix wk;              /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wv;              /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wr;              /* (n_head * d_rel, n_embd) */
    lm_matrix wo;              /* (n_embd, n_head * head_dim) */
    const float *q_norm;       /* (head_dim) */
    const float *k_norm;       /* (head_dim) */
    const float *rel_proj_t;   /* (extent, d_rel): attn_rel_proj transposed */
    const float *conv_k;       /* (n_kv_head * head_dim, conv_kernel) */
    const float *conv_v;       /* (n_kv_head * head_dim, conv_kernel) */
    const float *conv_attn;    /* (n_embd, conv_kernel) */
    const float *conv_mlp;     /* (n_embd, conv_kernel) */
    const float *ffn_norm;     /* (n_embd) */
    const float *gscale;       /* (1) */
    lm_matrix ffn_gate;        /* dense: (n_ff, n_embd) */
    lm_matrix ffn_up;          /* dense: (n_ff, n_embd) */
    lm_matrix ffn_down;        /* dense: (n_embd, n_ff) */
    lm_matrix router;          /* MoE: (n_expert + n_shared, n_embd) */
    const float *router_bias;  /* MoE: (n_expert) added for the choice only */
    lm_matrix gate_exps;       /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix up_exps;         /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix down_exps;       /* (n_expert, n_embd, n_ff_exp) */
    lm_matrix gate_shexp;      /* (n_shared, n_ff_exp, n_embd) */
    lm_matrix up_shexp;        /* (n_shared, n_ff_exp, n_embd) */
    lm_matrix down_shexp;      /* (n_shared, n_embd, n_ff_exp) */
} inkling_layer;

typedef struct inkling_weights {
    lm_io_tensors io;
    const float *token_embd_norm;  /* (n_embd) */
    const inkling_layer *layers;   /* (n_layer) */
} inkling_weights;

/* Borrows the weights (they must outlive the model; the layer array is copied); *out is the
 * model's lm_base, freed by lm_model_free. Every layer's cache: its K/V rows and the four
 * convolutions' state, (conv_kernel - 1) inputs of k, v, the attention output and the MLP
 * output, in that order, each time-major. */
int inkling_build(const inkling_config *config, const inkling_weights *weights, int n_threads,
                  int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_INKLING_FORWARD_H */
