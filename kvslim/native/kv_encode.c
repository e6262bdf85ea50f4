/* K/V rows into a format's packed row bytes, in C: the native decode step's quantize-on-append and the
 * CPU prompt path's encoders (kvslim/native/kv_encode.py), and the rotated formats' butterfly.
 *
 * The torch encoders in kvslim/formats are the reference; the parity tests hold these to them.
 * A format reaches this file as an encoder description (kvslim/native/kv_encode.py translates
 * the format's declared kernel_encoder, kvslim/formats/base.py), so C never guesses a layout:
 *   ENC_FLOAT  the row as f32, f16 or bf16 (round to nearest even)
 *   ENC_Q8_0 / ENC_Q4_0 / ENC_Q4_1 / ENC_Q5_0 / ENC_Q5_1 / ENC_IQ4_NL  ggml's blocks of 32
 *              (llama.cpp's reference quantizers;
 *              iq4_nl's scale search over 15 candidates, its grid in `centroids`), of the row
 *              after an optional block rotation: llama.cpp's Walsh-Hadamard in blocks of `rot`,
 *              as the same butterfly as kvslim/formats/rotation.py (so the same bytes)
 *   ENC_TURBO  TurboQuant's MSE variant: per group of `group` values, the norm, the unit vector
 *              rotated by R, each value's bucket among the Lloyd-Max boundaries, and
 *              [f16 norm / |centroids|][codes packed little-endian, `bits` each]
 *   ENC_GRID   the nl grids (kvslim/formats/grid.py): after the Hadamard rotation, per block a
 *              scale searched over `n_tries` candidates and refit by least squares,
 *              [f16 d][codes packed]
 *   ENC_GRID_SUB  the nls rows: per block of 128 one scale and per 16 values a 2-bit rung of
 *              the ladder, chosen by squared error and refit twice, [f16 d][rungs][codes]
 *   ENC_KLT    klt3, the calibrated transform-coded V rows (kvslim/formats/klt.py): per KV head
 *              its own basis, mean, spreads, bits and grids, so the row's head is an argument
 *              (encode_row_head); [f16 row scale][each direction's code, bits[e] wide, LSB first]
 * Each encoder also computes the token's overflow flag as the torch hot path does: NaN or inf,
 * or past what the fp16 fields can hold.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "half.c"

#define ENC_MAX_DIM 512

enum { ENC_FLOAT = 0, ENC_Q8_0 = 1, ENC_Q4_0 = 2, ENC_TURBO = 3, ENC_GRID = 4, ENC_GRID_SUB = 5, ENC_IQ4_NL = 6,
       ENC_Q4_1 = 7, ENC_Q5_0 = 8, ENC_Q5_1 = 9, ENC_KLT = 10 };
#define GRID_SUB 16               /* nls: values per rung */
#define GRID_MAX_TRIES 32         /* grids: candidate scales (kv_encode.py refuses more) */
#define KLT_MIDS 255              /* klt: midpoints per direction (8-bit codes at most) */
enum { FLOAT_F32 = 0, FLOAT_F16 = 1, FLOAT_BF16 = 2 };

typedef struct {
    int32_t kind;            /* ENC_* */
    int32_t float_type;      /* ENC_FLOAT: FLOAT_* */
    int32_t rot;             /* rotation block (ggml) or group (turbo) size; 0: none */
    int32_t bits;            /* turbo: bits per code */
    int32_t hadamard;        /* the rotation is H / sqrt(rot) (butterfly), else rot_m */
    const float *rot_m;      /* (rot, rot) row-major R: a block y = R x */
    const float *boundaries; /* turbo: 2^bits - 1 ascending; grids: the midpoints of the grid */
    const float *centroids;  /* turbo: 2^bits; grids: the grid, ascending */
    float limit;             /* flag values (ggml, f16) or group norms (turbo) past this; 0: none */
    int32_t block;           /* grids: values per block */
    int32_t n_tries;         /* grids: candidate scales */
    const float *tries;      /* grids: their factors of amax / max|grid| */
    const float *ladder;     /* nls: the 4 rung factors */
    int32_t klt_heads;       /* klt: KV heads (H); the tables below are per head */
    const float *klt_basis;  /* (H, D, D): basis[h][d][e], row -> code direction e */
    const float *klt_synthesis; /* (H, D, D): synthesis[h][e][d], code direction -> row */
    const float *klt_mean;   /* (H, D), in the row's domain */
    const float *klt_spread; /* (H, D): each direction's standard deviation */
    const float *klt_mids;   /* (H, D, KLT_MIDS): grid midpoints, ascending (+inf past 2^bits - 1) */
    const uint8_t *klt_bits; /* (H, D): bits of each direction's code, 0 to 8 */
} enc_t;

static void store_f16(uint8_t *p, float v) {
    float_to_half(p, v);
}

static void store_bf16(uint8_t *p, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;              /* NaN stays NaN */
    else u += 0x7fffu + ((u >> 16) & 1u);                              /* round to nearest even */
    p[0] = (uint8_t)(u >> 16), p[1] = (uint8_t)(u >> 24);
}

/* y = R x for each block of n values of x (dim of them); R (n, n) row-major, n a multiple of 8
 * (turbo's groups). Each dot product in 8 running sums, added at the end: one sum would chain
 * every add on the last, and the loop would not vectorise. (torch's matmul, the encoders'
 * reference, sums in its own order too: the bytes agree but for near-ties, as tested.) */
static void rotate_blocks(const float *rot_m, int n, const float *x, float *y, int dim) {
    for (int b = 0; b < dim; b += n)
        for (int i = 0; i < n; i++) {
            const float *r = rot_m + (size_t)i * n;
            float s[8] = {0};
            for (int j = 0; j < n; j += 8)
                for (int k = 0; k < 8; k++) s[k] += r[j + k] * x[b + j + k];
            y[b + i] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        }
}

/* x = R^T y per block: the way back out of a rotated code domain. */
static void unrotate_blocks(const float *rot_m, int n, const float *y, float *x, int dim) {
    for (int b = 0; b < dim; b += n) {
        for (int j = 0; j < n; j++) x[b + j] = 0.0f;
        for (int i = 0; i < n; i++) {
            const float *r = rot_m + (size_t)i * n;
            const float yi = y[b + i];
            for (int j = 0; j < n; j++) x[b + j] += r[j] * yi;
        }
    }
}

/* y = H x / sqrt(n) per block of n: rounds of sums and differences, then the scale. */
static void hadamard_blocks(int n, const float *x, float *y, int dim) {
    const float scale = (float)(1.0 / sqrt((double)n));
    memcpy(y, x, sizeof(float) * (size_t)dim);
    for (int h = 1; h < n; h *= 2)
        for (int b = 0; b < dim; b += 2 * h)
            for (int i = b; i < b + h; i++) {
                const float a = y[i], c = y[i + h];
                y[i] = a + c, y[i + h] = a - c;
            }
    for (int i = 0; i < dim; i++) y[i] *= scale;
}

/* kvslim.formats.rotation.hadamard_blocks on the CPU: x and y (rows, n) float32, the same sums and
 * differences in the same order as its torch butterfly, so the same bits. Returns 0. */
int kvslim_hadamard_rows(int n, const float *x, float *y, int64_t rows, int n_threads) {
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) hadamard_blocks(n, x + r * n, y + r * n, n);
    return 0;
}

/* Into the format's code domain (the rotation, or a copy) and back out of it. */
static void to_code_domain(const enc_t *e, const float *x, float *y, int dim) {
    if (!e->rot) memcpy(y, x, sizeof(float) * (size_t)dim);
    else if (e->hadamard) hadamard_blocks(e->rot, x, y, dim);
    else rotate_blocks(e->rot_m, e->rot, x, y, dim);
}

static void from_code_domain(const enc_t *e, const float *y, float *x, int dim) {
    if (!e->rot) memcpy(x, y, sizeof(float) * (size_t)dim);
    else if (e->hadamard) hadamard_blocks(e->rot, y, x, dim);     /* its own inverse */
    else unrotate_blocks(e->rot_m, e->rot, y, x, dim);
}

/* ggml's quantize_row_q8_0_ref / q4_0_ref for one block of 32; a non-finite x * id is 0, as x86's cast. */
static inline int8_t c_cast(float v) {
    return isfinite(v) ? (int8_t)v : 0;
}

static void encode_q8_0(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fabsf(x[l]) > amax ? fabsf(x[l]) : amax;
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    for (int l = 0; l < 32; l++) out[2 + l] = (uint8_t)c_cast(roundf(x[l] * id));
}

/* A ggml block's 32 codes after its header: 16 bytes of nibbles, byte j = code j | code j+16 << 4;
 * with 5-bit codes (q5_x) first a little-endian u32 whose bit j is bit 4 of code j. */
static void pack_ggml_codes(const int *q, int five_bit, uint8_t *out) {
    uint32_t high = 0;
    for (int l = 0; l < 16; l++) {
        out[(five_bit ? 4 : 0) + l] = (uint8_t)((q[l] & 0x0F) | (q[l + 16] & 0x0F) << 4);
        high |= (uint32_t)((q[l] >> 4) & 1) << l | (uint32_t)((q[l + 16] >> 4) & 1) << (l + 16);
    }
    if (five_bit) memcpy(out, &high, 4);
}

/* q4_0 / q5_0 (quantize_row_q4_0_ref / q5_0_ref): d = the signed max / -half (8 or 16), codes
 * trunc(x / d + half + 0.5) capped at 2 half - 1; x * id + 8.5 rounds twice, as the reference's.
 * [f16 d][codes]. */
__attribute__((optimize("fp-contract=off")))
static void encode_symmetric(const float *x, int half, uint8_t *out) {
    float amax = 0.0f, max = 0.0f;
    for (int l = 0; l < 32; l++)
        if (amax < fabsf(x[l])) amax = fabsf(x[l]), max = x[l];      /* the first of equal magnitudes */
    const float d = max / -(float)half, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    int q[32];
    for (int l = 0; l < 32; l++) {
        const int v = c_cast(x[l] * id + ((float)half + 0.5f));
        q[l] = v < 2 * half - 1 ? v : 2 * half - 1;
    }
    pack_ggml_codes(q, half == 16, out + 2);
}

/* q4_1 / q5_1 (ggml's quantize_row_q4_1_ref / q5_1_ref, as formats/ggml.py's _min_max_scale):
 * d = (max - min) / levels, codes trunc((x - min) / d + 0.5) capped at levels, [f16 d][f16 min]
 * [codes]. Products and sums round apart, as the references'. */
__attribute__((optimize("fp-contract=off")))
static void encode_min_max(const float *x, int levels, uint8_t *out) {
    float lo = x[0], hi = x[0];
    for (int l = 1; l < 32; l++) lo = x[l] < lo ? x[l] : lo, hi = x[l] > hi ? x[l] : hi;
    const float d = (hi - lo) / (float)levels, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    store_f16(out + 2, lo);
    int q[32];
    for (int l = 0; l < 32; l++) {
        const int v = c_cast((x[l] - lo) * id + 0.5f);
        q[l] = v < levels ? v : levels;
    }
    pack_ggml_codes(q, levels == 31, out + 4);
}

/* ggml's best_index_int8: the nearest of the 16 grid values, the upper one on exact ties. Its
 * binary search ends at the bracket grid[lo] <= x < grid[lo + 1]; counting the inner values at or
 * below x finds the same bracket without its four unpredictable branches, and vectorises. */
static inline int iq4nl_index(const float *grid, float x) {
    /* x <= grid[0] and x >= grid[15] need no test of their own: they count to brackets 0 and 14
     * and the nearer-end rule then picks 0 and 15 (NaN: 1, as the search gives) */
    int lo = 0;
    for (int j = 1; j < 15; j++) lo += grid[j] <= x;
    return x - grid[lo] < grid[lo + 1] - x ? lo : lo + 1;
}

#define IQ4NL_CANDIDATES 16          /* the starting scale and itry = -7 .. 7 */

/* sum(w q x) and sum(w q q) for each candidate scale's codes (q = grid[code of x * ids[c]],
 * w = x^2), each candidate's sums taken left to right over the 32 values as the reference
 * takes them. No FMA contraction: the sums must round as the reference's separate products and
 * adds do, or a rare block picks another scale (the bytes are compared with gguf's and the
 * torch encoder's). The candidates sit side by side (lane c: candidate c), so the per-value loop
 * vectorises across them without reordering any one candidate's sums: a 512-token chunk of
 * 2 x 128 rows took 13.4 ms with a binary search per value, 4.5 ms with the codes found
 * branch-free one candidate at a time, and less with the 16 side by side. */
__attribute__((optimize("fp-contract=off")))
static void iq4nl_fits(const float *grid, const float *x, const float *ids, float *sumqx, float *sumq2) {
    float sx[IQ4NL_CANDIDATES] = {0}, s2[IQ4NL_CANDIDATES] = {0};
    for (int j = 0; j < 32; j++) {
        const float w = x[j] * x[j];
        float q[IQ4NL_CANDIDATES];
        for (int c = 0; c < IQ4NL_CANDIDATES; c++) q[c] = grid[iq4nl_index(grid, ids[c] * x[j])];
        for (int c = 0; c < IQ4NL_CANDIDATES; c++) {
            const float wq = w * q[c];
            const float px = wq * x[j], pq = wq * q[c];
            sx[c] += px;
            s2[c] += pq;
        }
    }
    memcpy(sumqx, sx, sizeof sx), memcpy(sumq2, s2, sizeof s2);
}

/* quantize_row_iq4_nl_ref for one block of 32 (no importance weights: w = x^2, ntry = 7). */
__attribute__((optimize("fp-contract=off")))
static void encode_iq4_nl(const float *grid, const float *x, uint8_t *out) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];   /* the first of equal magnitudes */
    float d = 0.0f;
    if (amax >= 1e-15f) {                                         /* GROUP_MAX_EPS */
        float ids[IQ4NL_CANDIDATES], sumqx[IQ4NL_CANDIDATES], sumq2[IQ4NL_CANDIDATES];
        ids[0] = 1.0f / (-max / grid[0]);
        for (int itry = -7; itry <= 7; itry++) ids[itry + 8] = ((float)itry + grid[0]) / max;
        iq4nl_fits(grid, x, ids, sumqx, sumq2);
        d = sumqx[0] / sumq2[0];
        float best = d * sumqx[0];
        for (int c = 1; c < IQ4NL_CANDIDATES; c++)                /* in the reference's order */
            if (sumq2[c] > 0.0f && sumqx[c] * sumqx[c] > best * sumq2[c]) d = sumqx[c] / sumq2[c], best = d * sumqx[c];
    }
    store_f16(out, d);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;                 /* the float32 scale, not its fp16 */
    for (int j = 0; j < 16; j++)
        out[2 + j] = (uint8_t)(iq4nl_index(grid, id * x[j]) | iq4nl_index(grid, id * x[j + 16]) << 4);
}

/* Codes of `bits` bits, 8 to a little-endian word of `bits` bytes (kvslim/formats/bitpack.py). */
static void pack_codes(const uint8_t *codes, int n, int bits, uint8_t *out) {
    for (int w = 0; w < n / 8; w++) {
        uint64_t word = 0;
        for (int i = 0; i < 8; i++) word |= (uint64_t)codes[8 * w + i] << (bits * i);
        for (int b = 0; b < bits; b++) out[w * bits + b] = (uint8_t)(word >> (8 * b));
    }
}

static int encode_turbo(const enc_t *e, const float *x, int dim, uint8_t *out) {
    const int g = e->rot, n_codes = 1 << e->bits, group_bytes = 2 + g * e->bits / 8;
    int bad = 0;
    float unit[ENC_MAX_DIM], y[ENC_MAX_DIM];
    uint8_t codes[ENC_MAX_DIM];
    for (int start = 0; start < dim; start += g) {
        float ss = 0.0f;
        for (int j = 0; j < g; j++) ss += x[start + j] * x[start + j];
        const float norm = sqrtf(ss), div = norm > 1e-30f ? norm : 1e-30f;
        bad |= !isfinite(norm) || norm > e->limit;
        for (int j = 0; j < g; j++) unit[j] = x[start + j] / div;
        rotate_blocks(e->rot_m, g, unit, y, g);
        float cc = 0.0f;
        for (int j = 0; j < g; j++) {                     /* torch.bucketize: boundaries < y */
            int c = 0;
            while (c < n_codes - 1 && e->boundaries[c] < y[j]) c++;
            codes[j] = (uint8_t)c;
            cc += e->centroids[c] * e->centroids[c];
        }
        uint8_t *block = out + (start / g) * group_bytes;
        store_f16(block, norm / sqrtf(cc));
        pack_codes(codes, g, e->bits, block + 2);
    }
    return bad;
}

/* ----- the nl grids -------------------------------------------------------------------- */
/* codes[i] = torch.bucketize(x[i] / div, midpoints): how many midpoints lie below the value, for
 * n <= ENC_MAX_DIM values. Counted midpoint by midpoint over all values rather than searched
 * value by value: no data-dependent branch, and the compiler vectorizes the inner loops (a
 * binary search's mispredicted branches were most of the grids' encoding time). */
static inline void nearest_codes(const enc_t *e, const float *x, float div, int n, uint8_t *codes) {
    float v[ENC_MAX_DIM];
    for (int i = 0; i < n; i++) v[i] = x[i] / div, codes[i] = 0;
    for (int j = 0; j < (1 << e->bits) - 1; j++) {
        const float mid = e->boundaries[j];
        for (int i = 0; i < n; i++) codes[i] += mid < v[i];
    }
}

/* grid.search_scale for one block of n values: codes into `codes`, returns d. */
static float grid_search(const enc_t *e, const float *x, int n, uint8_t *codes) {
    const float *grid = e->centroids;
    const float gmax = fmaxf(fabsf(grid[0]), fabsf(grid[(1 << e->bits) - 1]));
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d0 = fmaxf(amax / gmax, 1e-30f);
    float best_score = -INFINITY, best_d = 0.0f;
    float cand[GRID_MAX_TRIES], sxg_t[GRID_MAX_TRIES] = {0}, sgg_t[GRID_MAX_TRIES] = {0};
    const int tries = e->n_tries, n_mids = (1 << e->bits) - 1;
    for (int t = 0; t < tries; t++) cand[t] = d0 * e->tries[t];
    /* The candidates side by side (lane t: candidate t), each one's sums still over the values in
     * order: the loops over t vectorise (16 tries, 16 lanes) where one candidate at a time left
     * the sums' dependent adds as the critical path. */
    for (int i = 0; i < n; i++) {
        int code[GRID_MAX_TRIES] = {0};
        float v[GRID_MAX_TRIES];
        for (int t = 0; t < tries; t++) v[t] = x[i] / cand[t];
        for (int j = 0; j < n_mids; j++)
            for (int t = 0; t < tries; t++) code[t] += e->boundaries[j] < v[t];
        for (int t = 0; t < tries; t++) {
            const float g = grid[code[t]];
            sxg_t[t] += g * x[i], sgg_t[t] += g * g;
        }
    }
    for (int t = 0; t < tries; t++) {
        const float sxg = sxg_t[t], sgg = fmaxf(sgg_t[t], 1e-30f);
        if (sxg * sxg / sgg > best_score) best_score = sxg * sxg / sgg, best_d = sxg / sgg;
    }
    const float div = fmaxf(best_d, 1e-30f);
    float sxg = 0.0f, sgg = 0.0f;
    nearest_codes(e, x, div, n, codes);
    for (int i = 0; i < n; i++) {
        const float g = grid[codes[i]];
        sxg += g * x[i], sgg += g * g;
    }
    return amax > 0.0f ? sxg / fmaxf(sgg, 1e-30f) : 0.0f;
}

/* grid.search_two_level for one block of e->block values (a multiple of GRID_SUB). */
static float grid_two_level(const enc_t *e, const float *x, uint8_t *rungs, uint8_t *codes) {
    const float *grid = e->centroids;
    const int n_sub = e->block / GRID_SUB;
    float d = 0.0f;
    for (int s = 0; s < n_sub; s++) d = fmaxf(d, grid_search(e, x + s * GRID_SUB, GRID_SUB, codes + s * GRID_SUB));
    d = half_round(d);
    for (int round = 0; round < 2; round++) {
        for (int s = 0; s < n_sub; s++) {                     /* each sub-block's best rung and codes */
            const float *xs = x + s * GRID_SUB;
            float best = INFINITY;
            for (int r = 0; r < 4; r++) {
                const float cand = fmaxf(d * e->ladder[r], 1e-30f);
                uint8_t c[GRID_SUB];
                float err = 0.0f;
                nearest_codes(e, xs, cand, GRID_SUB, c);
                for (int i = 0; i < GRID_SUB; i++) {
                    const float diff = xs[i] - grid[c[i]] * cand;
                    err += diff * diff;
                }
                if (err < best) {
                    best = err, rungs[s] = (uint8_t)r;
                    memcpy(codes + s * GRID_SUB, c, GRID_SUB);
                }
            }
        }
        float sgx = 0.0f, sgg = 0.0f;                         /* refit d, rounded as stored */
        for (int i = 0; i < e->block; i++) {
            const float g = grid[codes[i]] * e->ladder[rungs[i / GRID_SUB]];
            sgx += g * x[i], sgg += g * g;
        }
        d = half_round(sgx / fmaxf(sgg, 1e-30f));
    }
    return d;
}

static void encode_grid_blocks(const enc_t *e, const float *y, int dim, uint8_t *out) {
    const int sub = e->kind == ENC_GRID_SUB, n_sub = e->block / GRID_SUB;
    const int header = 2 + (sub ? n_sub * 2 / 8 : 0), block_bytes = header + e->block * e->bits / 8;
    uint8_t codes[ENC_MAX_DIM] = {0}, rungs[ENC_MAX_DIM / GRID_SUB] = {0};   /* a NaN block keeps zeros */
    for (int b = 0; b < dim / e->block; b++) {
        uint8_t *o = out + b * block_bytes;
        const float d = sub ? grid_two_level(e, y + b * e->block, rungs, codes)
                            : grid_search(e, y + b * e->block, e->block, codes);
        store_f16(o, d);
        if (sub) pack_codes(rungs, n_sub, 2, o + 2);
        pack_codes(codes, e->block, e->bits, o + header);
    }
}

/* Encode one row x (dim) into out (the format's row bytes); returns the row's overflow flag. Every
 * kind but ENC_KLT, whose tables are per head (encode_row_head). */
static int encode_row(const enc_t *e, const float *x, int dim, uint8_t *out) {
    if (e->kind == ENC_TURBO) return encode_turbo(e, x, dim, out);
    float y[ENC_MAX_DIM];
    to_code_domain(e, x, y, dim);
    int bad = 0;
    for (int i = 0; i < dim; i++) bad |= !isfinite(y[i]) || (e->limit > 0.0f && fabsf(y[i]) > e->limit);
    if (e->kind == ENC_GRID || e->kind == ENC_GRID_SUB) {
        encode_grid_blocks(e, y, dim, out);
    } else if (e->kind == ENC_FLOAT) {
        for (int i = 0; i < dim; i++) {
            if (e->float_type == FLOAT_F32) memcpy(out + 4 * i, &y[i], 4);
            else if (e->float_type == FLOAT_F16) store_f16(out + 2 * i, y[i]);
            else store_bf16(out + 2 * i, y[i]);
        }
    } else if (e->kind == ENC_IQ4_NL) {
        for (int b = 0; b < dim / 32; b++) encode_iq4_nl(e->centroids, y + 32 * b, out + 18 * b);
    } else if (e->kind == ENC_Q4_1 || e->kind == ENC_Q5_1) {
        const int levels = e->kind == ENC_Q4_1 ? 15 : 31, block_bytes = e->kind == ENC_Q4_1 ? 20 : 24;
        for (int b = 0; b < dim / 32; b++) encode_min_max(y + 32 * b, levels, out + b * block_bytes);
    } else if (e->kind == ENC_Q4_0 || e->kind == ENC_Q5_0) {
        const int half = e->kind == ENC_Q4_0 ? 8 : 16, block_bytes = e->kind == ENC_Q4_0 ? 18 : 22;
        for (int b = 0; b < dim / 32; b++) encode_symmetric(y + 32 * b, half, out + b * block_bytes);
    } else {
        for (int b = 0; b < dim / 32; b++) encode_q8_0(y + 32 * b, out + b * 34);
    }
    return bad;
}

/* ----- klt3: per-head transform coding ------------------------------------------------- */
/* y = (x - mean) @ basis with one head's tables (its code domain). Each row of the basis is added
 * into all dim sums at once: the inner loop runs along e, contiguous, and vectorises, where a dot
 * product per e would walk the basis by columns. */
static void klt_project(const float *basis, const float *mean, const float *x, float *y, int dim) {
    for (int j = 0; j < dim; j++) y[j] = 0.0f;
    for (int d = 0; d < dim; d++) {
        const float c = x[d] - mean[d], *b = basis + (size_t)d * dim;
        for (int j = 0; j < dim; j++) y[j] += c * b[j];
    }
}

/* x = y @ synthesis + mean: back out of the code domain (affine, as KLTFormat.from_code_domain). */
static void klt_synthesize(const float *synthesis, const float *mean, const float *y, float *x, int dim) {
    for (int d = 0; d < dim; d++) x[d] = 0.0f;
    for (int j = 0; j < dim; j++) {
        const float c = y[j], *s = synthesis + (size_t)j * dim;
        for (int d = 0; d < dim; d++) x[d] += c * s[d];
    }
    for (int d = 0; d < dim; d++) x[d] += mean[d];
}

/* torch.searchsorted(mids, u) (left) among a direction's 2^bits - 1 midpoints: a branch-free lower
 * bound, one halving step per code bit, so the +inf midpoints past them are never read. The test
 * is torch's "not mid >= u": NaN goes past every midpoint, to 2^bits - 1, which is what the torch
 * encoder's bytes hold once its code 255 is cut to the direction's bits. */
static inline int klt_code(const float *mids, int bits, float u) {
    int c = 0;
    for (int step = (1 << bits) >> 1; step > 0; step >>= 1) c += !(mids[c + step - 1] >= u) ? step : 0;
    return c;
}

/* One row of KV head `head`, as KLTFormat._encode: z = (x - mean) @ basis / spread, the fp16 RMS of
 * its coded directions as the row scale, each direction's code of z / scale, packed from bit 0.
 * Returns KLTFormat._bad_rows' flag: a non-finite value in x, or a non-finite scale. */
static int encode_klt(const enc_t *e, int head, const float *x, int dim, uint8_t *out) {
    const size_t hd = (size_t)head * dim;
    const float *spread = e->klt_spread + hd, *mids = e->klt_mids + hd * KLT_MIDS;
    const uint8_t *bits = e->klt_bits + hd;
    float z[ENC_MAX_DIM], ss = 0.0f;
    int live = 0, bad = 0;
    klt_project(e->klt_basis + hd * dim, e->klt_mean + hd, x, z, dim);
    for (int j = 0; j < dim; j++) {
        z[j] /= spread[j];
        ss += z[j] * z[j] * (float)(bits[j] > 0);       /* times 0, not skipped: inf * 0 is NaN in torch too */
        live += bits[j] > 0;
        bad |= !isfinite(x[j]);
    }
    const float scale = half_round(sqrtf(ss / (float)(live > 0 ? live : 1)));
    const float div = scale > 0.0f ? scale : 1.0f;        /* NaN and 0: 1, as torch.where(scale > 0, ...) */
    store_f16(out, scale);
    uint8_t *p = out + 2;
    uint32_t acc = 0;                                      /* fewer than 8 pending bits + a code of 8 */
    int fill = 0;
    for (int j = 0; j < dim; j++) {
        acc |= (uint32_t)klt_code(mids + (size_t)j * KLT_MIDS, bits[j], z[j] / div) << fill;
        for (fill += bits[j]; fill >= 8; fill -= 8) *p++ = (uint8_t)acc, acc >>= 8;
    }
    return bad | !isfinite(scale);
}

/* Encode one row x (dim) of KV head `head` (0 ..; only ENC_KLT reads it) into out; returns the row's
 * overflow flag. */
int encode_row_head(const enc_t *e, int head, const float *x, int dim, uint8_t *out) {
    return e->kind == ENC_KLT ? encode_klt(e, head, x, dim, out) : encode_row(e, x, dim, out);
}

/* Into a format's code domain and back out of it, for a row of KV head `head`. */
static void to_code_domain_head(const enc_t *e, int head, const float *x, float *y, int dim) {
    const size_t hd = (size_t)head * dim;
    if (e->kind == ENC_KLT) klt_project(e->klt_basis + hd * dim, e->klt_mean + hd, x, y, dim);
    else to_code_domain(e, x, y, dim);
}

static void from_code_domain_head(const enc_t *e, int head, const float *y, float *x, int dim) {
    const size_t hd = (size_t)head * dim;
    if (e->kind == ENC_KLT) klt_synthesize(e->klt_synthesis + hd * dim, e->klt_mean + hd, y, x, dim);
    else from_code_domain(e, y, x, dim);
}

/* The KV head of row r of a flat (N, H, D) batch: klt's tables are per head, the others' shared. */
static inline int row_head(const enc_t *e, int64_t r) {
    return e->kind == ENC_KLT ? (int)(r % e->klt_heads) : 0;
}

/* Rows (n, dim) into the format's code domain (inverse: back out of it), rows as row_head reads
 * them: the per-head transforms of the decode step, for the parity tests. Returns 0 (1: a row past
 * ENC_MAX_DIM, or klt without heads). */
int kvslim_code_domain_rows(const enc_t *e, const float *x, int64_t n, int dim, int inverse, float *y) {
    if (dim > ENC_MAX_DIM || (e->kind == ENC_KLT && e->klt_heads < 1)) return 1;
    for (int64_t r = 0; r < n; r++) {
        if (inverse) from_code_domain_head(e, row_head(e, r), x + r * dim, y + r * dim, dim);
        else to_code_domain_head(e, row_head(e, r), x + r * dim, y + r * dim, dim);
    }
    return 0;
}

/* torch.bucketize(v, bounds) (right=False): out[i] = how many of the nb ascending bounds are < v[i]
 * (NaN: nb, where torch sorts it: counted as "not <= b"). Counted bound by bound over a chunk of values, branch-free
 * and vectorised: torch's binary search spent 1.1 ms on a 512-token chunk's 262,144 turbo values. */
#define BUCKET_CHUNK 1024
int kvslim_bucketize(const float *v, int64_t n, const float *bounds, int nb, int64_t *out, int n_threads) {
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n >= 65536)
    for (int64_t c = 0; c < (n + BUCKET_CHUNK - 1) / BUCKET_CHUNK; c++) {
        const int64_t start = c * BUCKET_CHUNK, len = n - start < BUCKET_CHUNK ? n - start : BUCKET_CHUNK;
        int32_t count[BUCKET_CHUNK] = {0};
        for (int j = 0; j < nb; j++) {
            const float b = bounds[j];
            for (int64_t i = 0; i < len; i++) count[i] += !(v[start + i] <= b);
        }
        for (int64_t i = 0; i < len; i++) out[start + i] = count[i];
    }
    return 0;
}

/* Rows (n, dim) -> out (n, row_bytes), flags (n): the cache's prompt path on the CPU and the
 * parity tests (kvslim/native/kv_encode.py). Rows are independent: split across threads. For
 * ENC_KLT the rows are (N, H, D) flattened: row r is of head r % H (row_head). */
int kvslim_encode_rows(const enc_t *e, const float *x, int64_t n, int dim, int64_t row_bytes, uint8_t *out,
                       uint8_t *flags, int n_threads) {
    if (dim > ENC_MAX_DIM || (e->kind == ENC_KLT && e->klt_heads < 1)) return 1;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n * dim >= 16384)
    for (int64_t r = 0; r < n; r++)
        flags[r] = (uint8_t)encode_row_head(e, row_head(e, r), x + r * dim, dim, out + r * row_bytes);
    return 0;
}
