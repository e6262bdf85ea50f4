/* Decode's GEMV with 8-bit activations for the K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M and Q5_K_M
 * files are made of), the way llama.cpp computes it on a CPU.
 *
 * Why: the float loops (block_linear.c) turn every code into a float before multiplying, ~9
 * vector operations per group of 32 on AVX-512, and stayed compute-bound at ~36 GB/s of weights
 * on 2 cores where Q8_0's loop reads 56-78 GB/s. Here each activation row is quantized once per
 * call into blocks of 256 values (ggml's Q8_K: a float scale, 256 int8, the 16 sums of 16), and a
 * super-block's dot product is integer arithmetic: unsigned codes times signed activations summed
 * in pairs (maddubs), times the group's integer scale and summed in pairs again (madd), one float
 * multiply-add per super-block for the scale and one for the minima, which meet the activations'
 * sums of 16 instead of the values. Q6_K's codes are stored plus 32: its -32 is a "minimum" of
 * 32 times the group's scale.
 *
 * The result is not the float loops' one: the activations are rounded to 8 bits per block (as in
 * llama.cpp). quantize_q8k and the integer sums are reproduced in torch by
 * kvslim/weights/activations.py, the reference these loops are held to.
 *
 * Included by block_linear.c inside its AVX2 section (AVX2 only: one 256-bit form serves the AVX2
 * and AVX-512 builds; Zen 4 runs 512-bit integer operations as two halves anyway).
 */
#include <float.h>
#include <math.h>

typedef struct {
    float d;                /* the values are d * q; NaN when the block holds a NaN or an infinity */
    int8_t q[256];
    int16_t sums[16];       /* sums of q over each 16 values */
} q8k_t;

static inline int q8_types(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K;
}

/* 256 values as d * q, q = round-half-even(x * 127 / max |x|) (|q| <= 127: maddubs' pairs stay
 * within int16 for codes up to 63). The multiply and the rounding are torch's, so the reference
 * makes the same bytes. A non-finite value makes d NaN: the outputs it reaches are NaN, as with
 * float activations, and the engine's NaN check still sees them. */
static void quantize_q8k(const float *x, q8k_t *b) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int l = 0; l < 256; l += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + l));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));       /* inf, or NaN (unordered) */
        amax = _mm256_max_ps(amax, a);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    if (_mm256_movemask_ps(bad) || top == 0.0f) {
        b->d = _mm256_movemask_ps(bad) ? NAN : 0.0f;
        memset(b->q, 0, sizeof b->q), memset(b->sums, 0, sizeof b->sums);
        return;
    }
    const __m256 iscale = _mm256_set1_ps(127.0f / top);
    for (int l = 0; l < 256; l += 32) {
        __m256i w[4];
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + l + 8 * c), iscale),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs interleave 128-bit lanes: the permute puts the 32 bytes back in order */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
        _mm256_storeu_si256((__m256i *)(b->q + l),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    for (int s = 0; s < 16; s++) {
        int sum = 0;
        for (int l = 0; l < 16; l++) sum += b->q[16 * s + l];
        b->sums[s] = (int16_t)sum;
    }
    b->d = top / 127.0f;
}

/* Word j (int16) of each 128-bit lane of S, in every word of that lane. */
static inline __m256i word_of_lanes(__m256i s, int j) {
    return _mm256_shuffle_epi8(s, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}

/* A super-block's integer scales and minima: group j's scales are word_of_lanes(*scales, j) (the
 * low lane for its values 0-15, the high lane for 16-31), its minima times the activations' 16
 * sums in madd(sums, *minima); the super-block's value is d * (codes . x) - dmin * (minima . sums). */
static inline __attribute__((always_inline)) void q8k_scales(int type, const uint8_t *sb, __m256i *scales,
                                                             __m256i *minima, float *d, float *dmin) {
    if (type == TYPE_Q6_K) {                     /* 16 int8 scales; codes plus 32: the minimum is 32 * scale */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
        const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        *scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, even_odd));      /* lanes: s0 s2 .. s14 | s1 .. s15 */
        *minima = _mm256_cvtepi8_epi16(sc);
        *d = f16(sb + 208), *dmin = 32.0f * *d;
        return;
    }
    uint32_t in[3], w[4];                        /* Q4_K / Q5_K: k_scales' six-bit fields */
    memcpy(in, sb + 4, 12);
    w[0] = in[0] & 0x3F3F3F3Fu;
    w[1] = (in[2] & 0x0F0F0F0Fu) | ((in[0] >> 6) & 0x03030303u) << 4;
    w[2] = in[1] & 0x3F3F3F3Fu;
    w[3] = ((in[2] >> 4) & 0x0F0F0F0Fu) | ((in[1] >> 6) & 0x03030303u) << 4;
    const __m128i fields = _mm_loadu_si128((const __m128i *)w);       /* 8 scales, 8 minima */
    *scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(fields));
    *minima = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(fields, fields));  /* each minimum for both its 16s */
    *d = f16(sb), *dmin = f16(sb + 2);
}

/* Half h (groups 4h..4h+3) of a super-block as 32 unsigned byte codes per group. */
static inline __attribute__((always_inline)) void q8k_codes(int type, const uint8_t *sb, int h, __m256i u[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (type == TYPE_Q6_K) {                     /* q6_k_bytes without the -32 */
        const __m256i lo[2] = {_mm256_loadu_si256((const __m256i *)(sb + 64 * h)),
                               _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32))};
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
        for (int g = 0; g < 4; g++)
            u[g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo[g % 2], 4 * (g / 2)), m4),
                                   _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hi, 2 * g), 4),
                                                    _mm256_set1_epi8(0x30)));
        return;
    }
    const uint8_t *qs = sb + (type == TYPE_Q4_K ? 16 : 48);
    for (int p = 0; p < 2; p++) {                /* group j: nibble j % 2 of the 32 bytes of pair j / 2 */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * (2 * h + p)));
        u[2 * p] = _mm256_and_si256(b, m4);
        u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    }
    if (type == TYPE_Q5_K) {                     /* bit j of qh[l] is bit 4 of group j's value l */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16)), bit4 = _mm256_set1_epi8(0x10);
        for (int g = 0; g < 4; g++)
            u[g] = _mm256_or_si256(u[g], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 4 * h + g), 4), bit4));
    }
}

/* y[i * n] = row . x_i for m activation rows quantized as nb Q8_K blocks each (x: (m, nb)). A
 * super-block's integer sum is made the same way for one row and for several, so a sequence's
 * output does not depend on its batch. */
static inline __attribute__((always_inline)) void rows_times_q8k_typed(int type, const uint8_t *row, const q8k_t *x,
                                                                       int64_t m, int64_t nb, float *y, int64_t n) {
    __m256 acc[MAX_M];
    for (int64_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    const int64_t sb_bytes = group_bytes_x8(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = row + b * sb_bytes;
        __m256i scales, minima, isum[MAX_M];
        float d, dmin;
        q8k_scales(type, sb, &scales, &minima, &d, &dmin);
        for (int64_t i = 0; i < m; i++) isum[i] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i u[4];
            q8k_codes(type, sb, h, u);
            for (int64_t i = 0; i < m; i++) {
                const int8_t *xq = x[i * nb + b].q + 128 * h;
                for (int g = 0; g < 4; g++) {
                    const __m256i pairs = _mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(pairs, word_of_lanes(scales, 4 * h + g)));
                }
            }
        }
        for (int64_t i = 0; i < m; i++) {
            const q8k_t *xb = x + i * nb + b;
            const __m256i imin = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->sums), minima);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * xb->d), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_set1_ps(dmin * xb->d), acc[i]);
        }
    }
    for (int64_t i = 0; i < m; i++) y[i * n] = hsum(acc[i]);
}

static inline __attribute__((always_inline)) void rows_times_q8k(int type, const uint8_t *row, const q8k_t *x,
                                                                 int64_t m, int64_t nb, float *y, int64_t n) {
    switch (type) {                              /* one type per call: its checks leave the loop */
        case TYPE_Q4_K: rows_times_q8k_typed(TYPE_Q4_K, row, x, m, nb, y, n); break;
        case TYPE_Q5_K: rows_times_q8k_typed(TYPE_Q5_K, row, x, m, nb, y, n); break;
        default: rows_times_q8k_typed(TYPE_Q6_K, row, x, m, nb, y, n);
    }
}

/* The m activation rows (m, k) as Q8_K blocks, or NULL when out of memory. */
static q8k_t *quantize_rows_q8k(const float *x, int64_t m, int64_t k) {
    q8k_t *out = malloc((size_t)(m * (k / 256)) * sizeof(q8k_t));
    if (out)
        for (int64_t i = 0; i < m * (k / 256); i++) quantize_q8k(x + 256 * i, out + i);
    return out;
}
