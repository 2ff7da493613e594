/* Products of a few rows with a weight matrix, at the memory bound of the CPU: decode's kernels.
 *
 * y (M, O) = x (M, I) @ W.T for W (O, I) stored as
 *   gemv_i8:  int8 codes with one float32 scale per output row (storage/quant.py `int8`);
 *   gemv_i4:  4-bit codes in torch's CPU int4 layout (rows in blocks of 64; for each input column
 *             k, 32 bytes, byte j holding row j of the block in its low nibble and row 32 + j in
 *             its high one) with a float32 (scale, zero) per group of g inputs and row, laid out
 *             (I/g, O, 2): w = (code - 8) * scale + zero (storage/quant.py `int4`).
 * Activations and sums stay float32: the codes are widened in registers, never in memory.
 * (Float32 weights need no kernel here: torch's own product already streams them at the memory
 * bound.) Output rows are split over `threads` OpenMP threads; M is small (a decoding step's tokens), so
 * each weight row is read once for all M rows of x. Built with -O3 -march=native at install: the
 * loops are written for the compiler to vectorise (AVX2/AVX-512 where the machine has them).
 *
 * Loaded through ctypes by semoe/cpu_kernels.py; the Python module init below only lets setuptools
 * build and place it like any extension.
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define ROWS 4 /* output rows computed together, sharing the loads of x */

#ifdef __AVX512F__
static inline __m512 widen_i8(const int8_t *q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))); }
static inline __m512 widen_i8_masked(const int8_t *q, __mmask16 k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, q)));
}
#endif

void gemv_i8(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t O, int64_t I,
             int threads) {
    int64_t blocks = (O + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t o0 = b * ROWS, n = O - o0 < ROWS ? O - o0 : ROWS;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * I;
            int64_t r = 0;
#ifdef __AVX512F__
            if (n == 4) {
                const int8_t *q0 = q + o0 * I, *q1 = q0 + I, *q2 = q1 + I, *q3 = q2 + I;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int64_t i = 0;
                for (; i + 16 <= I; i += 16) {
                    __m512 xv = _mm512_loadu_ps(xm + i);
                    a0 = _mm512_fmadd_ps(widen_i8(q0 + i), xv, a0);
                    a1 = _mm512_fmadd_ps(widen_i8(q1 + i), xv, a1);
                    a2 = _mm512_fmadd_ps(widen_i8(q2 + i), xv, a2);
                    a3 = _mm512_fmadd_ps(widen_i8(q3 + i), xv, a3);
                }
                if (i < I) {
                    __mmask16 k = (__mmask16)((1u << (I - i)) - 1);
                    __m512 xv = _mm512_maskz_loadu_ps(k, xm + i);
                    a0 = _mm512_fmadd_ps(widen_i8_masked(q0 + i, k), xv, a0);
                    a1 = _mm512_fmadd_ps(widen_i8_masked(q1 + i, k), xv, a1);
                    a2 = _mm512_fmadd_ps(widen_i8_masked(q2 + i, k), xv, a2);
                    a3 = _mm512_fmadd_ps(widen_i8_masked(q3 + i, k), xv, a3);
                }
                float *ym = y + m * O + o0;
                ym[0] = _mm512_reduce_add_ps(a0) * scale[o0];
                ym[1] = _mm512_reduce_add_ps(a1) * scale[o0 + 1];
                ym[2] = _mm512_reduce_add_ps(a2) * scale[o0 + 2];
                ym[3] = _mm512_reduce_add_ps(a3) * scale[o0 + 3];
                r = 4;
            }
#endif
            for (; r < n; r++) {
                const int8_t *qo = q + (o0 + r) * I;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < I; i++) acc += (float)qo[i] * xm[i];
                y[m * O + o0 + r] = acc * scale[o0 + r];
            }
        }
    }
}

#define I4_BLOCK 64
#define I4_HALF 32
#define I4_MAX_M 16 /* rows of x per call (decode steps are far fewer) */

void gemv_i4(const float *x, const uint8_t *p, const float *sz, float *y, int64_t M, int64_t O, int64_t I,
             int64_t g, int threads) {
    int64_t blocks = O / I4_BLOCK, groups = I / g;
    /* per row of x and group, the sum of its inputs: the zero points' share of each output */
    float xsum[I4_MAX_M][I / g > 0 ? I / g : 1];
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < groups; gi++) {
            float s = 0.0f;
            for (int64_t k = gi * g; k < (gi + 1) * g; k++) s += x[m * I + k];
            xsum[m][gi] = s;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *pb = p + b * I * I4_HALF; /* (I, 32) bytes of this block of 64 rows */
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * I;
            float out[I4_BLOCK];
            memset(out, 0, sizeof(out));
            for (int64_t gi = 0; gi < groups; gi++) {
                float lo[I4_HALF], hi[I4_HALF];
                memset(lo, 0, sizeof(lo));
                memset(hi, 0, sizeof(hi));
#ifdef __AVX512F__
                {
                    __m512 l0 = _mm512_setzero_ps(), l1 = l0, h0 = l0, h1 = l0;
                    const __m512i low = _mm512_set1_epi32(0x0F);
                    for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                        const uint8_t *row = pb + k * I4_HALF;
                        __m512 xk = _mm512_set1_ps(xm[k]);
                        __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row));
                        __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16)));
                        l0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b0, low)), xk, l0);
                        l1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b1, low)), xk, l1);
                        h0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), xk, h0);
                        h1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), xk, h1);
                    }
                    _mm512_storeu_ps(lo, l0);
                    _mm512_storeu_ps(lo + 16, l1);
                    _mm512_storeu_ps(hi, h0);
                    _mm512_storeu_ps(hi + 16, h1);
                }
#else
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                    const uint8_t *row = pb + k * I4_HALF;
                    float xk = xm[k];
#pragma omp simd
                    for (int j = 0; j < I4_HALF; j++) {
                        lo[j] += (float)(row[j] & 0x0F) * xk;
                        hi[j] += (float)(row[j] >> 4) * xk;
                    }
                }
#endif
                /* sum_k ((c - 8) s + z) x_k = s (sum_k c x_k - 8 sum_k x_k) + z sum_k x_k */
                const float *szg = sz + (gi * O + b * I4_BLOCK) * 2;
                float xs = xsum[m][gi];
                for (int j = 0; j < I4_HALF; j++) {
                    out[j] += szg[2 * j] * (lo[j] - 8.0f * xs) + szg[2 * j + 1] * xs;
                    out[I4_HALF + j] += szg[2 * (I4_HALF + j)] * (hi[j] - 8.0f * xs) + szg[2 * (I4_HALF + j) + 1] * xs;
                }
            }
            memcpy(y + m * O + b * I4_BLOCK, out, sizeof(out));
        }
    }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "semoe's CPU kernels (loaded with ctypes)", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
