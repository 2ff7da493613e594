/* Products of a few rows with a weight matrix, at the memory bound of the CPU: decode's kernels.
 *
 * y (M, O) = x (M, I) @ W.T for W (O, I) stored as
 *   gemv_i8:  int8 codes with one float32 scale per output row (storage/quant.py `int8`);
 *   gemv_mxfp4: gpt-oss's MXFP4 blocks (O, I/32, 16) uint8, two e2m1 codes a byte (input 2j in the
 *             low nibble of byte j, 2j + 1 in the high one), and an e8m0 exponent e per block of 32
 *             inputs and row, (O, I/32) uint8: w = FP4[code] * 2^(e - 127) (storage/quant.py `mxfp4`);
 *   gemv_i4:  4-bit codes in torch's CPU int4 layout (rows in blocks of 64; for each input column
 *             k, 32 bytes, byte j holding row j of the block in its low nibble and row 32 + j in
 *             its high one) with a float32 (scale, zero) per group of g inputs and row, laid out
 *             (I/g, O, 2): w = (code - 8) * scale + zero (storage/quant.py `int4`).
 *
 * The activations are quantized too, as llama.cpp's CPU kernels do: each row of x in blocks of 32
 * inputs, a float32 scale d = amax / 127 per block and codes rint(x / d) (x * (1 / d), rounded to
 * nearest even), so each block's product is an exact integer sum that AVX-512 VNNI computes four
 * products per lane and instruction; the block sums are then scaled in float32. `q8_rows` below is
 * that quantization, and semoe/kernels/torch_ops.py's reference repeats it in torch, bit for bit.
 * Without VNNI, AVX2 computes the same integer sums two products per lane and instruction (as
 * llama.cpp's AVX2 kernels do), and elsewhere portable loops: the results differ only in the order of
 * the float32 additions.
 *
 * Float32 and bfloat16 weights are multiplied as they are, in float32 (`gemv_f32`, `gemv_bf16`, in
 * gemv_float.c). Output rows are split over `threads` OpenMP threads; M is small (a decoding step's
 * tokens), so each weight row is read from memory once for all M rows of x. Built with -O3
 * -march=native at install.
 *
 * Loaded through ctypes by semoe/kernels/torch_ops.py; the Python module init below only lets setuptools
 * build and place it like any extension.
 */
#include <Python.h>

#include "kernels.h"

/* row m of x (M, I) -> its codes q (Ip) and scales d (Ip / QB), Ip = I rounded up to 64; the padding is 0.
 * With AVX2 each full block's amax and codes eight at a time: the same max (exact in any order), the
 * same products and the same rounding to nearest even, so the same codes and scales as the plain loop. */
static void q8_row(const float *xr, int64_t I, int64_t Ip, int8_t *q, float *d) {
    memset(q, 0, (size_t)Ip);
    for (int64_t b = 0; b < Ip / QB; b++) {
        int64_t k0 = b * QB, n = I - k0 < QB ? (I > k0 ? I - k0 : 0) : QB;
        const float *xb = xr + k0;
#ifdef __AVX2__ /* the AVX-512 build too */
        if (n == QB) {
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], m = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m); /* a NaN input is passed over, as fmaxf does */
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h), db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            d[b] = db;
            const __m256 iv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
            __m256i c[4];
            for (int j = 0; j < 4; j++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                c[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
            }
            /* packs work within 128-bit lanes: the permute puts the 32 codes back in order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + k0), p);
            continue;
        }
#endif
        float amax = 0.0f;
        for (int64_t k = 0; k < n; k++) amax = fmaxf(amax, fabsf(xb[k]));
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int64_t k = 0; k < n; k++) {
            float v = nearbyintf(xb[k] * id);
            q[k0 + k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
    }
}

static void q8_rows(const float *x, int64_t M, int64_t I, int64_t Ip, int8_t *q, float *d) {
    for (int64_t m = 0; m < M; m++) q8_row(x + m * I, I, Ip, q + m * Ip, d + m * (Ip / QB));
}

void quantize_rows_q8(const float *x, int8_t *q, float *d, int64_t M, int64_t I, int64_t Ip) {
    q8_rows(x, M, I, Ip, q, d);
}

static int64_t padded(int64_t I) { return (I + 63) / 64 * 64; }

#ifdef SEMOE_AVX2
static inline __m256i load32_tail(const int8_t *w, int64_t k, int64_t I) {
    if (I - k >= 32) return _mm256_loadu_si256((const __m256i *)(w + k));
    int8_t t[32] = {0};
    memcpy(t, w + k, (size_t)(I - k));
    return _mm256_loadu_si256((const __m256i *)t);
}
#endif

/* ROWS rows of int8 codes (rows past n are not read), each I long, against one quantized row of x:
 * unscaled sums. Written out for ROWS = 4 so the accumulators stay in registers. */
static inline void i8_rows(const int8_t *w, int64_t I, int64_t Ip, int n, const int8_t *qx, const float *dx,
                           float *out) {
#ifdef SEMOE_VNNI
    /* One row after another, each read as one sequential stream, as on AVX2 below: four rows read
     * side by side kept two cores at 13 GB/s of codes on an AVX-512 EPYC, one stream at a time at
     * 26-28. Two accumulators per row hide the multiply-add's latency. */
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < n; r++) {
        const int8_t *wr = w + r * I;
        __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* two chains: even and odd 64s */
        for (int64_t k = 0; k < Ip; k += 64) {
            __mmask64 km = I - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (I - k)) - 1);
            __m512i xv = _mm512_loadu_si512((const void *)(qx + k));
            /* lanes 0-7 sum block k/32, lanes 8-15 block k/32 + 1 */
            __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(dx[k / QB]), _mm256_set1_ps(dx[k / QB + 1]), 1);
            _mm_prefetch((const char *)(wr + k + PREFETCH_STREAM), _MM_HINT_T0);
            /* VNNI multiplies unsigned by signed bytes: |w| times x carrying w's sign */
            __m512i wv = _mm512_maskz_loadu_epi8(km, wr + k);
            __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
            int j = (int)((k >> 6) & 1);
            f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), xs)), dv, f[j]);
        }
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
    }
#elif defined(SEMOE_AVX2)
    /* One row after another, each read as one sequential stream: four rows read side by side kept
     * one core at 7 GB/s of codes, one stream at a time at 10-11 (the core's read rate), with a
     * prefetch a few lines ahead once per line. Two accumulators per row hide the fma latency. */
    (void)Ip;
    for (int r = 0; r < n; r++) {
        const int8_t *wr = w + r * I;
        __m256 f0 = _mm256_setzero_ps(), f1 = f0;
        int64_t k = 0;
        for (; k + 2 * QB <= I; k += 2 * QB) {
            _mm_prefetch((const char *)(wr + k + PREFETCH_STREAM), _MM_HINT_T0);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + k));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + k + QB));
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + k));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + k + QB));
            f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(w0, x0)), _mm256_set1_ps(dx[k / QB]), f0);
            f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(w1, x1)), _mm256_set1_ps(dx[k / QB + 1]), f1);
        }
        for (; k < I; k += QB) /* x is padded to 64 with zeros: always readable */
            f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(load32_tail(wr, k, I),
                                                               _mm256_loadu_si256((const __m256i *)(qx + k)))),
                                 _mm256_set1_ps(dx[k / QB]), f0);
        out[r] = hsum8(_mm256_add_ps(f0, f1));
    }
#else
    for (int r = 0; r < n; r++) {
        const int8_t *wr = w + r * I;
        float acc = 0.0f;
        for (int64_t k0 = 0; k0 < I; k0 += QB) {
            int32_t s = 0;
            int64_t end = k0 + QB < I ? k0 + QB : I;
            for (int64_t k = k0; k < end; k++) s += (int32_t)wr[k] * qx[k];
            acc += dx[k0 / QB] * (float)s;
        }
        out[r] = acc;
    }
    (void)Ip;
#endif
}

Acts acts_alloc(int64_t M, int64_t I, int64_t g) {
    Acts a = {M, I, padded(I), g, g ? I / g : 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, QB};
    a.q = malloc((size_t)(M * a.Ip));
    a.d = malloc(sizeof(float) * (size_t)(M * a.Ip / QB));
    a.xsum = malloc(sizeof(float) * (size_t)(M * (a.groups ? a.groups : 1)));
    return a;
}

int acts_ok(const Acts *a) {
    return a->q && a->d && a->xsum;
}

void acts_fill_row(Acts *a, const float *x, int64_t m) {
    if (a->kb > QB && a->I % a->kb == 0) q8_row_wide(x + m * a->I, a->I, a->Ip, a->kb, a->q + m * a->Ip, a->d + m * (a->Ip / QB));
    else q8_row(x + m * a->I, a->I, a->Ip, a->q + m * a->Ip, a->d + m * (a->Ip / QB));
    for (int64_t gi = 0; gi < a->groups; gi++) {
        float s = 0.0f;
        for (int64_t kb = gi * a->g; kb < (gi + 1) * a->g; kb += QB) {
            int32_t t = 0;
            for (int64_t k = kb; k < kb + QB; k++) t += a->q[m * a->Ip + k];
            s += a->d[m * (a->Ip / QB) + kb / QB] * (float)t;
        }
        a->xsum[m * a->groups + gi] = s;
    }
}

void acts_fill(Acts *a, const float *x) {
    for (int64_t m = 0; m < a->M; m++) acts_fill_row(a, x, m);
}

void acts_free(Acts *a) {
    free(a->q);
    free(a->d);
    free(a->xsum);
    void *bufs[] = {a->qp, a->c16, a->dp, a->gu, a->gd, a->gs, a->gn, a->gb}; /* the kernels' layouts of the rows */
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) free(bufs[i]);
}

#ifdef SEMOE_AVX2
/* i8_rows for two weight rows w0, w1 against two quantized rows of x (a prompt's): each of the four
 * sums is i8_rows's own arithmetic (even and odd blocks in two accumulators, the tail in the even one,
 * then hsum8), the loads of both rows of w and of x shared by the four. out[2 * r + m]: w row r, x row m. */
static inline void i8_rows2x2(const int8_t *w0, const int8_t *w1, int64_t I, const int8_t *qa, const float *da,
                              const int8_t *qb, const float *db, float *out) {
    __m256 f[4][2];
    for (int i = 0; i < 4; i++) f[i][0] = f[i][1] = _mm256_setzero_ps();
    int64_t k = 0;
#define PAIR(i, aw, w, x, d, j) \
    f[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), \
                                                                   _mm256_set1_epi16(1))), d, f[i][j])
    for (; k + 2 * QB <= I; k += 2 * QB)
        for (int j = 0; j < 2; j++) {
            const int64_t kj = k + j * QB;
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + kj));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(w1 + kj));
            __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
            __m256i xa = _mm256_loadu_si256((const __m256i *)(qa + kj));
            __m256i xb = _mm256_loadu_si256((const __m256i *)(qb + kj));
            __m256 dva = _mm256_set1_ps(da[kj / QB]), dvb = _mm256_set1_ps(db[kj / QB]);
            PAIR(0, a0, v0, xa, dva, j);
            PAIR(1, a0, v0, xb, dvb, j);
            PAIR(2, a1, v1, xa, dva, j);
            PAIR(3, a1, v1, xb, dvb, j);
        }
    for (; k < I; k += QB) { /* x is padded to 64 with zeros: always readable */
        __m256i v0 = load32_tail(w0, k, I), v1 = load32_tail(w1, k, I);
        __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
        __m256i xa = _mm256_loadu_si256((const __m256i *)(qa + k)), xb = _mm256_loadu_si256((const __m256i *)(qb + k));
        __m256 dva = _mm256_set1_ps(da[k / QB]), dvb = _mm256_set1_ps(db[k / QB]);
        PAIR(0, a0, v0, xa, dva, 0);
        PAIR(1, a0, v0, xb, dvb, 0);
        PAIR(2, a1, v1, xa, dva, 0);
        PAIR(3, a1, v1, xb, dvb, 0);
    }
#undef PAIR
    for (int i = 0; i < 4; i++) out[i] = hsum8(_mm256_add_ps(f[i][0], f[i][1]));
}
#endif

/* int8: block b (ROWS output rows) of y (M, O); on AVX2, rows of x in pairs against pairs of weight rows */
void i8_block(const int8_t *q, const float *scale, int64_t O, const Acts *a, int64_t b, float *y) {
    int64_t I = a->I, Ip = a->Ip, o0 = b * ROWS, m = 0;
    int n = (int)(O - o0 < ROWS ? O - o0 : ROWS);
#if defined(SEMOE_AVX2)
    for (; m + 1 < a->M; m += 2) {
        const int8_t *qa = a->q + m * Ip, *qb = qa + Ip;
        const float *da = a->d + m * (Ip / QB), *db = da + Ip / QB;
        for (int r = 0; r < n; r += 2) {
            float out[4];
            if (r + 1 < n) {
                i8_rows2x2(q + (o0 + r) * I, q + (o0 + r + 1) * I, I, qa, da, qb, db, out);
            } else {
                i8_rows(q + (o0 + r) * I, I, Ip, 1, qa, da, out);
                i8_rows(q + (o0 + r) * I, I, Ip, 1, qb, db, out + 1);
            }
            y[m * O + o0 + r] = out[0] * scale[o0 + r];
            y[(m + 1) * O + o0 + r] = out[1] * scale[o0 + r];
            if (r + 1 < n) {
                y[m * O + o0 + r + 1] = out[2] * scale[o0 + r + 1];
                y[(m + 1) * O + o0 + r + 1] = out[3] * scale[o0 + r + 1];
            }
        }
    }
#endif
    for (; m < a->M; m++) {
        float out[ROWS];
        i8_rows(q + o0 * I, I, Ip, n, a->q + m * Ip, a->d + m * (Ip / QB), out);
        for (int r = 0; r < n; r++) y[m * O + o0 + r] = out[r] * scale[o0 + r];
    }
}

int64_t i8_blocks(int64_t O) { return (O + ROWS - 1) / ROWS; }

int gemv_i8(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t O, int64_t I,
            int threads) {
    Acts a = acts_alloc(M, I, 0);
    if (!acts_ok(&a)) return acts_free(&a), -1;
    acts_fill(&a, x);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < i8_blocks(O); b++) i8_block(q, scale, O, &a, b, y);
    acts_free(&a);
    return 0;
}

/* One group of a block of 64 rows against one quantized row of x: per row, sum_k code * xq_k */
static inline void i4_group(const uint8_t *pb, int64_t k0, int64_t g, const int8_t *qx, const float *dx,
                            float *lo, float *hi) {
#ifdef SEMOE_VNNI
    /* For 4 columns k..k+3 the 128 bytes hold 4 x 64 codes; a lane of VNNI wants one row's 4 codes.
     * Low nibbles of bytes 0-63 are (col k rows 0-31, col k+1 rows 0-31), of bytes 64-127 cols k+2,
     * k+3: byte 4r + j of a row-major vector is row r (+16) of col k + j, at 32 j + r (+16). */
    static const int8_t IDX[2][64] = {
#define L(r) r, 32 + r, 64 + r, 96 + r
        {L(0), L(1), L(2), L(3), L(4), L(5), L(6), L(7), L(8), L(9), L(10), L(11), L(12), L(13), L(14), L(15)},
        {L(16), L(17), L(18), L(19), L(20), L(21), L(22), L(23), L(24), L(25), L(26), L(27), L(28), L(29), L(30),
         L(31)},
#undef L
    };
    const __m512i ia = _mm512_loadu_si512((const void *)IDX[0]), ib = _mm512_loadu_si512((const void *)IDX[1]);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f[4];
    for (int r = 0; r < 4; r++) f[r] = _mm512_setzero_ps();
    for (int64_t kb = k0; kb < k0 + g; kb += QB) {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = kb; k < kb + QB; k += 4) {
            const uint8_t *p = pb + k * I4_HALF;
            _mm_prefetch((const char *)(p + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + PREFETCH + 64), _MM_HINT_T0);
            __m512i z0 = _mm512_loadu_si512((const void *)p), z1 = _mm512_loadu_si512((const void *)(p + 64));
            __m512i l0 = _mm512_and_si512(z0, low), l1 = _mm512_and_si512(z1, low);
            __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(z0, 4), low);
            __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(z1, 4), low);
            int32_t x4;
            memcpy(&x4, qx + k, 4);
            __m512i xv = _mm512_set1_epi32(x4);
            a0 = _mm512_dpbusd_epi32(a0, _mm512_permutex2var_epi8(l0, ia, l1), xv);
            a1 = _mm512_dpbusd_epi32(a1, _mm512_permutex2var_epi8(l0, ib, l1), xv);
            a2 = _mm512_dpbusd_epi32(a2, _mm512_permutex2var_epi8(h0, ia, h1), xv);
            a3 = _mm512_dpbusd_epi32(a3, _mm512_permutex2var_epi8(h0, ib, h1), xv);
        }
        __m512 db = _mm512_set1_ps(dx[kb / QB]);
        f[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), db, f[0]);
        f[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), db, f[1]);
        f[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), db, f[2]);
        f[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a3), db, f[3]);
    }
    _mm512_storeu_ps(lo, f[0]);
    _mm512_storeu_ps(lo + 16, f[1]);
    _mm512_storeu_ps(hi, f[2]);
    _mm512_storeu_ps(hi + 16, f[3]);
#elif defined(SEMOE_AVX2)
    /* Two columns k, k + 1 at a time: their bytes interleaved give each row's two codes side by side,
     * multiplied with (x_k, x_k+1) and summed to int16 (at most 2 * 15 * 127 a pair, 8 pairs before
     * widening to int32). Within a 128-bit lane the interleave takes rows 0-7 (low) or 8-15 (high) of
     * its 16: accumulators a hold rows 0-7 | 16-23, b rows 8-15 | 24-31. */
    const __m256i low = _mm256_set1_epi8(0x0F);
    memset(lo, 0, sizeof(float) * I4_HALF);
    memset(hi, 0, sizeof(float) * I4_HALF);
    for (int64_t kb = k0; kb < k0 + g; kb += QB) {
        __m256i s[8];
        for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_si256();
        for (int64_t k16 = kb; k16 < kb + QB; k16 += 16) {
            __m256i al = _mm256_setzero_si256(), bl = al, ah = al, bh = al;
            for (int64_t k = k16; k < k16 + 16; k += 2) {
                const uint8_t *p = pb + k * I4_HALF;
                _mm_prefetch((const char *)(p + PREFETCH), _MM_HINT_T0);
                __m256i c0 = _mm256_loadu_si256((const __m256i *)p), c1 = _mm256_loadu_si256((const __m256i *)(p + 32));
                /* the bytes interleaved first, then split into nibbles: two unpacks where four would
                 * interleave the nibbles */
                __m256i u0 = _mm256_unpacklo_epi8(c0, c1), u1 = _mm256_unpackhi_epi8(c0, c1);
                int16_t x2; /* x_k in the low byte, x_k+1 in the high one: one broadcast load */
                memcpy(&x2, qx + k, 2);
                __m256i xv = _mm256_set1_epi16(x2);
                al = _mm256_add_epi16(al, _mm256_maddubs_epi16(_mm256_and_si256(u0, low), xv));
                bl = _mm256_add_epi16(bl, _mm256_maddubs_epi16(_mm256_and_si256(u1, low), xv));
                ah = _mm256_add_epi16(ah, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u0, 4), low), xv));
                bh = _mm256_add_epi16(bh, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u1, 4), low), xv));
            }
            /* rows 0-7, 8-15, 16-23, 24-31 of the low nibbles, then of the high ones */
            __m256i acc[4] = {al, bl, ah, bh};
            for (int h = 0; h < 2; h++) {
                s[4 * h + 0] = _mm256_add_epi32(s[4 * h + 0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[2 * h])));
                s[4 * h + 1] = _mm256_add_epi32(s[4 * h + 1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[2 * h + 1])));
                s[4 * h + 2] = _mm256_add_epi32(s[4 * h + 2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[2 * h], 1)));
                s[4 * h + 3] = _mm256_add_epi32(s[4 * h + 3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[2 * h + 1], 1)));
            }
        }
        __m256 db = _mm256_set1_ps(dx[kb / QB]);
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(lo + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), db, _mm256_loadu_ps(lo + 8 * i)));
            _mm256_storeu_ps(hi + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[4 + i]), db, _mm256_loadu_ps(hi + 8 * i)));
        }
    }
#else
    memset(lo, 0, sizeof(float) * I4_HALF);
    memset(hi, 0, sizeof(float) * I4_HALF);
    for (int64_t kb = k0; kb < k0 + g; kb += QB) {
        int32_t sl[I4_HALF] = {0}, sh[I4_HALF] = {0};
        for (int64_t k = kb; k < kb + QB; k++) {
            const uint8_t *row = pb + k * I4_HALF;
            int32_t xk = qx[k];
            for (int j = 0; j < I4_HALF; j++) {
                sl[j] += (row[j] & 0x0F) * xk;
                sh[j] += (row[j] >> 4) * xk;
            }
        }
        for (int j = 0; j < I4_HALF; j++) {
            lo[j] += dx[kb / QB] * (float)sl[j];
            hi[j] += dx[kb / QB] * (float)sh[j];
        }
    }
#endif
}

/* i4_group for two rows of x at once (a prompt's rows): each pair of columns' codes is split into
 * nibbles once for both, which a row by itself spends as much on as on its products. The same sums,
 * in the same order, as two i4_group calls. */
static inline void i4_group2(const uint8_t *pb, int64_t k0, int64_t g, const int8_t *qx0, const float *dx0,
                             const int8_t *qx1, const float *dx1, float *lo0, float *hi0, float *lo1, float *hi1) {
#if defined(SEMOE_AVX2) && !defined(SEMOE_VNNI)
    const __m256i low = _mm256_set1_epi8(0x0F);
    float *lo[2] = {lo0, lo1}, *hi[2] = {hi0, hi1};
    const float *dx[2] = {dx0, dx1};
    for (int r = 0; r < 2; r++) {
        memset(lo[r], 0, sizeof(float) * I4_HALF);
        memset(hi[r], 0, sizeof(float) * I4_HALF);
    }
    for (int64_t kb = k0; kb < k0 + g; kb += QB) {
        __m256i s[2][8];
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 8; i++) s[r][i] = _mm256_setzero_si256();
        for (int64_t k16 = kb; k16 < kb + QB; k16 += 16) {
            __m256i al0 = _mm256_setzero_si256(), bl0 = al0, ah0 = al0, bh0 = al0;
            __m256i al1 = al0, bl1 = al0, ah1 = al0, bh1 = al0;
            for (int64_t k = k16; k < k16 + 16; k += 2) {
                const uint8_t *p = pb + k * I4_HALF;
                _mm_prefetch((const char *)(p + PREFETCH), _MM_HINT_T0);
                __m256i c0 = _mm256_loadu_si256((const __m256i *)p), c1 = _mm256_loadu_si256((const __m256i *)(p + 32));
                __m256i u0 = _mm256_unpacklo_epi8(c0, c1), u1 = _mm256_unpackhi_epi8(c0, c1);
                __m256i n0 = _mm256_and_si256(u0, low), n1 = _mm256_and_si256(u1, low);
                __m256i n2 = _mm256_and_si256(_mm256_srli_epi16(u0, 4), low);
                __m256i n3 = _mm256_and_si256(_mm256_srli_epi16(u1, 4), low);
                int16_t x2;
                memcpy(&x2, qx0 + k, 2);
                __m256i xv = _mm256_set1_epi16(x2);
                al0 = _mm256_add_epi16(al0, _mm256_maddubs_epi16(n0, xv));
                bl0 = _mm256_add_epi16(bl0, _mm256_maddubs_epi16(n1, xv));
                ah0 = _mm256_add_epi16(ah0, _mm256_maddubs_epi16(n2, xv));
                bh0 = _mm256_add_epi16(bh0, _mm256_maddubs_epi16(n3, xv));
                memcpy(&x2, qx1 + k, 2);
                xv = _mm256_set1_epi16(x2);
                al1 = _mm256_add_epi16(al1, _mm256_maddubs_epi16(n0, xv));
                bl1 = _mm256_add_epi16(bl1, _mm256_maddubs_epi16(n1, xv));
                ah1 = _mm256_add_epi16(ah1, _mm256_maddubs_epi16(n2, xv));
                bh1 = _mm256_add_epi16(bh1, _mm256_maddubs_epi16(n3, xv));
            }
            __m256i acc[2][4] = {{al0, bl0, ah0, bh0}, {al1, bl1, ah1, bh1}};
            for (int r = 0; r < 2; r++)
                for (int h = 0; h < 2; h++) {
                    __m256i *sr = s[r] + 4 * h, a = acc[r][2 * h], b = acc[r][2 * h + 1];
                    sr[0] = _mm256_add_epi32(sr[0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)));
                    sr[1] = _mm256_add_epi32(sr[1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b)));
                    sr[2] = _mm256_add_epi32(sr[2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
                    sr[3] = _mm256_add_epi32(sr[3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b, 1)));
                }
        }
        for (int r = 0; r < 2; r++) {
            __m256 db = _mm256_set1_ps(dx[r][kb / QB]);
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(lo[r] + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][i]), db,
                                                                _mm256_loadu_ps(lo[r] + 8 * i)));
                _mm256_storeu_ps(hi[r] + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][4 + i]), db,
                                                                _mm256_loadu_ps(hi[r] + 8 * i)));
            }
        }
    }
#else
    i4_group(pb, k0, g, qx0, dx0, lo0, hi0);
    i4_group(pb, k0, g, qx1, dx1, lo1, hi1);
#endif
}

/* out_j += s_j (c_j - 8 xs) + z_j xs for 32 rows j, their (scale, zero) pairs interleaved in sz */
static inline void i4_scale(const float *sz, const float *c, float xs, float *out) {
#ifdef SEMOE_AVX2
    const __m256 x8 = _mm256_set1_ps(8.0f * xs), xv = _mm256_set1_ps(xs);
    for (int j = 0; j < I4_HALF; j += 8) {
        __m256 a = _mm256_loadu_ps(sz + 2 * j), b = _mm256_loadu_ps(sz + 2 * j + 8);
        /* (s0 z0 s1 z1 s2 z2 s3 z3), (s4 z4 ... s7 z7) -> s0..s7 and z0..z7 */
        __m256 sv = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        __m256 zv = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
        __m256 t = _mm256_add_ps(_mm256_mul_ps(sv, _mm256_sub_ps(_mm256_loadu_ps(c + j), x8)), _mm256_mul_ps(zv, xv));
        _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(out + j), t));
    }
#else
    for (int j = 0; j < I4_HALF; j++) out[j] += sz[2 * j] * (c[j] - 8.0f * xs) + sz[2 * j + 1] * xs;
#endif
}

/* int4: block b (64 output rows) of y (M, O) */
void i4_block(const uint8_t *p, const float *sz, int64_t O, const Acts *a, int64_t b, float *y) {
    int64_t I = a->I, Ip = a->Ip, g = a->g;
    const uint8_t *pb = p + b * I * I4_HALF; /* (I, 32) bytes of this block of 64 rows */
    for (int64_t m = 0; m < a->M; m += 2) {
        const int pair = m + 1 < a->M; /* two rows of x share the unpacking of the codes */
        float out[2][I4_BLOCK], lo[2][I4_HALF], hi[2][I4_HALF];
        memset(out, 0, sizeof(out));
        for (int64_t gi = 0; gi < a->groups; gi++) {
            const int8_t *q0 = a->q + m * Ip;
            const float *d0 = a->d + m * (Ip / QB);
            if (pair)
                i4_group2(pb, gi * g, g, q0, d0, q0 + Ip, d0 + Ip / QB, lo[0], hi[0], lo[1], hi[1]);
            else
                i4_group(pb, gi * g, g, q0, d0, lo[0], hi[0]);
            /* sum_k ((c - 8) s + z) x_k = s (sum_k c x_k - 8 sum_k x_k) + z sum_k x_k */
            const float *szg = sz + (gi * O + b * I4_BLOCK) * 2;
            for (int r = 0; r <= pair; r++) {
                float xs = a->xsum[(m + r) * a->groups + gi];
                i4_scale(szg, lo[r], xs, out[r]);
                i4_scale(szg + 2 * I4_HALF, hi[r], xs, out[r] + I4_HALF);
            }
        }
        for (int r = 0; r <= pair; r++) memcpy(y + (m + r) * O + b * I4_BLOCK, out[r], sizeof(out[r]));
    }
}

int gemv_i4(const float *x, const uint8_t *p, const float *sz, float *y, int64_t M, int64_t O, int64_t I, int64_t g,
            int threads) {
    Acts a = acts_alloc(M, I, g);
    if (!acts_ok(&a)) return acts_free(&a), -1;
    acts_fill(&a, x);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < O / I4_BLOCK; b++) i4_block(p, sz, O, &a, b, y);
    acts_free(&a);
    return 0;
}

/* One block of a weight of any kind the SwiGLU kernel takes: bits 8 or 4 (int8 or int4 codes and
 * scales; g: int4's group, which `a` was filled for), 32 or 16 (float32 or bfloat16, against the
 * float rows x; `a` unused) */
static void any_block(int bits, const void *w, const float *s, int64_t O, const float *x, const Acts *a, int64_t b,
                      float *y) {
    if (bits == 8)
        i8_block((const int8_t *)w, s, O, a, b, y);
    else if (bits == 4)
        i4_block((const uint8_t *)w, s, O, a, b, y);
    else if (bits == 32)
        f32_block(x, (const float *)w, y, a->M, O, a->I, b);
    else
        bf16_block(x, (const uint16_t *)w, y, a->M, O, a->I, b);
}

static int64_t any_blocks(int bits, int64_t O) { return bits == 4 ? O / I4_BLOCK : i8_blocks(O); }

/* A SwiGLU expert in one call: y (M, D) = down(silu(gate x) * up x), gate and up (F, D) and down
 * (D, F) all int8 (bits 8), int4 (bits 4, groups g_in over D and g_down over F), float32 (bits 32)
 * or bfloat16 (bits 16; the float kinds take no scales). The same sums as three gemv calls with
 * silu(h) = h / (1 + exp(-h)) and the product in float32 between them: one parallel region instead
 * of three, and gate and up read in the same pass over x (its codes, for the integer kinds). */
int swiglu_q(const float *x, int64_t M, int64_t D, int64_t F, int bits, const void *wg, const float *sg,
             const void *wu, const float *su, int64_t g_in, const void *wd, const float *sd, int64_t g_down, float *y,
             int threads) {
    const int quant = bits == 8 || bits == 4;
    /* float kinds: Acts only says the rows' shape (no codes are made) */
    Acts ax = quant ? acts_alloc(M, D, bits == 4 ? g_in : 0) : (Acts){.M = M, .I = D},
         ah = quant ? acts_alloc(M, F, bits == 4 ? g_down : 0) : (Acts){.M = M, .I = F};
    float *hg = malloc(sizeof(float) * (size_t)(M * F)), *hu = malloc(sizeof(float) * (size_t)(M * F));
    int rc = (!quant || (acts_ok(&ax) && acts_ok(&ah))) && hg && hu ? 0 : -1;
    if (rc) goto done;
    if (quant) acts_fill(&ax, x);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < any_blocks(bits, F); b++) {
            any_block(bits, wg, sg, F, x, &ax, b, hg);
            any_block(bits, wu, su, F, x, &ax, b, hu);
        }
#pragma omp single
        {
            for (int64_t i = 0; i < M * F; i++) hg[i] = hg[i] / (1.0f + expf(-hg[i])) * hu[i];
            if (quant) acts_fill(&ah, hg);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < any_blocks(bits, D); b++) any_block(bits, wd, sd, D, hg, &ah, b, y);
    }
done:
    free(hg);
    free(hu);
    if (quant) {
        acts_free(&ax);
        acts_free(&ah);
    }
    return rc;
}

/* gpt-oss's expert in one call: y (M, D) = down(act(gate_up x + b_gu)) + b_d, with gate_up's outputs
 * interleaved (2j gate j, 2j + 1 up j; (2F, D) out-major) and act(g, u) = (clamp(u, -limit, limit)
 * + 1) * min(g, limit) * sigmoid(alpha * min(g, limit)); both weights int8 (kind 8), int4 (4, groups
 * g_in over D and g_down over F) or MXFP4 (1: blocks and e8m0 exponents in place of codes and
 * scales). The products are the gemv kernels' (x and the hidden row quantized once each); the
 * activation and the biases in float32 between them, with C's expf in the sigmoid (the module's
 * torch ops round it differently: within float32 rounding). One parallel region instead of the two
 * products and a dozen small torch ops. */
int clamped_swiglu_q(const float *x, int64_t M, int64_t D, int64_t F, int kind, const void *wgu, const void *sgu,
                     int64_t g_in, const float *bgu, const void *wd, const void *sd, int64_t g_down, const float *bd,
                     float alpha, float limit, float *y, int threads) {
    Acts ax = acts_alloc(M, D, kind == 4 ? g_in : 0), ah = acts_alloc(M, F, kind == 4 ? g_down : 0);
    float *hgu = malloc(sizeof(float) * (size_t)(M * 2 * F)), *h = malloc(sizeof(float) * (size_t)(M * F));
    int rc = acts_ok(&ax) && acts_ok(&ah) && hgu && h ? 0 : -1;
    if (rc) goto done;
    acts_fill(&ax, x);
    if (kind == 1) acts_fp4(&ax);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < any_blocks(kind == 1 ? 8 : kind, 2 * F); b++) {
            if (kind == 1)
                fp4_block((const uint8_t *)wgu, (const uint8_t *)sgu, 2 * F, &ax, b, hgu);
            else
                any_block(kind, wgu, (const float *)sgu, 2 * F, x, &ax, b, hgu);
        }
#pragma omp single
        {
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < F; j++) {
                    float g = hgu[m * 2 * F + 2 * j] + bgu[2 * j], u = hgu[m * 2 * F + 2 * j + 1] + bgu[2 * j + 1];
                    g = fminf(g, limit);
                    u = fminf(fmaxf(u, -limit), limit);
                    h[m * F + j] = (u + 1.0f) * g * (1.0f / (1.0f + expf(-(g * alpha))));
                }
            acts_fill(&ah, h);
            if (kind == 1) acts_fp4(&ah);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < any_blocks(kind == 1 ? 8 : kind, D); b++) {
            if (kind == 1)
                fp4_block((const uint8_t *)wd, (const uint8_t *)sd, D, &ah, b, y);
            else
                any_block(kind, wd, (const float *)sd, D, h, &ah, b, y);
        }
#pragma omp single
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < D; i++) y[m * D + i] += bd[i];
    }
done:
    free(hgu);
    free(h);
    acts_free(&ax);
    acts_free(&ah);
    return rc;
}

/* Which path this build took: 2 with AVX-512 VNNI, 1 with AVX2 and FMA, 0 for the portable loops */
int kernels_isa(void) {
#if defined(SEMOE_VNNI)
    return 2;
#elif defined(SEMOE_AVX2)
    return 1;
#else
    return 0;
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "semoe's CPU kernels (loaded with ctypes)", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
