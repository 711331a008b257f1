/*
 * The kit's memory and hooks without Python, built with the whole kernel library (under
 * AddressSanitizer and UndefinedBehaviorSanitizer by tests/test_native_sanitize.py, whose
 * leak check also holds every model's memory to being freed):
 *
 *   - the arena: lm_model_new and lm_base_alloc hand out zeroed, 64-byte aligned memory that
 *     lm_model_free frees, lm_base_init keeps it, a failed build frees it;
 *   - a pre-norm decoder of four blocks (global and sliding-window attention, a mixture of
 *     experts with a shared expert, post norms, an output scale, a layer reading an earlier
 *     layer's cache) with hooks: they nest in the order added, each context is found by its
 *     functions and freed once with the model, a fifth hook is refused and its context freed;
 *   - its forward passes: a prompt in chunks equals the same tokens one at a time, a batch of
 *     two sequences equals each alone, a bidirectional chunk and an f16 cache run.
 *
 * Prints one line per failure, then "N passed, M failed"; exits 1 on any failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmserve/kernels.h"
#include "lmserve/kernels_impl.h"

#include "rng.h"

enum { D = 32, NH = 4, NKV = 2, HD = 8, FF = 48, V = 40, NL = 4, NB = 8, WINDOW = 6, NE = 4,
       NU = 2, PROMPT = 19, THREADS = 2 };

static int g_passed, g_failed;

static void check(int ok, const char *what) {
    if (ok) {
        g_passed++;
        return;
    }
    g_failed++;
    printf("FAILED %s\n", what);
}

/* ------------------------------------------------------------------ the arena */

typedef struct family_model {
    lm_base base;
    float *rows;
    int64_t *table;
} family_model;

static int family_chunk(void *self, const int32_t *tokens, int64_t ntok, float *logits,
                        int64_t first_logit) {
    family_model *m = self;
    LM_TRY(lm_embed(&m->base, (lm_matrix){m->rows, LM_F32}, tokens, ntok));
    return lm_logits(&m->base, NULL, 1e-6f, (lm_matrix){m->rows, LM_F32},
                     m->base.x + first_logit * D, ntok - first_logit, 0.0f, logits);
}

static void check_arena(void) {
    lm_base *b = NULL;
    check(lm_model_new(sizeof(lm_base) - 1, &b) == LM_EINVAL && b == NULL, "model_new too small");
    check(lm_model_new(sizeof(family_model), &b) == LM_OK && b != NULL, "model_new");
    if (b == NULL) return;
    family_model *m = (family_model *)b;
    check(((uintptr_t)m & 63) == 0 && m->rows == NULL && b->pool == NULL, "model zeroed, aligned");
    size_t total = 0;
    int zeroed = 1, aligned = 1;
    for (int i = 0; i < 40; i++) {
        const size_t n = (size_t)(i * 37 % 300) + (i == 7 ? 0 : 1);
        uint8_t *p = lm_base_alloc(b, n);
        if (p == NULL) {
            check(0, "base_alloc");
            break;
        }
        total += n;
        aligned &= ((uintptr_t)p & 63) == 0;
        for (size_t j = 0; j < n; j++) zeroed &= p[j] == 0;
        memset(p, 0xA5, n); /* the whole of it is the caller's */
    }
    check(aligned && zeroed, "arena blocks zeroed and aligned");
    check(b->arena.bytes == total + sizeof(family_model), "arena counts its bytes");
    check(lm_base_alloc(NULL, 8) == NULL && lm_base_alloc(b, SIZE_MAX) == NULL, "base_alloc refuses");

    m->rows = lm_base_alloc(b, sizeof(float) * V * D);
    m->table = lm_base_alloc(b, sizeof(int64_t) * NL);
    for (int i = 0; i < V * D; i++) m->rows[i] = uniform();
    const lm_cache_layer layer = {1, HD, HD, 0, 0};
    /* a failed start leaves the arena as it was: the model is still the caller's */
    check(lm_base_init(b, THREADS, 0, V, D, 1, &layer, family_chunk, NULL) == LM_EINVAL,
          "base_init refuses");
    check(b->arena.last != NULL && m->rows != NULL && m->table[0] == 0, "arena kept on failure");
    check(lm_base_init(b, THREADS, NB, V, D, 1, &layer, family_chunk, NULL) == LM_OK, "base_init");
    check(b->arena.bytes >= total && m->rows != NULL, "arena kept by base_init");
    check(lm_decoder_hook_ctx(b, NULL, NULL) == NULL, "no hooks in a family's own model");
    lm_cache *cache = NULL;
    check(lm_cache_new(1, &layer, 16, LM_F32, &cache) == LM_OK, "cache");
    const int32_t tokens[3] = {1, 5, 9};
    float logits[3 * V];
    check(lm_forward(b, cache, tokens, 3, 0, logits, 1) == LM_OK, "family forward");
    /* tied rows: a token's own logit is its squared norm over its rms, the largest */
    int argmax = 0;
    for (int v = 1; v < V; v++) argmax = logits[2 * V + v] > logits[2 * V + argmax] ? v : argmax;
    check(argmax == 9, "family forward's logits");
    lm_cache_free(cache);
    lm_model_free(b);
}

/* ------------------------------------------------------------------ the decoder */

static void *g_owned[256];
static int g_n_owned;

static float *randf(int64_t n, float lo, float hi) {
    float *p = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * 0.5f * (uniform() + 1.0f);
    g_owned[g_n_owned++] = p;
    return p;
}

static lm_matrix mat(int64_t rows, int64_t cols) {
    const float s = 1.0f / sqrtf((float)cols);
    return (lm_matrix){randf(rows * cols, -s, s), LM_F32};
}

/* What the hooks write: one event per call, in order. */
static int g_events[4096], g_n_events, g_freed;

typedef struct hook_ctx {
    int id;
    float add; /* added to the residual after every block: the hooks change the result */
} hook_ctx;

static int hook_begin(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok) {
    (void)b, (void)tokens, (void)ntok;
    const hook_ctx *h = ctx;
    if (g_n_events < 4096) g_events[g_n_events++] = h->id * 100;
    return LM_OK;
}

static int hook_after(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n) {
    const hook_ctx *h = ctx;
    if (g_n_events < 4096) g_events[g_n_events++] = h->id * 100 + layer + 1;
    float *x = b->x + r0 * b->n_embd;
    for (int64_t i = 0; i < n * b->n_embd; i++) x[i] += h->add;
    return LM_OK;
}

static void hook_free(void *ctx) {
    g_freed++;
    free(ctx);
}

static hook_ctx *new_ctx(int id, float add) {
    hook_ctx *h = malloc(sizeof *h);
    h->id = id;
    h->add = add;
    return h;
}

static float g_inv_freq[HD / 2];
static float g_out_scale = 0.75f;

/* The four blocks; `broken` leaves layer 1 without its output matrix. */
static int build_decoder(int hooks, int broken, lm_base **out) {
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(NL, &m));
    m->rope = (lm_rotary){LM_ROPE_NEOX, HD, g_inv_freq, 1.0f};
    m->rope_swa = (lm_rotary){LM_ROPE_NORMAL, HD / 2, g_inv_freq, 1.0f};
    for (int l = 0; l < NL; l++) {
        lm_block *blk = &m->blocks[l];
        blk->norm_eps = 1e-5f;
        blk->attn_norm = randf(D, 0.5f, 1.5f);
        blk->ffn_norm = randf(D, 0.5f, 1.5f);
        blk->attn = (lm_attn){
            .wq = mat(NH * HD, D), .wk = mat(NKV * HD, D), .wv = mat(NKV * HD, D),
            .wo = mat(D, NH * HD), .q_norm = randf(HD, 0.5f, 1.5f),
            .k_norm = randf(HD, 0.5f, 1.5f), .n_head = NH, .n_kv_head = NKV, .head_dim = HD,
            .norm_eps = 1e-5f, .scale = 1.0f / sqrtf((float)HD), .rope = &m->rope,
        };
        blk->ffn = (lm_ffn){mat(FF, D), mat(FF, D), mat(D, FF), FF, LM_ACT_SILU};
    }
    m->blocks[1].attn.window = WINDOW;
    m->blocks[1].attn.rope = &m->rope_swa;
    m->blocks[1].moe = (lm_moe){
        .router = mat(NE, D), .gate_exps = mat(NE * FF, D), .up_exps = mat(NE * FF, D),
        .down_exps = mat(NE * D, FF), .n_expert = NE, .n_used = NU, .n_ff = FF,
        .gating = LM_GATING_SOFTMAX, .norm_weights = 1, .weights_scale = 1.0f,
        .act = LM_ACT_SILU,
    };
    m->blocks[1].shexp = (lm_ffn){mat(FF, D), mat(FF, D), mat(D, FF), FF, LM_ACT_SILU};
    m->blocks[1].shexp_gate = mat(1, D);
    m->blocks[2].ffn.act = LM_ACT_GELU_TANH;
    m->blocks[2].post_attn_norm = randf(D, 0.5f, 1.5f);
    m->blocks[2].post_ffn_norm = randf(D, 0.5f, 1.5f);
    m->blocks[2].out_scale = &g_out_scale;
    m->blocks[3].attn.kv_shared = 1;
    if (broken) m->blocks[1].attn.wo.data = NULL;
    m->dec.token_embd = mat(V, D);
    m->dec.output = m->dec.token_embd;
    m->dec.output_norm = randf(D, 0.5f, 1.5f);
    m->dec.norm_eps = 1e-5f;
    m->dec.embd_scale = 2.0f;
    m->dec.logit_softcap = 20.0f;
    for (int h = 0; h < hooks; h++) {
        const lm_hook hook = {new_ctx(h + 1, 0.01f * (float)(h + 1)), hook_begin, hook_after,
                              hook_free};
        const int rc = lm_decoder_add_hook(m, &hook);
        if (rc != LM_OK) {
            lm_model_free(&m->base);
            return rc;
        }
    }
    return lm_decoder_finish(m, THREADS, NB, V, D, out);
}

static float max_diff(const float *a, const float *b, int64_t n) {
    float d = 0.0f;
    for (int64_t i = 0; i < n; i++) d = fmaxf(d, fabsf(a[i] - b[i]));
    return d;
}

static int all_finite(const float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(a[i])) return 0;
    return 1;
}

static void check_hooks(void) {
    /* a fifth hook is refused, and its context freed with it */
    g_freed = 0;
    lm_base *b = NULL;
    check(build_decoder(5, 0, &b) == LM_EINVAL && b == NULL, "fifth hook refused");
    check(g_freed == 5, "every hook's context freed once on a refused hook");
    /* a decoder the kit refuses frees itself and its hooks */
    g_freed = 0;
    check(build_decoder(2, 1, &b) == LM_ETYPE && b == NULL, "broken decoder refused");
    check(g_freed == 2, "a refused decoder frees its hooks");
    /* before lm_decoder_finish, lm_model_free frees the model */
    lm_decoder_model *m;
    g_freed = 0;
    check(lm_decoder_new(NL, &m) == LM_OK, "decoder_new");
    const lm_hook only_after = {new_ctx(9, 0.0f), NULL, hook_after, hook_free};
    const lm_hook none = {new_ctx(8, 0.0f), NULL, NULL, hook_free};
    check(lm_decoder_add_hook(m, &only_after) == LM_OK, "hook with after_block alone");
    check(lm_decoder_add_hook(m, &none) == LM_EINVAL && g_freed == 1, "hook without functions");
    check(lm_decoder_add_hook(m, NULL) == LM_EINVAL, "no hook");
    check(lm_decoder_hook_ctx(&m->base, NULL, hook_after) != NULL, "hook_ctx by its functions");
    lm_model_free(&m->base);
    check(g_freed == 2, "an unfinished decoder frees its hooks");
}

static void check_decoder(void) {
    for (int i = 0; i < HD / 2; i++) g_inv_freq[i] = powf(10000.0f, -2.0f * (float)i / HD);
    lm_base *b = NULL, *plain = NULL;
    g_freed = 0;
    check(build_decoder(2, 0, &b) == LM_OK, "decoder with two hooks");
    check(build_decoder(0, 0, &plain) == LM_OK, "decoder without hooks");
    if (b == NULL || plain == NULL) return;
    hook_ctx *h1 = lm_decoder_hook_ctx(b, hook_begin, hook_after);
    check(h1 != NULL && h1->id == 1, "first hook's ctx");
    check(lm_decoder_hook_ctx(b, hook_begin, NULL) == NULL, "hook_ctx matches both functions");
    check(lm_decoder_hook_ctx(plain, hook_begin, hook_after) == NULL, "no hook, no ctx");

    lm_cache_layer geometry[NL];
    memcpy(geometry, b->cache_layers, sizeof geometry);
    lm_cache *c1 = NULL, *c2 = NULL, *c3 = NULL, *c16 = NULL;
    check(lm_cache_new(NL, geometry, 64, LM_F32, &c1) == LM_OK &&
              lm_cache_new(NL, geometry, 64, LM_F32, &c2) == LM_OK &&
              lm_cache_new(NL, geometry, 64, LM_F32, &c3) == LM_OK &&
              lm_cache_new(NL, geometry, 64, LM_F16, &c16) == LM_OK,
          "caches");
    int32_t tokens[PROMPT + 4];
    for (int i = 0; i < PROMPT + 4; i++) tokens[i] = (int32_t)(next() % V);

    /* one chunk: the hooks nest (begin 1, 2; after each block 2, then 1) */
    g_n_events = 0;
    float *logits = malloc(sizeof(float) * (PROMPT + 4) * V);
    float *step = malloc(sizeof(float) * (PROMPT + 4) * V);
    check(lm_forward(b, c3, tokens, 5, 0, logits, 1) == LM_OK, "forward of one chunk");
    int want[2 + 2 * NL] = {100, 200};
    for (int l = 0; l < NL; l++) {
        want[2 + 2 * l] = 200 + l + 1;
        want[3 + 2 * l] = 100 + l + 1;
    }
    check(g_n_events == 2 + 2 * NL && memcmp(g_events, want, sizeof want) == 0,
          "hooks nest in the order added");
    float *alone = malloc(sizeof(float) * 5 * V);
    check(lm_forward(plain, c2, tokens, 5, 0, alone, 1) == LM_OK, "forward without hooks");
    check(max_diff(alone, logits, 5 * V) > 1e-3f, "the hooks change the logits");

    /* a prompt in chunks of NB equals the tokens one at a time */
    check(lm_forward(b, c1, tokens, PROMPT, 0, logits, 1) == LM_OK, "prefill");
    for (int i = 0; i < PROMPT; i++)
        check(lm_forward(b, c2, tokens + i, 1, i, step + (int64_t)i * V, 0) == LM_OK, "decode");
    const float d = max_diff(logits, step, (int64_t)PROMPT * V);
    check(all_finite(logits, (int64_t)PROMPT * V) && d < 1e-3f, "prefill equals decode");
    if (!(d < 1e-3f)) printf("  prefill vs decode: %g\n", (double)d);

    /* two sequences in one batch equal each alone */
    lm_cache *caches[2] = {c1, c3};
    const int64_t ntoks[2] = {2, 3}, pos[2] = {PROMPT, 5};
    const int32_t batch[5] = {tokens[PROMPT], tokens[PROMPT + 1], tokens[5], tokens[6],
                              tokens[7]};
    check(lm_forward_batch(b, 2, caches, batch, ntoks, pos, logits) == LM_OK, "batch");
    check(lm_forward(b, c2, tokens + PROMPT, 2, PROMPT, step, 1) == LM_OK, "batch's first alone");
    float *second = malloc(sizeof(float) * 8 * V);
    lm_cache *c4 = NULL;
    check(lm_cache_new(NL, geometry, 64, LM_F32, &c4) == LM_OK, "cache");
    check(lm_forward(b, c4, tokens, 8, 0, second, 1) == LM_OK, "batch's second alone");
    check(max_diff(logits, step, 2 * V) < 1e-3f, "batch row 1 equals its sequence alone");
    check(max_diff(logits + 2 * V, second + 5 * V, 3 * V) < 1e-3f,
          "batch row 2 equals its sequence alone");

    /* a bidirectional canvas after a prefix; an f16 cache */
    check(lm_forward_bidirectional(b, c1, tokens, 4, PROMPT + 2, logits) == LM_OK &&
              all_finite(logits, 4 * V),
          "bidirectional chunk");
    check(lm_forward(b, c16, tokens, PROMPT, 0, logits, 0) == LM_OK && all_finite(logits, V),
          "f16 cache");
    check(lm_forward(b, c16, tokens, 1, 70, logits, 0) == LM_EINVAL, "past the context");

    free(second);
    free(alone);
    free(step);
    free(logits);
    lm_cache_free(c1);
    lm_cache_free(c2);
    lm_cache_free(c3);
    lm_cache_free(c4);
    lm_cache_free(c16);
    lm_model_free(plain);
    lm_model_free(b);
    check(g_freed == 2, "the model frees each hook's context once");
}

int main(void) {
    check_arena();
    check_decoder();
    check_hooks();
    for (int i = 0; i < g_n_owned; i++) free(g_owned[i]);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed > 0;
}
