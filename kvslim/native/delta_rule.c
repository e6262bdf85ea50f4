/* The gated delta rule in C: a prompt's tokens through one Gated DeltaNet layer's recurrence.
 *
 * Per value head, with state S (dk, dv), decay g <= 0 (log space), rate beta:
 *     S <- S * exp(g_t);  S <- S + k_t (x) beta_t (v_t - S^T k_t);  o_t = S^T q_t
 * Why the token-by-token form for a prompt on the CPU: its work is ~4 dk dv flops per head and
 * token (a few percent of the layer's projections), the state (64 KiB at 128 x 128) stays in
 * L1/L2 while it runs, and heads are independent (one thread each). torch's chunked form
 * (kvslim/models/delta_rule.py, the reference) turns the loop into matmuls, which suits a GPU,
 * but on the CPU its ~40 small ops per chunk cost more than the arithmetic (the bundled model:
 * 200 batched matmuls, 6 triangular solves and their copies in a 512-token chunk).
 * decode_step.c includes this file for the one-token step.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifndef MAX_DIM
#define MAX_DIM 512
#endif

/* One value head, one token: S <- S * exp(g); S += k (x) beta (v - S^T k); o = S^T q. */
static void delta_rule_head(float *S, const float *q, const float *k, const float *v, float g, float beta, int dk,
                            int dv, float *o) {
    const float decay = expf(g);
    float kv_mem[MAX_DIM], delta[MAX_DIM];
    for (int j = 0; j < dv; j++) kv_mem[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] *= decay;
            kv_mem[j] += row[j] * k[i];
        }
    }
    for (int j = 0; j < dv; j++) delta[j] = (v[j] - kv_mem[j]) * beta, o[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] += k[i] * delta[j];
            o[j] += row[j] * q[i];
        }
    }
}

/* T tokens of one sequence. q, k (T, H, dk) L2-normalised, repeated to the value heads (q not yet
 * scaled); v, out (T, H, dv); g, beta (T, H); state (H, dk, dv), updated in place. All float32,
 * contiguous. Returns 0, or 1 when dk or dv exceeds MAX_DIM. */
int kvslim_gated_delta_prefill(const float *q, const float *k, const float *v, const float *g, const float *beta,
                               float *state, float *out, int64_t T, int64_t H, int64_t dk, int64_t dv,
                               int n_threads) {
    if (dk > MAX_DIM || dv > MAX_DIM) return 1;
    const float scale = 1.0f / sqrtf((float)dk);
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        float *S = state + h * dk * dv, qs[MAX_DIM];
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = t * H + h;
            for (int64_t i = 0; i < dk; i++) qs[i] = q[row * dk + i] * scale;
            delta_rule_head(S, qs, k + row * dk, v + row * dv, g[row], beta[row], (int)dk, (int)dv, out + row * dv);
        }
    }
    return 0;
}
