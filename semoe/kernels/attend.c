/* A decoding step's float32 pieces around the products: the RMS norm, grouped-query attention over
 * the KV cache (rotary, window and sinks), and the weighted sum of a MoE layer's experts into the
 * residual stream. */
#include "kernels.h"

/* RMS norm of M rows of D, float32: y = x / sqrt(mean(x^2) + eps) * w, or without w where it is NULL
 * (torch's seven small ops of a norm cost more than the norm at one token) */
void rmsnorm_f32(const float *x, const float *w, float eps, float *y, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) ss += xm[i] * xm[i];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        if (w)
            for (int64_t i = 0; i < D; i++) y[m * D + i] = xm[i] * r * w[i];
        else /* a norm without weights (Llama-4's q/k norm) */
            for (int64_t i = 0; i < D; i++) y[m * D + i] = xm[i] * r;
    }
}

/* q . k over n values of a KV cache from its element i0 (float32, or float16 where h16: kv_get) in 8
 * independent partial sums (vector lanes, no reassociation needed) added in a fixed order (hsum8's),
 * then the tail: the same value on every build and thread count, and in attend_rows_head's blocked
 * form. Inlined with h16 a constant, each cache type gets its own loop. */
static inline __attribute__((always_inline)) float dot_kv(const float *a, const void *b, int64_t i0, int64_t n,
                                                          int h16) {
    int64_t i = 0;
#ifdef __AVX2__
    __m256 v = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(b, i0 + i, h16), v);
    float d = hsum8(v);
#else
    float acc[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = MADD(acc[j], a[i + j], kv_get(b, i0 + i + j, h16));
    float d = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
    for (; i < n; i++) d = MADD(d, a[i], kv_get(b, i0 + i, h16));
    return d;
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    return dot_kv(a, b, 0, n, 0);
}

float dot_f32_n(const float *a, const float *b, int64_t n) { return dot_kv(a, b, 0, n, 0); }

/* One decoding step of grouped-query attention for one sequence, float32: rotate the first R dims
 * of q (H heads) and k (G heads) by halves with the position's cos/sin (R each; the other Dh - R
 * dims pass through), write k and v at position `pos` of the layer's cache (G, S, Dh each), then
 * each head's softmax over the positions it sees (all of 0..pos, or the last `window` of them) of
 * its group's keys, scaled by `scale`, times the values: out (H, Dh). With `sinks` (H logits, or
 * NULL), each head's softmax denominator also holds exp(sinks[h]) (gpt-oss), which takes no value.
 * The dozens of small ops this takes in torch cost more than its arithmetic at one token. Heads are
 * split over `threads` threads; each head's sums are its own, so the result does not depend on it. */
void attend_rotate(const float *q, const float *k, const float *v, const float *cos, const float *sin, void *kc,
                   void *vc, int64_t H, int64_t G, int64_t Dh, int64_t R, int64_t S, int64_t pos, float *qr, int h16) {
    int64_t half = R / 2;
    float row[h16 ? Dh : 1]; /* a float16 cache's key, rotated in float32 before it is rounded */
    for (int64_t h = 0; h < H + G; h++) {
        const float *x = h < H ? q + h * Dh : k + (h - H) * Dh;
        float *y = h < H ? qr + h * Dh : h16 ? row : (float *)kc + ((h - H) * S + pos) * Dh;
        for (int64_t i = 0; i < R; i++) y[i] = x[i] * cos[i] + (i < half ? -x[i + half] : x[i - half]) * sin[i];
        for (int64_t i = R; i < Dh; i++) y[i] = x[i];
        if (h >= H && h16) kv_row_put(kc, ((h - H) * S + pos) * Dh, row, Dh, 1);
    }
    for (int64_t g = 0; g < G; g++) kv_row_put(vc, (g * S + pos) * Dh, v + g * Dh, Dh, h16);
}

#ifdef __AVX2__
/* exp of eight lanes, x <= 0 (a softmax's shifted scores): 2^n times a degree-6 polynomial of the
 * remainder (Cephes' expf: within 2 ulp of expf); below -87.3, where expf is subnormal or 0, 0 */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

/* the largest of mx and p[t0..n): fmaxf's result (a maximum is the same in any order), eight at a
 * time where the build has AVX2 (a NaN score is passed over, as fmaxf passes it) */
static float max_from(const float *p, int64_t t0, int64_t n, float mx) {
    int64_t t = t0;
#ifdef __AVX2__
    if (n - t0 >= 8) {
        __m256 m = _mm256_set1_ps(mx);
        for (; t + 8 <= n; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(p + t), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(_mm_movehl_ps(h, h), h);
        h = _mm_max_ss(_mm_movehdup_ps(h), h);
        mx = _mm_cvtss_f32(h);
    }
#endif
    for (; t < n; t++) mx = fmaxf(mx, p[t]);
    return mx;
}

/* p[t] = exp(p[t] - mx) for t in t0..n-1 and their sum, in eight lanes then a fixed order: the same
 * values for a decoding step's head and a prompt's row (every build and thread count alike) */
static float softmax_exp(float *p, int64_t t0, int64_t n, float mx) {
    int64_t t = t0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), m));
        _mm256_storeu_ps(p + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; t < n; t++) sum += (p[t] = expf(p[t] - mx));
    return sum;
}

static inline __attribute__((always_inline)) void head_of(const float *qr, const void *kc, const void *vc,
                                                          int64_t H, int64_t G, int64_t Dh, int64_t S, int64_t t0,
                                                          int64_t n, float scale, const float *sinks, float *p,
                                                          float *out, int64_t h, int h16) {
    const float *qh = qr + h * Dh;
    const int64_t g0 = (h / (H / G)) * S * Dh; /* the group's first key and value */
    float *ph = p + h * n;
    float mx = sinks ? sinks[h] : -INFINITY;
    for (int64_t t = t0; t < n; t++) ph[t] = dot_kv(qh, kc, g0 + t * Dh, Dh, h16) * scale;
    mx = max_from(ph, t0, n, mx);
    float sum = softmax_exp(ph, t0, n, mx);
    if (sinks) sum += expf(sinks[h] - mx);
    float *o = out + h * Dh;
    memset(o, 0, sizeof(float) * (size_t)Dh);
    for (int64_t t = t0; t < n; t++) {
        float w = ph[t] / sum;
        for (int64_t i = 0; i < Dh; i++) o[i] = MADD(o[i], w, kv_get(vc, g0 + t * Dh + i, h16));
    }
}

void attend_head(const float *qr, const void *kc, const void *vc, int64_t H, int64_t G, int64_t Dh, int64_t S,
                 int64_t t0, int64_t n, float scale, const float *sinks, float *p, float *out, int64_t h, int h16) {
    if (h16)
        head_of(qr, kc, vc, H, G, Dh, S, t0, n, scale, sinks, p, out, h, 1);
    else
        head_of(qr, kc, vc, H, G, Dh, S, t0, n, scale, sinks, p, out, h, 0);
}

#ifdef __AVX2__
/* scores of two rows' queries qa, qb (Dh, a multiple of 8) against the keys of positions t0..t1-1
 * (a cache's, from its element k0) into pa, pb, times scale: dot_kv's sums, four positions and two
 * rows at a time (eight independent chains where one dot alone waits on each add) */
static inline __attribute__((always_inline)) void scores2(const float *qa, const float *qb, const void *kc, int64_t k0,
                                                          int64_t Dh, int64_t t0, int64_t t1, float scale, float *pa,
                                                          float *pb, int h16) {
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const int64_t k = k0 + t * Dh;
        for (int64_t c = 0; c < Dh; c += 8) {
            __m256 x = _mm256_loadu_ps(qa + c), y = _mm256_loadu_ps(qb + c), kv = kv_load8(kc, k + c, h16);
            a0 = _mm256_fmadd_ps(x, kv, a0), b0 = _mm256_fmadd_ps(y, kv, b0);
            kv = kv_load8(kc, k + Dh + c, h16);
            a1 = _mm256_fmadd_ps(x, kv, a1), b1 = _mm256_fmadd_ps(y, kv, b1);
            kv = kv_load8(kc, k + 2 * Dh + c, h16);
            a2 = _mm256_fmadd_ps(x, kv, a2), b2 = _mm256_fmadd_ps(y, kv, b2);
            kv = kv_load8(kc, k + 3 * Dh + c, h16);
            a3 = _mm256_fmadd_ps(x, kv, a3), b3 = _mm256_fmadd_ps(y, kv, b3);
        }
        pa[t] = hsum8(a0) * scale, pa[t + 1] = hsum8(a1) * scale, pa[t + 2] = hsum8(a2) * scale;
        pa[t + 3] = hsum8(a3) * scale;
        pb[t] = hsum8(b0) * scale, pb[t + 1] = hsum8(b1) * scale, pb[t + 2] = hsum8(b2) * scale;
        pb[t + 3] = hsum8(b3) * scale;
    }
    for (; t < t1; t++)
        pa[t] = dot_kv(qa, kc, k0 + t * Dh, Dh, h16) * scale, pb[t] = dot_kv(qb, kc, k0 + t * Dh, Dh, h16) * scale;
}

/* out_j (Dh, a multiple of 8) = sum over t0..t1-1 of w_j[t] v_t for nj rows (w_j = p + j * P; the
 * values a cache's, from its element v0), each output in t order from 0 (attend_head's sums: a weight
 * of 0 adds nothing), 16 outputs of four rows at a time held in registers */
static inline __attribute__((always_inline)) void weigh4(const float *p, int64_t P, int64_t nj, const void *vc,
                                                         int64_t v0, int64_t Dh, int64_t t0, int64_t t1, float *out,
                                                         int64_t stride, int h16) {
    for (int64_t c = 0; c < Dh; c += 16) {
        const int two = c + 16 <= Dh;
        __m256 acc[ROW_GROUP][2];
        for (int64_t j = 0; j < ROW_GROUP; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t t = t0; t < t1; t++) {
            const int64_t v = v0 + t * Dh + c;
            __m256 x0 = kv_load8(vc, v, h16), x1 = two ? kv_load8(vc, v + 8, h16) : x0;
            for (int64_t j = 0; j < nj; j++) {
                __m256 w = _mm256_broadcast_ss(p + j * P + t);
                acc[j][0] = _mm256_fmadd_ps(w, x0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w, x1, acc[j][1]);
            }
        }
        for (int64_t j = 0; j < nj; j++) {
            _mm256_storeu_ps(out + j * stride + c, acc[j][0]);
            if (two) _mm256_storeu_ps(out + j * stride + c + 8, acc[j][1]);
        }
    }
}
#endif

static inline __attribute__((always_inline)) void rows_of(const float *qr, const void *kc, const void *vc, int64_t H,
                                                          int64_t G, int64_t Dh, int64_t Dv, int64_t S, int64_t pos0,
                                                          int64_t nr, int64_t window, int64_t chunk, float scale,
                                                          const float *sinks, float *p, float *out, int64_t h,
                                                          int h16) {
    const int64_t k0 = (h / (H / G)) * S * Dh, v0 = (h / (H / G)) * S * Dv; /* the group's first key, value */
    const int64_t P = pos0 + nr;
    for (int64_t r0 = 0; r0 < nr; r0 += ROW_GROUP) {
        const int64_t nj = nr - r0 < ROW_GROUP ? nr - r0 : ROW_GROUP;
        int64_t t0[ROW_GROUP] = {0}, n[ROW_GROUP] = {0};
        for (int64_t j = 0; j < nj; j++) {
            n[j] = pos0 + r0 + j + 1;
            t0[j] = first_seen(window, chunk, n[j] - 1);
        }
        const int64_t lo = t0[0], hi = n[nj - 1];
        const float *q = qr + (r0 * H + h) * Dh;
#ifdef __AVX2__
        const int blocked = Dh % 8 == 0, weighed = Dv % 8 == 0;
#endif
        for (int64_t j = 0; j < nj; j++) {
#ifdef __AVX2__
            if (blocked && j + 1 < nj) {
                scores2(q + j * H * Dh, q + (j + 1) * H * Dh, kc, k0, Dh, lo, hi, scale, p + j * P, p + (j + 1) * P,
                        h16);
                j++;
                continue;
            }
#endif
            for (int64_t t = lo; t < hi; t++) p[j * P + t] = dot_kv(q + j * H * Dh, kc, k0 + t * Dh, Dh, h16) * scale;
        }
        for (int64_t j = 0; j < nj; j++) { /* each row's softmax over its own positions; 0 elsewhere */
            float mx = sinks ? sinks[h] : -INFINITY, *pj = p + j * P;
            mx = max_from(pj, t0[j], n[j], mx);
            float sum = softmax_exp(pj, t0[j], n[j], mx);
            if (sinks) sum += expf(sinks[h] - mx);
            for (int64_t t = lo; t < hi; t++) pj[t] = t >= t0[j] && t < n[j] ? pj[t] / sum : 0.0f;
        }
        float *o = out + r0 * H * Dv + h * Dv;
#ifdef __AVX2__
        if (weighed) { /* else: Dv not a multiple of 8 */
            weigh4(p, P, nj, vc, v0, Dv, lo, hi, o, H * Dv, h16);
            continue;
        }
#endif
        for (int64_t j = 0; j < nj; j++) {
            float *oj = o + j * H * Dv;
            memset(oj, 0, sizeof(float) * (size_t)Dv);
            for (int64_t t = lo; t < hi; t++)
                for (int64_t i = 0; i < Dv; i++) oj[i] = MADD(oj[i], p[j * P + t], kv_get(vc, v0 + t * Dv + i, h16));
        }
    }
}

/* Head h of a prompt's nr rows at positions pos0.. (their k and v already in the caches: keys (G, S,
 * Dh), values (G, S, Dv), float16 where h16), queries rotated in qr (nr, H, Dh), into out (nr, H * Dv):
 * each row as attend_head computes it where Dv = Dh (the same sums in the same order), ROW_GROUP rows
 * at a time reading each position's key and value once for all of them, and their sums in independent
 * chains. window: 0, or the positions a row sees, itself included; chunk: 0, or a row at p sees only
 * p - p % chunk..p. p: ROW_GROUP * (pos0 + nr) floats of room. */
void attend_rows_head(const float *qr, const void *kc, const void *vc, int64_t H, int64_t G, int64_t Dh, int64_t Dv,
                      int64_t S, int64_t pos0, int64_t nr, int64_t window, int64_t chunk, float scale,
                      const float *sinks, float *p, float *out, int64_t h, int h16) {
    if (h16)
        rows_of(qr, kc, vc, H, G, Dh, Dv, S, pos0, nr, window, chunk, scale, sinks, p, out, h, 1);
    else
        rows_of(qr, kc, vc, H, G, Dh, Dv, S, pos0, nr, window, chunk, scale, sinks, p, out, h, 0);
}

int attend_decode_f32(const float *q, const float *k, const float *v, const float *cos, const float *sin, float *kc,
                      float *vc, int64_t H, int64_t G, int64_t Dh, int64_t R, int64_t S, int64_t pos, int64_t window,
                      float scale, const float *sinks, float *out, int threads) {
    int64_t n = pos + 1, t0 = first_seen(window, 0, pos);
    float *qr = malloc(sizeof(float) * (size_t)(H * Dh)), *p = malloc(sizeof(float) * (size_t)(n * H));
    if (!qr || !p) return free(qr), free(p), -1;
    attend_rotate(q, k, v, cos, sin, kc, vc, H, G, Dh, R, S, pos, qr, 0);
    /* a short context is not worth waking a second thread for */
#pragma omp parallel for num_threads((n - t0) * H * Dh >= 32768 ? threads : 1) schedule(static)
    for (int64_t h = 0; h < H; h++) attend_head(qr, kc, vc, H, G, Dh, S, t0, n, scale, sinks, p, out, h, 0);
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
 * permutation for queries and keys, as semoe.model.attention.apply_rope does). */
void rope_rotate(const float *x, const float *cos, const float *sin, int64_t R, int interleave, float *y) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        y[i] = a * cos[i] - b * sin[i];
        y[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One head of latent attention's absorbed form (DeepSeek, Kimi) over n cached positions (0..n-1, or
 * idx[0..n) where idx is not NULL: the positions DeepSeek sparse attention chose, in order): the head's
 * query in the latent space ql (L) and its rotated rotary part qr (R), scores against each position's
 * latent (rows of L) and rotary key (the first R of rows of rs), times `scale`, softmax, and the
 * latents' weighted sum into out (L); p: n floats of room. */
void mla_head(const float *ql, const float *qr, const float *latents, const float *rots, int64_t L, int64_t R,
              int64_t rs, const int32_t *idx, int64_t n, float scale, float *p, float *out) {
#define POS(i) (idx ? (int64_t)idx[i] : (i))
    for (int64_t i = 0; i < n; i++)
        p[i] = (dot_f32(ql, latents + POS(i) * L, L) + dot_f32(qr, rots + POS(i) * rs, R)) * scale;
    float sum = softmax_exp(p, 0, n, max_from(p, 0, n, -INFINITY));
    memset(out, 0, sizeof(float) * (size_t)L);
    for (int64_t i = 0; i < n; i++) {
        const float w = p[i] / sum, *lat = latents + POS(i) * L;
        for (int64_t j = 0; j < L; j++) out[j] += w * lat[j];
    }
#undef POS
}

/* LayerNorm of one row of D: (x - mean) / sqrt(var + eps) * w + b, the variance biased, as torch's */
void layernorm_f32(const float *x, const float *w, const float *b, float eps, float *y, int64_t D) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t i = 0; i < D; i++) mean += x[i];
    mean /= (float)D;
    for (int64_t i = 0; i < D; i++) var += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(var / (float)D + eps);
    for (int64_t i = 0; i < D; i++) y[i] = (x[i] - mean) * r * w[i] + b[i];
}

/* The indexer's score of one position for one query: the sum over Hi heads of iw[h] * relu(iq_h . k
 * * ds), iw the head weights already over sqrt(Hi) and ds 1 / sqrt(Di) (decode_abi.h's `Indexer`;
 * `index_dim_scale`) */
float index_score(const float *iq, const float *iw, int64_t Hi, int64_t Di, float ds, const float *k) {
    float sc = 0.0f;
    for (int64_t h = 0; h < Hi; h++) {
        const float d = dot_f32(iq + h * Di, k, Di) * ds;
        sc += iw[h] * (d > 0.0f ? d : 0.0f);
    }
    return sc;
}

/* the k-th largest of v[0..n) (1 <= k <= n), found in place (v is reordered): Hoare's selection */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const float t = v[i];
                v[i] = v[j], v[j] = t;
                i++, j--;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            break;
    }
    return v[want];
}

/* Which of n positions with scores sc a query reads: all where n <= k, else the k of the best scores
 * (among equal scores at the threshold the earliest), into idx in position order; returns how many
 * (min(n, k)). scratch: n floats. A NaN score (none from finite weights) counts as the lowest. */
int64_t choose_top(const float *sc, int64_t n, int64_t k, int32_t *idx, float *scratch) {
    if (n <= k) {
        for (int64_t t = 0; t < n; t++) idx[t] = (int32_t)t;
        return n;
    }
#define VAL(t) (sc[t] == sc[t] ? sc[t] : -INFINITY)
    for (int64_t t = 0; t < n; t++) scratch[t] = VAL(t);
    const float thr = kth_largest(scratch, n, k);
    int64_t above = 0, m = 0;
    for (int64_t t = 0; t < n; t++) above += VAL(t) > thr;
    for (int64_t t = 0, ties = k - above; t < n && m < k; t++) {
        const int tie = VAL(t) == thr && ties > 0;
        ties -= tie;
        if (VAL(t) > thr || tie) idx[m++] = (int32_t)t;
    }
#undef VAL
    return m; /* k: `above` < k scores exceed the k-th, and at least k - above equal it */
}
