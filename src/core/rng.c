// rng.c: xoshiro256** (Blackman & Vigna), seeded through splitmix64. Chosen
// for a tiny, explicit state that checkpoints can store and restore.
#include "fitlm/core.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void fl_rng_seed(fl_rng *rng, uint64_t seed) {
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

// the state's update (the draw without its output)
static void advance(uint64_t *s) {
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
}

uint64_t fl_rng_u64(fl_rng *rng) {
    uint64_t result = rotl(rng->s[1] * 5, 7) * 9;
    advance(rng->s);
    return result;
}

// The update is linear over GF(2): a map is the images of the 256 unit
// states. pow2[i] is the update applied 2^i times.
typedef struct {
    uint64_t col[256][4];
} gf2_map;
static gf2_map pow2[64];
static pthread_once_t pow2_once = PTHREAD_ONCE_INIT;

// out = f(s)
static void apply(const gf2_map *f, const uint64_t *s, uint64_t *out) {
    uint64_t r[4] = {0, 0, 0, 0};
    for (int j = 0; j < 256; j++)
        if (s[j / 64] >> (j % 64) & 1)
            for (int w = 0; w < 4; w++) r[w] ^= f->col[j][w];
    memcpy(out, r, sizeof r);
}

static void pow2_init(void) {
    for (int j = 0; j < 256; j++) {
        memset(pow2[0].col[j], 0, sizeof pow2[0].col[j]);
        pow2[0].col[j][j / 64] = 1ull << (j % 64);
        advance(pow2[0].col[j]);
    }
    for (int i = 1; i < 64; i++) // f^(2^i) = f^(2^(i-1)) twice
        for (int j = 0; j < 256; j++) apply(&pow2[i - 1], pow2[i - 1].col[j], pow2[i].col[j]);
}

void fl_rng_jump(fl_rng *rng, uint64_t n) {
    if (n < 64) { // cheaper drawn
        while (n--) advance(rng->s);
        return;
    }
    pthread_once(&pow2_once, pow2_init);
    for (int i = 0; i < 64; i++)
        if (n >> i & 1) apply(&pow2[i], rng->s, rng->s);
}

float fl_rng_uniform(fl_rng *rng) {
    return (float)(fl_rng_u64(rng) >> 40) / 16777216.0f; // 24 random bits
}

float fl_rng_normal(fl_rng *rng) {
    // Box-Muller on doubles; u1 in (0, 1] so the log is finite.
    double u1 = ((fl_rng_u64(rng) >> 11) + 1.0) / 9007199254740992.0;
    double u2 = (fl_rng_u64(rng) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

uint64_t fl_rng_below(fl_rng *rng, uint64_t n) {
    FL_ASSERT(n > 0);
    // Rejection sampling removes the modulo bias.
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = fl_rng_u64(rng);
    while (x >= limit);
    return x % n;
}
