/* The native harnesses' random numbers: xorshift64, the same sequence on every machine. */
#include <stdint.h>

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint32_t next(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

static float uniform(void) { /* [-1, 1) */
    return (float)(next() & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}
