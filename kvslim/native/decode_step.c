/* A whole decode step in C: one new token for each of B sequences, through every layer.
 *
 * Why: on a CPU a small model's decode step is dispatch, not arithmetic. Compiled by inductor,
 * the bundled model's step still costs ~3 ms, of which the arithmetic is ~1.4 ms: the rest is
 * the Python wrapper calling ~200 kernels and ~60 custom ops. Here the step is one call.
 *
 * What it runs is described by kvslim/engine/native_step.py, which reads the loaded torch modules
 * and refuses anything this file does not implement (the torch model is the reference, and the
 * parity tests hold this step's logits to it):
 *   embedding -> per layer: x += mixer(rmsnorm(x)); x += ffn(rmsnorm(x)) -> rmsnorm -> head
 *   ffn: SwiGLU (GeGLU, GELU's tanh form, for Gemma), or a sparse mixture of SwiGLU experts with
 *        a shared expert (Qwen3.5-MoE); Gemma's embeddings are scaled by sqrt(hidden) first
 *   mixer: GQA attention (optional output gate, per-head q/k RMSNorm, partial RoPE, K/V encoded
 *          into the paged pool, attention over the packed pages: paged_attention.c), or Gated
 *          DeltaNet (causal conv state, gated delta rule state updated in place).
 * Weights are block_linear.c's types (f32 rows included). Host work (page reservation, lengths)
 * stays in Python around the call, as for the compiled step.
 * An f16 window (the newest W tokens of a slot kept in f16, KIVI's residual) is kept as the torch
 * cache keeps it: oldest first; when it is full, its oldest token is encoded into the pages and the
 * rest move down a row. Window keys are scored in the model domain; the pages' softmax state is
 * taken out of V's code domain and merged with the window's there.
 */
#include "block_linear.c"
#include "paged_attention.c"
#include "kv_encode.c"
#include "delta_rule.c"      /* delta_rule_head: one token of the gated delta rule */

typedef struct {            /* y = x @ W.T (+ bias) */
    int32_t type;           /* block_linear's type code */
    int64_t rows, cols;
    const uint8_t *data;
    const float *bias;      /* NULL: none */
    const int64_t *perm;    /* NULL, or (cols,): the input's features in the file's column order
                             * (llama.cpp's GGUFs of Qwen3.5 order a DeltaNet's value heads their
                             * own way, and quantized blocks cannot be re-ordered) */
    int32_t q8;             /* round x to 8 bits first (block_linear.q8_activations) */
} mat_t;

enum { MIXER_ATTENTION = 0, MIXER_DELTA_NET = 1 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define MAX_EXPERTS 512
#define MAX_TOP_K 64

typedef struct {
    int32_t mixer;
    const float *in_norm, *post_norm;
    mat_t gate, up, down;                 /* SwiGLU */
    /* attention */
    mat_t q, k, v, o;
    int32_t n_heads, n_kv, head_dim, gated;
    const float *q_norm, *k_norm;         /* NULL: none */
    uint8_t *k_pool, *v_pool, *overflow;
    int64_t pool_pages, page_size, k_row_bytes, v_row_bytes, table_stride;
    const int32_t *table;
    const codec_t *ck, *cv;
    const enc_t *ek, *ev;                 /* K's rotation is the query's way into its code domain */
    int32_t f16_window;                   /* newest tokens per slot kept in f16 before they are packed */
    uint8_t *win_k, *win_v;               /* (slots, f16_window, n_kv, head_dim) f16, oldest first */
    /* gated delta net: qkv, z, b, a; or (fused_qkvz, Qwen3-Next) qkvz in `qkv` and ba in `b`,
     * grouped per key head: [q | k | its value heads' v | their z], [b | a] */
    mat_t qkv, z, b, a, out;
    int32_t fused_qkvz;
    int32_t n_k, n_v, dk, dv, conv_k;
    const float *conv_w, *dt_bias, *a_log, *gnorm;
    float *conv_state, *rec_state;        /* (slots, conv_dim, conv_k - 1), (slots, n_v, dk, dv) */
    /* sparse MoE feed-forward (n_experts > 0) instead of gate/up/down: a softmax router's top_k
     * experts, each a SwiGLU whose gate and up rows are one (2I, H) matrix, plus a shared
     * expert (gate/up/down above) scaled by sigmoid(shared_gate . x) */
    int32_t n_experts, top_k, renormalize;
    mat_t router, shared_gate, expert_gate_up, expert_down;   /* the experts' data: expert 0 */
    int64_t gate_up_stride, down_stride;                       /* bytes from one expert to the next */
    int32_t act;                          /* the gated feed-forward's activation: ACT_* */
} layer_t;

typedef struct {
    int32_t n_layers, hidden, vocab, rot_dim, zero_centered, n_threads;
    float eps;
    const layer_t *layers;
    mat_t embed, head;                    /* the head may be the embedding (tied) */
    const float *final_norm, *inv_freq;   /* inv_freq: rot_dim / 2 */
    float embed_scale;                    /* the embeddings times this before the first layer (Gemma) */
} model_t;

/* ----- small pieces ------------------------------------------------------------------- */
static void linear(const mat_t *w, const float *x, int64_t m, float *y, int n_threads) {
    float *gathered = NULL;
    if (w->perm) {                                       /* x[:, perm]: as the torch module gathers */
        gathered = malloc(sizeof(float) * (size_t)(m * w->cols));
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < w->cols; c++) gathered[i * w->cols + c] = x[i * w->cols + w->perm[c]];
        x = gathered;
    }
    kvslim_block_linear(w->type, x, w->data, y, m, w->rows, w->cols, n_threads, w->q8);
    free(gathered);
    if (w->bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < w->rows; r++) y[i * w->rows + r] += w->bias[r];
}

static float mean_square_rsqrt(const float *x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* RMSNorm of n values: y = x * rsqrt(mean(x^2) + eps) * (w, or 1 + w when zero-centred). */
static void rmsnorm(const float *x, const float *w, int n, float eps, int zero_centered, float *y) {
    const float r = mean_square_rsqrt(x, n, eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * r * (zero_centered ? 1.0f + w[i] : w[i]);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }
/* torch's F.gelu(approximate="tanh"): 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))) */
static inline float gelu_tanh(float v) { return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))); }
static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }   /* torch's threshold */

/* Half-split RoPE on the first rot_dim values of a head (rotate_half convention). */
static void rope(float *x, int rot_dim, const float *inv_freq, int64_t pos) {
    const int half = rot_dim / 2;
    for (int i = 0; i < half; i++) {
        const float f = (float)pos * inv_freq[i], c = cosf(f), s = sinf(f);
        const float a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

static void embed_row(const mat_t *e, int64_t token, float *out) {
    dequantize_row(e->type, e->data + token * (e->cols / QK * group_bytes_x8(e->type) / 8), e->cols, out);
}

/* ----- attention ---------------------------------------------------------------------------- */
/* Move slot's window along by the token (k, v), (Hk, D) each: when the window holds W tokens, the
 * oldest is encoded into the pool at packed position `packed` first. Returns the window's new
 * length and raises `bad` as the pool's encoders would for every row that enters the cache. */
static int64_t window_push(const layer_t *L, int64_t slot, int64_t packed, int64_t len, const float *k, const float *v,
                           int *bad) {
    const int Hk = L->n_kv, D = L->head_dim;
    const size_t row = (size_t)Hk * D * 2, slot_bytes = row * (size_t)L->f16_window;
    uint8_t *wk = L->win_k + slot * slot_bytes, *wv = L->win_v + slot * slot_bytes;
    uint8_t scratch[2 * MAX_DIM * 4 + 64];
    float x[MAX_DIM];
    for (int j = 0; j < Hk; j++) {                         /* the flags of the formats the token will take */
        *bad |= encode_row_head(L->ek, j, k + j * D, D, scratch);
        *bad |= encode_row_head(L->ev, j, v + j * D, D, scratch);
    }
    if (len == L->f16_window) {                            /* full: the oldest goes into the pages */
        const int64_t page = L->table[slot * L->table_stride + packed / L->page_size];
        const int64_t at = page * L->page_size + packed % L->page_size;
        for (int j = 0; j < Hk; j++) {
            for (int i = 0; i < D; i++) x[i] = f16_to_f32(wk + ((size_t)j * D + i) * 2);
            *bad |= encode_row_head(L->ek, j, x, D, L->k_pool + (j * (L->pool_pages * L->page_size) + at) * L->k_row_bytes);
            for (int i = 0; i < D; i++) x[i] = f16_to_f32(wv + ((size_t)j * D + i) * 2);
            *bad |= encode_row_head(L->ev, j, x, D, L->v_pool + (j * (L->pool_pages * L->page_size) + at) * L->v_row_bytes);
        }
        memmove(wk, wk + row, row * (size_t)(len - 1));
        memmove(wv, wv + row, row * (size_t)(len - 1));
        len--;
    }
    for (int64_t i = 0; i < (int64_t)Hk * D; i++) {
        store_f16(wk + (size_t)len * row + 2 * (size_t)i, k[i]);
        store_f16(wv + (size_t)len * row + 2 * (size_t)i, v[i]);
    }
    return len + 1;
}

/* Fold slot's n window tokens (KV head j) into a query row's normalised output o, given the pages'
 * max m and denominator l (l = 0: no pages). qm: the scaled query in the model domain. One pass,
 * rescaling as the running max grows (flash attention's merge), so no window size is too long. */
static void window_merge(const layer_t *L, int64_t slot, int64_t n, int j, const float *qm, float m, float l, float *o) {
    const int Hk = L->n_kv, D = L->head_dim;
    const size_t row = (size_t)Hk * D * 2, slot_bytes = row * (size_t)L->f16_window;
    const uint8_t *wk = L->win_k + slot * slot_bytes + (size_t)j * D * 2, *wv = L->win_v + slot * slot_bytes + (size_t)j * D * 2;
    float top = l > 0.0f ? m : -INFINITY, total = l > 0.0f ? l : 0.0f;
    for (int i = 0; i < D; i++) o[i] *= total;             /* the pages' sum, unnormalised */
    for (int64_t t = 0; t < n; t++) {
        float dot = 0.0f;
        for (int i = 0; i < D; i++) dot += qm[i] * f16_to_f32(wk + t * row + 2 * (size_t)i);
        if (dot > top) {                                   /* a new max: what is summed so far shrinks */
            const float shrink = expf(top - dot);
            for (int i = 0; i < D; i++) o[i] *= shrink;
            total *= shrink, top = dot;
        }
        const float p = expf(dot - top);
        total += p;
        for (int i = 0; i < D; i++) o[i] += p * f16_to_f32(wv + t * row + 2 * (size_t)i);
    }
    for (int i = 0; i < D; i++) o[i] /= total;
}

static void attention(const model_t *m, const layer_t *L, int64_t B, const int64_t *pos, const int64_t *slots,
                      const int64_t *win_len, const float *h, float *out) {
    const int H = L->n_heads, Hk = L->n_kv, D = L->head_dim, G = H / Hk, qw = L->gated ? 2 * D : D;
    float *q = malloc(sizeof(float) * (size_t)(B * H * qw)), *k = malloc(sizeof(float) * (size_t)(B * Hk * D));
    float *v = malloc(sizeof(float) * (size_t)(B * Hk * D)), *qg = malloc(sizeof(float) * (size_t)(Hk * B * G * D));
    float *ml = malloc(sizeof(float) * (size_t)(2 * Hk * B * G)), *acc = malloc(sizeof(float) * (size_t)(Hk * B * G * D));
    float *att = malloc(sizeof(float) * (size_t)(B * H * D));
    int64_t *n_keys = malloc(sizeof(int64_t) * (size_t)B), *n_win = calloc((size_t)B, sizeof(int64_t));
    float *qm = L->f16_window ? malloc(sizeof(float) * (size_t)(B * H * D)) : NULL;   /* queries, model domain */
    int32_t *table = malloc(sizeof(int32_t) * (size_t)(B * L->table_stride));
    linear(&L->q, h, B, q, m->n_threads);
    linear(&L->k, h, B, k, m->n_threads);
    linear(&L->v, h, B, v, m->n_threads);
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t s = 0; s < B; s++) {
        float *ks = k + s * Hk * D, *vs = v + s * Hk * D;
        for (int j = 0; j < Hk; j++) {
            if (L->k_norm) rmsnorm(ks + j * D, L->k_norm, D, m->eps, m->zero_centered, ks + j * D);
            rope(ks + j * D, m->rot_dim, m->inv_freq, pos[s]);
        }
        int bad = 0;
        n_keys[s] = pos[s] + 1;
        if (L->f16_window) {                               /* the token into the window */
            const int64_t packed = pos[s] - win_len[s];
            n_win[s] = window_push(L, slots[s], packed, win_len[s], ks, vs, &bad);
            n_keys[s] = packed + (win_len[s] == L->f16_window);
        } else {                                           /* the token's K/V rows into the pool */
            const int64_t page = L->table[slots[s] * L->table_stride + pos[s] / L->page_size];
            const int64_t at = page * L->page_size + pos[s] % L->page_size;
            for (int j = 0; j < Hk; j++) {
                bad |= encode_row_head(L->ek, j, ks + j * D, D, L->k_pool + (j * (L->pool_pages * L->page_size) + at) * L->k_row_bytes);
                bad |= encode_row_head(L->ev, j, vs + j * D, D, L->v_pool + (j * (L->pool_pages * L->page_size) + at) * L->v_row_bytes);
            }
        }
        if (bad) L->overflow[slots[s]] = 1;
        for (int hh = 0; hh < H; hh++) {                   /* the query: norm, RoPE, scale, K's code domain */
            float *qh = q + (s * H + hh) * qw, tmp[MAX_DIM];
            if (L->q_norm) rmsnorm(qh, L->q_norm, D, m->eps, m->zero_centered, qh);
            rope(qh, m->rot_dim, m->inv_freq, pos[s]);
            for (int i = 0; i < D; i++) tmp[i] = qh[i] * scale;
            if (qm) memcpy(qm + (s * H + hh) * D, tmp, sizeof(float) * (size_t)D);
            to_code_domain_head(L->ek, hh / G, tmp, qg + (((int64_t)(hh / G) * B + s) * G + hh % G) * D, D);
        }
        memcpy(table + s * L->table_stride, L->table + slots[s] * L->table_stride, sizeof(int32_t) * (size_t)L->table_stride);
    }
    kvslim_paged_decode(L->ck, L->cv, qg, L->k_pool, L->v_pool, L->pool_pages, L->page_size, L->k_row_bytes,
                        L->v_row_bytes, table, L->table_stride, n_keys, Hk, B, G, D, SPAN, ml, ml + Hk * B * G, acc,
                        m->n_threads);
    for (int64_t s = 0; s < B; s++)
        for (int hh = 0; hh < H; hh++) {                   /* normalise, back from V's code domain, gate */
            const int64_t row = ((int64_t)(hh / G) * B + s) * G + hh % G;
            float y[MAX_DIM], *o = att + (s * H + hh) * D;
            const float l = ml[Hk * B * G + row], inv_l = 1.0f / l;
            if (l > 0.0f) {
                for (int i = 0; i < D; i++) y[i] = acc[row * D + i] * inv_l;
                from_code_domain_head(L->ev, hh / G, y, o, D);     /* klt3: its KV head's basis */
            } else {
                memset(o, 0, sizeof(float) * (size_t)D);         /* no packed keys yet: the window alone */
            }
            if (qm) window_merge(L, slots[s], n_win[s], hh / G, qm + (s * H + hh) * D, ml[row], l, o);
            if (L->gated)
                for (int i = 0; i < D; i++) o[i] *= sigmoid(q[(s * H + hh) * qw + D + i]);
        }
    linear(&L->o, att, B, out, m->n_threads);
    free(q), free(k), free(v), free(qg), free(ml), free(acc), free(att), free(n_keys), free(n_win), free(qm), free(table);
}

/* ----- gated delta net ------------------------------------------------------------------- */
static void l2normalize(float *x, int n) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* Qwen3-Next's projections, grouped per key head, into Qwen3.5's layout: qkv = [all q | all k |
 * all v] (the conv's input), z and b, a per value head. */
static void project_grouped(const model_t *m, const layer_t *L, int64_t B, const float *h, float *qkv, float *z,
                            float *bb, float *aa) {
    const int rep = L->n_v / L->n_k, key_dim = L->n_k * L->dk, value_dim = L->n_v * L->dv;
    const int group = 2 * L->dk + 2 * rep * L->dv, conv_dim = 2 * key_dim + value_dim;
    float *qkvz = malloc(sizeof(float) * (size_t)(B * L->n_k * group)), *ba = malloc(sizeof(float) * (size_t)(B * 2 * L->n_v));
    linear(&L->qkv, h, B, qkvz, m->n_threads);
    linear(&L->b, h, B, ba, m->n_threads);
    for (int64_t s = 0; s < B; s++)
        for (int kh = 0; kh < L->n_k; kh++) {
            const float *g = qkvz + (s * L->n_k + kh) * group, *gba = ba + (s * L->n_k + kh) * 2 * rep;
            float *row = qkv + s * conv_dim;
            memcpy(row + kh * L->dk, g, sizeof(float) * (size_t)L->dk);
            memcpy(row + key_dim + kh * L->dk, g + L->dk, sizeof(float) * (size_t)L->dk);
            memcpy(row + 2 * key_dim + kh * rep * L->dv, g + 2 * L->dk, sizeof(float) * (size_t)(rep * L->dv));
            memcpy(z + s * value_dim + kh * rep * L->dv, g + 2 * L->dk + rep * L->dv, sizeof(float) * (size_t)(rep * L->dv));
            memcpy(bb + s * L->n_v + kh * rep, gba, sizeof(float) * (size_t)rep);
            memcpy(aa + s * L->n_v + kh * rep, gba + rep, sizeof(float) * (size_t)rep);
        }
    free(qkvz), free(ba);
}

static void delta_net(const model_t *m, const layer_t *L, int64_t B, const int64_t *slots, const float *h,
                      float *out) {
    const int key_dim = L->n_k * L->dk, value_dim = L->n_v * L->dv, conv_dim = 2 * key_dim + value_dim;
    const int K = L->conv_k, rep = L->n_v / L->n_k;
    float *qkv = malloc(sizeof(float) * (size_t)(B * conv_dim)), *z = malloc(sizeof(float) * (size_t)(B * value_dim));
    float *bb = malloc(sizeof(float) * (size_t)(B * L->n_v)), *aa = malloc(sizeof(float) * (size_t)(B * L->n_v));
    float *o = malloc(sizeof(float) * (size_t)(B * value_dim));
    if (L->fused_qkvz) project_grouped(m, L, B, h, qkv, z, bb, aa);
    else {
        linear(&L->qkv, h, B, qkv, m->n_threads);
        linear(&L->z, h, B, z, m->n_threads);
        linear(&L->b, h, B, bb, m->n_threads);
        linear(&L->a, h, B, aa, m->n_threads);
    }
    for (int64_t s = 0; s < B; s++) {                      /* the causal conv, its state shifted by one */
        float *x = qkv + s * conv_dim, *state = L->conv_state + slots[s] * conv_dim * (K - 1);
        for (int c = 0; c < conv_dim; c++) {
            float *st = state + c * (K - 1), acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += st[j] * L->conv_w[c * K + j];
            acc += x[c] * L->conv_w[c * K + K - 1];
            for (int j = 0; j + 1 < K - 1; j++) st[j] = st[j + 1];
            st[K - 2] = x[c];
            x[c] = silu(acc);
        }
        for (int j = 0; j < 2 * L->n_k; j++) l2normalize(x + j * L->dk, L->dk);   /* q heads, then k heads */
    }
    const float q_scale = 1.0f / sqrtf((float)L->dk);
    /* threads over heads, rows in order within a head: rows of one slot (a drafted chunk) update
     * its state one token after the other */
    #pragma omp parallel for num_threads(m->n_threads) schedule(static) if (B * L->n_v * L->dk * L->dv > 65536)
    for (int hv = 0; hv < L->n_v; hv++) {
        const int hk = hv / rep;
        for (int64_t s = 0; s < B; s++) {
            const float *x = qkv + s * conv_dim;
            float q[MAX_DIM];
            for (int i = 0; i < L->dk; i++) q[i] = x[hk * L->dk + i] * q_scale;
            const float beta = sigmoid(bb[s * L->n_v + hv]);
            const float g = -expf(L->a_log[hv]) * softplus(aa[s * L->n_v + hv] + L->dt_bias[hv]);
            float *S = L->rec_state + ((slots[s] * L->n_v) + hv) * (int64_t)L->dk * L->dv;
            delta_rule_head(S, q, x + key_dim + hk * L->dk, x + 2 * key_dim + hv * L->dv, g, beta, L->dk, L->dv,
                            o + s * value_dim + hv * L->dv);
        }
    }
    for (int64_t s = 0; s < B; s++)                         /* gated RMSNorm per value head */
        for (int hv = 0; hv < L->n_v; hv++) {
            float *oh = o + s * value_dim + hv * L->dv;
            const float *zh = z + s * value_dim + hv * L->dv;
            const float r = mean_square_rsqrt(oh, L->dv, m->eps);
            for (int i = 0; i < L->dv; i++) oh[i] = L->gnorm[i] * (oh[i] * r) * silu(zh[i]);
        }
    linear(&L->out, o, B, out, m->n_threads);
    free(qkv), free(z), free(bb), free(aa), free(o);
}

/* ----- the step ---------------------------------------------------------------------------- */
/* down(act(gate(h)) * up(h)): SwiGLU, or GeGLU where L->act says so */
static void gated_ffn(const model_t *m, const layer_t *L, int64_t B, const float *h, float *out) {
    const int64_t inter = L->gate.rows;
    float *g = malloc(sizeof(float) * (size_t)(B * inter)), *u = malloc(sizeof(float) * (size_t)(B * inter));
    linear(&L->gate, h, B, g, m->n_threads);
    linear(&L->up, h, B, u, m->n_threads);
    if (L->act == ACT_GELU_TANH)
        for (int64_t i = 0; i < B * inter; i++) g[i] = gelu_tanh(g[i]) * u[i];
    else
        for (int64_t i = 0; i < B * inter; i++) g[i] = silu(g[i]) * u[i];
    linear(&L->down, g, B, out, m->n_threads);
    free(g), free(u);
}

/* One token's routed experts: probabilities of the top_k (renormalised if asked), experts in
 * ascending order (the order the torch reference adds them in). */
static int route(const layer_t *L, const float *logits, int *experts, float *weights) {
    float top = -INFINITY, sum = 0.0f, probs[MAX_EXPERTS];
    const int E = L->n_experts;
    for (int e = 0; e < E; e++) top = fmaxf(top, logits[e]);
    for (int e = 0; e < E; e++) sum += probs[e] = expf(logits[e] - top);
    int k = 0;
    for (; k < L->top_k; k++) {                                 /* top-k by selection: k is small */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= experts[j] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        experts[k] = best, weights[k] = probs[best] / sum;
    }
    if (L->renormalize) {
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weights[j];
        for (int j = 0; j < k; j++) weights[j] /= total;
    }
    for (int i = 1; i < k; i++)                                 /* ascending expert ids */
        for (int j = i; j > 0 && experts[j] < experts[j - 1]; j--) {
            int e = experts[j]; experts[j] = experts[j - 1]; experts[j - 1] = e;
            float w = weights[j]; weights[j] = weights[j - 1]; weights[j - 1] = w;
        }
    return k;
}

static void moe(const model_t *m, const layer_t *L, int64_t B, const float *h, float *out) {
    const int64_t n = m->hidden, inter = L->expert_gate_up.rows / 2;
    float *logits = malloc(sizeof(float) * (size_t)(B * L->n_experts));
    float *gu = malloc(sizeof(float) * (size_t)(2 * inter)), *y = malloc(sizeof(float) * (size_t)n);
    float *acc = malloc(sizeof(float) * (size_t)n);
    float gate_logit;
    linear(&L->router, h, B, logits, m->n_threads);
    gated_ffn(m, L, B, h, out);                                 /* the shared expert */
    for (int64_t s = 0; s < B; s++) {
        const float *x = h + s * n;
        linear(&L->shared_gate, x, 1, &gate_logit, m->n_threads);
        const float g = sigmoid(gate_logit);
        int experts[MAX_TOP_K];
        float weights[MAX_TOP_K];
        const int k = route(L, logits + s * L->n_experts, experts, weights);
        float *o = out + s * n;
        for (int64_t i = 0; i < n; i++) o[i] *= g;
        for (int64_t i = 0; i < n; i++) acc[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            mat_t gate_up = L->expert_gate_up, down = L->expert_down;
            gate_up.data += experts[j] * L->gate_up_stride;
            down.data += experts[j] * L->down_stride;
            linear(&gate_up, x, 1, gu, m->n_threads);
            for (int64_t i = 0; i < inter; i++) gu[i] = silu(gu[i]) * gu[inter + i];
            linear(&down, gu, 1, y, m->n_threads);
            for (int64_t i = 0; i < n; i++) acc[i] += y[i] * weights[j];
        }
        for (int64_t i = 0; i < n; i++) o[i] = acc[i] + o[i];
    }
    free(logits), free(gu), free(y), free(acc);
}

/* tokens, positions, slots, and each slot's f16 window length before the step (B); logits (B, vocab).
 * A slot may take several rows at consecutive positions, in order (a drafted chunk: each row's
 * K/V are in the pages before any row attends, and a row reads its slot's keys up to its own
 * position; DeltaNet rows update the state in row order); not with an f16 window.
 * Returns 0, or 1 when a size is past the limits. */
int kvslim_decode_step(const model_t *m, int64_t B, const int64_t *tokens, const int64_t *positions,
                       const int64_t *slots, const int64_t *win_len, float *logits) {
    if (B < 1 || B > MAX_M) return 1;
    const int n = m->hidden;
    float *x = malloc(sizeof(float) * (size_t)(B * n)), *h = malloc(sizeof(float) * (size_t)(B * n));
    float *y = malloc(sizeof(float) * (size_t)(B * n));
    for (int64_t s = 0; s < B; s++) embed_row(&m->embed, tokens[s], x + s * n);
    if (m->embed_scale != 1.0f)
        for (int64_t i = 0; i < B * n; i++) x[i] *= m->embed_scale;
    for (int li = 0; li < m->n_layers; li++) {
        const layer_t *L = m->layers + li;
        for (int64_t s = 0; s < B; s++) rmsnorm(x + s * n, L->in_norm, n, m->eps, m->zero_centered, h + s * n);
        if (L->mixer == MIXER_ATTENTION) attention(m, L, B, positions, slots, win_len, h, y);
        else delta_net(m, L, B, slots, h, y);
        for (int64_t i = 0; i < B * n; i++) x[i] += y[i];
        for (int64_t s = 0; s < B; s++) rmsnorm(x + s * n, L->post_norm, n, m->eps, m->zero_centered, h + s * n);
        if (L->n_experts) moe(m, L, B, h, y);
        else gated_ffn(m, L, B, h, y);
        for (int64_t i = 0; i < B * n; i++) x[i] += y[i];
    }
    for (int64_t s = 0; s < B; s++) rmsnorm(x + s * n, m->final_norm, n, m->eps, m->zero_centered, h + s * n);
    linear(&m->head, h, B, logits, m->n_threads);
    free(x), free(h), free(y);
    return 0;
}
