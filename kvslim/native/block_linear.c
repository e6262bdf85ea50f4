/* y = x @ W.T for W kept as ggml blocks, a few rows of x at a time (decode).
 *
 * Each weight block is read once and unpacked in registers; no dequantized row is
 * written to memory. Rows of W are split across OpenMP threads. Built on first use by
 * kvslim/native/build.py; without a compiler kvslim uses the pure-torch path, which the
 * parity tests hold this one to (against gguf.quants).
 *
 * A row is walked in groups of 32 values. Every type's group is
 *     value[l] = s0 * q[l] + o0   (l < 16),   s1 * q[l] + o1   (l >= 16)
 * with small integer codes q (o0 = o1 but for Q2_K), so a group's contribution to y is
 *     s0 * (q[:16] . x[:16]) + s1 * (q[16:] . x[16:]) + o0 * sum(x[:16]) + o1 * sum(x[16:])
 * and the scales multiply sums, not values. Layouts (ggml, little-endian, f16 scales):
 *   Q8_0   [d][32 x int8]                      s = d, q = int8
 *   Q4_0   [d][16 B: byte j = q_j | q_j+16<<4]  s = d, q = nibble - 8
 *   Q4_1   [d][m][16 B nibbles]                 s = d, o = m, q = nibble
 *   Q5_0   [d][qh 4 B][16 B nibbles]            s = d, q = (nibble | bit j of qh << 4) - 16
 *   Q5_1   [d][m][qh 4 B][16 B nibbles]         s = d, o = m, q = nibble | bit << 4
 *   IQ4_NL [d][16 B nibbles]                    s = d, q = kvalues[nibble]
 *   Q4_K   256-value super-block [d][dmin][12 B 6-bit scales and mins][128 B nibbles]:
 *          group j: s = d * sc_j, o = -dmin * mn_j, q = nibble (low for even j, high for odd)
 *   Q5_K   Q4_K plus [qh 32 B]: bit j of qh[l] is bit 4 of group j's value l
 *   Q6_K   [ql 128 B][qh 64 B][16 x int8 scales][d]: q = (4 low bits | 2 high bits << 4) - 32,
 *          one scale per 16 values (s0 and s1 differ)
 *   Q3_K   [hmask 32 B][qs 64 B][12 B: 16 six-bit scales][d]: q = 2 bits of qs - (bit j of hmask ?
 *          0 : 4), s = d * (scale - 32) per 16 values
 *   Q2_K   [16 B: 4-bit scale | 4-bit min per 16 values][qs 64 B][d][dmin]: q = 2 bits,
 *          s = d * scale, o = -dmin * min per 16 values
 *   IQ4_XS [d][scales_h 2 B][scales_l 4 B][qs 128 B]: q = kvalues[nibble] (IQ4_NL's grid),
 *          s = d * (6-bit scale - 32) per 32 values
 *   MXFP4  [e8m0 exponent][16 B nibbles]          s = 2^(e - 128), q = MXFP4_VALUES[nibble] (e2m1, doubled)
 *   NVFP4  64 values: [4 x e4m3 scales][32 B: 8 per 16 values, low nibbles 0-7, high 8-15]: q as
 *          MXFP4's, s = scale / 2 per 16 values (s0 and s1 differ)
 *   The grid i-quants, 256-value super-blocks: q = a lattice entry's values (iq_grids.h, generated
 *   from gguf.quants at build time) times sign bits; see decode_iq_group for each layout.
 *   F16 / BF16 / F32  plain rows (s = 1)
 * With AVX2 + F16C + FMA the hot types (Q8_0, Q4_0, F16, BF16), the K-quants and IQ4_XS unpack
 * with intrinsics, the grid i-quants and MXFP4 make a group's codes as 32 signed bytes
 * (group_codes); the others (Q4_1, Q5_0, Q5_1, IQ4_NL) decode a group's codes in C and share the
 * vector dot products.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "half.c"
#include "iq_grids.h"

#define QK 32
#define MAX_M 8

enum {
    TYPE_Q4_0 = 4, TYPE_Q8_0 = 8, TYPE_F16 = 16, TYPE_BF16 = 17, TYPE_F32 = 32, TYPE_Q4_1 = 41, TYPE_IQ4_NL = 44,
    TYPE_Q5_0 = 50, TYPE_Q5_1 = 51, TYPE_Q2_K = 102, TYPE_Q3_K = 103, TYPE_Q4_K = 104, TYPE_Q5_K = 105,
    TYPE_Q6_K = 106, TYPE_IQ4_XS = 144, TYPE_IQ1_S = 181, TYPE_IQ1_M = 182, TYPE_IQ2_XXS = 121, TYPE_IQ2_XS = 122,
    TYPE_IQ2_S = 123, TYPE_IQ3_XXS = 131, TYPE_IQ3_S = 133, TYPE_MXFP4 = 204, TYPE_NVFP4 = 240
};

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

typedef struct {
    float q[QK];        /* codes as floats */
    float s0, s1, o0, o1;   /* scale and offset of values 0-15, of 16-31 */
} group_t;

static float f16(const uint8_t *p) {
    return half_to_float(p);
}

/* Row bytes per group of 32 values (a super-block's share for the K types); 0: unknown type. */
static int64_t group_bytes_x8(int type) {     /* times 8, so the K types' 144/8 etc. stay whole */
    switch (type) {
        case TYPE_Q4_0: case TYPE_IQ4_NL: return 8 * 18;
        case TYPE_Q8_0: return 8 * 34;
        case TYPE_F16: case TYPE_BF16: return 8 * 64;
        case TYPE_F32: return 8 * 128;
        case TYPE_Q4_1: return 8 * 20;
        case TYPE_Q5_0: return 8 * 22;
        case TYPE_Q5_1: return 8 * 24;
        case TYPE_Q4_K: return 144;
        case TYPE_Q5_K: return 176;
        case TYPE_Q6_K: return 210;
        case TYPE_Q3_K: return 110;
        case TYPE_Q2_K: return 84;
        case TYPE_IQ4_XS: return 136;
        case TYPE_MXFP4: return 8 * 17;
        case TYPE_NVFP4: return 8 * 18;         /* 36 bytes per 64 values */
        case TYPE_IQ2_XXS: return 66;           /* the grid types: a super-block's bytes (8 groups) */
        case TYPE_IQ2_XS: return 74;
        case TYPE_IQ2_S: return 82;
        case TYPE_IQ3_XXS: return 98;
        case TYPE_IQ3_S: return 110;
        case TYPE_IQ1_S: return 50;
        case TYPE_IQ1_M: return 56;
        default: return 0;
    }
}

static int grid_types(int type) {
    return type == TYPE_IQ2_XXS || type == TYPE_IQ2_XS || type == TYPE_IQ2_S || type == TYPE_IQ3_XXS
        || type == TYPE_IQ3_S || type == TYPE_IQ1_S || type == TYPE_IQ1_M;
}

static int super_blocks(int type);

/* Values per block: a row must be whole blocks. */
static int64_t block_values(int type) {
    return super_blocks(type) ? 256 : type == TYPE_NVFP4 ? 64 : QK;
}

static int super_blocks(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K || type == TYPE_Q3_K || type == TYPE_Q2_K
        || type == TYPE_IQ4_XS || grid_types(type);
}

static void nibbles(const uint8_t *qs, float *q, int offset) {
    for (int l = 0; l < 16; l++) {
        q[l] = (float)((qs[l] & 0x0F) + offset);
        q[l + 16] = (float)((qs[l] >> 4) + offset);
    }
}

static void nibbles_high_bit(const uint8_t *qh, const uint8_t *qs, float *q, int offset) {
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int l = 0; l < 16; l++) {
        q[l] = (float)((int)((qs[l] & 0x0F) | ((h >> l) & 1) << 4) + offset);
        q[l + 16] = (float)((int)((qs[l] >> 4) | ((h >> (l + 16)) & 1) << 4) + offset);
    }
}

/* Q4_K / Q5_K: the 6-bit scale and min of group j from the 12 packed bytes. */
static void scale_min_k4(const uint8_t *sc, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Q3_K: scale i (0-15) of the 12 packed bytes: 4 low bits from byte i % 8 (nibble i / 8), 2 high
 * bits from byte 8 + i % 4 (pair i / 4); stored plus 32. */
static int scale_q3_k(const uint8_t *sc, int i) {
    return (((sc[i % 8] >> (4 * (i / 8))) & 0x0F) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

/* IQ4_XS: group j's 6-bit scale (4 low bits in scales_l, 2 high in scales_h), stored plus 32. */
static int scale_iq4_xs(const uint8_t *sb, int j) {
    const int high = (sb[2] | sb[3] << 8) >> (2 * j) & 3;
    return (((sb[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | high << 4) - 32;
}

static void decode_k_group(int type, const uint8_t *sb, int j, group_t *g) {
    g->o0 = g->o1 = 0.0f;
    if (type == TYPE_Q2_K || type == TYPE_Q3_K) {      /* 2-bit codes: halves of 128, 32 B of qs each */
        const uint8_t *qs = sb + (type == TYPE_Q2_K ? 16 : 32) + 32 * (j / 4);
        const int shift = 2 * (j % 4);
        for (int l = 0; l < QK; l++) {
            int q = (qs[l] >> shift) & 3;
            if (type == TYPE_Q3_K) q -= (sb[l] >> j) & 1 ? 0 : 4;      /* hmask: bit j of byte l */
            g->q[l] = (float)q;
        }
        if (type == TYPE_Q3_K) {
            const float d = f16(sb + 108);
            g->s0 = d * (float)scale_q3_k(sb + 96, 2 * j);
            g->s1 = d * (float)scale_q3_k(sb + 96, 2 * j + 1);
        } else {
            const float d = f16(sb + 80), dmin = f16(sb + 82);
            g->s0 = d * (float)(sb[2 * j] & 0x0F), g->o0 = -(dmin * (float)(sb[2 * j] >> 4));
            g->s1 = d * (float)(sb[2 * j + 1] & 0x0F), g->o1 = -(dmin * (float)(sb[2 * j + 1] >> 4));
        }
        return;
    }
    if (type == TYPE_IQ4_XS) {
        const uint8_t *qs = sb + 8 + 16 * j;
        for (int l = 0; l < 16; l++) g->q[l] = IQ4NL_VALUES[qs[l] & 0x0F], g->q[l + 16] = IQ4NL_VALUES[qs[l] >> 4];
        g->s0 = g->s1 = f16(sb) * (float)scale_iq4_xs(sb, j);
        return;
    }
    if (type == TYPE_Q6_K) {                 /* halves of 128: ql 64 B, qh 32 B each */
        const uint8_t *ql = sb + 64 * (j / 4) + 32 * (j % 2), *qh = sb + 128 + 32 * (j / 4);
        const int low_shift = 4 * ((j / 2) % 2), high_shift = 2 * (j % 4);
        const int8_t *scales = (const int8_t *)(sb + 192);
        const float d = f16(sb + 208);
        for (int l = 0; l < QK; l++)
            g->q[l] = (float)((int)(((ql[l] >> low_shift) & 0x0F) | (((qh[l] >> high_shift) & 3) << 4)) - 32);
        g->s0 = d * scales[2 * j];
        g->s1 = d * scales[2 * j + 1];
        return;
    }
    const float d = f16(sb), dmin = f16(sb + 2);
    const uint8_t *qs = sb + (type == TYPE_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = sb + 16;
    const int shift = 4 * (j % 2);
    int scale, min;
    scale_min_k4(sb + 4, j, &scale, &min);
    for (int l = 0; l < QK; l++) {
        int q = (qs[l] >> shift) & 0x0F;
        if (type == TYPE_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        g->q[l] = (float)q;
    }
    g->s0 = g->s1 = d * (float)scale;
    g->o0 = g->o1 = -dmin * (float)min;
}

static uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint16_t u16_at(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}

/* Lattice entry `values` (n of them) times the sign bits of `signs` (bit l set: value l
 * negative), as codes at q. */
static void signed_entry(const int8_t *values, int n, int signs, float *q) {
    for (int l = 0; l < n; l++) {
        const int minus = -((signs >> l) & 1);                 /* no branch: the signs are random */
        q[l] = (float)((values[l] ^ minus) - minus);
    }
}

/* IQ2_XS / IQ2_S: a scale nibble per 16 values, d * (0.5 + s) * 0.25 (gguf's order). */
static void iq2_scales(float d, uint8_t sc, group_t *g) {
    g->s0 = d * (0.5f + (float)(sc & 0x0F)) * 0.25f;
    g->s1 = d * (0.5f + (float)(sc >> 4)) * 0.25f;
}

/* IQ1_S / IQ1_M: entry k's codes are the ternary lattice values plus delta (+-1/8). */
static void iq1_entry(int index, float delta, float *q) {
    for (int l = 0; l < 8; l++) q[l] = (float)IQ1S_GRID[index][l] + delta;
}

/* IQ1_M's scales of group j: d * (2s + 1) per 16 values, its fp16 d made of the top nibbles of
 * the 4 scale words. The words are read as one 64-bit load (four 16-bit reads cost the GEMV 15%). */
static inline void iq1_m_scales(const uint8_t *sb, int j, float *s0, float *s1) {
    uint64_t sc;
    memcpy(&sc, sb + 48, 8);
    const uint16_t bits = (uint16_t)(((sc >> 12) & 0xF) | ((sc >> 24) & 0xF0) | ((sc >> 36) & 0xF00) | ((sc >> 48) & 0xF000));
    const uint8_t d_bytes[2] = {(uint8_t)(bits & 0xFF), (uint8_t)(bits >> 8)};
    const float d = half_to_float(d_bytes);
    const int shift = 16 * (j / 2) + 6 * (j % 2);
    *s0 = d * (float)(2 * ((sc >> shift) & 7) + 1);
    *s1 = d * (float)(2 * ((sc >> (shift + 3)) & 7) + 1);
}

/* Group j (32 values) of a grid i-quant's super-block sb. Layouts (after the fp16 d, but IQ1_M):
 *   IQ2_XXS [qs 64 B]: per group two words, 4 grid indices (8 values each) then 4 x 7 sign bits
 *           (through KSIGNS) and a 4-bit scale on top: s = d * (0.5 + s) * 0.25
 *   IQ2_XS  [qs 32 x u16: 9-bit index | 7 sign bits << 9][8 B: a scale nibble per 16 values]
 *   IQ2_S   [qs 32 B][signs 32 B][qh 8 B: 2 high index bits per entry][8 B scale nibbles]
 *   IQ3_XXS [qs 64 B: an index per 4 values][8 words: 4 x 7 sign bits, 4-bit scale]: s = d * (0.5 + s) * 0.5
 *   IQ3_S   [qs 64 B][qh 8 B: the 9th index bit][signs 32 B][4 B scale nibbles]: s = d * (1 + 2s)
 *   IQ1_S   [qs 32 B][8 x u16: 3 high index bits per entry, 3-bit scale, delta sign]: s = d * (2s + 1),
 *           q = lattice value +- 1/8
 *   IQ1_M   [qs 32 B][qh 16 B: a nibble per entry, 3 index bits and the delta sign][4 x u16: 3-bit
 *           scales per 16 values, the fp16 d in their top nibbles] */
static void decode_iq_group(int type, const uint8_t *sb, int j, group_t *g) {
    g->o0 = g->o1 = 0.0f;
    if (type == TYPE_IQ1_M) {
        iq1_m_scales(sb, j, &g->s0, &g->s1);
        for (int k = 0; k < 4; k++) {
            const int nib = (sb[32 + 2 * j + k / 2] >> (4 * (k % 2))) & 0x0F;
            iq1_entry(sb[4 * j + k] | (nib & 7) << 8, nib & 8 ? -0.125f : 0.125f, g->q + 8 * k);
        }
        return;
    }
    const float d = f16(sb);
    const uint8_t *qs = sb + 2;
    switch (type) {
        case TYPE_IQ2_XXS: {
            const uint32_t signs = u32_at(qs + 8 * j + 4);
            g->s0 = g->s1 = d * (0.5f + (float)(signs >> 28)) * 0.25f;
            for (int k = 0; k < 4; k++) signed_entry(IQ2XXS_GRID[qs[8 * j + k]], 8, KSIGNS[(signs >> (7 * k)) & 127], g->q + 8 * k);
            break;
        }
        case TYPE_IQ2_XS:
            iq2_scales(d, sb[66 + j], g);
            for (int k = 0; k < 4; k++) {
                const uint16_t w = u16_at(qs + 8 * j + 2 * k);
                signed_entry(IQ2XS_GRID[w & 511], 8, KSIGNS[w >> 9], g->q + 8 * k);
            }
            break;
        case TYPE_IQ2_S:
            iq2_scales(d, sb[74 + j], g);
            for (int k = 0; k < 4; k++)
                signed_entry(IQ2S_GRID[qs[4 * j + k] | ((sb[66 + j] >> (2 * k)) & 3) << 8], 8, sb[34 + 4 * j + k], g->q + 8 * k);
            break;
        case TYPE_IQ3_XXS: {
            const uint32_t signs = u32_at(sb + 66 + 4 * j);
            g->s0 = g->s1 = d * (0.5f + (float)(signs >> 28)) * 0.5f;
            for (int k = 0; k < 8; k++)
                signed_entry(IQ3XXS_GRID[qs[8 * j + k]], 4, KSIGNS[(signs >> (7 * (k / 2))) & 127] >> (4 * (k % 2)), g->q + 4 * k);
            break;
        }
        case TYPE_IQ3_S:
            g->s0 = g->s1 = d * (float)(1 + 2 * ((sb[106 + j / 2] >> (4 * (j % 2))) & 0x0F));
            for (int k = 0; k < 8; k++)
                signed_entry(IQ3S_GRID[qs[8 * j + k] | ((sb[66 + j] >> k) & 1) << 8], 4, sb[74 + 4 * j + k / 2] >> (4 * (k % 2)),
                             g->q + 4 * k);
            break;
        default: {                                                  /* IQ1_S */
            const uint16_t w = u16_at(sb + 34 + 2 * j);
            g->s0 = g->s1 = d * (float)(2 * ((w >> 12) & 7) + 1);
            for (int k = 0; k < 4; k++) iq1_entry(qs[4 * j + k] | ((w >> (3 * k)) & 7) << 8, w & 0x8000 ? -0.125f : 0.125f, g->q + 8 * k);
        }
    }
}

/* MXFP4's shared exponent as 2^(e - 128) (the values are stored doubled); e < 2 a subnormal. */
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* NVFP4's unsigned e4m3 scale, halved (the values are stored doubled): UE4M3_HALF (iq_grids.h)
 * holds gguf.quants' value for each of the 256 bytes (0x7F, NaN's pattern, reads as 0 there). */
static float ue4m3_half(uint8_t b) {
    return UE4M3_HALF[b];
}

/* Group h (0, 1) of an NVFP4 block: sub-blocks 2h and 2h + 1, each 8 bytes of nibbles. */
static void decode_nvfp4_group(const uint8_t *b, int h, group_t *g) {
    g->s0 = ue4m3_half(b[2 * h]), g->s1 = ue4m3_half(b[2 * h + 1]);
    for (int half = 0; half < 2; half++) {
        const uint8_t *qs = b + 4 + 16 * h + 8 * half;
        for (int l = 0; l < 8; l++) {
            g->q[16 * half + l] = MXFP4_VALUES[qs[l] & 0x0F];
            g->q[16 * half + 8 + l] = MXFP4_VALUES[qs[l] >> 4];
        }
    }
}

/* Group `index` of a row, for every type: the portable path and the reference of the fast one. */
static void decode_group(int type, const uint8_t *row, int64_t index, group_t *g) {
    if (super_blocks(type)) {
        const uint8_t *sb = row + (index / 8) * (group_bytes_x8(type));
        if (grid_types(type)) decode_iq_group(type, sb, (int)(index % 8), g);
        else decode_k_group(type, sb, (int)(index % 8), g);
        return;
    }
    g->o0 = g->o1 = 0.0f;
    if (type == TYPE_NVFP4) {
        decode_nvfp4_group(row + (index / 2) * 36, (int)(index % 2), g);
        return;
    }
    const uint8_t *b = row + index * (group_bytes_x8(type) / 8);
    if (type == TYPE_MXFP4) {
        g->s0 = g->s1 = e8m0_half(b[0]);
        for (int l = 0; l < 16; l++) g->q[l] = MXFP4_VALUES[b[1 + l] & 0x0F], g->q[l + 16] = MXFP4_VALUES[b[1 + l] >> 4];
        return;
    }
    g->s0 = g->s1 = type == TYPE_F16 || type == TYPE_BF16 || type == TYPE_F32 ? 1.0f : f16(b);
    switch (type) {
        case TYPE_Q8_0: for (int l = 0; l < QK; l++) g->q[l] = (float)(int8_t)b[2 + l]; break;
        case TYPE_Q4_0: nibbles(b + 2, g->q, -8); break;
        case TYPE_Q4_1: nibbles(b + 4, g->q, 0); g->o0 = g->o1 = f16(b + 2); break;
        case TYPE_Q5_0: nibbles_high_bit(b + 2, b + 6, g->q, -16); break;
        case TYPE_Q5_1: nibbles_high_bit(b + 4, b + 8, g->q, 0); g->o0 = g->o1 = f16(b + 2); break;
        case TYPE_IQ4_NL:
            for (int l = 0; l < 16; l++) {
                g->q[l] = IQ4NL_VALUES[b[2 + l] & 0x0F];
                g->q[l + 16] = IQ4NL_VALUES[b[2 + l] >> 4];
            }
            break;
        case TYPE_F16: for (int l = 0; l < QK; l++) g->q[l] = f16(b + 2 * l); break;
        case TYPE_F32: memcpy(g->q, b, sizeof g->q); break;
        default:                                                     /* BF16: the high half of an f32 */
            for (int l = 0; l < QK; l++) {
                uint32_t bits = (uint32_t)(b[2 * l] | b[2 * l + 1] << 8) << 16;
                memcpy(&g->q[l], &bits, 4);
            }
    }
}

/* The types with a minimum per group (values s * q + o): their dot products add o times the
 * group's sum of x (xsum in kvslim_block_linear). */
static inline int has_offset(int type) {
    return type == TYPE_Q4_1 || type == TYPE_Q5_1 || type == TYPE_Q4_K || type == TYPE_Q5_K;
}

__attribute__((unused)) static float dot_portable(int type, const uint8_t *row, const float *x, int64_t k) {
    float total = 0.0f;
    group_t g;
    for (int64_t index = 0; index < k / QK; index++) {
        decode_group(type, row, index, &g);
        const float *xg = x + index * QK;
        float lo = 0.0f, hi = 0.0f, sum_lo = 0.0f, sum_hi = 0.0f;
        for (int l = 0; l < 16; l++) lo += g.q[l] * xg[l], hi += g.q[l + 16] * xg[l + 16];
        for (int l = 0; l < 16; l++) sum_lo += xg[l], sum_hi += xg[l + 16];
        total += g.s0 * lo + g.s1 * hi + g.o0 * sum_lo + g.o1 * sum_hi;
    }
    return total;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVSLIM_AVX2 1

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The hot types written out (one activation row or several): through a generic group decoder
 * gcc kept each group's four vectors on the stack and compared the f16 scales in
 * software, ~17 cycles a group for q8_0 and q4_0 alike. Here the scale is one F16C conversion
 * and consecutive groups go to two accumulators. */
static inline __m256 scale_of(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return _mm256_set1_ps(_cvtsh_ss(h));
}

/* Group g's 32 values as four vectors, unscaled, and its scale (1 for float rows). */
static inline __attribute__((always_inline)) void group_values(int type, const uint8_t *row, int64_t g, __m256 v[4],
                                                               __m256 *d) {
    if (type == TYPE_Q8_0) {
        const uint8_t *b = row + g * 34;
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
        *d = scale_of(b);
    } else if (type == TYPE_Q4_0) {
        const uint8_t *b = row + g * 18;
        const __m256i m4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
        for (int j = 0; j < 2; j++) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j)));
            v[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, m4), eight));
            v[j + 2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight));
        }
        *d = scale_of(b);
    } else {
        for (int j = 0; j < 4; j++) {
            if (type == TYPE_F32) {
                v[j] = _mm256_loadu_ps((const float *)(row + g * 128) + 8 * j);
            } else {
                __m128i h = _mm_loadu_si128((const __m128i *)(row + g * 64 + 16 * j));
                v[j] = type == TYPE_F16 ? _mm256_cvtph_ps(h)
                                        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
        }
        *d = _mm256_set1_ps(1.0f);
    }
}

/* One row's share of a group added to acc: scale times (values . x), the scale 1 for float
 * rows (a group's sum is its own chain, so groups overlap). The one-row and the several-rows
 * loops both go through here, with even groups in one accumulator and odd ones in another, so
 * a sequence's output is the same bits whatever else is in its decode step. */
static inline __attribute__((always_inline)) __m256 group_into(const __m256 v[4], __m256 d, const float *xg,
                                                               __m256 acc) {
    __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xg));
    for (int j = 1; j < 4; j++) s = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xg + 8 * j), s);
    return _mm256_fmadd_ps(d, s, acc);
}

/* Several activation rows (a decode step of several sequences): each group decoded once, into a
 * GROUP that VALUES(type, row, g, grp) fills and INTO(grp, x's group, acc) adds to an
 * accumulator. Even groups go to one accumulator and odd ones to another: named (indexed by g & 1
 * they lived on the stack, a store and a load on each group's chain), so that groups overlap,
 * and for one activation row and several alike, so that a sequence's output is the same bits
 * whatever else is in its decode step. One loop for every width and every kind of group. */
#define DEFINE_GROUP_LOOP(NAME, VEC, GROUP, ZERO, VALUES, INTO, ADD, HSUM)                                     \
    static inline __attribute__((always_inline)) void NAME(                                                    \
        int type, const uint8_t *row, const float *x, int64_t m, int64_t k, float *y, int64_t n) {            \
        VEC even[MAX_M], odd[MAX_M];                                                                           \
        GROUP grp;                                                                                             \
        for (int64_t i = 0; i < m; i++) even[i] = odd[i] = ZERO();                                             \
        const int64_t n_groups = k / QK;                                                                       \
        int64_t g = 0;                                                                                         \
        for (; g + 1 < n_groups; g += 2) {                                                                     \
            VALUES(type, row, g, grp);                                                                         \
            for (int64_t i = 0; i < m; i++) even[i] = INTO(grp, x + i * k + g * QK, even[i]);                  \
            VALUES(type, row, g + 1, grp);                                                                     \
            for (int64_t i = 0; i < m; i++) odd[i] = INTO(grp, x + i * k + (g + 1) * QK, odd[i]);              \
        }                                                                                                      \
        if (g < n_groups) {                                                                                    \
            VALUES(type, row, g, grp);                                                                         \
            for (int64_t i = 0; i < m; i++) even[i] = INTO(grp, x + i * k + g * QK, even[i]);                  \
        }                                                                                                      \
        for (int64_t i = 0; i < m; i++) y[i * n] = HSUM(ADD(even[i], odd[i]));                                 \
    }

/* Group g of both rows (a of row, b of row + row_bytes) into acc and acc2, x's group loaded once. */
#define PAIR_GROUP(VALUES, INTO, g, acc, acc2)                                                                 \
    VALUES(type, row, g, a);                                                                                   \
    VALUES(type, row + row_bytes, g, b);                                                                       \
    for (int64_t i = 0; i < m; i++) {                                                                          \
        acc[i] = INTO(a, x + i * k + (g) * QK, acc[i]);                                                        \
        acc2[i] = INTO(b, x + i * k + (g) * QK, acc2[i]);                                                      \
    }
/* DEFINE_GROUP_LOOP for two rows of W at once (row, row + row_bytes -> y[i * n], y[i * n + 1]):
 * each activation group is loaded once for both. Every accumulator takes the same sums in the
 * same order as in the one-row loop, so the bits are the same. */
#define DEFINE_GROUP_LOOP_PAIR(NAME, VEC, GROUP, ZERO, VALUES, INTO, ADD, HSUM)                                \
    static inline __attribute__((always_inline)) void NAME(                                                    \
        int type, const uint8_t *row, int64_t row_bytes, const float *x, int64_t m, int64_t k, float *y,      \
        int64_t n) {                                                                                           \
        VEC even[MAX_M], odd[MAX_M], even2[MAX_M], odd2[MAX_M];                                                \
        GROUP a, b;                                                                                            \
        for (int64_t i = 0; i < m; i++) even[i] = odd[i] = even2[i] = odd2[i] = ZERO();                        \
        const int64_t n_groups = k / QK;                                                                       \
        int64_t g = 0;                                                                                         \
        for (; g + 1 < n_groups; g += 2) {  /* unrolled by two: selecting the accumulators per group cost 25% */ \
            PAIR_GROUP(VALUES, INTO, g, even, even2)                                                           \
            PAIR_GROUP(VALUES, INTO, g + 1, odd, odd2)                                                         \
        }                                                                                                      \
        if (g < n_groups) {                                                                                    \
            PAIR_GROUP(VALUES, INTO, g, even, even2)                                                           \
        }                                                                                                      \
        for (int64_t i = 0; i < m; i++)                                                                        \
            y[i * n] = HSUM(ADD(even[i], odd[i])), y[i * n + 1] = HSUM(ADD(even2[i], odd2[i]));                \
    }

/* FN(T, ...) with T the hot type `type` names, as a constant. */
#define FAST_TYPE_SWITCH(type, FN, ...)                                                                        \
    switch (type) {                                                                                            \
        case TYPE_Q8_0: FN(TYPE_Q8_0, __VA_ARGS__); break;                                                     \
        case TYPE_Q4_0: FN(TYPE_Q4_0, __VA_ARGS__); break;                                                     \
        case TYPE_F16: FN(TYPE_F16, __VA_ARGS__); break;                                                       \
        case TYPE_BF16: FN(TYPE_BF16, __VA_ARGS__); break;                                                     \
        default: FN(TYPE_F32, __VA_ARGS__);                                                                    \
    }

/* The hot types' groups: NV vectors of values and their scale (VALUES and INTO: the width's
 * group_values / group_into over such a group). */
#define DEFINE_ROWS_TIMES(SUFFIX, VEC, NV, ZERO, VALUES, INTO, ADD, HSUM)                                      \
    typedef struct { VEC v[NV]; VEC d; } values##SUFFIX##_t;                                                   \
    DEFINE_GROUP_LOOP(rows_times_typed##SUFFIX, VEC, values##SUFFIX##_t, ZERO, VALUES, INTO, ADD, HSUM)       \
    DEFINE_GROUP_LOOP_PAIR(pair_times_typed##SUFFIX, VEC, values##SUFFIX##_t, ZERO, VALUES, INTO, ADD, HSUM)  \
    /* One type per call, so that the type checks leave the loop once inlined. */                             \
    static inline __attribute__((always_inline)) void pair_times_fast##SUFFIX(                                 \
        int type, const uint8_t *row, int64_t row_bytes, const float *x, int64_t m, int64_t k, float *y,      \
        int64_t n) {                                                                                           \
        FAST_TYPE_SWITCH(type, pair_times_typed##SUFFIX, row, row_bytes, x, m, k, y, n)                        \
    }                                                                                                          \
    static inline __attribute__((always_inline)) void rows_times_fast##SUFFIX(                                 \
        int type, const uint8_t *row, const float *x, int64_t m, int64_t k, float *y, int64_t n) {            \
        FAST_TYPE_SWITCH(type, rows_times_typed##SUFFIX, row, x, m, k, y, n)                                   \
    }

#define VALUES8(type, row, g, grp) group_values(type, row, g, (grp).v, &(grp).d)
#define INTO8(grp, xg, acc) group_into((grp).v, (grp).d, xg, acc)
DEFINE_ROWS_TIMES(8, __m256, 4, _mm256_setzero_ps, VALUES8, INTO8, _mm256_add_ps, hsum)

static inline int fast_types(int type) {     /* the types written out above */
    return type == TYPE_Q8_0 || type == TYPE_Q4_0 || type == TYPE_F16 || type == TYPE_BF16 || type == TYPE_F32;
}

/* The super-block types (the K-quants and IQ4_XS: what most GGUFs in use are made of; Q4_K_M is
 * Q4_K and Q6_K) written out too. Through decode_group's scalar unpacking a Q4_K row cost 5-7x a
 * Q4_0 row of the same shape. A super-block's scales are unpacked once (k_scales), its groups'
 * values made a few groups at a time (k_groups), every value s * q + o in one FMA: the minimum
 * joins the values, instead of a scalar sum per group whose chain of adds cost more than its
 * vectors. decode_k_group is the reference these loops are held to. */

/* The 8 bytes of b (little-endian) as floats times d (one vector), stored at out. The bytes come
 * in a register: written as bytes or words on the stack and loaded as one vector, they stalled
 * the load (a store-to-load forward that fails: IQ4_XS's and Q3_K's GEMV 9-12% slower). */
static inline __attribute__((always_inline)) void bytes_times(uint64_t b, float d, float *out) {
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)b))),
                                        _mm256_set1_ps(d)));
}

/* The 8 bytes of b less 32 as floats times d. */
static inline __attribute__((always_inline)) void bytes_less_32_times(uint64_t b, float d, float *out) {
    const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)b)), _mm256_set1_epi32(32));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d)));
}

static inline uint64_t two_words(uint32_t lo, uint32_t hi) { return (uint64_t)hi << 32 | lo; }

/* A super-block's scales and offsets per group: s0/o0 for its values 0-15, s1/o1 for 16-31.
 * The six-bit fields are unpacked a 32-bit word (4 fields) at a time, and turned into floats 8 at
 * a time: one group's scalar unpacking cost more than its vector work. */
static inline __attribute__((always_inline)) void k_scales(int type, const uint8_t *sb, float s0[8], float s1[8],
                                                           float o0[8], float o1[8]) {
    float per16[16], mins16[16];
    uint32_t w[4];
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        /* 12 bytes S: scale j < 4 is S[j] & 63, min S[j + 4] & 63; for j >= 4 the low (scale) or
         * high (min) nibble of S[j + 4], with the top two bits of S[j - 4] (scale) or S[j] (min) */
        uint32_t in[3];
        memcpy(in, sb + 4, 12);
        w[0] = in[0] & 0x3F3F3F3Fu;                                                  /* scales 0-3 */
        w[1] = (in[2] & 0x0F0F0F0Fu) | ((in[0] >> 6) & 0x03030303u) << 4;            /* scales 4-7 */
        w[2] = in[1] & 0x3F3F3F3Fu;                                                  /* mins 0-3 */
        w[3] = ((in[2] >> 4) & 0x0F0F0F0Fu) | ((in[1] >> 6) & 0x03030303u) << 4;     /* mins 4-7 */
        bytes_times(two_words(w[0], w[1]), f16(sb), s0);
        bytes_times(two_words(w[2], w[3]), -f16(sb + 2), o0);
        memcpy(s1, s0, 8 * sizeof(float));
        memcpy(o1, o0, 8 * sizeof(float));
        return;
    }
    if (type == TYPE_IQ4_XS) {         /* scale_iq4_xs's fields from two words (calling it per group: 1.2x slower) */
        uint32_t lo;
        memcpy(&lo, sb + 4, 4);
        const uint32_t hi = (uint32_t)(sb[2] | sb[3] << 8);
        uint64_t b = 0;
        for (int j = 0; j < 8; j++) b |= (uint64_t)(((lo >> (4 * j)) & 0x0F) | ((hi >> (2 * j)) & 3) << 4) << (8 * j);
        bytes_less_32_times(b, f16(sb), s0);
        memcpy(s1, s0, 8 * sizeof(float));
        memset(o0, 0, 8 * sizeof(float)), memset(o1, 0, 8 * sizeof(float));
        return;
    }
    if (type == TYPE_Q6_K) {                                    /* int8 scales, one per 16 values */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
        const __m256 d = _mm256_set1_ps(f16(sb + 208));
        _mm256_storeu_ps(per16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
        _mm256_storeu_ps(per16 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d));
        memset(mins16, 0, sizeof mins16);
    } else if (type == TYPE_Q3_K) {
        /* scale i: 4 low bits from byte i % 8 (nibble i / 8), 2 high bits from byte 8 + i % 4
         * (pair i / 4), less 32: word k holds scales 4k..4k+3 */
        uint32_t in[3];
        memcpy(in, sb + 96, 12);
        for (int k = 0; k < 4; k++)
            w[k] = ((in[k % 2] >> (4 * (k / 2))) & 0x0F0F0F0Fu) | ((in[2] >> (2 * k)) & 0x03030303u) << 4;
        const float d = f16(sb + 108);
        bytes_less_32_times(two_words(w[0], w[1]), d, per16);
        bytes_less_32_times(two_words(w[2], w[3]), d, per16 + 8);
        memset(mins16, 0, sizeof mins16);
    } else {                                                    /* Q2_K: scale | min << 4 per 16 values */
        const __m128i b = _mm_loadu_si128((const __m128i *)sb);
        const __m256 d = _mm256_set1_ps(f16(sb + 80)), dmin = _mm256_set1_ps(-f16(sb + 82));
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(b, 8) : b);
            _mm256_storeu_ps(per16 + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d));
            _mm256_storeu_ps(mins16 + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), dmin));
        }
    }
    for (int j = 0; j < 8; j++) s0[j] = per16[2 * j], s1[j] = per16[2 * j + 1], o0[j] = mins16[2 * j], o1[j] = mins16[2 * j + 1];
}

/* Values of N consecutive groups (from group j0) of a K-type super-block. V: the width's vector
 * of floats, VI of int32, W lanes; WIDEN(p) widens W bytes at p to int32 lanes; BYTES_AT(q, c)
 * widens vector c's bytes of a group made as 32 bytes; LUT(idx) looks int32 indices up in
 * IQ4_NL's grid as floats; OPS: and/or/shifts/sub/set1/cvt/mul/fma of the width. Writes
 * v[N x 32 / W] = s * q + o, group by group (the first half of a group's vectors take s0 and
 * o0, the second s1 and o1); for Q4_K and Q5_K the codes q alone (the loop applies the scale
 * per group, and the minimum through the group's sum of x: has_offset). How each type makes its codes was measured: Q6_K and Q5_K as bytes
 * first (32 values per operation), Q2_K and Q3_K widened once per half super-block (their 32
 * bytes serve 4 groups), Q4_K and IQ4_XS widened per group (byte-first measured no faster). */
#define DEFINE_K_GROUPS(SUFFIX, V, VI, W, WIDEN, BYTES_AT, LUT, AND, OR, SRLI, SLLI, SUB, SET1I, CVT, MUL, FMA, SET1) \
    static inline __attribute__((always_inline)) void k_groups##SUFFIX(int type, const uint8_t *sb, int j0,     \
                                                                       int N, const float *s0, const float *s1,\
                                                                       const float *o0, const float *o1, V *v) {\
        enum { PER = 32 / W };                                      /* vectors a group */                     \
        const VI m4 = SET1I(0x0F);                                                                             \
        if (type == TYPE_Q6_K) {  /* half j0 / 4 at once (N = 4): codes made as bytes, 32 at a time */     \
            const int half = j0 / 4;                                                                           \
            const __m256i lo[2] = {_mm256_loadu_si256((const __m256i *)(sb + 64 * half)),                      \
                                   _mm256_loadu_si256((const __m256i *)(sb + 64 * half + 32))};                \
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * half));                    \
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {   /* ql: nibble g / 2 of byte 32 (g % 2) + l */ \
                const __m256i q = q6_k_bytes(lo[g % 2], hi, g);                                                \
                for (int c = 0; c < PER; c++)                                                                  \
                    v[PER * g + c] = MUL(CVT(BYTES_AT(q, c)), SET1(c >= PER / 2 ? s1[j0 + g] : s0[j0 + g]));   \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        if (type == TYPE_Q2_K || type == TYPE_Q3_K) {  /* half j0 / 4 at once (N = 4): 32 B of 2-bit codes */ \
            const int half = j0 / 4;                                                                           \
            VI a[PER], hm[PER];                                                                                \
            for (int c = 0; c < PER; c++) a[c] = WIDEN(sb + (type == TYPE_Q2_K ? 16 : 32) + 32 * half + W * c); \
            if (type == TYPE_Q3_K)                                                                             \
                for (int c = 0; c < PER; c++) hm[c] = WIDEN(sb + W * c);                      /* hmask */      \
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                                              \
                const int j = j0 + g;                                                                          \
                for (int c = 0; c < PER; c++) {                                                                \
                    VI q = AND(SRLI(a[c], 2 * g), SET1I(3));                                                   \
                    if (type == TYPE_Q3_K)          /* (q | bit j of hmask << 2) - 4: minus 4 without it */    \
                        q = SUB(OR(q, SLLI(AND(SRLI(hm[c], j), SET1I(1)), 2)), SET1I(4));                      \
                    const int second = c >= PER / 2;                                                           \
                    v[PER * g + c] = FMA(CVT(q), SET1(second ? s1[j] : s0[j]), SET1(second ? o1[j] : o0[j])); \
                }                                                                                              \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        if (type == TYPE_Q5_K) {                    /* codes as bytes: a nibble, bit j of qh on top */        \
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));                                 \
            _Pragma("GCC unroll 4") for (int t = 0; t < N; t++) {                                              \
                const int j = j0 + t;                                                                          \
                const __m256i qs = _mm256_loadu_si256((const __m256i *)(sb + 48 + 32 * (j / 2)));              \
                const __m256i q = _mm256_or_si256(                                                             \
                    _mm256_and_si256(_mm256_srli_epi16(qs, 4 * (j % 2)), _mm256_set1_epi8(0x0F)),              \
                    _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, j), 4), _mm256_set1_epi8(0x10))); \
                for (int c = 0; c < PER; c++) v[PER * t + c] = CVT(BYTES_AT(q, c));                             \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        _Pragma("GCC unroll 4") for (int t = 0; t < N; t++) {                                                  \
            const int j = j0 + t;                                                                              \
            for (int c = 0; c < PER; c++) {                                                                    \
                if (type == TYPE_IQ4_XS) {             /* a group's 16 B: low nibbles, then high */          \
                    const VI b = WIDEN(sb + 8 + 16 * j + (W * c) % 16);                                        \
                    v[PER * t + c] = MUL(LUT(c >= PER / 2 ? SRLI(b, 4) : AND(b, m4)), SET1(s0[j]));            \
                } else {                                /* Q4_K: nibble j % 2 of 32 B per pair */              \
                    const VI a = WIDEN(sb + 16 + 32 * (j / 2) + W * c);                                        \
                    v[PER * t + c] = CVT(AND(SRLI(a, 4 * (j % 2)), m4));                                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

/* Q4_K and Q5_K: values s * q + o per group, summed as s * (q . x) + o * (sum of x): the
 * minimum costs one 8-wide FMA a super-block (its 8 groups' minima times their sums of x, from
 * xsum) instead of an FMA on every vector of values. 2048 x 2048 GEMV, one row: Q4_K 96 -> 83 us,
 * Q5_K 104 -> 87 (AVX-512; AVX2 132 -> 111, 153 -> 131). Among the K types these are has_offset's. */

/* y[i * n] = row . x[i] for K-type rows; groups alternate between two accumulators, for one
 * activation row and for several alike (a sequence's output does not depend on its batch).
 * xsum (m, k / 32): each group's sum of x (has_offset types). */
#define DEFINE_ROWS_TIMES_K(SUFFIX, V, W, N, ZERO, LOAD, MUL, FMA, SET1, ADD, HSUM)                            \
    static inline __attribute__((always_inline)) void rows_times_k_typed##SUFFIX(                              \
        int type, const uint8_t *row, const float *x, const float *xsum, int64_t m, int64_t k, float *y,      \
        int64_t n) {                                                                                           \
        enum { PER = 32 / W };                                                                                 \
        /* N groups a pass, so that their values stay in registers; Q6_K, Q3_K and Q2_K take a half (4  \
         * groups) at once in any width, as their bytes serve several groups (measured faster) */            \
        const int per_pass = type == TYPE_Q6_K || type == TYPE_Q3_K || type == TYPE_Q2_K ? 4 : N;              \
        V acc[2][MAX_M], v[4 * PER];                                                                           \
        __m256 minima[MAX_M];                                                                                  \
        for (int64_t i = 0; i < m; i++) acc[0][i] = acc[1][i] = ZERO(), minima[i] = _mm256_setzero_ps();       \
        const int64_t sb_bytes = group_bytes_x8(type);                                                         \
        for (int64_t b = 0; b < k / 256; b++) {                                                                \
            const uint8_t *sb = row + b * sb_bytes;                                                            \
            float s0[8], s1[8], o0[8], o1[8];                                                                  \
            k_scales(type, sb, s0, s1, o0, o1);                                                                \
            for (int j0 = 0; j0 < 8; j0 += per_pass) {                                                         \
                k_groups##SUFFIX(type, sb, j0, per_pass, s0, s1, o0, o1, v);                                   \
                for (int64_t i = 0; i < m; i++) {                                                              \
                    const float *xs = x + i * k + b * 256 + 32 * j0;                                           \
                    for (int t = 0; t < per_pass; t++) {                                                       \
                        V a = acc[(j0 + t) & 1][i];                                                            \
                        if (has_offset(type)) {                                                                 \
                            V p = MUL(v[PER * t], LOAD(xs + 32 * t));                                          \
                            for (int c = 1; c < PER; c++) p = FMA(v[PER * t + c], LOAD(xs + 32 * t + W * c), p); \
                            a = FMA(SET1(s0[j0 + t]), p, a);                                                   \
                        } else {                                                                               \
                            for (int c = 0; c < PER; c++) a = FMA(v[PER * t + c], LOAD(xs + 32 * t + W * c), a); \
                        }                                                                                      \
                        acc[(j0 + t) & 1][i] = a;                                                              \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            if (has_offset(type))                                                                               \
                for (int64_t i = 0; i < m; i++)                                                                \
                    minima[i] = _mm256_fmadd_ps(_mm256_loadu_ps(o0), _mm256_loadu_ps(xsum + i * (k / QK) + 8 * b), \
                                                minima[i]);                                                    \
        }                                                                                                      \
        for (int64_t i = 0; i < m; i++)                                                                        \
            y[i * n] = HSUM(ADD(acc[0][i], acc[1][i])) + (has_offset(type) ? hsum(minima[i]) : 0.0f);           \
    }                                                                                                          \
    static inline __attribute__((always_inline)) void rows_times_k##SUFFIX(                                     \
        int type, const uint8_t *row, const float *x, const float *xsum, int64_t m, int64_t k, float *y,      \
        int64_t n) {                                                                                           \
        switch (type) {                                                                                        \
            case TYPE_Q4_K: rows_times_k_typed##SUFFIX(TYPE_Q4_K, row, x, xsum, m, k, y, n); break;             \
            case TYPE_Q5_K: rows_times_k_typed##SUFFIX(TYPE_Q5_K, row, x, xsum, m, k, y, n); break;             \
            case TYPE_Q3_K: rows_times_k_typed##SUFFIX(TYPE_Q3_K, row, x, xsum, m, k, y, n); break;             \
            case TYPE_Q2_K: rows_times_k_typed##SUFFIX(TYPE_Q2_K, row, x, xsum, m, k, y, n); break;             \
            case TYPE_IQ4_XS: rows_times_k_typed##SUFFIX(TYPE_IQ4_XS, row, x, xsum, m, k, y, n); break;         \
            default: rows_times_k_typed##SUFFIX(TYPE_Q6_K, row, x, xsum, m, k, y, n);                           \
        }                                                                                                      \
    }

/* Q6_K's 32 codes of group g of a half, as signed bytes: the low nibble (g / 2) of lo, bits
 * 2g of hi on top, less 32. Byte-wide operations do a group's 32 values at once; widening
 * each value first cost 3x the operations. */
static inline __m256i q6_k_bytes(__m256i lo, __m256i hi, int g) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (g / 2)), m4);
    const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hi, 2 * g), 4), m2);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

/* Signed bytes 8c..8c+7 of q as 8 int32 lanes. */
static inline __m256i bytes_at8(__m256i q, int c) {
    const __m128i lane = c < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    return _mm256_cvtepi8_epi32(c % 2 ? _mm_srli_si128(lane, 8) : lane);
}

static inline __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i srli8(__m256i a, int n) { return _mm256_srli_epi32(a, n); }
static inline __m256i slli8(__m256i a, int n) { return _mm256_slli_epi32(a, n); }
static inline __m256 iq4nl_lut8(__m256i idx) {     /* two 8-entry permutes, chosen by bit 3 */
    const __m256 lo = _mm256_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10);
    const __m256 hi = _mm256_setr_ps(1, 13, 25, 38, 53, 69, 89, 113);
    const __m256 pick = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));       /* bit 3 to the sign */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), pick);
}

DEFINE_K_GROUPS(8, __m256, __m256i, 8, widen8, bytes_at8, iq4nl_lut8, _mm256_and_si256, _mm256_or_si256, srli8, slli8, _mm256_sub_epi32,
              _mm256_set1_epi32, _mm256_cvtepi32_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_set1_ps)
DEFINE_ROWS_TIMES_K(8, __m256, 8, 2, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_set1_ps,
                    _mm256_add_ps, hsum)

static inline int k_types(int type) {
    return super_blocks(type) && !grid_types(type);
}

/* The 32-value blocks with a 16-bit scale and nibbles: Q4_1, Q5_0, Q5_1, IQ4_NL. Through
 * decode_group's scalar codes their GEMVs cost 10-15x a Q4_0 row's; they are code types (below). */
static inline int block32_types(int type) {
    return type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 || type == TYPE_IQ4_NL;
}

/* The grid i-quants and MXFP4 written out: a group's 32 codes are made as signed bytes in one
 * vector (lattice entries are whole words of bytes; 32 sign bits become a byte mask), then
 * widened as the other types' values are. Through decode_group's scalar codes their GEMVs cost
 * 10-14x a Q4_0 row's. decode_iq_group (and decode_group for MXFP4) is the reference. */
static inline int code_types(int type) {
    return grid_types(type) || block32_types(type) || type == TYPE_MXFP4 || type == TYPE_NVFP4;
}

/* 0xFF in byte l where bit l of m is set. */
static inline __m256i bits_to_bytes(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);   /* byte l: byte l / 8 of m */
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

static inline uint64_t entry8(const int8_t *values) {
    uint64_t v;
    memcpy(&v, values, 8);
    return v;
}

static inline uint32_t entry4(const int8_t *values) {
    uint32_t v;
    memcpy(&v, values, 4);
    return v;
}

/* q negated where bit l of signs is set. */
static inline __m256i with_signs(__m256i q, uint32_t signs) {
#if defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(KVSLIM_NO_MASK_SIGNS)
    return _mm256_mask_sub_epi8(q, (__mmask32)signs, _mm256_setzero_si256(), q);    /* the bits are a mask */
#else
    return _mm256_sign_epi8(q, _mm256_or_si256(bits_to_bytes(signs), _mm256_set1_epi8(1)));
#endif
}

static inline uint32_t ksigns4(uint32_t w) {       /* 4 x 7 sign bits through KSIGNS: 32 sign bits */
    return (uint32_t)KSIGNS[w & 127] | (uint32_t)KSIGNS[(w >> 7) & 127] << 8 | (uint32_t)KSIGNS[(w >> 14) & 127] << 16
         | (uint32_t)KSIGNS[(w >> 21) & 127] << 24;
}

/* IQ1's codes times 8, so they stay integers: 8 * lattice value +- 1 (bit k of `minus`: entry k's
 * delta is negative), with the scale divided by 8 (exact). */
static inline __m256i iq1_codes(__m256i grid, uint32_t minus) {
    const __m256i g8 = _mm256_slli_epi16(grid, 3);                       /* bytes -1, 0, 1 -> -8, 0, 8 */
    const __m256i fix = _mm256_and_si256(g8, _mm256_set1_epi8((char)0xF8));  /* the carry of -8 into the next byte */
    const uint32_t bytes = ((minus * 0x00204081u) & 0x01010101u) * 0xFF;     /* bit k -> byte k all ones */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bytes), spread);   /* entry k's 8 bytes */
    return _mm256_add_epi8(fix, _mm256_or_si256(m, _mm256_set1_epi8(1)));      /* -1 or +1 per entry */
}

/* 16 added to byte l of q where bit l of bits is set (Q5's fifth bit). */
static inline __m256i with_bit4(__m256i q, uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(q, (__mmask32)bits, q, _mm256_set1_epi8(16));
#else
    return _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(16)));
#endif
}

/* A block32 type's block b as 32 signed byte codes (values 0-15 from the low nibbles, 16-31 from
 * the high ones, as nibbles() reads them) and its scale; Q4_1 and Q5_1's minimum is added after
 * the dot product, times the group's sum of x (add_offsets). */
static inline __attribute__((always_inline)) __m256i block32_codes(int type, const uint8_t *b, float *s0, float *s1) {
    *s0 = *s1 = f16(b);
    const int qs_at = type == TYPE_Q4_1 ? 4 : type == TYPE_Q5_0 ? 6 : type == TYPE_Q5_1 ? 8 : 2;
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + qs_at)), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
    if (type == TYPE_IQ4_NL) {                                           /* the grid is 16 signed bytes */
        const __m128i grid = _mm_loadu_si128((const __m128i *)IQ4NL_VALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(grid, hi), _mm_shuffle_epi8(grid, lo));
    }
    __m256i q = _mm256_set_m128i(hi, lo);
    if (type == TYPE_Q5_0 || type == TYPE_Q5_1) q = with_bit4(q, u32_at(b + qs_at - 4));
    return type == TYPE_Q5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
}

/* Group `index` of a row as 32 signed byte codes, and its scales s0 (values 0-15), s1 (16-31). */
static inline __attribute__((always_inline)) __m256i group_codes(int type, const uint8_t *row, int64_t index,
                                                                 float *s0, float *s1) {
    if (block32_types(type)) return block32_codes(type, row + index * (group_bytes_x8(type) / 8), s0, s1);
    if (type == TYPE_MXFP4 || type == TYPE_NVFP4) {           /* e2m1 codes: a 16-entry byte lookup */
        const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES), m4 = _mm_set1_epi8(0x0F);
        if (type == TYPE_MXFP4) {
            const uint8_t *b = row + index * 17;
            const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 1));
            *s0 = *s1 = e8m0_half(b[0]);
            return _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), m4)),
                                    _mm_shuffle_epi8(table, _mm_and_si128(qs, m4)));
        }
        const uint8_t *b = row + (index / 2) * 36;           /* NVFP4: sub-blocks of 8 bytes, low then high */
        const int h = (int)(index % 2);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 4 + 16 * h));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, m4));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), m4));
        *s0 = ue4m3_half(b[2 * h]), *s1 = ue4m3_half(b[2 * h + 1]);
        return _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
    }
    const uint8_t *sb = row + (index / 8) * group_bytes_x8(type);
    const int j = (int)(index % 8);
    const uint8_t *qs = sb + 2;
    float d = type == TYPE_IQ1_M ? 0.0f : f16(sb);
    switch (type) {
        case TYPE_IQ2_XXS: {
            const uint32_t w = u32_at(qs + 8 * j + 4);
            *s0 = *s1 = d * (0.5f + (float)(w >> 28)) * 0.25f;
            const uint8_t *i = qs + 8 * j;
            return with_signs(_mm256_setr_epi64x((long long)entry8(IQ2XXS_GRID[i[0]]), (long long)entry8(IQ2XXS_GRID[i[1]]),
                                                 (long long)entry8(IQ2XXS_GRID[i[2]]), (long long)entry8(IQ2XXS_GRID[i[3]])),
                              ksigns4(w));
        }
        case TYPE_IQ2_XS: {
            uint16_t w[4];
            memcpy(w, qs + 8 * j, 8);
            group_t g;
            iq2_scales(d, sb[66 + j], &g);
            *s0 = g.s0, *s1 = g.s1;
            const uint32_t signs = (uint32_t)KSIGNS[w[0] >> 9] | (uint32_t)KSIGNS[w[1] >> 9] << 8
                                 | (uint32_t)KSIGNS[w[2] >> 9] << 16 | (uint32_t)KSIGNS[w[3] >> 9] << 24;
            return with_signs(_mm256_setr_epi64x((long long)entry8(IQ2XS_GRID[w[0] & 511]), (long long)entry8(IQ2XS_GRID[w[1] & 511]),
                                                 (long long)entry8(IQ2XS_GRID[w[2] & 511]), (long long)entry8(IQ2XS_GRID[w[3] & 511])),
                              signs);
        }
        case TYPE_IQ2_S: {
            group_t g;
            iq2_scales(d, sb[74 + j], &g);
            *s0 = g.s0, *s1 = g.s1;
            const uint8_t *i = qs + 4 * j;
            const int h = sb[66 + j];
            return with_signs(_mm256_setr_epi64x((long long)entry8(IQ2S_GRID[i[0] | (h & 3) << 8]),
                                                 (long long)entry8(IQ2S_GRID[i[1] | (h >> 2 & 3) << 8]),
                                                 (long long)entry8(IQ2S_GRID[i[2] | (h >> 4 & 3) << 8]),
                                                 (long long)entry8(IQ2S_GRID[i[3] | (h >> 6) << 8])),
                              u32_at(sb + 34 + 4 * j));
        }
        case TYPE_IQ3_XXS: {
            const uint32_t w = u32_at(sb + 66 + 4 * j);
            *s0 = *s1 = d * (0.5f + (float)(w >> 28)) * 0.5f;
            const uint8_t *i = qs + 8 * j;
            return with_signs(_mm256_setr_epi32((int)entry4(IQ3XXS_GRID[i[0]]), (int)entry4(IQ3XXS_GRID[i[1]]),
                                                (int)entry4(IQ3XXS_GRID[i[2]]), (int)entry4(IQ3XXS_GRID[i[3]]),
                                                (int)entry4(IQ3XXS_GRID[i[4]]), (int)entry4(IQ3XXS_GRID[i[5]]),
                                                (int)entry4(IQ3XXS_GRID[i[6]]), (int)entry4(IQ3XXS_GRID[i[7]])),
                              ksigns4(w));
        }
        case TYPE_IQ3_S: {
            *s0 = *s1 = d * (float)(1 + 2 * ((sb[106 + j / 2] >> (4 * (j % 2))) & 0x0F));
            /* its 9-bit indices made 8 at a time and gathered: 1.5x the 8 scalar lookups (measured);
             * for IQ3_XXS's and IQ2_XXS's byte indices a gather was 15% slower than them */
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sb[66 + j]),
                                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                                  _mm256_set1_epi32(1));
            const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j))),
                                                _mm256_slli_epi32(high, 8));
            return with_signs(_mm256_i32gather_epi32((const int *)IQ3S_GRID, idx, 4), u32_at(sb + 74 + 4 * j));
        }
        case TYPE_IQ1_S: {
            const uint16_t w = u16_at(sb + 34 + 2 * j);
            *s0 = *s1 = d * (float)(2 * ((w >> 12) & 7) + 1) * 0.125f;
            const uint8_t *i = qs + 4 * j;
            const uint32_t minus = w >> 15 ? 0xF : 0;
            return iq1_codes(_mm256_setr_epi64x((long long)entry8(IQ1S_GRID[i[0] | (w & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[1] | (w >> 3 & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[2] | (w >> 6 & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[3] | (w >> 9 & 7) << 8])), minus);
        }
        default: {                                                         /* IQ1_M */
            iq1_m_scales(sb, j, s0, s1);
            *s0 *= 0.125f, *s1 *= 0.125f;
            const uint8_t *i = sb + 4 * j, *qh = sb + 32 + 2 * j;
            const int n[4] = {qh[0] & 0x0F, qh[0] >> 4, qh[1] & 0x0F, qh[1] >> 4};
            const uint32_t minus = (uint32_t)(n[0] >> 3 | (n[1] >> 3) << 1 | (n[2] >> 3) << 2 | (n[3] >> 3) << 3);
            return iq1_codes(_mm256_setr_epi64x((long long)entry8(IQ1S_GRID[i[0] | (n[0] & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[1] | (n[1] & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[2] | (n[2] & 7) << 8]),
                                                (long long)entry8(IQ1S_GRID[i[3] | (n[3] & 7) << 8])), minus);
        }
    }
}

/* The code types' groups: 32 signed byte codes and the scales of their halves. INTO(codes, s0, s1,
 * x's group, acc) is the width's. */
typedef struct { __m256i q; float s0, s1; } codes_t;
#define CODES_VALUES(type, row, g, grp) ((grp).q = group_codes(type, row, g, &(grp).s0, &(grp).s1))
#define DEFINE_ROWS_TIMES_CODES(SUFFIX, VEC, ZERO, INTO, ADD, HSUM)                                              \
    DEFINE_GROUP_LOOP(rows_times_codes_typed##SUFFIX, VEC, codes_t, ZERO, CODES_VALUES, INTO, ADD, HSUM)       \
    static inline __attribute__((always_inline)) void rows_times_codes##SUFFIX(                                 \
        int type, const uint8_t *row, const float *x, int64_t m, int64_t k, float *y, int64_t n) {            \
        switch (type) {                                                                                        \
            case TYPE_IQ2_XXS: rows_times_codes_typed##SUFFIX(TYPE_IQ2_XXS, row, x, m, k, y, n); break;        \
            case TYPE_IQ2_XS: rows_times_codes_typed##SUFFIX(TYPE_IQ2_XS, row, x, m, k, y, n); break;          \
            case TYPE_IQ2_S: rows_times_codes_typed##SUFFIX(TYPE_IQ2_S, row, x, m, k, y, n); break;            \
            case TYPE_IQ3_XXS: rows_times_codes_typed##SUFFIX(TYPE_IQ3_XXS, row, x, m, k, y, n); break;        \
            case TYPE_IQ3_S: rows_times_codes_typed##SUFFIX(TYPE_IQ3_S, row, x, m, k, y, n); break;            \
            case TYPE_IQ1_S: rows_times_codes_typed##SUFFIX(TYPE_IQ1_S, row, x, m, k, y, n); break;            \
            case TYPE_IQ1_M: rows_times_codes_typed##SUFFIX(TYPE_IQ1_M, row, x, m, k, y, n); break;            \
            case TYPE_MXFP4: rows_times_codes_typed##SUFFIX(TYPE_MXFP4, row, x, m, k, y, n); break;            \
            case TYPE_Q4_1: rows_times_codes_typed##SUFFIX(TYPE_Q4_1, row, x, m, k, y, n); break;              \
            case TYPE_Q5_0: rows_times_codes_typed##SUFFIX(TYPE_Q5_0, row, x, m, k, y, n); break;              \
            case TYPE_Q5_1: rows_times_codes_typed##SUFFIX(TYPE_Q5_1, row, x, m, k, y, n); break;              \
            case TYPE_IQ4_NL: rows_times_codes_typed##SUFFIX(TYPE_IQ4_NL, row, x, m, k, y, n); break;          \
            default: rows_times_codes_typed##SUFFIX(TYPE_NVFP4, row, x, m, k, y, n);                            \
        }                                                                                                      \
    }

static inline __attribute__((always_inline)) __m256 codes_into8(__m256i q, float s0, float s1, const float *xg,
                                                                __m256 acc) {
    __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(bytes_at8(q, 0)), _mm256_loadu_ps(xg));
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bytes_at8(q, 1)), _mm256_loadu_ps(xg + 8), lo);
    __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(bytes_at8(q, 2)), _mm256_loadu_ps(xg + 16));
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bytes_at8(q, 3)), _mm256_loadu_ps(xg + 24), hi);
    return _mm256_fmadd_ps(_mm256_set1_ps(s1), hi, _mm256_fmadd_ps(_mm256_set1_ps(s0), lo, acc));
}

#define CODES_INTO8(grp, xg, acc) codes_into8((grp).q, (grp).s0, (grp).s1, xg, acc)
DEFINE_ROWS_TIMES_CODES(8, __m256, _mm256_setzero_ps, CODES_INTO8, _mm256_add_ps, hsum)

#if defined(__AVX512F__)
/* The same loops 16 wide: a group is two vectors instead of four, so a group costs half the
 * unpacks, multiplies and adds. The sums' order is still the same for one activation row and
 * for several (even and odd groups in two accumulators), so a sequence's output does not depend
 * on its batch; it differs from the AVX2 build's in the last bits. */
static inline __attribute__((always_inline)) void group_values16(int type, const uint8_t *row, int64_t g,
                                                                 __m512 v[2], __m512 *d) {
    if (type == TYPE_Q8_0) {
        const uint8_t *b = row + g * 34;
        for (int j = 0; j < 2; j++)
            v[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * j))));
        *d = _mm512_set1_ps(f16(b));
    } else if (type == TYPE_Q4_0) {
        const uint8_t *b = row + g * 18;
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))), eight = _mm512_set1_epi32(8);
        v[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight));
        v[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight));
        *d = _mm512_set1_ps(f16(b));
    } else {
        for (int j = 0; j < 2; j++) {
            if (type == TYPE_F32) {
                v[j] = _mm512_loadu_ps((const float *)(row + g * 128) + 16 * j);
            } else {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(row + g * 64 + 32 * j));
                v[j] = type == TYPE_F16 ? _mm512_cvtph_ps(h)
                                        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
        }
        *d = _mm512_set1_ps(1.0f);
    }
}

static inline __attribute__((always_inline)) __m512 group_into16(const __m512 v[2], __m512 d, const float *xg,
                                                                 __m512 acc) {
    const __m512 s = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xg + 16), _mm512_mul_ps(v[0], _mm512_loadu_ps(xg)));
    return _mm512_fmadd_ps(d, s, acc);
}

#define VALUES16(type, row, g, grp) group_values16(type, row, g, (grp).v, &(grp).d)
#define INTO16(grp, xg, acc) group_into16((grp).v, (grp).d, xg, acc)
DEFINE_ROWS_TIMES(16, __m512, 2, _mm512_setzero_ps, VALUES16, INTO16, _mm512_add_ps,
                  _mm512_reduce_add_ps)

/* The K types 16 wide: a group's halves are one vector each (Q6_K's two scales, one each). */
static inline __m512i widen16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i srli16(__m512i a, int n) { return _mm512_srli_epi32(a, n); }
static inline __m512i slli16(__m512i a, int n) { return _mm512_slli_epi32(a, n); }
/* Signed bytes 16c..16c+15 of q as 16 int32 lanes. */
static inline __m512i bytes_at16(__m256i q, int c) {
    return _mm512_cvtepi8_epi32(c ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q));
}

static inline __m512 iq4nl_lut16(__m512i idx) {
    const __m512 grid = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return _mm512_permutexvar_ps(idx, grid);
}

DEFINE_K_GROUPS(16, __m512, __m512i, 16, widen16, bytes_at16, iq4nl_lut16, _mm512_and_si512, _mm512_or_si512, srli16, slli16,
              _mm512_sub_epi32, _mm512_set1_epi32, _mm512_cvtepi32_ps, _mm512_mul_ps, _mm512_fmadd_ps,
              _mm512_set1_ps)
DEFINE_ROWS_TIMES_K(16, __m512, 16, 4, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_set1_ps,
                    _mm512_add_ps, _mm512_reduce_add_ps)

static inline __attribute__((always_inline)) __m512 codes_into16(__m256i q, float s0, float s1, const float *xg,
                                                                 __m512 acc) {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(bytes_at16(q, 0)), _mm512_loadu_ps(xg));
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(bytes_at16(q, 1)), _mm512_loadu_ps(xg + 16));
    return _mm512_fmadd_ps(_mm512_set1_ps(s1), hi, _mm512_fmadd_ps(_mm512_set1_ps(s0), lo, acc));
}

#define CODES_INTO16(grp, xg, acc) codes_into16((grp).q, (grp).s0, (grp).s1, xg, acc)
DEFINE_ROWS_TIMES_CODES(16, __m512, _mm512_setzero_ps, CODES_INTO16, _mm512_add_ps, _mm512_reduce_add_ps)
#define KVSLIM_AVX512 1
#endif

#include "block_linear_q8.c"
#endif

/* Rows of W as float32: out (n, k) = gguf.quants' values of w (n, row_bytes). The prompt's
 * GEMM (kvslim/weights/matmul.py) multiplies a step of such rows at a time; torch's decoders
 * make and read back several temporaries per value, this writes each value once.
 * Values are s * q + o as in decode_group, product and sum rounded apart (no FMA
 * contraction) as ggml's dequantize rounds them. ``dequantize_row`` is one row (decode_step.c's
 * embedding lookup too); the rows call returns 0, or 1 for a type it does not know or k not
 * whole blocks. */
__attribute__((optimize("fp-contract=off")))
static void dequantize_row(int type, const uint8_t *row, int64_t k, float *out) {
    group_t g;
    for (int64_t index = 0; index < k / QK; index++) {
        decode_group(type, row, index, &g);
        float *o = out + index * QK;
        for (int l = 0; l < 16; l++) o[l] = g.s0 * g.q[l] + g.o0;
        for (int l = 16; l < QK; l++) o[l] = g.s1 * g.q[l] + g.o1;
    }
}

int kvslim_dequantize_rows(int type, const uint8_t *w, float *out, int64_t n, int64_t k, int n_threads) {
    if (!group_bytes_x8(type) || k % block_values(type)) return 1;
    const int64_t row_bytes = k / QK * group_bytes_x8(type) / 8;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) dequantize_row(type, w + r * row_bytes, k, out + r * k);
    return 0;
}

#ifdef KVSLIM_AVX2
/* Q4_1 and Q5_1's minimum per group (the 16 bits after its scale) times the group's sum of x,
 * added to the codes' dot product of each activation row. */
static void add_offsets(int type, const uint8_t *row, const float *xsum, int64_t m, int64_t k, float *y, int64_t n) {
    const int64_t block = group_bytes_x8(type) / 8, n_groups = k / QK;
    for (int64_t i = 0; i < m; i++) {
        float s = 0.0f;
        for (int64_t g = 0; g < n_groups; g++) s += f16(row + g * block + 2) * xsum[i * n_groups + g];
        y[i * n] += s;
    }
}
#endif

#ifdef KVSLIM_AVX2
/* The widest loops the build has: name##16 with AVX-512, name##8 with AVX2. */
#ifdef KVSLIM_AVX512
#define WIDE(name) name##16
#else
#define WIDE(name) name##8
#endif

/* block_linear_q8.c's loops over every row of W; 1 when out of memory. */
static int block_linear_q8(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
                           int n_threads) {
    const int64_t row_bytes = k / QK * group_bytes_x8(type) / 8;
    q8_rows_t xq;
    if (quantize_rows_q8(x, m, k, &xq)) return 1;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        if (m == 1) rows_times_q8(type, w + r * row_bytes, &xq, 1, k, y + r, n);     /* m a constant */
        else rows_times_q8(type, w + r * row_bytes, &xq, m, k, y + r, n);
    }
    free(xq.q);
    return 0;
}
#endif

/* Whether kvslim_block_linear(..., q8_activations = 1) quantizes the activations of `type` in this
 * build (block_linear_q8.c's types, with AVX2); where not, it multiplies float activations. */
int kvslim_q8_activations(int type) {
#ifdef KVSLIM_AVX2
    return q8_types(type);
#else
    (void)type;
    return 0;
#endif
}

/* x (m, k) float32 contiguous; w (n, row_bytes) rows of `type`; y (m, n) float32. q8_activations:
 * round x to 8 bits (a scale per 32 values) first, as llama.cpp does, where kvslim_q8_activations(type).
 * Returns 0, or 1 for a type it does not know, k not whole blocks, or m > MAX_M. */
int kvslim_block_linear(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
                        int n_threads, int q8_activations) {
    if (!group_bytes_x8(type) || k % block_values(type) || m > MAX_M) return 1;
    const int64_t row_bytes = k / QK * group_bytes_x8(type) / 8;
#ifdef KVSLIM_AVX2
    if (q8_activations && q8_types(type)) return block_linear_q8(type, x, w, y, m, n, k, n_threads);
    /* Two rows of W per pass over x where x (m rows) is past 32 KB, L1's share: each activation
     * group is then read from L2 once for both. Smaller, x stays in L1 and the pair's extra
     * accumulators cost more than they save (the bundled model's drafted chunks, 5 rows of 256-768
     * values: 1.25x slower through the pair). Either way the bits are the same. */
    if (m > 1 && fast_types(type) && m * k * (int64_t)sizeof(float) > 32768) {
        #pragma omp parallel for num_threads(n_threads) schedule(static)
        for (int64_t r = 0; r < n; r += 2) {
            if (r + 1 < n) WIDE(pair_times_fast)(type, w + r * row_bytes, row_bytes, x, m, k, y + r, n);
            else WIDE(rows_times_fast)(type, w + r * row_bytes, x, m, k, y + r, n);
        }
        return 0;
    }
    float *xsum = NULL;                 /* each group's sum of x, for the types with a minimum per group */
    if (has_offset(type)) {
        if (!(xsum = malloc((size_t)(m * (k / QK)) * sizeof(float)))) return 1;
        for (int64_t i = 0; i < m * (k / QK); i++) {
            float s = 0.0f;
            for (int l = 0; l < QK; l++) s += x[i * QK + l];
            xsum[i] = s;
        }
    }
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_bytes;              /* m == 1 calls: m a constant in the loop */
        if (m == 1 && fast_types(type)) WIDE(rows_times_fast)(type, row, x, 1, k, y + r, n);
        else if (fast_types(type)) WIDE(rows_times_fast)(type, row, x, m, k, y + r, n);
        else if (m == 1 && k_types(type)) WIDE(rows_times_k)(type, row, x, xsum, 1, k, y + r, n);
        else if (k_types(type)) WIDE(rows_times_k)(type, row, x, xsum, m, k, y + r, n);
        else if (m == 1 && code_types(type)) WIDE(rows_times_codes)(type, row, x, 1, k, y + r, n);
        else if (code_types(type)) WIDE(rows_times_codes)(type, row, x, m, k, y + r, n);
        else                                                    /* every type has a loop above */
            for (int64_t i = 0; i < m; i++) y[i * n + r] = dot_portable(type, row, x + i * k, k);
        if (xsum && code_types(type)) add_offsets(type, row, xsum, m, k, y + r, n);
    }
    free(xsum);
#else
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < m; i++) y[i * n + r] = dot_portable(type, w + r * row_bytes, x + i * k, k);
#endif
    return 0;
}
