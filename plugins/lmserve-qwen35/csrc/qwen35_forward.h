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

typedef struct qwen35_layer {
    int recurrent;              /* 1: a DeltaNet layer; 0: gated attention */
    const float *attn_norm;     /* (n_embd) */
    const float *ffn_norm;      /* (n_embd) post_attention_norm: the norm before the FFN */
    /* gated attention */
    lm_matrix wq;               /* (n_head * 2 * head_dim, n_embd) per head: query, gate */
    lm_matrix wk;               /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wv;               /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wo;               /* (n_embd, n_head * head_dim) */
    const float *q_norm;        /* (head_dim) */
    const float *k_norm;        /* (head_dim) */
    /* gated DeltaNet */
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
    /* dense MLP */
    lm_matrix ffn_gate;         /* (n_ff, n_embd) */
    lm_matrix ffn_up;           /* (n_ff, n_embd) */
    lm_matrix ffn_down;         /* (n_embd, n_ff) */
    /* experts */
    lm_matrix ffn_gate_inp;     /* (n_expert, n_embd) router */
    lm_matrix ffn_gate_exps;    /* (n_expert, n_ff, n_embd) */
    lm_matrix ffn_up_exps;      /* (n_expert, n_ff, n_embd) */
    lm_matrix ffn_gate_up_exps; /* (n_expert, 2 n_ff, n_embd); data NULL: the two above */
    lm_matrix ffn_down_exps;    /* (n_expert, n_embd, n_ff) */
    lm_matrix ffn_gate_inp_shexp; /* (1, n_embd) the shared expert's gate */
    lm_matrix ffn_gate_shexp;   /* (n_ff_shexp, n_embd) */
    lm_matrix ffn_up_shexp;     /* (n_ff_shexp, n_embd) */
    lm_matrix ffn_down_shexp;   /* (n_embd, n_ff_shexp) */
} qwen35_layer;

typedef struct qwen35_weights {
    lm_matrix token_embd;        /* (n_vocab, n_embd) */
    const qwen35_layer *layers;  /* (n_layer) */
    const float *output_norm;    /* (n_embd) */
    lm_matrix output;            /* (n_vocab, n_embd); token_embd when tied */
    lm_rotary rope;              /* NEOX pairs over the first n_rot dims of a head */
} qwen35_weights;

/* Borrows the weights (the mapped tensors and the rope frequencies must outlive the model;
 * the layer array is read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int qwen35_build(const qwen35_config *config, const qwen35_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_QWEN35_FORWARD_H */
