/*
 * What both counting drivers share: the counted (rows, tokens) segments, the mark the log
 * parser splits on, and random blocks of a GGML type (lmserve's type ids are GGML's).
 */
#include <stdint.h>
#include <string.h>

/* (rows, tokens) of each counted product */
static const int SEGMENTS[][2] = {{128, 1},  {256, 1},  {64, 64}, {128, 64},
                                  {64, 128}, {128, 128}, {64, 192}};
#define NSEG (int)(sizeof SEGMENTS / sizeof *SEGMENTS)

__attribute__((noinline)) void lmcount_mark(int i) { __asm__ volatile("" ::"r"(i) : "memory"); }

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint64_t next64(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static float uniform(void) { /* [-1, 1) */
    return (float)(next64() >> 40) / (float)(1 << 23) - 1.0f;
}

/* the most rows and tokens of any segment */
static void segments_max(int64_t *rows, int64_t *tokens) {
    *rows = *tokens = 0;
    for (int s = 0; s < NSEG; s++) {
        *rows = SEGMENTS[s][0] > *rows ? SEGMENTS[s][0] : *rows;
        *tokens = SEGMENTS[s][1] > *tokens ? SEGMENTS[s][1] : *tokens;
    }
}

/* nb random blocks of bb bytes of GGML type `type` (3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K), with
 * sane f16 scales (random scale bits would include NaNs); half() rounds a float to f16 bits */
static void random_blocks(int type, uint8_t *w, int64_t nb, int64_t bb, uint16_t (*half)(float)) {
    for (int64_t i = 0; i + 8 <= nb * bb; i += 8) {
        const uint64_t r = next64();
        memcpy(w + i, &r, 8);
    }
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * bb;
        const uint16_t d = half(0.001f + 0.02f * (uniform() + 1.0f));
        const uint16_t m = half(0.01f * uniform());
        switch (type) {
        case 3:  /* Q4_1 */
        case 12: /* Q4_K */
            memcpy(blk + 2, &m, 2);
            /* fallthrough */
        case 8: /* Q8_0 */
            memcpy(blk, &d, 2);
            break;
        case 14: /* Q6_K */
            memcpy(blk + 208, &d, 2);
            break;
        default:
            break;
        }
    }
}
