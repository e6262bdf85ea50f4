/* K/V rows into a format's packed row bytes, in C: the native decode step's quantize-on-append.
 *
 * The torch encoders in kvslim/formats are the reference; the parity tests hold these to them.
 * A format reaches this file as an encoder description (kvslim/engine/native_step.py builds it
 * from the format's own fields), so C never guesses a layout from a name:
 *   ENC_FLOAT  the row as f32, f16 or bf16 (round to nearest even)
 *   ENC_Q8_0 / ENC_Q4_0  ggml's blocks of 32 (llama.cpp's reference quantizers), of the row
 *              after an optional block rotation: llama.cpp's Walsh-Hadamard in blocks of `rot`,
 *              as the same butterfly as kvslim/formats/rotation.py (so the same bytes)
 *   ENC_TURBO  TurboQuant's MSE variant: per group of `group` values, the norm, the unit vector
 *              rotated by R, each value's bucket among the Lloyd-Max boundaries, and
 *              [f16 norm / |centroids|][codes packed little-endian, `bits` each]
 * Each encoder also computes the token's overflow flag as the torch hot path does: NaN or inf,
 * or past what the fp16 fields can hold.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ENC_MAX_DIM 512

enum { ENC_FLOAT = 0, ENC_Q8_0 = 1, ENC_Q4_0 = 2, ENC_TURBO = 3 };
enum { FLOAT_F32 = 0, FLOAT_F16 = 1, FLOAT_BF16 = 2 };

typedef struct {
    int32_t kind;            /* ENC_* */
    int32_t float_type;      /* ENC_FLOAT: FLOAT_* */
    int32_t rot;             /* rotation block (ggml) or group (turbo) size; 0: none */
    int32_t bits;            /* turbo: bits per code */
    int32_t hadamard;        /* the rotation is H / sqrt(rot) (butterfly), else rot_m */
    const float *rot_m;      /* (rot, rot) row-major R: a block y = R x */
    const float *boundaries; /* turbo: 2^bits - 1 ascending */
    const float *centroids;  /* turbo: 2^bits */
    float limit;             /* flag values (ggml, f16) or group norms (turbo) past this; 0: none */
} enc_t;

static void store_f16(uint8_t *p, float v) {
    _Float16 h = (_Float16)v;
    memcpy(p, &h, 2);
}

static void store_bf16(uint8_t *p, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;              /* NaN stays NaN */
    else u += 0x7fffu + ((u >> 16) & 1u);                              /* round to nearest even */
    p[0] = (uint8_t)(u >> 16), p[1] = (uint8_t)(u >> 24);
}

/* y = R x for each block of n values of x (dim of them); R (n, n) row-major. */
static void rotate_blocks(const float *rot_m, int n, const float *x, float *y, int dim) {
    for (int b = 0; b < dim; b += n)
        for (int i = 0; i < n; i++) {
            const float *r = rot_m + (size_t)i * n;
            float s = 0.0f;
            for (int j = 0; j < n; j++) s += r[j] * x[b + j];
            y[b + i] = s;
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

static void encode_q4_0(const float *x, uint8_t *out) {
    float amax = 0.0f, max = 0.0f;
    for (int l = 0; l < 32; l++)
        if (amax < fabsf(x[l])) amax = fabsf(x[l]), max = x[l];      /* the first of equal magnitudes */
    const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    for (int l = 0; l < 16; l++) {
        int lo = c_cast(x[l] * id + 8.5f), hi = c_cast(x[l + 16] * id + 8.5f);
        out[2 + l] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
    }
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

/* Encode one row x (dim) into out (the format's row bytes); returns the row's overflow flag. */
static int encode_row(const enc_t *e, const float *x, int dim, uint8_t *out) {
    if (e->kind == ENC_TURBO) return encode_turbo(e, x, dim, out);
    float y[ENC_MAX_DIM];
    to_code_domain(e, x, y, dim);
    int bad = 0;
    for (int i = 0; i < dim; i++) bad |= !isfinite(y[i]) || (e->limit > 0.0f && fabsf(y[i]) > e->limit);
    if (e->kind == ENC_FLOAT) {
        for (int i = 0; i < dim; i++) {
            if (e->float_type == FLOAT_F32) memcpy(out + 4 * i, &y[i], 4);
            else if (e->float_type == FLOAT_F16) store_f16(out + 2 * i, y[i]);
            else store_bf16(out + 2 * i, y[i]);
        }
    } else {
        const int block_bytes = e->kind == ENC_Q8_0 ? 34 : 18;
        for (int b = 0; b < dim / 32; b++)
            (e->kind == ENC_Q8_0 ? encode_q8_0 : encode_q4_0)(y + 32 * b, out + b * block_bytes);
    }
    return bad;
}

/* The standalone entry the parity tests call: rows (n, dim) -> out (n, row_bytes), flags (n). */
int kvslim_encode_rows(const enc_t *e, const float *x, int64_t n, int dim, int64_t row_bytes, uint8_t *out,
                       uint8_t *flags) {
    if (dim > ENC_MAX_DIM) return 1;
    for (int64_t r = 0; r < n; r++) flags[r] = (uint8_t)encode_row(e, x + r * dim, dim, out + r * row_bytes);
    return 0;
}
