/* A decoding step's float32 pieces around the products: the RMS norm, grouped-query attention over
 * the KV cache (rotary, window and sinks), and the weighted sum of a MoE layer's experts into the
 * residual stream. */
#include "kernels.h"

/* RMS norm of M rows of D, float32: y = x / sqrt(mean(x^2) + eps) * w (torch's seven small ops of a
 * norm cost more than the norm at one token) */
void rmsnorm_f32(const float *x, const float *w, float eps, float *y, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) ss += xm[i] * xm[i];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) y[m * D + i] = xm[i] * r * w[i];
    }
}

/* q . k over Dh in 8 independent partial sums (vector lanes, no reassociation needed) added in a
 * fixed order, then the tail: the same value on every build and thread count. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float d = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) d += a[i] * b[i];
    return d;
}

/* One decoding step of grouped-query attention for one sequence, float32: rotate the first R dims
 * of q (H heads) and k (G heads) by halves with the position's cos/sin (R each; the other Dh - R
 * dims pass through), write k and v at position `pos` of the layer's cache (G, S, Dh each), then
 * each head's softmax over the positions it sees (all of 0..pos, or the last `window` of them) of
 * its group's keys, scaled by `scale`, times the values: out (H, Dh). With `sinks` (H logits, or
 * NULL), each head's softmax denominator also holds exp(sinks[h]) (gpt-oss), which takes no value.
 * The dozens of small ops this takes in torch cost more than its arithmetic at one token. Heads are
 * split over `threads` threads; each head's sums are its own, so the result does not depend on it. */
void attend_rotate(const float *q, const float *k, const float *v, const float *cos, const float *sin, float *kc,
                   float *vc, int64_t H, int64_t G, int64_t Dh, int64_t R, int64_t S, int64_t pos, float *qr) {
    int64_t half = R / 2;
    for (int64_t h = 0; h < H + G; h++) {
        const float *x = h < H ? q + h * Dh : k + (h - H) * Dh;
        float *y = h < H ? qr + h * Dh : kc + ((h - H) * S + pos) * Dh;
        for (int64_t i = 0; i < R; i++) y[i] = x[i] * cos[i] + (i < half ? -x[i + half] : x[i - half]) * sin[i];
        for (int64_t i = R; i < Dh; i++) y[i] = x[i];
    }
    for (int64_t g = 0; g < G; g++) memcpy(vc + (g * S + pos) * Dh, v + g * Dh, sizeof(float) * (size_t)Dh);
}

void attend_head(const float *qr, const float *kc, const float *vc, int64_t H, int64_t G, int64_t Dh, int64_t S,
                 int64_t t0, int64_t n, float scale, const float *sinks, float *p, float *out, int64_t h) {
    const float *qh = qr + h * Dh, *kg = kc + (h / (H / G)) * S * Dh, *vg = vc + (h / (H / G)) * S * Dh;
    float *ph = p + h * n;
    float mx = sinks ? sinks[h] : -INFINITY, sum = 0.0f;
    for (int64_t t = t0; t < n; t++) {
        ph[t] = dot_f32(qh, kg + t * Dh, Dh) * scale;
        mx = fmaxf(mx, ph[t]);
    }
    for (int64_t t = t0; t < n; t++) sum += (ph[t] = expf(ph[t] - mx));
    if (sinks) sum += expf(sinks[h] - mx);
    float *o = out + h * Dh;
    memset(o, 0, sizeof(float) * (size_t)Dh);
    for (int64_t t = t0; t < n; t++) {
        float w = ph[t] / sum;
        for (int64_t i = 0; i < Dh; i++) o[i] += w * vg[t * Dh + i];
    }
}

int attend_decode_f32(const float *q, const float *k, const float *v, const float *cos, const float *sin, float *kc,
                      float *vc, int64_t H, int64_t G, int64_t Dh, int64_t R, int64_t S, int64_t pos, int64_t window,
                      float scale, const float *sinks, float *out, int threads) {
    int64_t n = pos + 1, t0 = window > 0 && window < n ? n - window : 0;
    float *qr = malloc(sizeof(float) * (size_t)(H * Dh)), *p = malloc(sizeof(float) * (size_t)(n * H));
    if (!qr || !p) return free(qr), free(p), -1;
    attend_rotate(q, k, v, cos, sin, kc, vc, H, G, Dh, R, S, pos, qr);
    /* a short context is not worth waking a second thread for */
#pragma omp parallel for num_threads((n - t0) * H * Dh >= 32768 ? threads : 1) schedule(static)
    for (int64_t h = 0; h < H; h++) attend_head(qr, kc, vc, H, G, Dh, S, t0, n, scale, sinks, p, out, h);
    free(qr);
    free(p);
    return 0;
}

/* A MoE layer's output added to the residual stream for one row: x += sum over K choices of y_k * w_k,
 * each product rounded to float32 and the sum taken in choice order, then added to x: the model's
 * one-token path (rows[k] = y_k * w_k; rows[0] + rows[1] + ...; x + that), the same bits, so no
 * fused multiply-adds here. */
__attribute__((optimize("fp-contract=off"))) void moe_combine_f32(float *x, const float *const *ys, const float *w,
                                                                  int64_t K, int64_t D) {
    for (int64_t i = 0; i < D; i++) {
        float s = ys[0][i] * w[0];
        for (int64_t k = 1; k < K; k++) {
            float r = ys[k][i] * w[k];
            s = s + r;
        }
        x[i] = x[i] + s;
    }
}

/* Rotate R dims of x with the position's cos/sin (R each, the frequencies twice over) into y: by
 * halves (i, i + R/2), or interleaved pairs (2i, 2i + 1) written out as halves (DeepSeek's; the same
 * permutation for queries and keys, as semoe.attention.apply_rope does). */
void rope_rotate(const float *x, const float *cos, const float *sin, int64_t R, int interleave, float *y) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        y[i] = a * cos[i] - b * sin[i];
        y[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One head of latent attention's absorbed form (DeepSeek, Kimi) over the n cached positions: the
 * head's query in the latent space ql (L) and its rotated rotary part qr (R), scores against each
 * position's latent (S, L) and rotary key (S, R), times `scale`, softmax, and the latents' weighted
 * sum into out (L); p: n floats of room. */
void mla_head(const float *ql, const float *qr, const float *latents, const float *rots, int64_t L, int64_t R,
              int64_t n, float scale, float *p, float *out) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        p[t] = (dot_f32(ql, latents + t * L, L) + dot_f32(qr, rots + t * R, R)) * scale;
        mx = fmaxf(mx, p[t]);
    }
    for (int64_t t = 0; t < n; t++) sum += (p[t] = expf(p[t] - mx));
    memset(out, 0, sizeof(float) * (size_t)L);
    for (int64_t t = 0; t < n; t++) {
        float w = p[t] / sum;
        for (int64_t i = 0; i < L; i++) out[i] += w * latents[t * L + i];
    }
}
