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

/* x (m, k) float32 contiguous; w (n, row_bytes) blocks; y (m, n) float32. type: 8 = Q8_0, 4 = Q4_0. */
int kvslim_block_linear(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
                        int n_threads) {
    int64_t n_blocks = k / QK;
    int64_t row_bytes = n_blocks * (type == 8 ? 34 : 18);
    if (k % QK || (type != 8 && type != 4)) return 1;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t i = 0; i < m; i++) {
            y[i * n + r] = type == 8 ? dot_q8_0(row, x + i * k, n_blocks) : dot_q4_0(row, x + i * k, n_blocks);
        }
    }
    return 0;
}
