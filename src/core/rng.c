// rng.c: xoshiro256** (Blackman & Vigna), seeded through splitmix64. Chosen
// for a tiny, explicit state that checkpoints can store and restore.
#include "fitlm/core.h"

#include <math.h>

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

uint64_t fl_rng_u64(fl_rng *rng) {
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
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
