/* gpt-oss's MXFP4 weights times quantized rows of x (gemv.c's header comment says the layouts):
 * `fp4_block` for decoding's few rows and, on AVX2, a prompt's many (each weight row's codes decoded
 * once for several rows of x, from the codes `acts_fill` lays out for it), and `gemv_mxfp4`.
 * The avx512-vnni build takes the same AVX2 code: on an AVX-512 Xeon its own 512-bit form (one pair
 * of blocks a step, the exponents' powers scalar) decoded gpt-oss-20b at 4.31 tok/s against 5.73 and
 * took 37.1 s against 15.3 for a 256-token prompt, which it had no batched form for. */
#include "kernels.h"

/* MXFP4. Twice each e2m1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so each
 * block's product with the quantized x is an exact integer sum, as for int8, scaled by
 * d_x * 2^(e - 128); 2^(e - 128) is exact in float32 for every e8m0 exponent. */
static const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#ifdef SEMOE_HAS_AVX2
static const uint8_t FP4_OFFSET[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}; /* twice + 12 */
#endif

static inline float pow2_e8m0(uint8_t e) { /* 2^(e - 128) from its bits: e 0 and 1 are subnormal */
    union {
        uint32_t u;
        float f;
    } v = {e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e};
    return v.f;
}

/* ROWS rows (rows past n are not read) of G = I / 32 blocks against one quantized row of x: scaled sums */
static inline void fp4_rows(const uint8_t *w, const uint8_t *e, int64_t G, int n, const int8_t *qx,
                            const float *dx, float *out) {
#if defined(SEMOE_HAS_AVX2)
    /* Eight blocks (128 bytes of a row) at a time. The codes index twice their value plus 12 (0 to 24,
     * unsigned), so one maddubs multiplies them by x's signed codes; the 12 * x it adds is the same for
     * every row and is taken off once per pair of blocks (every int16 sum stays within +-12192). The
     * eight blocks' integer sums come together in one vector (three hadds) and are scaled at once. */
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_OFFSET));
    const __m256i low4 = _mm256_set1_epi8(0x0F), twelve = _mm256_set1_epi8(12), ones = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), one = _mm256_set1_epi32(1);
    const __m256i sub_one = _mm256_set1_epi32(0x00200000);
    const int64_t rb = G * 16;
    __m256 f[ROWS];
    for (int r = 0; r < ROWS; r++) f[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        __m256i xa[4], xb[4], c16[4];
        for (int p = 0; p < 4; p++) { /* x of blocks g + 2p and g + 2p + 1: inputs 0-15 of each, then 16-31 */
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + (g + 2 * p) * QB));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + (g + 2 * p + 1) * QB));
            xa[p] = _mm256_permute2x128_si256(x0, x1, 0x20);
            xb[p] = _mm256_permute2x128_si256(x0, x1, 0x31);
            c16[p] = _mm256_add_epi16(_mm256_maddubs_epi16(twelve, xa[p]), _mm256_maddubs_epi16(twelve, xb[p]));
        }
        /* the blocks' order after the hadds: 0, 2, 4, 6 in the low lane, 1, 3, 5, 7 in the high one */
        const __m256 dv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(dx + g), order);
        for (int r = 0; r < ROWS; r++) {
            int64_t row = r < n ? r : 0;
            const uint8_t *wr = w + row * rb + g * 16;
            _mm_prefetch((const char *)(wr + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + PREFETCH + 64), _MM_HINT_T0);
            __m256i s[4];
            for (int p = 0; p < 4; p++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(wr + 32 * p));
                __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                __m256i wa = _mm256_shuffle_epi8(lut, _mm256_unpacklo_epi8(lo, hi));
                __m256i wb = _mm256_shuffle_epi8(lut, _mm256_unpackhi_epi8(lo, hi));
                __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(wa, xa[p]), _mm256_maddubs_epi16(wb, xb[p]));
                s[p] = _mm256_madd_epi16(_mm256_sub_epi16(t, c16[p]), ones);
            }
            __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
            /* 2^(e - 128) of the eight exponents, in the same order: (e - 1) << 23, or subnormal for e < 2 */
            __m256i ev = _mm256_permutevar8x32_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + row * G + g))), order);
            __m256i bits = _mm256_blendv_epi8(_mm256_sllv_epi32(sub_one, ev),
                                              _mm256_slli_epi32(_mm256_sub_epi32(ev, one), 23),
                                              _mm256_cmpgt_epi32(ev, one));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dv, _mm256_castsi256_ps(bits)), f[r]);
        }
    }
    const __m256i lut2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_TWICE));
    const __m128i low4x = _mm_set1_epi8(0x0F);
    for (; g < G; g++) { /* the last G % 8 blocks, one at a time */
        __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + g * QB));
        for (int r = 0; r < ROWS; r++) {
            int64_t row = r < n ? r : 0;
            __m128i b = _mm_loadu_si128((const __m128i *)(w + row * rb + g * 16));
            __m128i lo = _mm_and_si128(b, low4x), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4x);
            /* codes in input order: the low lane inputs 0-15, the high lane 16-31 */
            __m256i wv = _mm256_shuffle_epi8(lut2, _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
            __m256 d1 = _mm256_set1_ps(dx[g] * pow2_e8m0(e[row * G + g]));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv)), d1, f[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) out[r] = hsum8(f[r]);
#else
    for (int r = 0; r < n; r++) {
        const uint8_t *wr = w + r * G * 16;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++) {
            int32_t s = 0;
            for (int j = 0; j < 16; j++) {
                uint8_t byte = wr[g * 16 + j];
                s += FP4_TWICE[byte & 0x0F] * qx[g * QB + 2 * j] + FP4_TWICE[byte >> 4] * qx[g * QB + 2 * j + 1];
            }
            acc += dx[g] * pow2_e8m0(e[r * G + g]) * (float)s;
        }
        out[r] = acc;
    }
#endif
}

#ifdef SEMOE_HAS_AVX2
#define XT 4 /* rows of x multiplied by each weight row's codes once they are decoded */
/* n weight rows (G blocks each) against every row of x (a prompt's: a->qp, c16 and dp made), y[m * O + r]:
 * fp4_rows' sums, each weight row's codes decoded once for XT rows of x */
static void fp4_rows_many(const uint8_t *w, const uint8_t *e, int64_t G, int n, const Acts *a, float *y,
                          int64_t O) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_OFFSET));
    const __m256i lut2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_TWICE));
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), one = _mm256_set1_epi32(1);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), sub_one = _mm256_set1_epi32(0x00200000);
    const __m128i low4x = _mm_set1_epi8(0x0F);
    const int64_t Ip = a->Ip, P = Ip / 64, B = Ip / QB, G8 = G / 8 * 8;
    for (int r = 0; r < n; r++) {
        const uint8_t *wr = w + r * G * 16, *er = e + r * G;
        for (int64_t m0 = 0; m0 < a->M; m0 += XT) {
            const int mt = a->M - m0 < XT ? (int)(a->M - m0) : XT;
            __m256 f[XT];
            for (int i = 0; i < XT; i++) f[i] = _mm256_setzero_ps();
            for (int64_t g = 0; g < G8; g += 8) {
                __m256i wa[4], wb[4];
                for (int p = 0; p < 4; p++) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)(wr + g * 16 + 32 * p));
                    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                    wa[p] = _mm256_shuffle_epi8(lut, _mm256_unpacklo_epi8(lo, hi));
                    wb[p] = _mm256_shuffle_epi8(lut, _mm256_unpackhi_epi8(lo, hi));
                }
                __m256i ev = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(er + g))),
                                                         order);
                __m256 pv = _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_sllv_epi32(sub_one, ev),
                                                                   _mm256_slli_epi32(_mm256_sub_epi32(ev, one), 23),
                                                                   _mm256_cmpgt_epi32(ev, one)));
                for (int i = 0; i < mt; i++) {
                    const int64_t m = m0 + i;
                    const int8_t *xq = a->qp + m * Ip + g * 32;
                    const int16_t *cq = a->c16 + (m * P + g / 2) * 16;
                    __m256i s[4];
                    for (int p = 0; p < 4; p++) {
                        __m256i t = _mm256_add_epi16(
                            _mm256_maddubs_epi16(wa[p], _mm256_loadu_si256((const __m256i *)(xq + 64 * p))),
                            _mm256_maddubs_epi16(wb[p], _mm256_loadu_si256((const __m256i *)(xq + 64 * p + 32))));
                        s[p] = _mm256_madd_epi16(_mm256_sub_epi16(t, _mm256_loadu_si256((const __m256i *)(cq + 16 * p))),
                                                 ones);
                    }
                    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
                    f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(_mm256_loadu_ps(a->dp + m * B + g), pv),
                                           f[i]);
                }
            }
            for (int64_t g = G8; g < G; g++) { /* the last G % 8 blocks, one at a time */
                __m128i b = _mm_loadu_si128((const __m128i *)(wr + g * 16));
                __m128i lo = _mm_and_si128(b, low4x), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4x);
                __m256i wv = _mm256_shuffle_epi8(lut2, _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
                for (int i = 0; i < mt; i++) {
                    const int64_t m = m0 + i;
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + m * Ip + g * QB));
                    __m256 d1 = _mm256_set1_ps(a->d[m * B + g] * pow2_e8m0(er[g]));
                    f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv)), d1, f[i]);
                }
            }
            for (int i = 0; i < mt; i++) y[(m0 + i) * O + r] = hsum8(f[i]);
        }
    }
}
#endif

/* mxfp4: block b (ROWS output rows) of y (M, O), blocks (O, G, 16) and e8m0 exponents (O, G) */
void fp4_block(const uint8_t *w, const uint8_t *e, int64_t O, const Acts *a, int64_t b, float *y) {
    int64_t G = a->I / QB, o0 = b * ROWS;
    int n = (int)(O - o0 < ROWS ? O - o0 : ROWS);
#ifdef SEMOE_HAS_AVX2
    if (a->qp) {
        fp4_rows_many(w + o0 * G * 16, e + o0 * G, G, n, a, y + o0, O);
        return;
    }
#endif
    for (int64_t m = 0; m < a->M; m++) {
        float out[ROWS];
        fp4_rows(w + o0 * G * 16, e + o0 * G, G, n, a->q + m * a->Ip, a->d + m * (a->Ip / QB), out);
        for (int r = 0; r < n; r++) y[m * O + o0 + r] = out[r];
    }
}

void acts_fp4(Acts *a) {
#ifdef SEMOE_HAS_AVX2
    if (a->M < 2) return;
    a->qp = malloc((size_t)(a->M * a->Ip));
    a->c16 = malloc(sizeof(int16_t) * (size_t)(a->M * a->Ip / 4));
    a->dp = malloc(sizeof(float) * (size_t)(a->M * a->Ip / QB));
    if (!(a->qp && a->c16 && a->dp)) { /* memory short: fp4_block takes the rows one at a time */
        free(a->qp), free(a->c16), free(a->dp);
        a->qp = NULL, a->c16 = NULL, a->dp = NULL;
        return;
    }
    const __m256i twelve = _mm256_set1_epi8(12);
    const int64_t P = a->Ip / 64, B = a->Ip / QB;
    for (int64_t m = 0; m < a->M; m++) {
        for (int64_t p = 0; p < P; p++) {
            const int8_t *x = a->q + m * a->Ip + p * 64;
            __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 32));
            __m256i xa = _mm256_permute2x128_si256(x0, x1, 0x20), xb = _mm256_permute2x128_si256(x0, x1, 0x31);
            _mm256_storeu_si256((__m256i *)(a->qp + m * a->Ip + p * 64), xa);
            _mm256_storeu_si256((__m256i *)(a->qp + m * a->Ip + p * 64 + 32), xb);
            _mm256_storeu_si256((__m256i *)(a->c16 + (m * P + p) * 16),
                                _mm256_add_epi16(_mm256_maddubs_epi16(twelve, xa), _mm256_maddubs_epi16(twelve, xb)));
        }
        static const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
        for (int64_t k = 0; k < B; k++)
            a->dp[m * B + k] = k / 8 * 8 + 8 <= B ? a->d[m * B + k / 8 * 8 + order[k % 8]] : a->d[m * B + k];
    }
#else
    (void)a;
#endif
}

int gemv_mxfp4(const float *x, const uint8_t *w, const uint8_t *e, float *y, int64_t M, int64_t O, int64_t I,
               int threads) {
    Acts a = acts_alloc(M, I, 0);
    if (!acts_ok(&a)) return acts_free(&a), -1;
    acts_fill(&a, x);
    acts_fp4(&a);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < i8_blocks(O); b++) fp4_block(w, e, O, &a, b, y);
    acts_free(&a);
    return 0;
}

