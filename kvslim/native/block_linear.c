/* y = x @ W.T for W kept as ggml blocks, a few rows of x at a time (decode).
 *
 * Each weight block is read once and unpacked in registers; no dequantized row is
 * written to memory. Rows of W are split across OpenMP threads. Built on first use by
 * kvslim/weights/native.py with the machine's C compiler (-O3 -march=native: the block
 * loops are written so that gcc/clang vectorise them); without a compiler kvslim uses
 * the pure-torch path, which the parity tests hold this one to.
 *
 * Block layouts (ggml): Q8_0 = f16 d, 32 x int8 q; value = d * q.
 *                       Q4_0 = f16 d, 16 bytes; byte j holds value j (low nibble) and
 *                              value j + 16 (high nibble); value = d * (nibble - 8).
 *                       F16 / BF16 = plain rows (treated as blocks of 32 without a scale).
 *
 * With AVX2 + F16C (explicit intrinsics below) a block is unpacked into four vectors of
 * 8 floats; each activation row multiplies them into a block sum that the scale then
 * folds into the row's accumulator: one multiply by d per block, not per value. Without
 * them, plain loops the compiler vectorises as it can.
 */
#include <stdint.h>
#include <string.h>

#define QK 32

/* A block's scale: the f16 at its start. */
static float block_scale(const uint8_t *block) {
    _Float16 v;
    memcpy(&v, block, 2);
    return (float)v;
}

/* Per-lane partial sums across blocks (acc[i] collects value i of every block), summed once
 * per row: the block loop then vectorises without a horizontal sum per block. */
static float lanes_sum(const float *acc) {
    float total = 0.0f;
    for (int i = 0; i < QK; i++) total += acc[i];
    return total;
}

static float dot_q8_0(const uint8_t *row, const float *x, int64_t n_blocks) {
    float acc[QK] = {0};
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *block = row + b * 34;
        const float d = block_scale(block);
        const int8_t *q = (const int8_t *)(block + 2);
        const float *xb = x + b * QK;
        #pragma omp simd
        for (int i = 0; i < QK; i++) acc[i] += d * (float)q[i] * xb[i];
    }
    return lanes_sum(acc);
}

static float dot_q4_0(const uint8_t *row, const float *x, int64_t n_blocks) {
    float acc[QK] = {0};
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *block = row + b * 18;
        const float d = block_scale(block);
        const uint8_t *q = block + 2;
        const float *xb = x + b * QK;
        #pragma omp simd
        for (int i = 0; i < QK / 2; i++) {
            acc[i] += d * (float)((int)(q[i] & 0x0F) - 8) * xb[i];
            acc[i + QK / 2] += d * (float)((int)(q[i] >> 4) - 8) * xb[i + QK / 2];
        }
    }
    return lanes_sum(acc);
}

enum { TYPE_Q8_0 = 8, TYPE_Q4_0 = 4, TYPE_F16 = 16, TYPE_BF16 = 17 };
#define MAX_M 8

static int64_t block_bytes(int type) {
    return type == TYPE_Q8_0 ? 34 : type == TYPE_Q4_0 ? 18 : type == TYPE_F16 || type == TYPE_BF16 ? 64 : 0;
}

static float dot_f16(const uint8_t *row, const float *x, int64_t k) {
    float total = 0.0f;
    #pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < k; i++) total += (float)((const _Float16 *)row)[i] * x[i];
    return total;
}

static float dot_bf16(const uint8_t *row, const float *x, int64_t k) {
    float total = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
        float v;
        memcpy(&v, &bits, 4);
        total += v * x[i];
    }
    return total;
}

__attribute__((unused)) static float dot_portable(int type, const uint8_t *row, const float *x, int64_t k) {
    switch (type) {
        case TYPE_Q8_0: return dot_q8_0(row, x, k / QK);
        case TYPE_Q4_0: return dot_q4_0(row, x, k / QK);
        case TYPE_F16: return dot_f16(row, x, k);
        default: return dot_bf16(row, x, k);
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

/* One block (32 values) into v[0..3], without its scale; returns the scale (1 for floats). */
static inline float unpack_block(int type, const uint8_t *b, __m256 v[4]) {
    if (type == TYPE_Q8_0) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
        return block_scale(b);
    }
    if (type == TYPE_Q4_0) {
        const __m256i m4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
        for (int j = 0; j < 2; j++) {                   /* bytes 8j..8j+7: values 8j.. (low), 16+8j.. (high) */
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j)));
            v[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, m4), eight));
            v[j + 2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight));
        }
        return block_scale(b);
    }
    for (int j = 0; j < 4; j++) {
        __m128i h = _mm_loadu_si128((const __m128i *)(b + 16 * j));
        v[j] = type == TYPE_F16 ? _mm256_cvtph_ps(h)
                                : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return 1.0f;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[i * n] = row . x[i] for the m activation rows. */
static void row_times_rows(int type, const uint8_t *row, const float *x, int64_t m, int64_t k, float *y, int64_t n) {
    __m256 acc[MAX_M];
    for (int64_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < k / QK; b++) {
        __m256 v[4];
        const __m256 d = _mm256_set1_ps(unpack_block(type, row + b * bb, v));
        for (int64_t i = 0; i < m; i++) {
            const float *xb = x + i * k + b * QK;
            __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
            acc[i] = _mm256_fmadd_ps(d, t, acc[i]);
        }
    }
    for (int64_t i = 0; i < m; i++) y[i * n] = hsum(acc[i]);
}
#define KVSLIM_AVX2 1
#endif

/* x (m, k) float32 contiguous; w (n, row_bytes) rows of `type`; y (m, n) float32.
 * Returns 0, or 1 for a type it does not know, k not whole blocks, or m > MAX_M. */
int kvslim_block_linear(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
                        int n_threads) {
    if (!block_bytes(type) || k % QK || m > MAX_M) return 1;
    const int64_t row_bytes = k / QK * block_bytes(type);
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_bytes;
#ifdef KVSLIM_AVX2
        row_times_rows(type, row, x, m, k, y + r, n);
#else
        for (int64_t i = 0; i < m; i++) y[i * n + r] = dot_portable(type, row, x + i * k, k);
#endif
    }
    return 0;
}
