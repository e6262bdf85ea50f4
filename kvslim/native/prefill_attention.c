/* Prefill attention with bfloat16 dot products: many query rows of one sequence over a block
 * of decoded keys and values, folded into a running online-softmax state.
 *
 * Why: a prompt chunk at depth spends its time in two GEMMs per KV head (scores = Q K^T,
 * out = P V). In float32 they run at ~100-180 GFLOP/s on two AVX-512 cores; the AVX512_BF16
 * dot product (vdpbf16ps: two bf16 products added into each float32 lane) doubles that.
 * torch's bf16 matmul would round its float32 sums to bf16 on the way out (scores of 20
 * off by 0.06); here only the operands are rounded, every sum, the scores, the softmax and
 * the accumulators stay float32: what llama.cpp's CPU flash attention does with f16 operands.
 *
 * Work items are (KV head, tile of RT query rows); each walks the keys in tiles of KT in
 * order, so a row's result does not depend on the other rows in the call or on the threads.
 * Per key tile: scores by RM x 32 micro-tiles, the online softmax per row (rescaling the
 * row's sums only when its maximum moved), then sums += P V by RV x (NV*16) micro-tiles.
 *
 * Layouts (32-bit words holding two bf16, the low one first, as vdpbf16ps pairs them):
 *   K: per 16 keys, per pair of dims, 16 words (key i's dims 2p, 2p+1);
 *   V: per pair of keys, per dim, a word (keys 2j, 2j+1 of that dim);
 *   Q, P: per row, a word per pair of dims / keys.
 * Keys and values come as float rows (any format, decoded by torch; row scales folded in as they
 * are packed) or straight from the packed pages, decoded by paged_attention.c's codecs.
 */
#include "paged_attention.c"     /* codec_t, pages_t, decode_row: the packed rows' decoders */

#define RT 48        /* query rows per work item */
#define KT 64        /* keys per tile */
#define RM 6         /* rows per score micro-tile */
#define RV 3         /* rows per value micro-tile */
#define BLOCK 4096   /* keys packed at once from pages (bounds the packed copy) */

#if defined(KVSLIM_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#include <immintrin.h>

int kvslim_prefill_bf16_available(void) { return 1; }

static inline uint32_t bf16_bits(float x) {          /* round to nearest even, as vcvtne2ps2bf16 */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

static inline uint32_t pair(float lo, float hi) { return bf16_bits(lo) | bf16_bits(hi) << 16; }

/* e^x for x <= 0, 16 lanes: paged_attention.c's 8-lane exp on each half. */
static inline __m512 exp16_nonpositive(__m512 x) {
    __m256 lo = exp_nonpositive(_mm512_castps512_ps256(x)), hi = exp_nonpositive(_mm512_extractf32x8_ps(x, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* Lanes j .. j+15 of a tile row whose keys [0, seen) are visible. */
static inline __mmask16 visible16(int seen, int j) {
    return seen - j >= 16 ? 0xffff : seen > j ? (__mmask16)((1u << (seen - j)) - 1) : 0;
}

/* Where a head's rows come from: float rows (n_kv, n, dim) times an optional row scale (n_kv, n),
 * or packed pages decoded with a codec (then keys are positions 0 .. n of the sequence). */
typedef struct {
    const float *values, *scale;
    const pages_t *pages;
    const codec_t *codec;
    int value_side;                                   /* pages: read the V pool */
} rows_t;

/* Rows [j0, j0 + n) of one head as floats (n <= 16), the rest of 16 zero. */
static void fetch16(const rows_t *src, int64_t head, int64_t n_keys, int64_t j0, int n, int dim, float *out) {
    memset(out + (size_t)n * dim, 0, (size_t)(16 - n) * dim * 4);
    if (src->values) {
        for (int i = 0; i < n; i++) {
            const float *row = src->values + (head * n_keys + j0 + i) * dim;
            float s = src->scale ? src->scale[head * n_keys + j0 + i] : 1.0f;
            for (int d = 0; d < dim; d++)
                out[i * dim + d] = s * row[d];
        }
        return;
    }
    const uint8_t *k_rows[16], *v_rows[16];
    tile_rows(src->pages, head, 0, j0, n, k_rows, v_rows);
    codec_t local;
    const codec_t *codec = codec_for_head(src->codec, head, dim, &local);
    for (int i = 0; i < n; i++)
        decode_row(codec, src->value_side ? v_rows[i] : k_rows[i], dim, out + (size_t)i * dim);
}

/* Keys [j0, j0 + n) of one head into 16-key groups of word pairs (n padded to KT with zeros). */
static void pack_keys(const rows_t *src, int64_t head, int64_t n_keys, int64_t j0, int64_t n, int dim,
                      float *rows, uint32_t *out) {
    int half = dim / 2;
    for (int64_t g = 0; g < (n + KT - 1) / KT * KT / 16; g++) {
        int64_t left = n - g * 16;
        fetch16(src, head, n_keys, j0 + g * 16, left <= 0 ? 0 : left < 16 ? (int)left : 16, dim, rows);
        for (int i = 0; i < 16; i++)
            for (int p = 0; p < half; p++)
                out[(g * half + p) * 16 + i] = pair(rows[i * dim + 2 * p], rows[i * dim + 2 * p + 1]);
    }
}

/* Values [j0, j0 + n) of one head into words of key pairs, per dim (padded to KT with zeros). */
static void pack_values(const rows_t *src, int64_t head, int64_t n_keys, int64_t j0, int64_t n, int dim,
                        float *rows, uint32_t *out) {
    for (int64_t g = 0; g < (n + KT - 1) / KT * KT / 16; g++) {
        int64_t left = n - g * 16;
        fetch16(src, head, n_keys, j0 + g * 16, left <= 0 ? 0 : left < 16 ? (int)left : 16, dim, rows);
        for (int i = 0; i < 16; i += 2)
            for (int d = 0; d < dim; d++)
                out[(g * 8 + i / 2) * dim + d] = pair(rows[i * dim + d], rows[(i + 1) * dim + d]);
    }
}

/* scores[r][0..31] for RM rows from q words (row stride half) against two 16-key groups. */
static inline void score_micro(const uint32_t *q, int half, const uint32_t *k0, const uint32_t *k1,
                               float *scores) {
    __m512 c[RM][2];
    for (int i = 0; i < RM; i++)
        c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int p = 0; p < half; p++) {
        __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + 16 * p), b = (__m512bh)_mm512_loadu_si512(k1 + 16 * p);
        for (int i = 0; i < RM; i++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)q[i * half + p]);
            c[i][0] = _mm512_dpbf16_ps(c[i][0], a, w);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], b, w);
        }
    }
    for (int i = 0; i < RM; i++) {
        _mm512_storeu_ps(scores + i * KT, c[i][0]);
        _mm512_storeu_ps(scores + i * KT + 16, c[i][1]);
    }
}

/* acc[r][d0 .. d0+16*NV) += sum over the tile's key pairs of P[r][pair] . V[pair][d], RV rows. */
static inline __attribute__((always_inline)) void value_micro(const int NV, const uint32_t *p, const uint32_t *v,
                                                              int dim, int d0, float *acc) {
    __m512 a[RV][8];
    for (int i = 0; i < RV; i++)
        for (int u = 0; u < NV; u++)
            a[i][u] = _mm512_loadu_ps(acc + i * dim + d0 + 16 * u);
    for (int jp = 0; jp < KT / 2; jp++) {
        __m512bh w[RV];
        for (int i = 0; i < RV; i++)
            w[i] = (__m512bh)_mm512_set1_epi32((int)p[i * (KT / 2) + jp]);
        for (int u = 0; u < NV; u++) {
            __m512bh x = (__m512bh)_mm512_loadu_si512(v + (int64_t)jp * dim + d0 + 16 * u);
            for (int i = 0; i < RV; i++)
                a[i][u] = _mm512_dpbf16_ps(a[i][u], x, w[i]);
        }
    }
    for (int i = 0; i < RV; i++)
        for (int u = 0; u < NV; u++)
            _mm512_storeu_ps(acc + i * dim + d0 + 16 * u, a[i][u]);
}

/* The online softmax for one row over one key tile: keys [0, seen) are visible. Turns the
 * row's scores into bf16 probability pairs, rescales the row's sums if its maximum moved. */
static void softmax_row(float *s, int seen, float *m, float *l, float *acc, int dim, uint32_t *p) {
    memset(p, 0, (KT / 2) * 4);
    if (seen <= 0)
        return;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < KT; j += 16)
        top = _mm512_mask_max_ps(top, visible16(seen, j), top, _mm512_loadu_ps(s + j));
    float mx = _mm512_reduce_max_ps(top), m_new = mx > *m ? mx : *m;
    if (m_new == -INFINITY)
        return;
    __m512 shift = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
    for (int j = 0; j < KT; j += 16) {
        __m512 e = _mm512_maskz_mov_ps(visible16(seen, j),
                                       exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j / 2), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (m_new > *m) {                                 /* the sums so far were relative to the old maximum */
        float corr = expf(*m - m_new);
        *l *= corr;
        for (int d = 0; d < dim; d++)
            acc[d] *= corr;
    }
    *l += _mm512_reduce_add_ps(sum);
    *m = m_new;
}

/* One work item: rows [r0, r0 + RT) of one head over the packed block. */
static void attend_rows(const float *q, int64_t n_rows, int64_t r0, int dim, const uint32_t *kp, const uint32_t *vp,
                        int64_t n_keys, const int64_t *q_pos, int64_t start, int64_t length,
                        float *m, float *l, float *acc, uint32_t *qw, float *scores, uint32_t *pw, float *sums) {
    int half = dim / 2, nv = dim % 128 == 0 ? 8 : 4;
    int64_t rows = n_rows - r0 < RT ? n_rows - r0 : RT;
    float mt[RT], lt[RT];
    int64_t limit[RT];                                /* keys [start, limit) are visible to the row */
    memset(qw, 0, (size_t)RT * half * 4);
    memset(sums, 0, (size_t)RT * dim * 4);
    for (int64_t r = 0; r < RT; r++) {
        mt[r] = r < rows ? m[r0 + r] : -INFINITY;
        lt[r] = r < rows ? l[r0 + r] : 0.0f;
        limit[r] = r < rows ? (q_pos[r0 + r] + 1 < length ? q_pos[r0 + r] + 1 : length) : start;
        if (r < rows) {
            memcpy(sums + r * dim, acc + (r0 + r) * dim, (size_t)dim * 4);
            for (int p = 0; p < half; p++)
                qw[r * half + p] = pair(q[(r0 + r) * dim + 2 * p], q[(r0 + r) * dim + 2 * p + 1]);
        }
    }
    int64_t reach = start;                            /* no row sees a key at or past this position */
    for (int r = 0; r < rows; r++)
        reach = limit[r] > reach ? limit[r] : reach;
    for (int64_t t0 = 0; t0 < n_keys && start + t0 < reach; t0 += KT) {
        for (int r = 0; r < RT; r += RM)
            for (int g = 0; g < KT / 16; g += 2)
                score_micro(qw + r * half, half, kp + ((t0 / 16 + g) * half) * 16, kp + ((t0 / 16 + g + 1) * half) * 16,
                            scores + r * KT + g * 16);
        for (int r = 0; r < RT; r++) {
            int64_t seen = limit[r] - (start + t0), left = n_keys - t0;
            seen = seen < left ? seen : left;
            softmax_row(scores + r * KT, (int)(seen < KT ? seen : KT), mt + r, lt + r, sums + r * dim, dim,
                        pw + r * (KT / 2));
        }
        for (int r = 0; r < RT; r += RV)
            for (int d0 = 0; d0 < dim; d0 += 16 * nv) {
                if (nv == 8)
                    value_micro(8, pw + r * (KT / 2), vp + (t0 / 2) * dim, dim, d0, sums + r * dim);
                else
                    value_micro(4, pw + r * (KT / 2), vp + (t0 / 2) * dim, dim, d0, sums + r * dim);
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        m[r0 + r] = mt[r];
        l[r0 + r] = lt[r];
        memcpy(acc + (r0 + r) * dim, sums + r * dim, (size_t)dim * 4);
    }
}

/* Fold keys [j0, j0 + n) of the sources (at positions start + j0 ...) into the state. */
static int fold_block(const float *q, const rows_t *ks, const rows_t *vs, int64_t n_kv, int64_t n_rows,
                      int64_t n_keys, int64_t j0, int64_t n, int64_t dim, const int64_t *q_pos, int64_t start,
                      int64_t length, float *m, float *l, float *acc, int threads) {
    int64_t padded = (n + KT - 1) / KT * KT, tiles = (n_rows + RT - 1) / RT;
    uint32_t *kp = malloc((size_t)n_kv * padded * dim / 2 * 4), *vp = malloc((size_t)n_kv * padded * dim / 2 * 4);
    int failed = !kp || !vp;
    #pragma omp parallel num_threads(threads)
    {
        float *rows = malloc((size_t)16 * dim * 4);
        uint32_t *qw = aligned_alloc(64, (size_t)RT * dim / 2 * 4), *pw = aligned_alloc(64, RT * KT / 2 * 4);
        float *scores = aligned_alloc(64, RT * KT * 4), *sums = aligned_alloc(64, (size_t)RT * dim * 4);
        if (!rows || !qw || !pw || !scores || !sums) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            #pragma omp for schedule(static)
            for (int64_t h = 0; h < 2 * n_kv; h++) {          /* keys and values of a head: one item each */
                int64_t head = h / 2;
                if (h % 2 == 0)
                    pack_keys(ks, head, n_keys, j0, n, (int)dim, rows, kp + head * padded * dim / 2);
                else
                    pack_values(vs, head, n_keys, j0, n, (int)dim, rows, vp + head * padded * dim / 2);
            }
            #pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < n_kv * tiles; item++) {
                int64_t head = item / tiles, r0 = item % tiles * RT;
                attend_rows(q + head * n_rows * dim, n_rows, r0, (int)dim, kp + head * padded * dim / 2,
                            vp + head * padded * dim / 2, n, q_pos, start + j0, length, m + head * n_rows,
                            l + head * n_rows, acc + head * n_rows * dim, qw, scores, pw, sums);
            }
        }
        free(rows);
        free(qw);
        free(pw);
        free(scores);
        free(sums);
    }
    free(kp);
    free(vp);
    return failed ? -1 : 0;
}

/* q (n_kv, n_rows, dim) float32, scaled, K's code domain; k, v (n_kv, n_keys, dim) float32, k_scale,
 * v_scale (n_kv, n_keys) or NULL; key j is at position start + j and row r sees it when that is
 * <= q_pos[r] and < length. m, l (n_kv, n_rows), acc (n_kv, n_rows, dim): the state, updated.
 * Returns 0, or -1 for a head_dim it does not serve (a multiple of 64 is needed) or no memory. */
int kvslim_prefill_bf16(const float *q, const float *k, const float *k_scale, const float *v, const float *v_scale,
                        int64_t n_kv, int64_t n_rows, int64_t n_keys, int64_t dim, const int64_t *q_pos,
                        int64_t start, int64_t length, float *m, float *l, float *acc, int threads) {
    if (dim % 64 != 0 || dim > 1024 || n_keys < 1)
        return -1;
    rows_t ks = {k, k_scale, NULL, NULL, 0}, vs = {v, v_scale, NULL, NULL, 0};
    return fold_block(q, &ks, &vs, n_kv, n_rows, n_keys, 0, n_keys, dim, q_pos, start, length, m, l, acc, threads);
}

/* The same over one sequence's packed pages: keys 0 .. length of (n_kv, pool_pages, page_size, row
 * bytes) pools through its page table, decoded by the codecs, BLOCK keys packed at a time. */
int kvslim_prefill_bf16_pages(const codec_t *ck, const codec_t *cv, const float *q, const uint8_t *k_pool,
                              const uint8_t *v_pool, int64_t pool_pages, int64_t page_size, int64_t k_row_bytes,
                              int64_t v_row_bytes, const int32_t *table, int64_t n_kv, int64_t n_rows,
                              int64_t length, int64_t dim, const int64_t *q_pos, float *m, float *l, float *acc,
                              int threads) {
    if (dim % 64 != 0 || dim > 1024)
        return -1;
    pages_t pages = {k_pool, v_pool, pool_pages, page_size, k_row_bytes, v_row_bytes, table, 0};
    rows_t ks = {NULL, NULL, &pages, ck, 0}, vs = {NULL, NULL, &pages, cv, 1};
    int64_t reach = 0;                                /* keys past every row's position are not read */
    for (int64_t r = 0; r < n_rows; r++)
        reach = q_pos[r] + 1 > reach ? q_pos[r] + 1 : reach;
    reach = reach < length ? reach : length;
    for (int64_t j0 = 0; j0 < reach; j0 += BLOCK) {
        int64_t n = reach - j0 < BLOCK ? reach - j0 : BLOCK;
        if (fold_block(q, &ks, &vs, n_kv, n_rows, length, j0, n, dim, q_pos, 0, length, m, l, acc, threads))
            return -1;
    }
    return 0;
}

#else

int kvslim_prefill_bf16_available(void) { return 0; }

int kvslim_prefill_bf16_pages(const codec_t *ck, const codec_t *cv, const float *q, const uint8_t *k_pool,
                              const uint8_t *v_pool, int64_t pool_pages, int64_t page_size, int64_t k_row_bytes,
                              int64_t v_row_bytes, const int32_t *table, int64_t n_kv, int64_t n_rows,
                              int64_t length, int64_t dim, const int64_t *q_pos, float *m, float *l, float *acc,
                              int threads) {
    return -1;
}

int kvslim_prefill_bf16(const float *q, const float *k, const float *k_scale, const float *v, const float *v_scale,
                        int64_t n_kv, int64_t n_rows, int64_t n_keys, int64_t dim, const int64_t *q_pos,
                        int64_t start, int64_t length, float *m, float *l, float *acc, int threads) {
    return -1;                                        /* the torch path serves machines without AVX512_BF16 */
}

#endif
