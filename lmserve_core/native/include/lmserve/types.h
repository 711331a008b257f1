/*
 * lmserve native types: status codes, tensor types and the plain structs shared by the core's
 * kernels and every family's forward pass.
 *
 * The region between the cdef markers is also the cffi declaration of these types (the core's
 * module and every family module read it): plain C declarations only, no preprocessor lines.
 */
#ifndef LMSERVE_TYPES_H
#define LMSERVE_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

/* ------------------------------------------------------------------ status codes
 * Functions return LM_OK (0) or a negative status; they never exit or print. */
enum lm_status {
    LM_OK = 0,
    LM_EINVAL = -1,   /* bad argument: NULL, size out of range, position past n_ctx */
    LM_ENOMEM = -2,
    LM_ETYPE = -3,    /* tensor type not supported */
    LM_EISA = -4,     /* instruction set not available on this CPU */
    LM_EABI = -5,     /* a family module built against another kit ABI */
    LM_EMISMATCH = -6 /* a cache of another geometry than the model's */
};

/* recurrent states a cache keeps while one chunk is read (lm_cache_plan_snapshots) */
enum { LM_MAX_SNAPSHOTS = 8 };

/* ------------------------------------------------------------------ tensor types
 * Values are GGML's type ids, so a GGUF tensor's type passes through unchanged; one
 * exception, LM_Q2_0_128 (below). */
enum lm_type {
    LM_F32 = 0,
    LM_F16 = 1,
    LM_Q4_0 = 2,
    LM_Q4_1 = 3,
    LM_Q5_0 = 6,
    LM_Q5_1 = 7,
    LM_Q8_0 = 8,
    LM_Q4_K = 12,
    LM_Q5_K = 13,
    LM_Q6_K = 14,
    LM_BF16 = 30,
    /* 2-bit codes c (element j of a block at bits 2 (j % 4) of byte j / 4), value (c - 1) d:
     * -1, 0, +1, +2 times the block's f16 scale d. Q2_0 is llama.cpp's: 64 elements, 18
     * bytes. Q2_0_128 holds 128 elements in 34 bytes, the same codes: the layout of the
     * Ternary-Bonsai files PrismML published under GGML id 42 as well (the loader tells the
     * two apart by the tensor's bytes in the file). Its id is lmserve's own, the one
     * PrismML's llama.cpp later gave that layout; no GGML type has it. */
    LM_Q2_0 = 42,
    LM_Q2_0_128 = 142
};

/* Layouts lmserve rewrites matrices into (never a GGUF's type): the same blocks, 16 rows
 * interleaved. Each run of 16 rows is stored block column by block column; the block column
 * b of rows 16g .. 16g + 15 holds the 16 scales (and mins), then the 512 integers ordered as
 * 8 rows of 64 bytes, row R holding elements 4R .. 4R + 3 of each of the 16 rows in turn
 * (Q4_K and Q6_K: per super-block of 256, the rows' factors and scales, then 64 such rows;
 * docs/numerics.md, "Interleaved super-blocks"). A matrix's bytes are those of the GGML
 * type it came from, and rows 16g .. 16g + 15 occupy the same byte range, so a matrix can
 * be cut at any multiple of 16 rows. Values: 64 + the GGML type's id. */
enum lm_r16_type {
    LM_Q4_0_R16 = 66,
    LM_Q4_1_R16 = 67,
    LM_Q8_0_R16 = 72,
    LM_Q4_K_R16 = 76,
    LM_Q6_K_R16 = 78
};

/* The kernels' instruction-set paths: x86-64 (AVX2 with FMA and F16C; AVX-512 F/BW/VL) and
 * AArch64 (NEON with the dot products, FEAT_DotProd; with FEAT_I8MM too). */
enum lm_isa {
    LM_ISA_PORTABLE = 0,
    LM_ISA_AVX2 = 1,
    LM_ISA_AVX512 = 2,
    LM_ISA_NEON_DOTPROD = 3,
    LM_ISA_NEON_I8MM = 4
};

/* Activations of the few-token products (decode, short chunks): f32 throughout, or int16 per
 * group of 32 with integer products against the weights' integers (about 2x fewer
 * instructions per weight; each value within max|group| / 65534 of the f32 one). */
enum lm_decode_precision { LM_DECODE_F32 = 0, LM_DECODE_I16 = 1 };

/* Activations of the many-token products (prefill, 32 tokens and more): f32 throughout, or
 * int16 (as decode's) for the interleaved matrices, whose integer products outrun the f32
 * GEMM; the other types keep the f32 GEMM either way. */
enum lm_prefill_precision { LM_PREFILL_F32 = 0, LM_PREFILL_I16 = 1 };

/* Query rows a forward pass of one sequence may have and still run decode's kernels: the
 * per-token attention path and the few-token products, which give each row the bits it gets
 * in a pass of its own. Speculative verification stays within it. */
enum lm_decode_rows { LM_DECODE_MAX_ROWS = 15 };

/* Which dimensions RoPE rotates together: (2i, 2i+1) or (i, i + n_rot/2). */
enum lm_rope_mode { LM_ROPE_NORMAL = 0, LM_ROPE_NEOX = 2 };

/* Activation of a feed-forward: act(gate) * up when gated, act(up) alone otherwise;
 * RELU2 is relu(x)^2 (nanochat's). */
enum lm_act { LM_ACT_SILU = 0, LM_ACT_GELU_TANH = 1, LM_ACT_RELU2 = 2 };

/* How a mixture-of-experts router turns its logits into expert weights. */
enum lm_gating { LM_GATING_SOFTMAX = 0, LM_GATING_SIGMOID = 1 };

typedef struct lm_pool lm_pool;
typedef struct lm_cache lm_cache;
typedef struct lm_base lm_base;
typedef void (*lm_task_fn)(void *ctx, int ith, int nth);

/* A weight matrix (the GGUF's bytes, mapped or copied): rows x cols of `type`, row-major,
 * each row lm_row_bytes(type, cols) bytes. A 3-D expert tensor is n_expert such matrices in
 * a row. */
typedef struct lm_matrix {
    const void *data;
    int type;
} lm_matrix;

/* One product of a group: y (ntok, rows) = x (ntok, cols) . w^T. */
typedef struct lm_mm {
    lm_matrix w;     /* (rows, cols) */
    int64_t rows;
    int64_t cols;
    const float *x;  /* (ntok, cols) */
    float *y;        /* (ntok, rows) */
} lm_mm;

/* Rotary position embedding: pair i of a head turns by pos * inv_freq[i]; cos and sin are
 * multiplied by mscale (the YaRN attention factor, 1 otherwise). Scaling schemes (linear,
 * llama3, YaRN) are folded into inv_freq by the Python side. */
typedef struct lm_rotary {
    int mode;               /* enum lm_rope_mode */
    int n_rot;              /* rotated dims per head: even, <= head_dim */
    const float *inv_freq;  /* (n_rot / 2) */
    float mscale;
} lm_rotary;

/* The sizes every decoder-only family has (lmserve_core.kit.DecoderConfig). */
typedef struct lm_dims {
    int n_layer;
    int n_embd;     /* model width */
    int n_head;
    int n_kv_head;
    int head_dim;
    int n_ff;       /* feed-forward width (one expert's in a mixture) */
    int n_vocab;
    float rms_eps;  /* of the block norms */
} lm_dims;

/* One layer's cache geometry: K/V rows (attention), a recurrent state, or both. */
typedef struct lm_cache_layer {
    int n_kv_head;  /* 0 with both head dims 0: no K/V rows (a recurrent layer) */
    int head_dim_k;
    int head_dim_v;
    int64_t ring;   /* 0: a row for every position of the context; > 0: a ring of `ring` rows,
                       position p in row p % ring (a sliding-window layer keeps its window and
                       one chunk: window + n_batch) */
    int64_t state;  /* f32 values of the layer's recurrent state (0: none): what the layer
                       carries from the last position written to the next, as laid out by
                       the layer's mixer; zero before position 0 */
} lm_cache_layer;

/* Self-attention of one layer: projections, optional per-head RMS norm of q, k and v, RoPE,
 * cache write, causal attention over the cache, output projection. A layer may instead
 * attend to an earlier layer's cache (kv_shared): it then projects queries only and writes
 * no cache rows. */
typedef struct lm_attn {
    lm_matrix wq;           /* (n_head * head_dim, n_embd) */
    lm_matrix wk;           /* (n_kv_head * head_dim, n_embd); unused with kv_shared */
    lm_matrix wv;           /* (n_kv_head * head_dim, n_embd); data NULL: the values are the
                               keys' projection (before k_norm and RoPE) */
    lm_matrix wo;           /* (n_embd, n_head * head_dim) */
    const float *bq;        /* (n_head * head_dim) bias, or NULL */
    const float *bk;        /* (n_kv_head * head_dim) bias, or NULL */
    const float *bv;        /* (n_kv_head * head_dim) bias, or NULL */
    const float *q_norm;    /* (head_dim) per-head RMS norm weight, or NULL */
    const float *k_norm;    /* (head_dim) per-head RMS norm weight, or NULL */
    int n_head;
    int n_kv_head;
    int head_dim;
    float norm_eps;         /* of q_norm / k_norm */
    float scale;            /* of q . k */
    int64_t window;         /* sliding window in positions; 0: the whole context */
    float softcap;          /* cap * tanh(score / cap) before the softmax; 0: none */
    const lm_rotary *rope;    /* NULL: no rotary embedding */
    int gated;              /* 1: wq is (n_head * 2 * head_dim, n_embd), each head's query rows
                               then its gate rows; the attention output is multiplied by
                               sigmoid(gate) before wo */
    int v_norm;             /* 1: every value head RMS-normalised (no weight, norm_eps) */
    int kv_shared;          /* 0: keys and values of its own, written to its cache layer;
                               n > 0: none, it attends to the cache of layer (its own - n), an
                               attention layer with its own of the same heads, head width and
                               window */
    /* A value residual (ResFormer's value embeddings): a vector of n_kv_head * head_dim floats
     * per row of the chunk added to the row's values (after bv and before v_norm), kv head h's
     * part times its gate v_gate_scale * sigmoid(v_gate[h] . x[:v_gate_cols]), x the block's
     * normed input. The family fills the rows (e.g. in rows of the model's arena, from a table
     * indexed by the chunk's tokens) before the block runs. Not with kv_shared. */
    const float *v_extra;   /* row r of the chunk at v_extra + r * v_extra_stride; NULL: none */
    int64_t v_extra_stride; /* floats from one row to the next */
    const float *v_gate;    /* (n_kv_head, v_gate_cols) f32; NULL: every gate is 1 */
    int v_gate_cols;        /* <= the model width */
    float v_gate_scale;
} lm_attn;

/* How a gated DeltaNet's value heads find their key head (n_v_head a multiple of n_k_head,
 * r = n_v_head / n_k_head): tiled (value head j reads key head j % n_k_head) or grouped
 * (j / r). */
enum lm_head_map { LM_HEADS_TILED = 0, LM_HEADS_GROUPED = 1 };

/* A gated DeltaNet mixer (linear attention with a recurrent state):
 *   qkv = silu(causal_conv1d(wqkv . x))        channels: q (n_k_head * head_k), k (same),
 *                                               v (n_v_head * head_v); kernel `conv_kernel`
 *   q, k = l2norm per head (eps norm_eps), q *= 1 / sqrt(head_k)
 *   g = a * softplus(alpha + dt_bias), beta = sigmoid(beta)          per value head
 *   per value head and token: S *= exp(g); S += k (x) (beta * (v - k . S)); o = q . S
 *   y = wo . (rmsnorm_per_head(o) * norm * silu(wz . x))
 * S is (head_k, head_v) per value head. alpha and beta come from wa / wb, or from one fused
 * wba whose rows hold, per key head, its r beta rows then its r alpha rows (qwen3next). The
 * state a sequence keeps (lm_cache_layer.state): the last conv_kernel - 1 inputs of the
 * convolution (conv_kernel - 1, conv_dim) then S of every value head. */
typedef struct lm_deltanet {
    lm_matrix wqkv;         /* (conv_dim, n_embd), conv_dim = 2 n_k_head head_k + n_v_head head_v */
    lm_matrix wz;           /* (n_v_head * head_v, n_embd) gate of the output norm */
    lm_matrix wa;           /* (n_v_head, n_embd) alpha; unused when wba is set */
    lm_matrix wb;           /* (n_v_head, n_embd) beta; unused when wba is set */
    lm_matrix wba;          /* (2 n_v_head, n_embd) fused beta / alpha; data NULL: wa and wb */
    lm_matrix wo;           /* (n_embd, n_v_head * head_v) */
    const float *conv;      /* (conv_dim, conv_kernel) depthwise kernel, no bias */
    const float *a;         /* (n_v_head) the decay rate: -exp(A_log) */
    const float *dt_bias;   /* (n_v_head) */
    const float *norm;      /* (head_v) weight of the gated output norm */
    int n_k_head;
    int n_v_head;
    int head_k;
    int head_v;
    int conv_kernel;        /* >= 1 */
    int head_map;           /* enum lm_head_map */
    float norm_eps;         /* of the output norm and of the l2 norms */
} lm_deltanet;

/* A gated feed-forward: down . (act(gate . x) * (up . x)); without gate (data NULL) a plain
 * MLP: down . act(up . x). */
typedef struct lm_ffn {
    lm_matrix gate;         /* (n_ff, n_embd); data NULL: ungated */
    lm_matrix up;           /* (n_ff, n_embd) */
    lm_matrix down;         /* (n_embd, n_ff) */
    int64_t n_ff;
    int act;                /* enum lm_act */
} lm_ffn;

/* A mixture of gated feed-forward experts behind a router. The experts' gate and up
 * matrices are either two tensors or one fused tensor (gate_up_exps.data set). The router
 * reads the input x, or rmsnorm(x) * router_norm * router_scale; the experts read x, or
 * rmsnorm(x) * norm. */
typedef struct lm_moe {
    lm_matrix router;       /* (n_expert, n_embd) */
    lm_matrix gate_exps;    /* (n_expert, n_ff, n_embd); unused when gate_up_exps is set */
    lm_matrix up_exps;      /* (n_expert, n_ff, n_embd); unused when gate_up_exps is set */
    lm_matrix gate_up_exps; /* (n_expert, 2 * n_ff, n_embd): per expert, its n_ff gate rows
                               then its n_ff up rows; data NULL: gate_exps and up_exps */
    lm_matrix down_exps;    /* (n_expert, n_embd, n_ff) */
    int n_expert;
    int n_used;             /* experts per token (top-k) */
    int64_t n_ff;           /* of one expert */
    int gating;             /* enum lm_gating */
    int norm_weights;       /* renormalise the chosen weights to sum to 1 */
    float weights_scale;    /* multiplies the chosen weights (1: none) */
    int act;                /* enum lm_act */
    const float *expert_scale; /* (n_expert) multiplies each chosen expert's weight, or NULL */
    const float *norm;      /* (n_embd) RMS norm weight of the experts' input, or NULL: x */
    const float *router_norm;  /* (n_embd) RMS norm weight of the router's input, or NULL: x */
    float router_scale;     /* multiplies the router's normed input (0: 1) */
    float norm_eps;         /* of norm and router_norm */
} lm_moe;

/* What mixes a block's tokens: self-attention over a KV cache, or a recurrent mixer. */
enum lm_mixer { LM_MIXER_ATTENTION = 0, LM_MIXER_DELTANET = 1 };

/* A pre-norm decoder block:  x += post_attn_norm(mixer(rmsnorm(x) * attn_norm))
 *                            x += post_ffn_norm(ffn(rmsnorm(x) * ffn_norm))   (or the experts)
 * attn_norm or ffn_norm NULL: that norm has no weight (rmsnorm(x) alone).
 * The post norms (Gemma's "sandwich") are skipped when NULL. With experts and ffn_parallel,
 * the dense ffn and the experts run side by side, each with its own norms:
 *   x += post_ffn_norm(post_dense_norm(ffn(rmsnorm(x) * ffn_norm))
 *                      + post_moe_norm(experts(x)))        (moe.norm, moe.router_norm set)
 * out_scale, when set, multiplies x at the end of the layer (lm_decoder_chunk applies it,
 * after the decoder's after_block hook). */
typedef struct lm_block {
    float norm_eps;           /* of every norm of the block */
    const float *attn_norm;   /* (n_embd); NULL: no weight */
    int mixer;                /* enum lm_mixer */
    lm_attn attn;             /* LM_MIXER_ATTENTION */
    lm_deltanet delta;        /* LM_MIXER_DELTANET */
    const float *post_attn_norm; /* (n_embd) RMS norm of the attention output, or NULL */
    const float *ffn_norm;    /* (n_embd); NULL: no weight */
    lm_ffn ffn;               /* used when moe.n_expert == 0 */
    lm_moe moe;               /* n_expert > 0: a mixture of experts instead of ffn */
    lm_ffn shexp;             /* with experts, n_ff > 0: a shared expert every token goes
                                 through, added to the routed experts' sum */
    lm_matrix shexp_gate;     /* (1, n_embd): the shared expert's output times
                                 sigmoid(shexp_gate . x); data NULL: ungated */
    int ffn_parallel;         /* 1 (with experts): the dense ffn beside the experts */
    const float *post_dense_norm; /* (n_embd) ffn_parallel: RMS norm of the dense output */
    const float *post_moe_norm;   /* (n_embd) ffn_parallel: RMS norm of the experts' output */
    const float *post_ffn_norm;  /* (n_embd) RMS norm of the feed-forward output, or NULL */
    const float *out_scale;   /* (1) multiplies the layer's output, or NULL */
} lm_block;

/* A step of a family's own between the decoder's blocks, with its context (each function
 * NULL: none):
 *   begin_chunk(ctx, b, tokens, ntok)   after the embedding (b->x), before the first block
 *   after_block(ctx, b, layer, r0, n)   after block `layer` ran rows [r0, r0 + n) of b->x,
 *                                       before its out_scale; b->xb is free scratch
 *   free(ctx)                           when the model is freed: releases what ctx holds
 *                                       outside the model's arena (lm_base_alloc), if anything
 * A context in the model's arena needs no free. */
typedef int (*lm_begin_chunk_fn)(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok);
typedef int (*lm_after_block_fn)(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n);
typedef struct lm_hook {
    void *ctx;
    lm_begin_chunk_fn begin_chunk;
    lm_after_block_fn after_block;
    void (*free)(void *ctx);
} lm_hook;

/* A decoder-only transformer of pre-norm blocks: embedding, blocks, final norm, output.
 *
 * A chunk runs every block over all its rows, except the trailing blocks that write no cache
 * (attention with kv_shared): they run only over the rows whose logits are asked for.
 * A family with steps of its own between the blocks adds hooks (lm_decoder_add_hook). They
 * nest in the order added: every begin_chunk runs first to last, every after_block last to
 * first, so the first hook added sees the embeddings first and a block's output last. */
typedef struct lm_decoder {
    lm_matrix token_embd;     /* (n_vocab, n_embd) */
    const lm_block *blocks;   /* (n_layer) */
    const float *output_norm; /* (n_embd); NULL: the output norm has no weight */
    lm_matrix output;         /* (n_vocab, n_embd); token_embd when tied */
    float norm_eps;           /* of the output norm */
    float embd_scale;         /* multiplies the embeddings (Gemma: sqrt(n_embd)); 0: none */
    float logit_softcap;      /* cap * tanh(logit / cap); 0: none */
    int n_hooks;
    lm_hook hooks[4];         /* (n_hooks) in the order added */
} lm_decoder;

/* One sequence's rows of a chunk: consecutive rows at positions pos.. of its own cache. */
typedef struct lm_seq {
    lm_cache *cache;
    int64_t pos;            /* position of its first row */
    int64_t ntok;           /* rows it has in the chunk */
    int bidirectional;      /* 1: each row also sees the later rows of its sequence in the
                               chunk (a block-diffusion canvas); 0: causal */
} lm_seq;

/* The forward pass of one chunk of at most n_batch rows: the rows of the sequences in the
 * base's seqs, in order (one sequence for a prompt, several for a batched decode step).
 * Writes every row's cache row, and logits (n_vocab floats per row) for rows
 * [first_logit, ntok). */
typedef int (*lm_chunk_fn)(void *model, const int32_t *tokens, int64_t ntok, float *logits,
                           int64_t first_logit);

/* Where MoE routing is recorded when a caller asks for it (tests compare it with a
 * reference): ids and weights of every layer's chosen experts, (n_layer, cap, n_used). */
typedef struct lm_trace {
    int32_t *ids;
    float *weights;
    int64_t cap;            /* tokens the buffers hold */
    int n_used;
} lm_trace;

/* What a model's build was handed (lm_base_alloc): freed with the model. Every allocation
 * begins with a link to the one before. */
typedef struct lm_arena {
    void *last;             /* the latest allocation, or NULL */
    size_t bytes;           /* handed out so far */
} lm_arena;

/* The kit's part of a family model: the family's model struct starts with it. */
struct lm_base {
    lm_pool *pool;
    int64_t n_batch;        /* most tokens pushed through one weight pass */
    int64_t n_vocab;
    int64_t n_embd;
    int n_layer;
    const lm_cache_layer *cache_layers; /* (n_layer) geometry of the caches it runs on */
    lm_chunk_fn forward_chunk;
    void (*free_model)(void *model);    /* frees what the family holds outside the arena,
                                           then calls lm_base_free; NULL: lm_base_free */
    lm_arena arena;         /* the model's memory: its struct (lm_model_new), the family's
                               scratch and state (lm_base_alloc) */
    float *x;               /* (n_batch, n_embd) residual stream */
    float *xb;              /* (n_batch, n_embd) normed input / block output */
    float *xs;              /* (n_batch, n_embd + 1) a shared expert's output and gate, or
                               the experts' output beside a dense ffn; NULL unless a block has
                               one (lm_decoder_finish allocates it) */
    void *tmp;              /* scratch of the kit's layer helpers, grown on demand */
    size_t tmp_bytes;
    const lm_seq *seqs;     /* (n_seqs) whose rows the running chunk holds, in order */
    int n_seqs;
    lm_trace *trace;        /* NULL unless routing is being recorded */
    int64_t trace_row;      /* first trace row of the chunk being run */
    float *hidden;          /* NULL, or (rows, n_embd) floats lm_logits fills with every row
                               it reads after the final norm (embeddings): the last row
                               alone unless every row's logits are asked for */
};

/* A pre-norm decoder model the kit runs whole: a family fills the blocks (and the rope
 * they point to) between lm_decoder_new and lm_decoder_finish. */
typedef struct lm_decoder_model {
    lm_base base;             /* first: the kit drives the model through it */
    lm_decoder dec;           /* dec.blocks == blocks */
    lm_rotary rope;           /* places for the blocks' attn.rope to point to: */
    lm_rotary rope_swa;       /* e.g. global and sliding-window layers */
    lm_block *blocks;         /* (n_layer) */
    lm_cache_layer *geometry; /* (n_layer) derived from the blocks by lm_decoder_finish */
    int n_layer;
} lm_decoder_model;

/* ------------------------------------------------------------------ weight tables
 * What a family's Python side fills from the GGUF (lmserve_core.kit's io_tensors,
 * attention_tensors, mlp_tensors and moe_tensors, under llama.cpp's tensor names) and its
 * build function maps onto blocks (kit.h: lm_decoder_begin, lm_block_attn, lm_block_ffn,
 * lm_decoder_end). A family's own layer struct holds them beside what is its own. */

/* The attention half of a block. */
typedef struct lm_attn_tensors {
    const float *attn_norm;   /* (n_embd) */
    lm_matrix wqkv;           /* (q_dim + 2 kv_dim, n_embd) q, k, v rows in one matrix; data
                                 NULL: wq, wk, wv */
    lm_matrix wq;             /* (q_dim, n_embd); gated: (2 q_dim, n_embd) */
    lm_matrix wk;             /* (kv_dim, n_embd) */
    lm_matrix wv;             /* (kv_dim, n_embd); data NULL: the values are the keys */
    lm_matrix wo;             /* (n_embd, q_dim) */
    const float *bq;          /* (q_dim) bias, or NULL */
    const float *bk;          /* (kv_dim) bias, or NULL */
    const float *bv;          /* (kv_dim) bias, or NULL */
    const float *q_norm;      /* (head_dim) RMS norm of every query head, before RoPE, or NULL */
    const float *k_norm;      /* (head_dim) RMS norm of every key head, before RoPE, or NULL */
    const float *post_attn_norm; /* (n_embd) RMS norm of the attention output, or NULL */
} lm_attn_tensors;

/* The feed-forward half of a block: a gated MLP, a mixture of experts, or both. */
typedef struct lm_ffn_tensors {
    const float *ffn_norm;    /* (n_embd) */
    lm_matrix ffn_gate;       /* (n_ff, n_embd) */
    lm_matrix ffn_up;         /* (n_ff, n_embd) */
    lm_matrix ffn_down;       /* (n_embd, n_ff) */
    lm_matrix ffn_gate_inp;   /* (n_expert, n_embd) router; data NULL: no experts */
    lm_matrix ffn_gate_exps;  /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix ffn_up_exps;    /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix ffn_gate_up_exps; /* (n_expert, 2 n_ff_exp, n_embd) gate rows then up rows; data
                                   NULL: the two above */
    lm_matrix ffn_down_exps;  /* (n_expert, n_embd, n_ff_exp) */
    lm_matrix ffn_gate_inp_shexp; /* (1, n_embd) the shared expert's gate; data NULL: none */
    lm_matrix ffn_gate_shexp; /* (n_ff_shexp, n_embd) */
    lm_matrix ffn_up_shexp;   /* (n_ff_shexp, n_embd) */
    lm_matrix ffn_down_shexp; /* (n_embd, n_ff_shexp) */
    const float *post_ffn_norm; /* (n_embd) RMS norm of the feed-forward output, or NULL */
} lm_ffn_tensors;

/* A block of the standard kinds: attention (swa: over a sliding window, with the local
 * RoPE) and a feed-forward. */
typedef struct lm_layer_tensors {
    int swa;
    lm_attn_tensors attn;
    lm_ffn_tensors ffn;
} lm_layer_tensors;

/* The decoder's input and output. */
typedef struct lm_io_tensors {
    lm_matrix token_embd;     /* (n_vocab, n_embd) */
    const float *output_norm; /* (n_embd) */
    lm_matrix output;         /* (n_vocab, n_embd); token_embd when tied */
} lm_io_tensors;

/* A decoder of standard blocks. */
typedef struct lm_decoder_tensors {
    lm_io_tensors io;
    const lm_layer_tensors *layers; /* (n_layer) */
    lm_rotary rope;           /* of the global layers */
    lm_rotary rope_swa;       /* of the sliding-window layers */
} lm_decoder_tensors;

/* cdef-end */

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_TYPES_H */
