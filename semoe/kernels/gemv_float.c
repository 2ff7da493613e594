/* Products of a few rows with float32 and bfloat16 weights (O, I), in float32: `gemv_f32`,
 * `gemv_bf16` and their block bodies (kernels.h). torch's own float32 product keeps to one core at
 * a decoding step's sizes, and its bfloat16 one widens at half the memory bound: these split the
 * output rows over the threads and stream each weight row once for all rows of x. */
#include "kernels.h"

/* bfloat16 weights (O, I) against float32 x: each code widened to float32 in registers (a bfloat16
 * is the top half of a float32), float32 sums. */
void bf16_block(const float *x, const uint16_t *w, float *y, int64_t M, int64_t O, int64_t I, int64_t b) {
    int64_t o0 = b * ROWS;
    int n = (int)(O - o0 < ROWS ? O - o0 : ROWS);
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * I;
#ifdef SEMOE_VNNI
        /* the float32 kernel's order (one row after another, two accumulators, 32 columns a step,
         * the rest one by one), so that a bfloat16 weight gives the bits of its float32 widening */
        int64_t k32 = I / 32 * 32;
        for (int r = 0; r < n; r++) {
            const uint16_t *wr = w + (o0 + r) * I;
            __m512 f0 = _mm512_setzero_ps(), f1 = f0;
            for (int64_t j = 0; j < k32; j += 32) {
                _mm_prefetch((const char *)(wr + j) + PREFETCH, _MM_HINT_T0);
                __m512i h0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr + j)));
                __m512i h1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr + j + 16)));
                f0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h0, 16)), _mm512_loadu_ps(xm + j), f0);
                f1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h1, 16)), _mm512_loadu_ps(xm + j + 16), f1);
            }
            float acc = _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
            for (int64_t t = k32; t < I; t++) {
                uint32_t bits = (uint32_t)wr[t] << 16;
                float v;
                memcpy(&v, &bits, 4);
                acc = MADD(acc, v, xm[t]);
            }
            y[m * O + o0 + r] = acc;
        }
#elif defined(SEMOE_AVX2)
        __m256 f[ROWS];
        for (int r = 0; r < ROWS; r++) f[r] = _mm256_setzero_ps();
        const uint16_t *wr[ROWS];
        for (int r = 0; r < ROWS; r++) wr[r] = w + (o0 + (r < n ? r : 0)) * I;
        int64_t k = 0;
        for (; k + 8 <= I; k += 8) {
            __m256 xv = _mm256_loadu_ps(xm + k);
            for (int r = 0; r < ROWS; r++) {
                _mm_prefetch((const char *)(wr[r] + k) + PREFETCH, _MM_HINT_T0);
                __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr[r] + k)));
                f[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), xv, f[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            float acc = hsum8(f[r]);
            for (int64_t t = k; t < I; t++) {
                uint32_t bits = (uint32_t)wr[r][t] << 16;
                float v;
                memcpy(&v, &bits, 4);
                acc = MADD(acc, v, xm[t]);
            }
            y[m * O + o0 + r] = acc;
        }
#else
        for (int r = 0; r < n; r++) {
            const uint16_t *wr = w + (o0 + r) * I;
            float acc = 0.0f;
            for (int64_t k = 0; k < I; k++) {
                uint32_t bits = (uint32_t)wr[k] << 16;
                float v;
                memcpy(&v, &bits, 4);
                acc = MADD(acc, v, xm[k]);
            }
            y[m * O + o0 + r] = acc;
        }
#endif
    }
}

void gemv_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t O, int64_t I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < i8_blocks(O); b++) bf16_block(x, w, y, M, O, I, b);
}

/* float32 weights (O, I) against float32 x. torch's own float32 product stays on one core at these
 * sizes (12.7 GB/s on one thread, 12.4 on two, on an AVX2 server core): this one splits the rows
 * over the threads and prefetches each row's stream. */
void f32_block(const float *x, const float *w, float *y, int64_t M, int64_t O, int64_t I, int64_t b) {
    int64_t o0 = b * ROWS;
    int n = (int)(O - o0 < ROWS ? O - o0 : ROWS);
    const float *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (o0 + (r < n ? r : 0)) * I;
    int64_t m = 0;
#if defined(SEMOE_VNNI)
    /* A batch's rows three at a time against the block's four weight rows: 24 accumulators, each
     * weight vector loaded once for three rows and each row's vector once for four weight rows (a row
     * alone below streams the weights again for every row: a prompt's products ran at half the AVX2
     * build's speed on an AVX-512 Xeon). Each output sums as a row alone does (two accumulators,
     * reduced, then the tail), so the same bits. */
    const int64_t k32 = I / 32 * 32;
    for (; m + 3 <= M; m += 3) {
        const float *x0 = x + m * I, *x1 = x0 + I, *x2 = x1 + I;
        __m512 f[ROWS][3][2];
        for (int r = 0; r < ROWS; r++)
            for (int i = 0; i < 3; i++) f[r][i][0] = f[r][i][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k32; j += 32) {
            __m512 a0 = _mm512_loadu_ps(x0 + j), a1 = _mm512_loadu_ps(x1 + j), a2 = _mm512_loadu_ps(x2 + j);
            __m512 b0 = _mm512_loadu_ps(x0 + j + 16), b1 = _mm512_loadu_ps(x1 + j + 16);
            __m512 b2 = _mm512_loadu_ps(x2 + j + 16);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                __m512 wa = _mm512_loadu_ps(wr[r] + j), wb = _mm512_loadu_ps(wr[r] + j + 16);
                f[r][0][0] = _mm512_fmadd_ps(wa, a0, f[r][0][0]);
                f[r][1][0] = _mm512_fmadd_ps(wa, a1, f[r][1][0]);
                f[r][2][0] = _mm512_fmadd_ps(wa, a2, f[r][2][0]);
                f[r][0][1] = _mm512_fmadd_ps(wb, b0, f[r][0][1]);
                f[r][1][1] = _mm512_fmadd_ps(wb, b1, f[r][1][1]);
                f[r][2][1] = _mm512_fmadd_ps(wb, b2, f[r][2][1]);
            }
        }
        const float *xs[3] = {x0, x1, x2};
        for (int r = 0; r < n; r++)
            for (int i = 0; i < 3; i++) {
                float acc = _mm512_reduce_add_ps(_mm512_add_ps(f[r][i][0], f[r][i][1]));
                for (int64_t t = k32; t < I; t++) acc = MADD(acc, wr[r][t], xs[i][t]);
                y[(m + i) * O + o0 + r] = acc;
            }
    }
#elif defined(SEMOE_AVX2)
    /* A batch's rows three at a time: twelve accumulators, each weight vector loaded once for three
     * rows (one row is bound by memory, a batch by these loads and the fmas). Each output sums in
     * the same order as a row alone below, so the same bits. */
    for (; m + 3 <= M; m += 3) {
        const float *xs[3] = {x + m * I, x + (m + 1) * I, x + (m + 2) * I};
        __m256 f0[ROWS], f1[ROWS], f2[ROWS];
        for (int r = 0; r < ROWS; r++) f0[r] = f1[r] = f2[r] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= I; k += 8) {
            __m256 a = _mm256_loadu_ps(xs[0] + k), c = _mm256_loadu_ps(xs[1] + k), e = _mm256_loadu_ps(xs[2] + k);
            for (int r = 0; r < ROWS; r++) {
                __m256 wv = _mm256_loadu_ps(wr[r] + k);
                f0[r] = _mm256_fmadd_ps(wv, a, f0[r]);
                f1[r] = _mm256_fmadd_ps(wv, c, f1[r]);
                f2[r] = _mm256_fmadd_ps(wv, e, f2[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            float acc[3] = {hsum8(f0[r]), hsum8(f1[r]), hsum8(f2[r])};
            for (int i = 0; i < 3; i++) {
                for (int64_t t = k; t < I; t++) acc[i] = MADD(acc[i], wr[r][t], xs[i][t]);
                y[(m + i) * O + o0 + r] = acc[i];
            }
        }
    }
#endif
    for (; m < M; m++) {
        const float *xm = x + m * I;
        float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t k = 0;
#if defined(SEMOE_VNNI)
        /* the block's four rows side by side, two accumulators a row (each row sums as it did one
         * after another, so the same bits): one row at a time streamed 6-10% slower on the AMX Xeon
         * (a qwen3_moe step of wide experts: 25-29 GB/s against 29-34), where the AVX2 build's four
         * streams had been faster on it and on the AVX-512 EPYC */
        int64_t k16 = I / 32 * 32;
        __m512 f[ROWS][2];
        for (int r = 0; r < ROWS; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k16; j += 32) {
            const __m512 a = _mm512_loadu_ps(xm + j), b = _mm512_loadu_ps(xm + j + 16);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                f[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[r] + j), a, f[r][0]);
                f[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[r] + j + 16), b, f[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(f[r][0], f[r][1]));
        k = k16;
#elif defined(SEMOE_AVX2)
        __m256 f[ROWS];
        for (int r = 0; r < ROWS; r++) f[r] = _mm256_setzero_ps();
        /* no software prefetch: the hardware's keeps up with four float32 streams (measured 15%
         * faster without, where the integer kernels above need it) */
        for (; k + 8 <= I; k += 8) {
            __m256 xv = _mm256_loadu_ps(xm + k);
            for (int r = 0; r < ROWS; r++) f[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[r] + k), xv, f[r]);
        }
        for (int r = 0; r < ROWS; r++) acc[r] = hsum8(f[r]);
#endif
        for (int r = 0; r < n; r++) {
            for (int64_t t = k; t < I; t++) acc[r] = MADD(acc[r], wr[r][t], xm[t]);
            y[m * O + o0 + r] = acc[r];
        }
    }
}

void gemv_f32(const float *x, const float *w, float *y, int64_t M, int64_t O, int64_t I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < i8_blocks(O); b++) f32_block(x, w, y, M, O, I, b);
}

/* y (M, O) = x (M, I) @ W for a float32 weight laid out (I, O), in-major, as gpt-oss's fused experts
 * are: each thread takes a strip of the output columns and streams that strip of every weight row
 * once for all rows of x, four weight rows at a time: y[m, strip] += x[m, i..i+3] . W[i..i+3, strip]
 * (multiply-adds across the strip, which the compiler vectorizes). Each output sums over i in the
 * same order whatever the thread count. torch's x @ W keeps to one core at these sizes, as its
 * (O, I) product does. */
void gemv_f32_io(const float *restrict x, const float *restrict w, float *restrict y, int64_t M, int64_t O,
                 int64_t I, int threads) {
    int64_t width = ((O + threads - 1) / threads + 15) / 16 * 16;
    int64_t strips = (O + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        int64_t c0 = s * width, n = (c0 + width < O ? c0 + width : O) - c0;
        for (int64_t m = 0; m < M; m++) memset(y + m * O + c0, 0, sizeof(float) * (size_t)n);
        int64_t i = 0;
        for (; i + 4 <= I; i += 4) {
            const float *restrict w0 = w + i * O + c0, *restrict w1 = w0 + O, *restrict w2 = w1 + O,
                                  *restrict w3 = w2 + O;
            for (int64_t m = 0; m < M; m++) {
                const float x0 = x[m * I + i], x1 = x[m * I + i + 1], x2 = x[m * I + i + 2], x3 = x[m * I + i + 3];
                float *restrict ym = y + m * O + c0;
#pragma omp simd
                for (int64_t c = 0; c < n; c++) ym[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
            }
        }
        for (; i < I; i++) {
            const float *restrict wi = w + i * O + c0;
            for (int64_t m = 0; m < M; m++) {
                const float xi = x[m * I + i];
                float *restrict ym = y + m * O + c0;
#pragma omp simd
                for (int64_t c = 0; c < n; c++) ym[c] += xi * wi[c];
            }
        }
    }
}

int64_t io_blocks(int64_t O) { return (O + IO_STRIP - 1) / IO_STRIP; }

static inline float bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* One strip of IO_STRIP columns of y (O) = x (I) @ W, W (I, O) in-major, float32 or bfloat16: the
 * strip of every weight row streamed once, four rows at a time. The same sums in the same order as
 * `gemv_f32_io`'s for one row of x. The one-call step multiplies gpt-oss's float experts with it,
 * their blocks shared out with the other chosen experts'. A strip's rows lie a whole weight row
 * apart: on the 2-core bench machine strips of 1024 columns (4 KiB a row) streamed 16 GB/s on one
 * thread against 14 for 256 columns, and prefetching rows ahead in software slowed both; that is
 * still under gemv_f32_io's contiguous half-rows (25 GB/s), which cannot share out its work with
 * the other experts' blocks. */
void io_block(const float *restrict x, const void *w, int bf16, int64_t O, int64_t I, int64_t b, float *restrict y) {
    const int64_t c0 = b * IO_STRIP, n = (c0 + IO_STRIP < O ? c0 + IO_STRIP : O) - c0, size = bf16 ? 2 : 4;
    const char *base = (const char *)w + c0 * size;
    float acc[IO_STRIP];
    for (int64_t c = 0; c < n; c++) acc[c] = 0.0f;
    int64_t i = 0;
    for (; i + 4 <= I; i += 4) {
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
        if (bf16) {
            const uint16_t *restrict w0 = (const uint16_t *)base + i * O, *restrict w1 = w0 + O, *restrict w2 = w1 + O,
                                     *restrict w3 = w2 + O;
#pragma omp simd
            for (int64_t c = 0; c < n; c++)
                acc[c] += x0 * bf16_to_f32(w0[c]) + x1 * bf16_to_f32(w1[c]) + x2 * bf16_to_f32(w2[c]) +
                          x3 * bf16_to_f32(w3[c]);
        } else {
            const float *restrict w0 = (const float *)base + i * O, *restrict w1 = w0 + O, *restrict w2 = w1 + O,
                                  *restrict w3 = w2 + O;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) acc[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
        }
    }
    for (; i < I; i++) {
        const float xi = x[i];
        if (bf16) {
            const uint16_t *restrict wi = (const uint16_t *)base + i * O;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) acc[c] += xi * bf16_to_f32(wi[c]);
        } else {
            const float *restrict wi = (const float *)base + i * O;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) acc[c] += xi * wi[c];
        }
    }
    for (int64_t c = 0; c < n; c++) y[c0 + c] = acc[c];
}

/* An e4m3 code's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal,
 * m / 8 * 2^-6. (0x7F and 0xFF are e4m3fn's NaN; a weight holds none, and they read as 480 here.) */
static inline float fp8_value(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
    return c & 0x80 ? -v : v;
}

#if defined(__AVX2__) && defined(__F16C__)
/* 16 e4m3 codes as float32 / 2^8, exactly: each code's 7 magnitude bits moved to half precision's
 * exponent and mantissa (5 and 10 bits: the exponent bias 15 against e4m3's 7 leaves a factor
 * 2^-8, subnormals included, which F16C widens exactly), its sign to the half's sign */
static inline void fp8x16(const uint8_t *c, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
    __m256i sign = _mm256_and_si256(h, _mm256_set1_epi16(0x80));
    __m256i half = _mm256_or_si256(_mm256_slli_epi16(sign, 8), _mm256_slli_epi16(_mm256_xor_si256(h, sign), 7));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}
#endif

/* FP8 weights computed as FP8: per row, each block of g inputs' sum of code value times x, in
 * float32, then times the block's scale. That is the dequantized weight's product but for the
 * rounding: no weight is widened into memory, and none is rounded to bfloat16 first. */
void fp8_block(const float *x, const uint8_t *w, const float *s, float *y, int64_t M, int64_t O, int64_t I, int64_t g,
               int64_t b) {
    const int64_t o0 = b * ROWS, cols = (I + g - 1) / g;
    const int n = (int)(O - o0 < ROWS ? O - o0 : ROWS);
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * I;
        for (int r = 0; r < n; r++) {
            const uint8_t *wr = w + (o0 + r) * I;
            const float *sr = s + (o0 + r) / g * cols;
            float acc = 0.0f;
            int64_t k0 = 0;
#if defined(__AVX2__) && defined(__F16C__)
            if (g % 16 == 0) {
                __m256 tot = _mm256_setzero_ps();
                for (; k0 + g <= I; k0 += g) {
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
                    for (int64_t k = k0; k < k0 + g; k += 16) {
                        __m256 lo, hi;
                        fp8x16(wr + k, &lo, &hi);
                        a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xm + k), a0);
                        a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xm + k + 8), a1);
                    }
                    tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sr[k0 / g] * 256.0f), tot);
                }
                acc = hsum8(tot);
            }
#endif
            for (; k0 < I; k0 += g) {
                float part = 0.0f;
                for (int64_t k = k0; k < k0 + g && k < I; k++) part += fp8_value(wr[k]) * xm[k];
                acc += part * sr[k0 / g];
            }
            y[m * O + o0 + r] = acc;
        }
    }
}

void gemv_fp8(const float *x, const uint8_t *w, const float *s, float *y, int64_t M, int64_t O, int64_t I, int64_t g,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < i8_blocks(O); b++) fp8_block(x, w, s, y, M, O, I, g, b);
}

/* y (H, O) with y[h] = W[h] x[h] for H float32 weights (H, O, I) and rows x (H, I): one product per
 * head, as latent attention's absorbed form takes q into the latent space and each head's output
 * out of it (semoe/decode/plan.py). torch's batched product of single rows ran at 3 GB/s on one
 * core; this shares every head's blocks of rows out among the threads. */
void gemv_f32_heads(const float *x, const float *w, float *y, int64_t H, int64_t O, int64_t I, int threads) {
    const int64_t nb = i8_blocks(O);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < H * nb; t++) {
        int64_t h = t / nb;
        f32_block(x + h * I, w + h * O * I, y + h * O, 1, O, I, t % nb);
    }
}
