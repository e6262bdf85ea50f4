/* Decode attention over packed K/V pages: one query position per sequence.
 *
 * The torch path (kvslim/cache/attention.py) decodes a block of pages to float32 in
 * memory, then scores it; at depth that is most of a decode step. Here each packed row
 * is decoded into a buffer of head_dim floats that stays in L1, scored against the G
 * query rows that share its KV head (GQA), and forgotten: the pool is read once, in its
 * stored size, which is the point of a compressed cache.
 *
 * Work items are (KV head, sequence, span of SPAN keys); spans let one long sequence use
 * every thread (flash-decoding's split), and their partial softmax states are merged in
 * order at the end. Scores are taken tile by tile (TILE keys), so the online softmax rescales the
 * accumulators once per tile, not once per key.
 *
 * Rows: a row is head_dim values in the format's code domain (the caller rotates the
 * query in, and the output back out). Every block format is [f16 scale][codes] repeated:
 *   CODEC_Q8     32 int8 per block, value = d * q                       (ggml q8_0)
 *   CODEC_NIBBLE 32 codes in 16 bytes, byte j = code j | code j+16 << 4,
 *                value = d * lut[code]                                  (ggml q4_0, iq4_nl)
 *   CODEC_PACKED block_values codes of `bits` bits, packed little-endian 8 codes per
 *                `bits` bytes, value = d * lut[code]                    (TurboQuant, nl grids)
 * and the float rows CODEC_F32 / CODEC_F16 / CODEC_BF16. ggml's q4_1/q5_0/q5_1 are NIBBLE blocks with
 * an f16 offset in the header added to every value (value = d * lut[code] + m, offset_at) and/or
 * 5-bit codes (bits 5: a u32 of each code's bit 4 before the nibbles, a lut of 32): decode_block_ggml,
 * and DEC_GGML in the fused loops. A PACKED block may carry two scale
 * levels (the nls rows): [f16 d][sub_bits-bit rung per sub_values values][codes], and then
 * value = (d * ladder[rung]) * lut[code].
 *   CODEC_KLT    klt3's transform-coded V rows (kvslim/formats/klt.py): [f16 scale][one bit stream
 *                of the row's codes, direction j's `bits[j]` wide], value j = d * levels[j][code j].
 *                Bit widths and levels are the calibration's, per KV head: `klt_plan` and
 *                `klt_levels` hold every head's, and the work item takes its head's
 *                (codec_for_head). A head's levels are packed, 2^bits[j] per direction (~1K
 *                floats at 2.6 bits, in L1), then 32 zeros (sum_klt loads 32 from any start).
 *                Decoded by the buffered loops (AVX-512: V by sum_klt, a direction at a time).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "half.c"

enum { CODEC_F32 = 0, CODEC_F16 = 1, CODEC_BF16 = 2, CODEC_Q8 = 3, CODEC_NIBBLE = 4, CODEC_PACKED = 5, CODEC_KLT = 6 };
#define TILE 32
/* Keys per work item. Fixed, not fitted to the batch or the threads: where a sequence's keys
 * are cut into spans sets the order its sums are added in, so a fixed cut gives a sequence the
 * same bits whatever else is in the step and however many threads run it. 512 keys leave
 * enough items for the threads from depth ~1K on, and a merge per 512 keys costs ~1%. */
#define SPAN 512
#define MAX_DIM 512
#define MAX_ROWS 64

typedef struct {
    int32_t kind, bits, block_values, block_bytes;
    const float *lut;            /* 32 floats: the code values (NIBBLE, PACKED), zero-padded */
    int32_t header_bytes;        /* the f16 scale, then (sub_values > 0) the sub-blocks' rung indices */
    int32_t sub_values, sub_bits;
    const float *ladder;         /* 2^sub_bits factors: sub-block i's scale is d * ladder[rung i] */
    int32_t offset_at;           /* byte of an f16 added to every value (ggml q4_1/q5_1); 0: none */
    /* CODEC_KLT: per (head, direction j), lo | shift << 9 | bits << 12 | level << 16: the code is
     * bits wide from bit `shift` of byte lo of the stream after the scale (reaching into byte lo + 1
     * at most), its value klt_levels[level + code]; each head's levels start at head * klt_stride */
    const int32_t *klt_plan;
    const float *klt_levels;
    int32_t klt_stride;
} codec_t;

static float f16_to_f32(const uint8_t *p) {
    return half_to_float(p);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVSLIM_AVX2 1

/* lut[code & 15] for 8 codes (int32 lanes): two 8-entry permutes and a blend on bit 3. */
static inline __m256 lut16(__m256i codes, __m256 lo, __m256 hi) {
    __m256 a = _mm256_permutevar8x32_ps(lo, codes), b = _mm256_permutevar8x32_ps(hi, codes);
    __m256i high = _mm256_slli_epi32(codes, 28);                 /* bit 3 -> sign bit, read by blendv */
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(high));
}

static inline __m256i bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

static void decode_floats(const codec_t *c, const uint8_t *row, int dim, float *out) {
    int i = 0;
    if (c->kind == CODEC_F32) {
        memcpy(out, row, (size_t)dim * 4);
        return;
    }
    if (c->kind == CODEC_F16) {
#ifdef KVSLIM_AVX2
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))));
#endif
        for (; i < dim; i++) out[i] = f16_to_f32(row + 2 * i);
    } else {                                            /* bf16: the high half of an f32 */
        const uint16_t *h = (const uint16_t *)row;
        uint32_t *o = (uint32_t *)out;
        for (; i < dim; i++) o[i] = (uint32_t)h[i] << 16;
    }
}

/* The scale of value i of a block: d, or d times its sub-block's rung of the ladder. */
static inline float scale_at(const codec_t *c, float d, uint64_t rungs, int i) {
    if (!c->sub_values) return d;
    return d * c->ladder[(rungs >> (c->sub_bits * (i / c->sub_values))) & ((1u << c->sub_bits) - 1)];
}

/* Codes of one block, any layout, one at a time: the portable path and the reference of the rest. */
static void decode_block_scalar(const codec_t *c, const uint8_t *q, float d, uint64_t rungs, float *out) {
    const int n = c->block_values;
    if (c->kind == CODEC_Q8) {
        for (int i = 0; i < n; i++) out[i] = d * (float)(int8_t)q[i];
    } else if (c->kind == CODEC_NIBBLE) {
        for (int i = 0; i < n / 2; i++) {
            out[i] = d * c->lut[q[i] & 0x0F];
            out[i + n / 2] = d * c->lut[q[i] >> 4];
        }
    } else {                                            /* 8 codes per `bits` bytes */
        const int bits = c->bits, mask = (1 << bits) - 1;
        for (int w = 0; w < n / 8; w++) {
            uint64_t word = 0;
            for (int b = 0; b < bits; b++) word |= (uint64_t)q[w * bits + b] << (8 * b);
            for (int j = 0; j < 8; j++)
                out[w * 8 + j] = scale_at(c, d, rungs, w * 8 + j) * c->lut[(word >> (bits * j)) & mask];
        }
    }
}

/* Whether a codec is one of ggml's q4_1/q5_0/q5_1 layouts (an offset, or 5-bit nibble codes). */
static inline int ggml_extra(const codec_t *c) {
    return c->offset_at || (c->kind == CODEC_NIBBLE && c->bits == 5);
}

/* A NIBBLE block of ggml's q4_1, q5_0 or q5_1: 32 values, byte j of the nibbles = code j |
 * code j+16 << 4, with 5-bit codes bit 4 of code j from the u32 before them, plus the offset. */
static void decode_block_ggml(const codec_t *c, const uint8_t *block, float *out) {
    const float d = f16_to_f32(block), m = c->offset_at ? f16_to_f32(block + c->offset_at) : 0.0f;
    const uint8_t *q = block + c->header_bytes;
    uint32_t high = 0;
    if (c->bits == 5) memcpy(&high, q, 4), q += 4;
    for (int j = 0; j < 16; j++) {
        out[j] = d * c->lut[(q[j] & 0x0F) | ((high >> j) & 1) << 4] + m;
        out[j + 16] = d * c->lut[(q[j] >> 4) | ((high >> (j + 16)) & 1) << 4] + m;
    }
}

static inline __attribute__((always_inline)) void decode_block(const codec_t *c, const uint8_t *block, float *out) {
    if (ggml_extra(c)) {
        decode_block_ggml(c, block, out);
        return;
    }
    const float d = f16_to_f32(block);
    const uint8_t *q = block + c->header_bytes;
    uint64_t rungs = 0;
    for (int b = 2; b < c->header_bytes; b++) rungs |= (uint64_t)block[b] << (8 * (b - 2));
#ifdef KVSLIM_AVX2
    const int n = c->block_values;
    const __m256 m4 = _mm256_castsi256_ps(_mm256_set1_epi32(0x0F));
    __m256 vd = _mm256_set1_ps(d);
    if (c->kind == CODEC_Q8 && n % 8 == 0) {
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))))));
        return;
    }
    if ((c->kind == CODEC_NIBBLE || (c->kind == CODEC_PACKED && c->bits == 4)) && n % 16 == 0
        && c->sub_values % 16 == 0) {
        const __m256 lo = _mm256_loadu_ps(c->lut), hi = _mm256_loadu_ps(c->lut + 8);
        for (int i = 0; i < n / 2; i += 8) {                  /* 8 bytes: 16 codes */
            if (c->sub_values) vd = _mm256_set1_ps(scale_at(c, d, rungs, 2 * i));
            __m256i b = bytes8(q + i);
            __m256i low = _mm256_castps_si256(_mm256_and_ps(_mm256_castsi256_ps(b), m4));
            __m256 a = _mm256_mul_ps(vd, lut16(low, lo, hi));
            __m256 h = _mm256_mul_ps(vd, lut16(_mm256_srli_epi32(b, 4), lo, hi));
            if (c->kind == CODEC_NIBBLE) {                    /* byte j: codes j and j + n/2 */
                _mm256_storeu_ps(out + i, a);
                _mm256_storeu_ps(out + i + n / 2, h);
            } else {                                          /* byte j: codes 2j and 2j + 1 */
                __m256 x = _mm256_unpacklo_ps(a, h), y = _mm256_unpackhi_ps(a, h);
                _mm256_storeu_ps(out + 2 * i, _mm256_permute2f128_ps(x, y, 0x20));
                _mm256_storeu_ps(out + 2 * i + 8, _mm256_permute2f128_ps(x, y, 0x31));
            }
        }
        return;
    }
    if (c->kind == CODEC_PACKED && c->bits <= 3 && n % 8 == 0 && c->sub_values % 8 == 0) {   /* one permute */
        const __m256 table = _mm256_loadu_ps(c->lut);
        const int bits = c->bits;
        const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
        const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
        for (int w = 0; w < n / 8; w++) {
            int32_t word = 0;
            for (int b = 0; b < bits; b++) word |= (int32_t)q[w * bits + b] << (8 * b);
            __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
            if (c->sub_values) vd = _mm256_set1_ps(scale_at(c, d, rungs, 8 * w));
            _mm256_storeu_ps(out + 8 * w, _mm256_mul_ps(vd, _mm256_permutevar8x32_ps(table, codes)));
        }
        return;
    }
#endif
    decode_block_scalar(c, q, d, rungs, out);
}

/* Inlined: the kind checks then leave the block loop, and the row of blocks costs no calls
 * (q8_0, four blocks a row: 2.86 -> 2.42 ms a layer at 16K, 1 thread). */
/* A klt3 row: codes of any width, each read from the two bytes it may span (the last byte's
 * code ends in it: its second byte is itself). The reference of sum_klt, which sums V in AVX2
 * and AVX-512 builds; this serves the portable build and the bf16 prefill kernel. */
static void decode_klt(const codec_t *c, const uint8_t *row, int dim, float *out) {
    const float d = f16_to_f32(row);
    const uint8_t *body = row + 2;
    const uint32_t last = (uint32_t)c->block_bytes - 3;
    for (int j = 0; j < dim; j++) {
        const uint32_t p = (uint32_t)c->klt_plan[j], lo = p & 511;
        const uint32_t word = body[lo] | (uint32_t)body[lo < last ? lo + 1 : lo] << 8;
        const uint32_t code = (word >> ((p >> 9) & 7)) & ((1u << ((p >> 12) & 15)) - 1);
        out[j] = d * c->klt_levels[(p >> 16) + code];
    }
}

/* The codec as one KV head reads it: a klt3 codec's plan and levels moved to that head's. */
static const codec_t *codec_for_head(const codec_t *c, int64_t head, int dim, codec_t *local) {
    if (c->kind != CODEC_KLT) return c;
    *local = *c;
    local->klt_plan += head * dim;
    local->klt_levels += head * c->klt_stride;
    return local;
}

static inline __attribute__((always_inline)) void decode_row(const codec_t *c, const uint8_t *row, int dim, float *out) {
    if (c->kind <= CODEC_BF16) {
        decode_floats(c, row, dim, out);
        return;
    }
    if (c->kind == CODEC_KLT) {
        decode_klt(c, row, dim, out);
        return;
    }
    for (int b = 0; b < dim / c->block_values; b++)
        decode_block(c, row + (size_t)b * c->block_bytes, out + b * c->block_values);
}

static float dot(const float *a, const float *b, int dim) {
    int i = 0;
    float s = 0.0f;
#ifdef KVSLIM_AVX2
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= dim; i += 32)                       /* four chains: an add's latency is not the limit */
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
    __m256 t = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; i < dim; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float *y, float a, const float *x, int dim) {
    #pragma omp simd
    for (int i = 0; i < dim; i++) y[i] += a * x[i];
}

#ifdef KVSLIM_AVX2
/* e^x for x <= 0 within ~2 ulp: 2^k * p(r), r = x - k ln2 (ln2 in two parts), p of degree 6;
 * x below -87 gives e^-87 (~1e-38) instead of 0, which no softmax sum can tell apart. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[j] = e^(s[j] - top) for j < n (s has room for TILE values). */
static void exp_shifted(float *s, int n, float top) {
    int j = 0;
#ifdef KVSLIM_AVX2
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(s + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top))));
#endif
    for (; j < n; j++) s[j] = expf(s[j] - top);
}

typedef struct {
    const uint8_t *k_pool, *v_pool;
    int64_t pool_pages, page_size, k_row_bytes, v_row_bytes;
    const int32_t *table;
    int64_t table_stride;
} pages_t;

/* The K and V rows of keys [start, start + n): one division per tile, not two per key (a
 * 64-bit division costs more than decoding an f16 row). */
static void tile_rows(const pages_t *p, int64_t head, int64_t seq, int64_t start, int n, const uint8_t **k_rows,
                      const uint8_t **v_rows) {
    int64_t index = start / p->page_size, offset = start % p->page_size;
    for (int j = 0; j < n; j++) {
        const int64_t row = (head * p->pool_pages + p->table[seq * p->table_stride + index]) * p->page_size + offset;
        k_rows[j] = p->k_pool + row * p->k_row_bytes;
        v_rows[j] = p->v_pool + row * p->v_row_bytes;
        if (++offset == p->page_size) offset = 0, index++;
    }
}

#ifdef KVSLIM_AVX2
/* Eight vectors' horizontal sums as one vector, in order. */
static inline __m256 hsum8(const __m256 s[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[r][j] = q_r . keys[j] for the tile's decoded keys (n, dim): eight keys' sums reduced
 * together, not one horizontal sum per key and row. */
static void tile_scores(const float *q, int n_rows, int dim, const float *keys, int n, float scores[][TILE]) {
    for (int r = 0; r < n_rows; r++) {
        const float *qr = q + (size_t)r * dim;
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 s[8];                               /* eight independent chains, q read once */
            const float *k = keys + (size_t)j * dim;
            for (int jj = 0; jj < 8; jj++) s[jj] = _mm256_setzero_ps();
            for (int i = 0; i < dim; i += 8) {
                const __m256 qi = _mm256_loadu_ps(qr + i);
                for (int jj = 0; jj < 8; jj++) s[jj] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (size_t)jj * dim + i), s[jj]);
            }
            _mm256_storeu_ps(&scores[r][j], hsum8(s));
        }
        for (; j < n; j++) scores[r][j] = dot(qr, keys + (size_t)j * dim, dim);
    }
}

/* acc_r += sum_j w[r][j] * values[j] with the sums held in registers across the tile: 32 of
 * dim and two rows at a time (in memory, every key re-read and re-wrote acc: a load-FMA-store
 * chain per vector per key, the kernel's largest cost). */
static void tile_values(const float *values, int n, int dim, float w[][TILE], int n_rows, float *acc) {
    for (int c = 0; c < dim; c += 32)
        for (int r = 0; r < n_rows; r += 2) {
            const int two = r + 1 < n_rows;
            float *a = acc + (size_t)r * dim + c, *b = two ? a + dim : a;
            __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16),
                   a3 = _mm256_loadu_ps(a + 24);
            __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16),
                   b3 = _mm256_loadu_ps(b + 24);
            for (int j = 0; j < n; j++) {
                const float *v = values + (size_t)j * dim + c;
                const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                             v3 = _mm256_loadu_ps(v + 24);
                const __m256 wa = _mm256_set1_ps(w[r][j]), wb = _mm256_set1_ps(w[two ? r + 1 : r][j]);
                a0 = _mm256_fmadd_ps(wa, v0, a0), a1 = _mm256_fmadd_ps(wa, v1, a1);
                a2 = _mm256_fmadd_ps(wa, v2, a2), a3 = _mm256_fmadd_ps(wa, v3, a3);
                b0 = _mm256_fmadd_ps(wb, v0, b0), b1 = _mm256_fmadd_ps(wb, v1, b1);
                b2 = _mm256_fmadd_ps(wb, v2, b2), b3 = _mm256_fmadd_ps(wb, v3, b3);
            }
            _mm256_storeu_ps(a, a0), _mm256_storeu_ps(a + 8, a1), _mm256_storeu_ps(a + 16, a2);
            _mm256_storeu_ps(a + 24, a3);
            if (two) {
                _mm256_storeu_ps(b, b0), _mm256_storeu_ps(b + 8, b1), _mm256_storeu_ps(b + 16, b2);
                _mm256_storeu_ps(b + 24, b3);
            }
        }
}
#endif

#ifdef KVSLIM_AVX2
/* K and V rows decoded in registers and used at once, no row buffer: the query rows' sums for
 * a group of keys, and V's weighted sums over a tile, stay in registers, so the pool is read
 * once at its packed size and nothing goes through memory in between. AVX-512 (32 registers,
 * a 16-entry table lookup in one permute: vpermps reads the low 4 bits of each index) takes 32
 * values a vector pair; AVX2 (16 registers, two permutes and a blend) 32 values in four
 * vectors. Every layout above (the nls blocks' rungs too, for 16-value sub-blocks). */
#define KVSLIM_FUSED 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSLIM_AVX512 1
#define LANE_GROUP 32
#else
#define LANE_GROUP 16
#endif
enum { DEC_F32, DEC_F16, DEC_BF16, DEC_Q8, DEC_NIBBLE, DEC_PACKED4, DEC_PACKED3, DEC_PACKED2,
       DEC_PACKED4S, DEC_PACKED3S, DEC_GGML, DEC_NONE };  /* ...S: two scale levels, a rung per 16 values;
                                                            GGML: q4_1/q5_0/q5_1 (offset, 5th bit) */

static int fused_kind(const codec_t *c) {
    if (c->kind <= CODEC_BF16) return c->kind;                 /* DEC_F32, DEC_F16, DEC_BF16 */
    if (c->kind == CODEC_KLT) return DEC_NONE;
    if (ggml_extra(c)) {                                       /* q4_1, q5_0, q5_1 */
        if (c->kind != CODEC_NIBBLE || c->block_values != 32) return DEC_NONE;
        for (int k = 0; k < 1 << c->bits; k++)         /* the fused loop computes lut[code] as lut[0] + code */
            if (c->lut[k] != c->lut[0] + (float)k) return DEC_NONE;
        return DEC_GGML;
    }
    if (c->block_values % 32) return DEC_NONE;
    if (c->sub_values) {
        const int rung_bits = c->sub_bits * c->block_values / c->sub_values;
        if (c->kind != CODEC_PACKED || c->sub_values != 16 || rung_bits > 64 || c->header_bytes != 2 + (rung_bits + 7) / 8)
            return DEC_NONE;
        return c->bits == 4 ? DEC_PACKED4S : c->bits == 3 ? DEC_PACKED3S : DEC_NONE;
    }
    if (c->header_bytes != 2) return DEC_NONE;
    if (c->kind == CODEC_Q8) return DEC_Q8;
    if (c->kind == CODEC_NIBBLE) return c->block_values == 32 ? DEC_NIBBLE : DEC_NONE;
    return c->bits == 4 ? DEC_PACKED4 : c->bits == 3 ? DEC_PACKED3 : c->bits == 2 ? DEC_PACKED2 : DEC_NONE;
}

/* PACKED4 rows come out of dec32 interleaved: byte j of a block holds codes 2j and 2j + 1, so
 * within each LANE_GROUP values the first half of the lanes gets the even values and the second
 * half the odd ones. Dot products do not care about order: the query is put in that order
 * once, and V's sums are put back. */
static void interleave(const float *x, float *y, int dim, int back) {
    const int half = LANE_GROUP / 2;
    for (int i = 0; i < dim; i += LANE_GROUP)
        for (int j = 0; j < half; j++) {
            if (back) y[i + 2 * j] = x[i + j], y[i + 2 * j + 1] = x[i + half + j];
            else y[i + j] = x[i + 2 * j], y[i + half + j] = x[i + 2 * j + 1];
        }
}

#ifdef KVSLIM_AVX512
/* Values [i, i + 32) of a row (i a multiple of 32) as two vectors, scaled. */
static inline __attribute__((always_inline)) void dec32(const int kind, const codec_t *c, const __m512 lut,
                                                        const uint8_t *row, int i, __m512 *a, __m512 *b) {
    if (kind == DEC_F32) {
        *a = _mm512_loadu_ps(row + 4 * i), *b = _mm512_loadu_ps(row + 4 * i + 64);
        return;
    }
    if (kind == DEC_F16) {
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
        *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i + 32)));
        return;
    }
    if (kind == DEC_BF16) {
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * i))), 16));
        *b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * i + 32))), 16));
        return;
    }
    const int bv = c->block_values, at = i % bv;
    const uint8_t *block = row + (size_t)(i / bv) * c->block_bytes, *q = block + c->header_bytes;
    __m512 d = _mm512_set1_ps(f16_to_f32(block)), e = d;      /* the scales of *a and *b */
    if (kind == DEC_PACKED4S || kind == DEC_PACKED3S) {          /* values i.. and i+16.. have their own rungs */
        uint64_t rungs;                          /* 8 bytes: the rungs, then codes never shifted down to */
        memcpy(&rungs, block + 2, 8);
        const int mask = (1 << c->sub_bits) - 1, shift = c->sub_bits * (at / 16);
        const float s0 = c->ladder[(rungs >> shift) & mask], s1 = c->ladder[(rungs >> (shift + c->sub_bits)) & mask];
        if (kind == DEC_PACKED4S)                                /* interleaved: both vectors span both halves */
            d = e = _mm512_mul_ps(d, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)));
        else
            d = _mm512_mul_ps(d, _mm512_set1_ps(s0)), e = _mm512_mul_ps(e, _mm512_set1_ps(s1));
    }
    if (kind == DEC_GGML) {                                      /* d * (lut[0] + code) + m, 32-value blocks */
        const uint8_t *qs = q + (c->bits == 5 ? 4 : 0);
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        __m512i lo = _mm512_and_si512(x, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(x, 4);
        if (c->bits == 5) {                                      /* bit j of the u32 before: code j's bit 4 */
            uint32_t h;
            memcpy(&h, q, 4);
            const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i one = _mm512_set1_epi32(1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)h), lanes), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)(h >> 16)), lanes), one), 4));
        }
        const __m512 bias = _mm512_set1_ps(c->lut[0]);
        const __m512 m = _mm512_set1_ps(c->offset_at ? f16_to_f32(block + c->offset_at) : 0.0f);
        *a = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_cvtepi32_ps(lo), bias), m);
        *b = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_cvtepi32_ps(hi), bias), m);
    } else if (kind == DEC_Q8) {
        *a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + at)))));
        *b = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + at + 16)))));
    } else if (kind == DEC_NIBBLE || kind == DEC_PACKED4 || kind == DEC_PACKED4S) {   /* 16 bytes: low nibbles, then high */
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + at / 2)));
        *a = _mm512_mul_ps(d, _mm512_permutexvar_ps(x, lut));
        *b = _mm512_mul_ps(e, _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), lut));
    } else if (kind == DEC_PACKED3 || kind == DEC_PACKED3S) {    /* 12 bytes: four 24-bit words of 8 codes */
        uint64_t lo;
        uint32_t hi;
        memcpy(&lo, q + at * 3 / 8, 8), memcpy(&hi, q + at * 3 / 8 + 8, 4);
        const __m128i bytes = _mm_insert_epi32(_mm_cvtsi64_si128((long long)lo), (int)hi, 2);
        const __m128i words = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
        const __m512i w = _mm512_castsi128_si512(words), mask = _mm512_set1_epi32(7);
        const __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
        const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(2));
        *a = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(first, w), shifts), mask), lut));
        *b = _mm512_mul_ps(e, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(second, w), shifts), mask), lut));
    } else {                                                     /* PACKED2: 8 bytes, two words of 16 codes */
        uint32_t w[2];
        memcpy(w, q + at / 4, 8);
        const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i mask = _mm512_set1_epi32(3);
        *a = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w[0]), shifts), mask), lut));
        *b = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w[1]), shifts), mask), lut));
    }
}

static inline __m256 fold256(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* scores[r][j] for R query rows (q, in K's lane order) and KEYS keys: each key decoded once
 * for all R rows, KEYS x R sums in registers, reduced together at the end. */
static inline __attribute__((always_inline)) void score_keys(const int kind, const int R, const int KEYS,
        const codec_t *c, const __m512 lut, const uint8_t *const *k_rows, const float *q, int dim,
        float scores[][TILE], int r0, int j0) {
    __m512 s[4][8];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < KEYS; k++) s[r][k] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 32) {
        __m512 qa[4], qb[4];
        for (int r = 0; r < R; r++)
            qa[r] = _mm512_loadu_ps(q + (size_t)r * dim + i), qb[r] = _mm512_loadu_ps(q + (size_t)r * dim + i + 16);
        for (int k = 0; k < KEYS; k++) {
            __m512 a, b;
            dec32(kind, c, lut, k_rows[k], i, &a, &b);
            for (int r = 0; r < R; r++) s[r][k] = _mm512_fmadd_ps(qb[r], b, _mm512_fmadd_ps(qa[r], a, s[r][k]));
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 h[8];
        for (int k = 0; k < KEYS; k++) h[k] = fold256(s[r][k]);
        for (int k = KEYS; k < 8; k++) h[k] = _mm256_setzero_ps();
        float out[8];
        _mm256_storeu_ps(out, hsum8(h));
        for (int k = 0; k < KEYS; k++) scores[r0 + r][j0 + k] = out[k];
    }
}

/* The tile's scores, R rows at a time (4, 2 or 1), 8 keys at a time (4 with 4 rows); a short
 * last group re-reads the tile's first key and drops those sums. */
static inline __attribute__((always_inline)) void score_tile_fused(const int kind, const codec_t *c,
        const uint8_t *const *k_rows, int n, const float *q, int n_rows, int dim, float scores[][TILE]) {
    const __m512 lut = c->lut ? _mm512_loadu_ps(c->lut) : _mm512_setzero_ps();
    for (int r0 = 0; r0 < n_rows;) {
        const int R = n_rows - r0 >= 4 ? 4 : n_rows - r0 >= 2 ? 2 : 1, keys = R == 4 ? 4 : 8;
        for (int j0 = 0; j0 < n; j0 += keys) {
            const uint8_t *rows[8];
            for (int k = 0; k < keys; k++) rows[k] = k_rows[j0 + k < n ? j0 + k : 0];
            float part[4][TILE];
            const float *qr = q + (size_t)r0 * dim;
            if (R == 4) score_keys(kind, 4, 4, c, lut, rows, qr, dim, part, 0, 0);
            else if (R == 2) score_keys(kind, 2, 8, c, lut, rows, qr, dim, part, 0, 0);
            else score_keys(kind, 1, 8, c, lut, rows, qr, dim, part, 0, 0);
            for (int r = 0; r < R; r++)
                for (int k = 0; k < keys && j0 + k < n; k++) scores[r0 + r][j0 + k] = part[r][k];
        }
        r0 += R;
    }
}

/* acc_r += sum_j w[r][j] * value_j for R rows and 64 values of dim [c0, c0 + 64): the sums stay
 * in registers over the tile's keys, each V row decoded once per chunk for all R rows. */
static inline __attribute__((always_inline)) void sum_chunk(const int kind, const int R, const codec_t *c,
        const __m512 lut, const uint8_t *const *v_rows, int n, float w[][TILE], int r0, int dim, int c0, float *acc) {
    __m512 s[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) s[r][v] = _mm512_loadu_ps(acc + (size_t)(r0 + r) * dim + c0 + 16 * v);
    for (int j = 0; j < n; j++) {
        __m512 a0, b0, a1, b1;
        dec32(kind, c, lut, v_rows[j], c0, &a0, &b0);
        dec32(kind, c, lut, v_rows[j], c0 + 32, &a1, &b1);
        for (int r = 0; r < R; r++) {
            const __m512 wr = _mm512_set1_ps(w[r0 + r][j]);
            s[r][0] = _mm512_fmadd_ps(wr, a0, s[r][0]), s[r][1] = _mm512_fmadd_ps(wr, b0, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(wr, a1, s[r][2]), s[r][3] = _mm512_fmadd_ps(wr, b1, s[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + (size_t)(r0 + r) * dim + c0 + 16 * v, s[r][v]);
}

static inline __attribute__((always_inline)) void sum_tile_fused(const int kind, const codec_t *c,
        const uint8_t *const *v_rows, int n, float w[][TILE], int n_rows, int dim, float *acc) {
    const __m512 lut = c->lut ? _mm512_loadu_ps(c->lut) : _mm512_setzero_ps();
    for (int r0 = 0; r0 < n_rows;) {
        const int R = n_rows - r0 >= 4 ? 4 : n_rows - r0 >= 2 ? 2 : 1;
        for (int c0 = 0; c0 < dim; c0 += 64) {
            if (R == 4) sum_chunk(kind, 4, c, lut, v_rows, n, w, r0, dim, c0, acc);
            else if (R == 2) sum_chunk(kind, 2, c, lut, v_rows, n, w, r0, dim, c0, acc);
            else sum_chunk(kind, 1, c, lut, v_rows, n, w, r0, dim, c0, acc);
        }
        r0 += R;
    }
}

#else
/* AVX2: values [i, i + 32) as four vectors of 8 (PACKED4 interleaved per 16), scaled. */
static inline __attribute__((always_inline)) void dec32(const int kind, const codec_t *c, const __m256 lo,
                                                        const __m256 hi, const uint8_t *row, int i, __m256 v[4]) {
    if (kind == DEC_F32) {
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps((const float *)row + i + 8 * j);
        return;
    }
    if (kind == DEC_F16) {
        for (int j = 0; j < 4; j++) v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (i + 8 * j))));
        return;
    }
    if (kind == DEC_BF16) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(row + 2 * (i + 8 * j)))), 16));
        return;
    }
    const int bv = c->block_values, at = i % bv;
    const uint8_t *block = row + (size_t)(i / bv) * c->block_bytes, *q = block + c->header_bytes;
    __m256 d = _mm256_set1_ps(f16_to_f32(block)), e = d;      /* the scales of values i.. and i+16.. */
    if (kind == DEC_PACKED4S || kind == DEC_PACKED3S) {
        uint64_t rungs;                          /* 8 bytes: the rungs, then codes never shifted down to */
        memcpy(&rungs, block + 2, 8);
        const int mask = (1 << c->sub_bits) - 1, shift = c->sub_bits * (at / 16);
        e = _mm256_mul_ps(d, _mm256_set1_ps(c->ladder[(rungs >> (shift + c->sub_bits)) & mask]));
        d = _mm256_mul_ps(d, _mm256_set1_ps(c->ladder[(rungs >> shift) & mask]));
    }
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    if (kind == DEC_GGML) {                                      /* d * (lut[0] + code) + m, 32-value blocks */
        const uint8_t *qs = q + (c->bits == 5 ? 4 : 0);
        const __m256i x0 = bytes8(qs), x1 = bytes8(qs + 8);
        __m256i codes[4] = {_mm256_and_si256(x0, m4), _mm256_and_si256(x1, m4), _mm256_srli_epi32(x0, 4),
                            _mm256_srli_epi32(x1, 4)};               /* values 0-7, 8-15, 16-23, 24-31 */
        const __m256 bias = _mm256_set1_ps(c->lut[0]);
        const __m256 m = _mm256_set1_ps(c->offset_at ? f16_to_f32(block + c->offset_at) : 0.0f);
        uint32_t h = 0;
        if (c->bits == 5) memcpy(&h, q, 4);                      /* bit j: code j's bit 4 */
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
        for (int j = 0; j < 4; j++) {
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(h >> (8 * j))), lanes), one);
            codes[j] = _mm256_or_si256(codes[j], _mm256_slli_epi32(high, 4));
            v[j] = _mm256_fmadd_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(codes[j]), bias), m);
        }
    } else if (kind == DEC_Q8) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + at + 8 * j)))));
    } else if (kind == DEC_NIBBLE) {                             /* byte j: codes j and j + 16 */
        const __m256i x0 = bytes8(q), x1 = bytes8(q + 8);
        v[0] = _mm256_mul_ps(d, lut16(_mm256_and_si256(x0, m4), lo, hi));
        v[1] = _mm256_mul_ps(d, lut16(_mm256_and_si256(x1, m4), lo, hi));
        v[2] = _mm256_mul_ps(d, lut16(_mm256_srli_epi32(x0, 4), lo, hi));
        v[3] = _mm256_mul_ps(d, lut16(_mm256_srli_epi32(x1, 4), lo, hi));
    } else if (kind == DEC_PACKED4 || kind == DEC_PACKED4S) {    /* per 8 bytes: even codes, then odd */
        const __m256i x0 = bytes8(q + at / 2), x1 = bytes8(q + at / 2 + 8);
        v[0] = _mm256_mul_ps(d, lut16(_mm256_and_si256(x0, m4), lo, hi));
        v[1] = _mm256_mul_ps(d, lut16(_mm256_srli_epi32(x0, 4), lo, hi));
        v[2] = _mm256_mul_ps(e, lut16(_mm256_and_si256(x1, m4), lo, hi));
        v[3] = _mm256_mul_ps(e, lut16(_mm256_srli_epi32(x1, 4), lo, hi));
    } else {                                                     /* 3 or 2 bits: 8 codes per `bits` bytes */
        const int bits = kind == DEC_PACKED2 ? 2 : 3;
        const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
        const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
        const uint8_t *w = q + at * bits / 8;
        for (int j = 0; j < 4; j++) {
            const uint8_t *b = w + bits * j;
            const int32_t word = b[0] | b[1] << 8 | (bits == 3 ? b[2] << 16 : 0);
            const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
            v[j] = _mm256_mul_ps(j < 2 ? d : e, _mm256_permutevar8x32_ps(lo, codes));
        }
    }
}

/* scores for R query rows (q, in K's lane order) and KEYS keys, R x KEYS = 8 sums in
 * registers; the query is read from L1 by the FMAs. */
static inline __attribute__((always_inline)) void score_keys(const int kind, const int R, const int KEYS,
        const codec_t *c, const __m256 lo, const __m256 hi, const uint8_t *const *k_rows, const float *q, int dim,
        float out[8]) {
    __m256 s[8];
    for (int x = 0; x < 8; x++) s[x] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 32)
        for (int k = 0; k < KEYS; k++) {
            __m256 v[4];
            dec32(kind, c, lo, hi, k_rows[k], i, v);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++)
                    s[r * KEYS + k] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(q + (size_t)r * dim + i + 8 * j), s[r * KEYS + k]);
        }
    _mm256_storeu_ps(out, hsum8(s));
}

static inline __attribute__((always_inline)) void score_tile_fused(const int kind, const codec_t *c,
        const uint8_t *const *k_rows, int n, const float *q, int n_rows, int dim, float scores[][TILE]) {
    const __m256 lo = c->lut ? _mm256_loadu_ps(c->lut) : _mm256_setzero_ps();
    const __m256 hi = c->lut ? _mm256_loadu_ps(c->lut + 8) : _mm256_setzero_ps();
    for (int r0 = 0; r0 < n_rows;) {
        const int R = n_rows - r0 >= 4 ? 4 : n_rows - r0 >= 2 ? 2 : 1, keys = 8 / R;
        const float *qr = q + (size_t)r0 * dim;
        for (int j0 = 0; j0 < n; j0 += keys) {
            const uint8_t *rows[8];
            float out[8];
            for (int k = 0; k < keys; k++) rows[k] = k_rows[j0 + k < n ? j0 + k : 0];
            if (R == 4) score_keys(kind, 4, 2, c, lo, hi, rows, qr, dim, out);
            else if (R == 2) score_keys(kind, 2, 4, c, lo, hi, rows, qr, dim, out);
            else score_keys(kind, 1, 8, c, lo, hi, rows, qr, dim, out);
            for (int r = 0; r < R; r++)
                for (int k = 0; k < keys && j0 + k < n; k++) scores[r0 + r][j0 + k] = out[r * keys + k];
        }
        r0 += R;
    }
}

/* acc_r += sum_j w[r][j] * value_j for R rows over WIDTH values of dim from c0 (R x WIDTH = 64:
 * eight sums in registers over the tile). */
static inline __attribute__((always_inline)) void sum_chunk(const int kind, const int R, const codec_t *c,
        const __m256 lo, const __m256 hi, const uint8_t *const *v_rows, int n, float w[][TILE], int r0, int dim,
        int c0, float *acc) {
    const int width = 64 / R;
    __m256 s[8];
    for (int r = 0; r < R; r++)
        for (int x = 0; x < width / 8; x++) s[r * (width / 8) + x] = _mm256_loadu_ps(acc + (size_t)(r0 + r) * dim + c0 + 8 * x);
    for (int j = 0; j < n; j++)
        for (int h = 0; h < width; h += 32) {
            __m256 v[4];
            dec32(kind, c, lo, hi, v_rows[j], c0 + h, v);
            for (int r = 0; r < R; r++) {
                const __m256 wr = _mm256_set1_ps(w[r0 + r][j]);
                for (int x = 0; x < 4; x++) s[r * (width / 8) + h / 8 + x] = _mm256_fmadd_ps(wr, v[x], s[r * (width / 8) + h / 8 + x]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int x = 0; x < width / 8; x++) _mm256_storeu_ps(acc + (size_t)(r0 + r) * dim + c0 + 8 * x, s[r * (width / 8) + x]);
}

static inline __attribute__((always_inline)) void sum_tile_fused(const int kind, const codec_t *c,
        const uint8_t *const *v_rows, int n, float w[][TILE], int n_rows, int dim, float *acc) {
    const __m256 lo = c->lut ? _mm256_loadu_ps(c->lut) : _mm256_setzero_ps();
    const __m256 hi = c->lut ? _mm256_loadu_ps(c->lut + 8) : _mm256_setzero_ps();
    for (int r0 = 0; r0 < n_rows;) {
        const int R = n_rows - r0 >= 2 ? 2 : 1;
        for (int c0 = 0; c0 < dim; c0 += 64 / R) {
            if (R == 2) sum_chunk(kind, 2, c, lo, hi, v_rows, n, w, r0, dim, c0, acc);
            else sum_chunk(kind, 1, c, lo, hi, v_rows, n, w, r0, dim, c0, acc);
        }
        r0 += R;
    }
}
#endif

/* One copy of each loop per row layout: the kind is a constant inside. */
#define KVSLIM_BY_KIND(kind, call)                                                              \
    switch (kind) {                                                                             \
    case DEC_F32: call(DEC_F32); break;                                                         \
    case DEC_F16: call(DEC_F16); break;                                                         \
    case DEC_BF16: call(DEC_BF16); break;                                                       \
    case DEC_Q8: call(DEC_Q8); break;                                                           \
    case DEC_NIBBLE: call(DEC_NIBBLE); break;                                                   \
    case DEC_PACKED4: call(DEC_PACKED4); break;                                                  \
    case DEC_PACKED3: call(DEC_PACKED3); break;                                                 \
    case DEC_PACKED4S: call(DEC_PACKED4S); break;                                               \
    case DEC_PACKED3S: call(DEC_PACKED3S); break;                                               \
    case DEC_GGML: call(DEC_GGML); break;                                                       \
    default: call(DEC_PACKED2); break;                                                          \
    }

static void score_fused(int kind, const codec_t *c, const uint8_t *const *k_rows, int n, const float *q,
                        int n_rows, int dim, float scores[][TILE]) {
#define SCORE(K) score_tile_fused(K, c, k_rows, n, q, n_rows, dim, scores)
    KVSLIM_BY_KIND(kind, SCORE)
#undef SCORE
}

static void sum_fused(int kind, const codec_t *c, const uint8_t *const *v_rows, int n, float w[][TILE],
                      int n_rows, int dim, float *acc) {
#define SUM(K) sum_tile_fused(K, c, v_rows, n, w, n_rows, dim, acc)
    KVSLIM_BY_KIND(kind, SUM)
#undef SUM
}
#endif

/* scores[r][j] for the tile's keys: decoded into `rows` and scored together (AVX2), or one
 * decoded row at a time in `rows` (the portable build; rows then holds one row). */
static void score_tile(const codec_t *ck, const uint8_t *const *k_rows, int n, const float *q, int n_rows, int dim,
                       float *rows, int tiled, float scores[][TILE]) {
#ifdef KVSLIM_AVX2
    if (tiled) {
        for (int j = 0; j < n; j++) decode_row(ck, k_rows[j], dim, rows + (size_t)j * dim);
        tile_scores(q, n_rows, dim, rows, n, scores);
        return;
    }
#endif
    (void)tiled;
    for (int j = 0; j < n; j++) {
        decode_row(ck, k_rows[j], dim, rows);
        for (int r = 0; r < n_rows; r++) scores[r][j] = dot(q + (size_t)r * dim, rows, dim);
    }
}

#ifdef KVSLIM_AVX2
/* klt3 values of a tile, direction by direction: acc_r[j] += sum_t w[r][t] * d_t * levels_j[code_tj].
 * A row-by-row decode gathers each code's level from its own direction's table; here one
 * direction's 32 codes (one per key) share a table, held in registers (AVX-512: up to 5 bits in a
 * permute; AVX2: up to 4), wider a gather. The tile's streams are transposed to words first (word i
 * of every key side by side), so a direction's codes are two vector loads and shifts, not a gather
 * of each key's bytes; eight directions' sums over the keys are reduced together (hsum8).
 * nl4s/klt3 tg64 at depth 4096 on the bundled model, against the row-by-row decode: 732 -> 1,310 t/s
 * in the AVX-512 build, 686 -> 1,061 in the AVX2 build (single runs, noisy; gathering each key's
 * bytes instead of transposing gave 943). */
#define KLT_WORDS_MAX (MAX_DIM / 4 + 2)    /* a row's codes (at most MAX_DIM bytes) as words, and a zero word */

/* One direction's values for the tile's 32 keys, 8 keys a vector. Its code is bits [bit, bit + bits)
 * of the stream: in word bit / 32 and maybe the next. words[i][t]: word i of key t's stream (vector
 * shifts by 32 give 0, so a code within one word takes nothing from the next). */
static inline void klt_direction(const codec_t *c, uint32_t p, const uint32_t words[][TILE], __m256 v[4]) {
    const uint32_t bits = (p >> 12) & 15, bit = (p & 511) * 8 + ((p >> 9) & 7), off = bit & 31;
    const uint32_t *first = words[bit >> 5], *next = words[(bit >> 5) + 1];
    const float *table = c->klt_levels + (p >> 16);
    if (bits == 0) {                                           /* a fifth of the directions: one level */
        v[0] = v[1] = v[2] = v[3] = _mm256_set1_ps(table[0]);
        return;
    }
#ifdef KVSLIM_AVX512
    const __m512i right = _mm512_set1_epi32((int)off), left = _mm512_set1_epi32((int)(32 - off));
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int half = 0; half < 2; half++) {
        const __m512i code = _mm512_and_si512(mask, _mm512_or_si512(
            _mm512_srlv_epi32(_mm512_loadu_si512(first + 16 * half), right),
            _mm512_sllv_epi32(_mm512_loadu_si512(next + 16 * half), left)));
        __m512 x;
        if (bits <= 4) x = _mm512_permutexvar_ps(code, _mm512_loadu_ps(table));
        else if (bits == 5) x = _mm512_permutex2var_ps(_mm512_loadu_ps(table), code, _mm512_loadu_ps(table + 16));
        else if (bits == 6)                                     /* two 32-entry halves, chosen by bit 5 */
            x = _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, _mm512_set1_epi32(32)),
                                     _mm512_permutex2var_ps(_mm512_loadu_ps(table), code, _mm512_loadu_ps(table + 16)),
                                     _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32), code, _mm512_loadu_ps(table + 48)));
        else x = _mm512_i32gather_ps(code, table, 4);
        v[2 * half] = _mm512_castps512_ps256(x);
        v[2 * half + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    }
#else
    const __m256i right = _mm256_set1_epi32((int)off), left = _mm256_set1_epi32((int)(32 - off));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256 low = _mm256_loadu_ps(table), high = _mm256_loadu_ps(table + 8);
    for (int g = 0; g < 4; g++) {
        const __m256i code = _mm256_and_si256(mask, _mm256_or_si256(
            _mm256_srlv_epi32(_mm256_loadu_si256((const __m256i *)(first + 8 * g)), right),
            _mm256_sllv_epi32(_mm256_loadu_si256((const __m256i *)(next + 8 * g)), left)));
        v[g] = bits <= 3 ? _mm256_permutevar8x32_ps(low, code)
             : bits == 4 ? lut16(code, low, high)
                         : _mm256_i32gather_ps(table, code, 4);
    }
#endif
}

static void sum_klt(const codec_t *c, const uint8_t *const *v_rows, int n, float w[][TILE], int n_rows, int dim,
                    float *acc) {
    const int body = c->block_bytes - 2, n_words = (body + 3) / 4;
    uint32_t words[KLT_WORDS_MAX][TILE];                       /* the streams, transposed; then a zero word */
    float d[TILE] = {0}, wt[MAX_ROWS][TILE];
    for (int t = 0; t < TILE; t++) {
        uint32_t row[KLT_WORDS_MAX];
        memset(row, 0, sizeof(uint32_t) * (size_t)(n_words + 1));        /* this row's words, not the buffer */
        if (t < n) d[t] = f16_to_f32(v_rows[t]), memcpy(row, v_rows[t] + 2, body);
        for (int i = 0; i <= n_words; i++) words[i][t] = row[i];
    }
    for (int r = 0; r < n_rows; r++)                            /* past n: 0, whatever the scores hold */
        for (int t = 0; t < TILE; t++) wt[r][t] = t < n ? w[r][t] * d[t] : 0.0f;
    for (int j0 = 0; j0 < dim; j0 += 8) {
        __m256 v[8][4];
        for (int k = 0; k < 8; k++) klt_direction(c, (uint32_t)c->klt_plan[j0 + k], words, v[k]);
        for (int r = 0; r < n_rows; r++) {
            __m256 s[8];
            for (int k = 0; k < 8; k++) {
                s[k] = _mm256_mul_ps(v[k][0], _mm256_loadu_ps(wt[r]));
                for (int g = 1; g < 4; g++) s[k] = _mm256_fmadd_ps(v[k][g], _mm256_loadu_ps(wt[r] + 8 * g), s[k]);
            }
            float *a = acc + (size_t)r * dim + j0;
            _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), hsum8(s)));
        }
    }
}
#endif

/* acc_r += sum_j w[r][j] * value_j over the tile, the same two ways. */
static void sum_tile(const codec_t *cv, const uint8_t *const *v_rows, int n, float w[][TILE], int n_rows, int dim,
                     float *rows, int tiled, float *acc) {
#ifdef KVSLIM_AVX2
    if (cv->kind == CODEC_KLT && dim % 8 == 0) {
        sum_klt(cv, v_rows, n, w, n_rows, dim, acc);
        return;
    }
    if (tiled) {
        for (int j = 0; j < n; j++) decode_row(cv, v_rows[j], dim, rows + (size_t)j * dim);
        tile_values(rows, n, dim, w, n_rows, acc);
        return;
    }
#endif
    (void)tiled;
    for (int j = 0; j < n; j++) {
        decode_row(cv, v_rows[j], dim, rows);
        for (int r = 0; r < n_rows; r++) axpy(acc + (size_t)r * dim, w[r][j], rows, dim);
    }
}

/* Keys [t0, t1) of one (head, sequence) into the state m, l (n_rows) and acc (n_rows x dim),
 * TILE keys at a time: scores, the online-softmax rescale, then the weighted values. */
/* Which fused loop reads K (fk) and V (fv) rows, or DEC_NONE: the buffered loops. Decided once
 * per call: the query is put in K's lane order and V's sums taken out of theirs once, not per span. */
#ifndef KVSLIM_FUSED
enum { DEC_NONE = -1 };
#endif
static int fused_for(const codec_t *c, int64_t dim, int64_t multiple) {
#ifdef KVSLIM_FUSED
    return dim % multiple == 0 ? fused_kind(c) : DEC_NONE;
#else
    (void)c, (void)dim, (void)multiple;
    return DEC_NONE;
#endif
}

/* Whether a fused kind reads its rows out of dim order (the interleaved 4-bit rows). */
static int interleaved(int kind) {
#ifdef KVSLIM_FUSED
    return kind == DEC_PACKED4 || kind == DEC_PACKED4S;
#else
    (void)kind;
    return 0;
#endif
}

/* Rows (n, dim) into an interleaved kind's lane order (back = 0) or out of it (back = 1), in place. */
static void to_lanes(int kind, float *x, int64_t n, int dim, int back) {
#ifdef KVSLIM_FUSED
    if (!interleaved(kind)) return;
    float tmp[MAX_DIM];
    for (int64_t r = 0; r < n; r++) {
        memcpy(tmp, x + r * dim, sizeof(float) * (size_t)dim);
        interleave(tmp, x + r * dim, dim, back);
    }
#else
    (void)kind, (void)x, (void)n, (void)dim, (void)back;
#endif
}

/* Keys [t0, t1) of one (head, sequence) into the state m, l (n_rows) and acc (n_rows x dim),
 * TILE keys at a time: scores, the online-softmax rescale, then the weighted values. q and acc
 * are in the lane orders of fk and fv. */
static void attend_span(const pages_t *p, const codec_t *ck, const codec_t *cv, int fk, int fv, const float *q,
                        int n_rows, int dim, int64_t head, int64_t seq, int64_t t0, int64_t t1, float *m, float *l,
                        float *acc) {
    float scores[MAX_ROWS][TILE];
#ifdef KVSLIM_AVX2
    const int tiled = dim % 32 == 0;
#else
    const int tiled = 0;
#endif
    float *rows = fk == DEC_NONE || fv == DEC_NONE      /* the buffered loops' decoded rows */
                      ? aligned_alloc(64, sizeof(float) * (size_t)(tiled ? TILE * dim : MAX_DIM)) : NULL;
    codec_t k_head, v_head;
    ck = codec_for_head(ck, head, dim, &k_head);
    cv = codec_for_head(cv, head, dim, &v_head);
    for (int64_t start = t0; start < t1; start += TILE) {
        int n = (int)(t1 - start < TILE ? t1 - start : TILE);
        const uint8_t *k_rows[TILE], *v_rows[TILE];
        tile_rows(p, head, seq, start, n, k_rows, v_rows);
#ifdef KVSLIM_FUSED
        if (fk != DEC_NONE) score_fused(fk, ck, k_rows, n, q, n_rows, dim, scores);
        else
#endif
        score_tile(ck, k_rows, n, q, n_rows, dim, rows, tiled, scores);
        for (int r = 0; r < n_rows; r++) {             /* scores -> weights, rescale the running sums */
            float top = m[r];
            for (int j = 0; j < n; j++) top = scores[r][j] > top ? scores[r][j] : top;
            float corr = expf(m[r] - top);
            l[r] *= corr;
            for (int i = 0; i < dim; i++) acc[(size_t)r * dim + i] *= corr;
            exp_shifted(scores[r], n, top);
            for (int j = 0; j < n; j++) l[r] += scores[r][j];
            m[r] = top;
        }
#ifdef KVSLIM_FUSED
        if (fv != DEC_NONE) sum_fused(fv, cv, v_rows, n, scores, n_rows, dim, acc);
        else
#endif
        sum_tile(cv, v_rows, n, scores, n_rows, dim, rows, tiled, acc);
    }
    free(rows);
}

/* Fold state (m2, l2, acc2) into (m, l, acc). */
static void merge(float *m, float *l, float *acc, const float *m2, const float *l2, const float *acc2, int n_rows,
                  int dim) {
    for (int r = 0; r < n_rows; r++) {
        if (l2[r] == 0.0f) continue;
        float top = m[r] > m2[r] ? m[r] : m2[r];
        float a = expf(m[r] - top), b = expf(m2[r] - top);
        l[r] = l[r] * a + l2[r] * b;
        for (int i = 0; i < dim; i++) acc[(size_t)r * dim + i] = acc[(size_t)r * dim + i] * a + acc2[(size_t)r * dim + i] * b;
        m[r] = top;
    }
}

/* q (n_kv, n_seq, n_rows, dim) float32, scaled, in K's code domain; keys [0, n_keys[s]) of
 * sequence s are read through table (n_seq, table_stride) int32. Out: the softmax state per
 * query row: m, l (n_kv, n_seq, n_rows) and acc (n_kv, n_seq, n_rows, dim), unnormalised,
 * in V's code domain; a row with no keys gets m = -inf, l = 0, acc = 0.
 * Returns 0, or 1 when a size is past this kernel's limits. */
int kvslim_paged_decode(const codec_t *ck, const codec_t *cv, const float *q, const uint8_t *k_pool,
                        const uint8_t *v_pool, int64_t pool_pages, int64_t page_size, int64_t k_row_bytes,
                        int64_t v_row_bytes, const int32_t *table, int64_t table_stride, const int64_t *n_keys,
                        int64_t n_kv, int64_t n_seq, int64_t n_rows, int64_t dim, int64_t span,
                        float *m, float *l, float *acc, int n_threads) {
    if (dim > MAX_DIM || n_rows > MAX_ROWS || span < 1) return 1;
    const pages_t p = {k_pool, v_pool, pool_pages, page_size, k_row_bytes, v_row_bytes, table, table_stride};
    int64_t longest = 0;
    for (int64_t s = 0; s < n_seq; s++) longest = n_keys[s] > longest ? n_keys[s] : longest;
    const int64_t n_spans = longest > 0 ? (longest + span - 1) / span : 1;
    const int64_t n_items = n_kv * n_seq * n_spans, state = n_rows * (dim + 2);
    const int fk = fused_for(ck, dim, 32), fv = fused_for(cv, dim, 64);
    const size_t q_size = sizeof(float) * (size_t)(n_kv * n_seq * n_rows * dim);
    float *part = malloc((size_t)(n_items * state) * sizeof(float)), *q_lanes = interleaved(fk) ? malloc(q_size) : NULL;
    if (!part || (interleaved(fk) && !q_lanes)) return free(part), free(q_lanes), 1;
    if (q_lanes) memcpy(q_lanes, q, q_size), to_lanes(fk, q_lanes, n_kv * n_seq * n_rows, (int)dim, 0);
    const float *qk = q_lanes ? q_lanes : q;
    #pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; item++) {
        int64_t hs = item / n_spans, k = item % n_spans, head = hs / n_seq, seq = hs % n_seq;
        float *pm = part + item * state, *pl = pm + n_rows, *pacc = pl + n_rows;
        for (int r = 0; r < n_rows; r++) pm[r] = -INFINITY, pl[r] = 0.0f;
        memset(pacc, 0, (size_t)(n_rows * dim) * sizeof(float));
        int64_t t0 = k * span, t1 = (k + 1) * span < n_keys[seq] ? (k + 1) * span : n_keys[seq];
        if (t0 < t1)
            attend_span(&p, ck, cv, fk, fv, qk + hs * n_rows * dim, (int)n_rows, (int)dim, head, seq, t0, t1,
                        pm, pl, pacc);
    }
    for (int64_t hs = 0; hs < n_kv * n_seq; hs++) {     /* merge each (head, sequence)'s spans in order */
        float *om = m + hs * n_rows, *ol = l + hs * n_rows, *oacc = acc + hs * n_rows * dim;
        const float *first = part + hs * n_spans * state;
        memcpy(om, first, (size_t)n_rows * sizeof(float));
        memcpy(ol, first + n_rows, (size_t)n_rows * sizeof(float));
        memcpy(oacc, first + 2 * n_rows, (size_t)(n_rows * dim) * sizeof(float));
        for (int64_t k = 1; k < n_spans; k++) {
            const float *s = first + k * state;
            merge(om, ol, oacc, s, s + n_rows, s + 2 * n_rows, (int)n_rows, (int)dim);
        }
    }
    to_lanes(fv, acc, n_kv * n_seq * n_rows, (int)dim, 1);            /* V's sums back in dim order */
    free(part), free(q_lanes);
    return 0;
}
