/* IEEE half <-> float for the other C files (included by them; not a library of its own).
 *
 * Where the compiler has _Float16 (GCC 12+ on x86, clang 15+, Apple's clang on arm64) its
 * conversions are used: F16C or the CPU's own instructions. Older compilers (Debian's clang 14
 * on x86, for one) have no _Float16, and the kernels then built nowhere; the bit-exact software
 * conversions below serve them (round to nearest even, subnormals, inf, NaN kept NaN).
 * KVSLIM_SOFT_HALF forces them, so the tests hold them to the hardware's on every value. */
#ifndef KVSLIM_HALF_C
#define KVSLIM_HALF_C
#include <stdint.h>
#include <string.h>

#if defined(__FLT16_MAX__) && !defined(KVSLIM_SOFT_HALF)
static inline float half_to_float(const uint8_t *p) {
    _Float16 v;
    memcpy(&v, p, 2);
    return (float)v;
}

static inline void float_to_half(uint8_t *p, float f) {
    _Float16 h = (_Float16)f;
    memcpy(p, &h, 2);
}
#else
static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t x;
    float f;
    if (exp == 0x1fu) x = sign | 0x7f800000u | mant << 13;                  /* inf, NaN */
    else if (exp) x = sign | (exp + 112u) << 23 | mant << 13;               /* rebias 15 -> 127 */
    else {                                                                  /* zero, subnormal */
        f = (float)mant * 0x1p-24f;
        memcpy(&x, &f, 4);
        x |= sign;
    }
    memcpy(&f, &x, 4);
    return f;
}

static inline void float_to_half(uint8_t *p, float f) {
    uint32_t x, q;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) q = 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u);
    else if (a >= 0x477ff000u) q = 0x7c00u;            /* from 65520 up: rounds past 65504 */
    else if (a < 0x38800000u) {                        /* below 2^-14: a subnormal half or zero */
        const uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;               /* value / 2^-24 = mant >> shift */
        if (e == 0 || shift > 24u) q = 0u;             /* under 2^-25 (a float subnormal too) */
        else {
            const uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
            q = mant >> shift;
            q += rem > halfway || (rem == halfway && (q & 1u));
        }
    } else {
        const uint32_t rem = a & 0x1fffu;
        q = (a - 0x38000000u) >> 13;                   /* rebias 127 -> 15 */
        q += rem > 0x1000u || (rem == 0x1000u && (q & 1u));
    }
    q |= sign;
    p[0] = (uint8_t)q, p[1] = (uint8_t)(q >> 8);
}
#endif

/* Round a float to the nearest half and back (the scales the formats store). */
static inline float half_round(float v) {
    uint8_t b[2];
    float_to_half(b, v);
    return half_to_float(b);
}

/* Software-path checks: every half to float, and float bit patterns to half (tests). */
void kvslim_half_to_float(const uint8_t *h, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(h + 2 * i);
}

void kvslim_float_to_half(const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) float_to_half(out + 2 * i, x[i]);
}
#endif
