/* Decode's GEMV with 8-bit activations for the K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M and Q5_K_M
 * files are made of), Q4_0, IQ4_NL and IQ4_XS, as llama.cpp computes them on a CPU, but with a scale per
 * 32 activations where llama.cpp's K-quants take one per 256 (3.7x lower KL from float
 * activations on the bundled model, at about the same cost for one row).
 *
 * Why: the float loops (block_linear.c) turn every code into a float before multiplying, ~9
 * vector operations per group of 32 on AVX-512, and stayed compute-bound at ~36 GB/s of weights
 * on 2 cores where Q8_0's loop reads 56-78 GB/s. Here each activation row is quantized once per
 * call (int8 codes, a float scale per 32 values, the codes' sums per 16), and the dot products
 * are integer arithmetic: unsigned weight codes times signed activation codes, summed in fours
 * (VNNI's vpdpbusd, or AVX2's maddubs + madd); four groups' sums folded into one vector (two
 * horizontal adds for one row, a transposed layout for several: chunk_sums); then scaled in float
 * by the weights' and the activations' scales. Offsets
 * (K-quant minima, Q6_K's and Q4_0's stored-plus-32 and plus-8 codes) meet the activations'
 * sums of 16 instead of the values.
 *
 * The result is not the float loops' one: the activations are rounded to 8 bits. quantize_group_q8
 * and the integer sums are reproduced in torch by kvslim/weights/activations.py, the reference
 * these loops are held to.
 *
 * Included by block_linear.c inside its AVX2 section (AVX2 only: one 256-bit form serves the AVX2
 * and AVX-512 builds; Zen 4 runs 512-bit integer operations as two halves anyway).
 */
#include <float.h>
#include <math.h>

/* m activation rows (m, k), k whole groups of 32, as 8-bit codes: values d * q per group. Rows
 * are padded with zero groups to whole chunks of 4 groups (128 values): the loops take 4 groups
 * at a time, and fold their sums into one vector (lane g: group g's first 16 values, g + 4: its
 * second 16), so per chunk the scales and sums are also kept in that layout. */
typedef struct {
    int64_t stride;         /* values per padded row: k rounded up to 128 */
    int8_t *q;              /* (m, stride) */
    float *d;               /* (m, stride / 32); NaN for a group that holds a NaN or an infinity */
    int16_t *sums;          /* (m, stride / 16): the sums of q over each 16 values */
    float *d_fold;          /* (m, stride / 16): per chunk, d of its groups 0-3, twice */
    int32_t *sums_fold;     /* (m, stride / 16): per chunk, the sums of groups 0-3's first 16, then second 16 */
    int8_t *q_across;       /* m > 1: (m, stride), each chunk's codes transposed (transpose4) */
} q8_rows_t;

/* IQ4_NL's and IQ4_XS's grid values (-127..113) are signed. With VNNI they are made unsigned by
 * adding 128 (up to 241; vpdpbusd sums in int32) and the offset meets the activations' sums;
 * AVX2's maddubs would saturate such pairs in int16, so without VNNI the codes stay signed and
 * multiply |code| by the activation with the code's sign (pairs <= 2 * 127 * 127). The same
 * products either way (IQ4_XS's offset term is applied in float, so its last bits differ). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define IQ4_SIGNED 0
#else
#define IQ4_SIGNED 1
#endif

/* The types whose GEMV takes 8-bit activations. Not Q8_0: its float loop already reads weights at
 * the memory's speed for one row, and its users ask for near-lossless (greedy tokens as f16
 * weights give: 8-bit activations changed them). */
static inline int q8_types(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K || type == TYPE_Q4_0 || type == TYPE_IQ4_NL
        || type == TYPE_IQ4_XS;
}

static inline int signed_codes(int type) { return IQ4_SIGNED && (type == TYPE_IQ4_NL || type == TYPE_IQ4_XS); }

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* 32 values as d * q, q = round-half-even(x * 127 / max |x|) (|q| <= 127: maddubs' pairs stay
 * within int16 for codes up to 63). The multiply and the rounding are torch's, so the reference
 * makes the same bytes. A non-finite value makes d NaN: the outputs it reaches are NaN, as with
 * float activations, and the engine's NaN check still sees them. */
static void quantize_group_q8(const float *x, int8_t *q, float *d, int16_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_loadu_ps(x + 8 * c);
        const __m256 a = _mm256_andnot_ps(sign, v[c]);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));       /* inf, or NaN (unordered) */
        amax = _mm256_max_ps(amax, a);
    }
    const float top = hmax(amax);
    if (_mm256_movemask_ps(bad) || top == 0.0f) {
        *d = _mm256_movemask_ps(bad) ? NAN : 0.0f;
        memset(q, 0, 32), sums[0] = sums[1] = 0;
        return;
    }
    const __m256 iscale = _mm256_set1_ps(127.0f / top);
    __m256i w[4];
    for (int c = 0; c < 4; c++)
        w[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[c], iscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* packs interleave 128-bit lanes: the permute puts the 32 bytes back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i halves = _mm256_add_epi32(w[0], w[1]), halves2 = _mm256_add_epi32(w[2], w[3]);
    const __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
    const __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(halves2), _mm256_extracti128_si256(halves2, 1));
    const __m128i both = _mm_hadd_epi32(_mm_hadd_epi32(s0, s1), _mm_setzero_si128());
    sums[0] = (int16_t)_mm_extract_epi32(both, 0), sums[1] = (int16_t)_mm_extract_epi32(both, 1);
    *d = top / 127.0f;
}

/* A chunk's four vectors of 8 dwords (four groups, each dwords 0-3 its first 16 values, 4-7 its
 * second 16) transposed within 128-bit lanes: out[t] dword g is in[g]'s dword t, dword 4 + g
 * in[g]'s dword 4 + t. Four chained dot products of transposed codes and transposed activations
 * then sum each group's half in its own lane: chunk_sums' layout without the horizontal adds. */
static inline void transpose4(const __m256i in[4], __m256i out[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpacklo_epi32(in[2], in[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(in[0], in[1]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t1), out[1] = _mm256_unpackhi_epi64(t0, t1);
    out[2] = _mm256_unpacklo_epi64(t2, t3), out[3] = _mm256_unpackhi_epi64(t2, t3);
}

/* The activation rows as q8_rows_t (one allocation; free(rows->q)); 1 when out of memory. Only
 * the padding is zeroed: the rest is written. */
static int quantize_rows_q8(const float *x, int64_t m, int64_t k, q8_rows_t *rows) {
    const int64_t stride = (k + 127) / 128 * 128, groups = m * (stride / 32), across = m > 1 ? m * stride : 0;
    char *mem = malloc((size_t)(m * stride + across + groups * (int64_t)(3 * sizeof(float) + 2 * sizeof(int16_t) + 2 * sizeof(int32_t))));
    if (!mem) return 1;
    rows->stride = stride;
    rows->q = (int8_t *)mem;
    rows->q_across = m > 1 ? rows->q + m * stride : NULL;
    rows->d = (float *)(mem + m * stride + across);       /* stride is a multiple of 128: aligned */
    rows->d_fold = rows->d + groups;
    rows->sums_fold = (int32_t *)(rows->d_fold + 2 * groups);
    rows->sums = (int16_t *)(rows->sums_fold + 2 * groups);
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < stride / 32; g++) {
            const int64_t at = i * (stride / 32) + g;
            if (g < k / 32) quantize_group_q8(x + i * k + 32 * g, rows->q + 32 * at, rows->d + at, rows->sums + 2 * at);
            else memset(rows->q + 32 * at, 0, 32), rows->d[at] = 0.0f, rows->sums[2 * at] = rows->sums[2 * at + 1] = 0;
        }
    for (int64_t c = 0; c < groups / 4; c++)               /* the chunks' folded layouts */
        for (int l = 0; l < 8; l++) {
            rows->d_fold[8 * c + l] = rows->d[4 * c + l % 4];
            rows->sums_fold[8 * c + l] = rows->sums[2 * (4 * c + l % 4) + l / 4];
        }
    for (int64_t c = 0; m > 1 && c < groups / 4; c++) {    /* several rows: the codes transposed */
        __m256i v[4], t[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_si256((const __m256i *)(rows->q + 128 * c + 32 * j));
        transpose4(v, t);
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(rows->q_across + 128 * c + 32 * j), t[j]);
    }
    return 0;
}


/* IQ4_NL's grid (block_linear.c's IQ4NL_VALUES) as a byte shuffle's table in both lanes: plus 128
 * (unsigned codes), or as it is (IQ4_SIGNED). */
static inline __m256i iq4nl_grid_u8(void) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
    return IQ4_SIGNED ? grid : _mm256_xor_si256(grid, _mm256_set1_epi8((char)0x80));      /* v ^ 0x80 = v + 128 */
}

/* A super-block's scales as floats in the layout of a half's folded sums (rows_times_q8k_typed):
 * scales[h] lane g is d times group 4h + g's scale of its first 16 values, lane g + 4 of its
 * second 16 (Q6_K's differ, the others' are one scale per 32). Its minima times the activations'
 * 16 sums are madd(sums, *minima), lane j group j's; the super-block's value is the scaled sums
 * less dmin * dx_j times those. */
static inline __attribute__((always_inline)) void q8k_scales(int type, const uint8_t *sb, __m256 scales[2],
                                                             __m256i *minima, float *dmin) {
    float d;
    if (type == TYPE_Q6_K) {                     /* 16 int8 scales; codes plus 32: the minimum is 32 * scale */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
        *minima = _mm256_cvtepi8_epi16(sc);
        d = f16(sb + 208), *dmin = 32.0f * d;
        const __m256 vd = _mm256_set1_ps(d);
        /* half h: the first-16 scales of groups 4h..4h+3 (s[8h], s[8h + 2], ...), then their second-16 ones */
        const __m128i halves[2] = {_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0)),
                                   _mm_shuffle_epi8(sc, _mm_setr_epi8(8, 10, 12, 14, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0))};
        for (int h = 0; h < 2; h++) scales[h] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h])));
        return;
    }
    if (type == TYPE_IQ4_XS) {                   /* codes plus 128: the minimum is 128 * scale */
        uint32_t lo;                             /* scale j: nibble j of scales_l, bits 2j of scales_h, less 32 */
        memcpy(&lo, sb + 4, 4);
        const __m256i j4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), j2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i sc = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)lo), j4), _mm256_set1_epi32(0x0F)),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sb[2] | sb[3] << 8), j2),
                                                               _mm256_set1_epi32(3)), 4)),
            _mm256_set1_epi32(32));                                            /* lane j: scale j */
        *minima = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
        d = f16(sb), *dmin = IQ4_SIGNED ? 0.0f : 128.0f * d;                  /* minima: each in both its 16s */
        const __m256 vd = _mm256_set1_ps(d), scf = _mm256_cvtepi32_ps(sc);
        scales[0] = _mm256_mul_ps(vd, _mm256_permutevar8x32_ps(scf, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)));
        scales[1] = _mm256_mul_ps(vd, _mm256_permutevar8x32_ps(scf, _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7)));
        return;
    }
    /* Q4_K / Q5_K: k_scales' six-bit fields, from words in0..in2 of the 12 bytes: w0 = in0 & 0x3F..
     * (scales 0-3), w1 = (in2 & 0x0F..) | (in0 >> 6 & 0x03..) << 4 (scales 4-7), w2 = in1 & 0x3F..
     * (minima 0-3), w3 = (in2 >> 4 & 0x0F..) | (in1 >> 6 & 0x03..) << 4 (minima 4-7), made in a
     * vector: words written one by one and read back as a vector stall the load (IQ4_XS's scales
     * so made cost its GEMV 1.5x). The 16-byte load reads 4 bytes of the codes after them. */
    const __m128i in = _mm_loadu_si128((const __m128i *)(sb + 4));
    const __m128i a = _mm_shuffle_epi32(in, _MM_SHUFFLE(2, 1, 2, 0)), b = _mm_shuffle_epi32(in, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i low6 = _mm_and_si128(a, _mm_set1_epi8(0x3F));
    const __m128i split = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi8(0x0F)),
                                       _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(b, 6), _mm_set1_epi8(0x03)), 4));
    const __m128i fields = _mm_blend_epi32(low6, split, 0xA);          /* 8 scales, 8 minima */
    *minima = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(fields, fields));  /* each minimum for both its 16s */
    d = f16(sb), *dmin = f16(sb + 2);
    const __m256 vd = _mm256_set1_ps(d);
    for (int h = 0; h < 2; h++)                  /* scales 4h..4h+3, twice */
        scales[h] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_shuffle_epi8(fields, _mm_setr_epi8(4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3, 4 * h, 4 * h + 1, 4 * h + 2,
                                                   4 * h + 3, 0, 0, 0, 0, 0, 0, 0, 0)))));
}

/* 32 unsigned bytes times 32 signed ones, summed in fours: 8 int32 lanes. VNNI does it in one
 * instruction; AVX2 sums pairs in int16 (no saturation: codes <= 63, |activations| <= 127), then
 * pairs of those. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Signed codes c times signed activations s, summed in fours (IQ4_SIGNED): |c| times s with c's sign. */
static inline __m256i dot_s8s8(__m256i c, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(s, c)), _mm256_set1_epi16(1));
}

/* acc plus dot_u8s8(u, s). */
static inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

/* A chunk's four groups of codes u times a row's activations, the sums folded into one vector:
 * lane g is group g's first 16 values, lane g + 4 its second 16. One row (xq, the codes as
 * stored): a dot product per group, folded by two horizontal adds. Several rows (xt, the
 * activations transposed, and ut = transpose4(u), made once for all rows): four chained dot
 * products, no horizontal adds. The integer sums are equal either way, so a row's output does not
 * depend on its batch. */
static inline __attribute__((always_inline)) __m256i chunk_sums(const __m256i u[4], const __m256i ut[4],
                                                                const int8_t *xq, const int8_t *xt, int one_row,
                                                                int is_signed) {
    if (one_row) {
        __m256i p[4];
        for (int g = 0; g < 4; g++) {
            const __m256i s = _mm256_loadu_si256((const __m256i *)(xq + 32 * g));
            p[g] = is_signed ? dot_s8s8(u[g], s) : dot_u8s8(u[g], s);
        }
        return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    }
    __m256i acc = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        const __m256i s = _mm256_loadu_si256((const __m256i *)(xt + 32 * t));
        acc = is_signed ? _mm256_add_epi32(acc, dot_s8s8(ut[t], s)) : dot_u8s8_add(acc, ut[t], s);
    }
    return acc;
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
    if (type == TYPE_IQ4_XS) {                   /* 16 B of grid indices per group: two groups a load */
        for (int p = 0; p < 2; p++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(sb + 8 + 16 * (4 * h + 2 * p)));
            const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
            u[2 * p] = _mm256_shuffle_epi8(iq4nl_grid_u8(), _mm256_permute2x128_si256(lo, hi, 0x20));
            u[2 * p + 1] = _mm256_shuffle_epi8(iq4nl_grid_u8(), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
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

/* y[i * n] = row . x_i for m activation rows. A half super-block's four groups are summed in
 * integers (codes times activations: chunk_sums, lane g and g + 4: group g's first and second 16 values), then
 * scaled in float by d times each group's activation scale. The same for one row and for several,
 * so a sequence's output does not depend on its batch. */
static inline __attribute__((always_inline)) void rows_times_q8k_typed(int type, const uint8_t *row, const q8_rows_t *x,
                                                                       int64_t m, int64_t k, float *y, int64_t n) {
    __m256 acc[MAX_M], acc2[MAX_M];
    for (int64_t i = 0; i < m; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
    const int64_t sb_bytes = group_bytes_x8(type);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *sb = row + b * sb_bytes;
        __m256 scales[2];
        __m256i minima;
        float dmin;
        q8k_scales(type, sb, scales, &minima, &dmin);
        for (int h = 0; h < 2; h++) {
            __m256i u[4], ut[4];
            q8k_codes(type, sb, h, u);
            if (m > 1) transpose4(u, ut);
            for (int64_t i = 0; i < m; i++) {
                const int64_t at = i * x->stride + 256 * b + 128 * h;
                const __m256i sums = chunk_sums(u, ut, x->q + at, x->q_across + at, m == 1, signed_codes(type));
                const __m256 dx = _mm256_loadu_ps(x->d_fold + i * (x->stride / 16) + 16 * b + 8 * h);
                __m256 *a = h ? &acc2[i] : &acc[i];
                *a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), dx), scales[h], *a);
            }
        }
        for (int64_t i = 0; i < m; i++) {
            const __m256 dx = _mm256_loadu_ps(x->d + i * (x->stride / 32) + 8 * b);       /* groups 0-7's scales */
            const __m256i imin = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x->sums + i * (x->stride / 16) + 16 * b)), minima);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(_mm256_set1_ps(dmin), dx), acc[i]);
        }
    }
    for (int64_t i = 0; i < m; i++) y[i * n] = hsum(_mm256_add_ps(acc[i], acc2[i]));
}

/* Group g of a 32-value block row as 32 codes and its scale: value = d * (u - offset). Both types
 * are [d][16 B of nibbles]: Q4_0's codes are the nibbles (block_linear.c's block32_codes reads
 * them), offset 8; IQ4_NL's the grid at them, plus 128 (offset 128, none under IQ4_SIGNED). */
static inline __attribute__((always_inline)) __m256i block32_u8(int type, const uint8_t *row, int64_t g, float *d) {
    float s1;
    const __m256i nibbles = block32_codes(TYPE_Q4_0, row + g * 18, d, &s1);
    return type == TYPE_Q4_0 ? nibbles : _mm256_shuffle_epi8(iq4nl_grid_u8(), nibbles);
}

/* y[i * n] = row . x_i for a row of 32-value blocks: four groups at a time, their sums folded,
 * less offset times the activations' sums, times the weights' and activations' scales. */
static inline __attribute__((always_inline)) void rows_times_q8_block32_typed(int type, const uint8_t *row,
                                                                              const q8_rows_t *x, int64_t m, int64_t k,
                                                                              float *y, int64_t n) {
    __m256 acc[MAX_M];
    for (int64_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    const int shift = type == TYPE_Q4_0 ? 3 : 7;            /* times the codes' offset, 8 or 128 (none: signed) */
    for (int64_t g0 = 0; g0 < k / 32; g0 += 4) {
        __m256i u[4];
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < 4; j++)                         /* a row's last chunk: zero codes past its end */
            u[j] = g0 + j < k / 32 ? block32_u8(type, row, g0 + j, &d[j]) : _mm256_setzero_si256();
        const __m256 dw = _mm256_setr_ps(d[0], d[1], d[2], d[3], d[0], d[1], d[2], d[3]);
        __m256i ut[4];
        if (m > 1) transpose4(u, ut);
        for (int64_t i = 0; i < m; i++) {
            const int64_t codes = i * x->stride + 32 * g0, at = i * (x->stride / 16) + 2 * g0;
            const __m256i dots = chunk_sums(u, ut, x->q + codes, x->q_across + codes, m == 1, signed_codes(type));
            const __m256i sums = signed_codes(type) ? dots : _mm256_sub_epi32(dots, _mm256_slli_epi32(
                _mm256_loadu_si256((const __m256i *)(x->sums_fold + at)), shift));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_loadu_ps(x->d_fold + at)), acc[i]);
        }
    }
    for (int64_t i = 0; i < m; i++) y[i * n] = hsum(acc[i]);
}

static inline __attribute__((always_inline)) void rows_times_q8(int type, const uint8_t *row, const q8_rows_t *x,
                                                                 int64_t m, int64_t k, float *y, int64_t n) {
    switch (type) {                              /* one type per call: its checks leave the loop */
        case TYPE_Q4_0: rows_times_q8_block32_typed(TYPE_Q4_0, row, x, m, k, y, n); break;
        case TYPE_IQ4_NL: rows_times_q8_block32_typed(TYPE_IQ4_NL, row, x, m, k, y, n); break;
        case TYPE_Q4_K: rows_times_q8k_typed(TYPE_Q4_K, row, x, m, k, y, n); break;
        case TYPE_Q5_K: rows_times_q8k_typed(TYPE_Q5_K, row, x, m, k, y, n); break;
        case TYPE_IQ4_XS: rows_times_q8k_typed(TYPE_IQ4_XS, row, x, m, k, y, n); break;
        default: rows_times_q8k_typed(TYPE_Q6_K, row, x, m, k, y, n);
    }
}

