/* What semoe/kernels/gemv.c shares with gemv_float.c and decode_step.c: the vector path this build
 * takes, the layouts' constants, x quantized for the integer kernels, and the per-block bodies of
 * the products (each computes one block of output rows, so a caller splits the blocks over its
 * threads however it likes: every output row is summed by one thread, in one order). */
#ifndef SEMOE_KERNELS_H
#define SEMOE_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SEMOE_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SEMOE_AVX2 1
#endif
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 and FMA: the avx2 build, and the avx512-vnni one (its CPUs have both), for code whose AVX2 form
 * the measurements keep in both (gemv_fp4.c's) */
#define SEMOE_HAS_AVX2 1
#endif

#ifdef __AVX2__
/* the sum of a vector's eight lanes, in a fixed order */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef SEMOE_HAS_AVX2
/* AVX2 has no VNNI: a block of 32 signed bytes w times 32 signed bytes x sums as |w| (unsigned)
 * times x carrying w's sign, in pairs to int16 (at most 2 * 128 * 127, no saturation), then pairs
 * of those to int32: eight lanes holding the block's exact sum between them. */
static inline __m256i dot32_avx2(__m256i w, __m256i x) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* 32 bytes of row w from k on, zero past I (a copy for the last, partial block: never read past the row) */
#endif

#ifdef SEMOE_VNNI
/* the sums of ROWS rows' lane accumulators */
static inline void reduce_rows(__m512 f0, __m512 f1, __m512 f2, __m512 f3, float *out) {
    out[0] = _mm512_reduce_add_ps(f0);
    out[1] = _mm512_reduce_add_ps(f1);
    out[2] = _mm512_reduce_add_ps(f2);
    out[3] = _mm512_reduce_add_ps(f3);
}
#endif

/* A KV cache holds float32, or IEEE float16 where `h16` (half the bytes, as llama.cpp's default
 * cache): values rounded to nearest even as written, read back exactly; elements counted from c */
static inline float kv_get(const void *c, int64_t i, int h16) {
    return h16 ? (float)((const _Float16 *)c)[i] : ((const float *)c)[i];
}

/* n values of x written at element i of a cache */
static inline void kv_row_put(void *c, int64_t i, const float *x, int64_t n, int h16) {
    int64_t j = 0;
    if (!h16) {
        memcpy((float *)c + i, x, sizeof(float) * (size_t)n);
        return;
    }
#ifdef __F16C__
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)c + i + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) ((_Float16 *)c)[i + j] = (_Float16)x[j];
}

#ifdef __AVX2__
/* eight values of a cache from element i, as float32 */
static inline __m256 kv_load8(const void *c, int64_t i, int h16) {
    if (!h16) return _mm256_loadu_ps((const float *)c + i);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)));
#else
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = kv_get(c, i + j, 1);
    return _mm256_loadu_ps(t);
#endif
}
#endif

/* a + b * c for the float kernels' scalar tails: fused wherever the build has FMA, as their vector
 * bodies are (left to itself the compiler vectorized one kernel's tail into separate multiplies and
 * adds and fused another's, so a bfloat16 weight and its float32 widening summed to other bits) */
#ifdef __FMA__
#define MADD(a, b, c) fmaf((b), (c), (a))
#else
#define MADD(a, b, c) ((a) + (b) * (c))
#endif

#define QB 32 /* inputs per activation block */
#define ROWS 4 /* int8: output rows computed together, sharing the loads of x */
#define I4_BLOCK 64
#define I4_HALF 32
/* Bytes ahead of each weight stream to prefetch: one core's hardware prefetch alone kept well under
 * the memory bound (6 GB/s of int8 codes on one thread, 16 on two, against 20-25 with this). A
 * prefetch past the end of the weights is harmless: prefetches never fault. */
#ifndef PREFETCH
#define PREFETCH 4096
#endif
/* The same for one weight row read as a single stream (AVX2 int8): the hardware prefetcher follows
 * it, so a short distance suffices (measured: 1 KB best, 4 KB slower than none) */
#ifndef PREFETCH_STREAM
#define PREFETCH_STREAM 1024
#endif

/* x quantized for the kernels: codes (M, Ip), scales (M, Ip / QB) and, for int4 weights in groups
 * of g, the sum of each group's quantized inputs (M, I / g): the zero points' share of each output */
typedef struct {
    int64_t M, I, Ip, g, groups;
    int8_t *q;
    float *d, *xsum;
    /* `acts_fp4`'s, for MXFP4 weights on AVX2 and two rows or more (a prompt's): the codes of each pair
     * of blocks as the kernel reads them (inputs 0-15 of both, then 16-31 of both), twelve times their
     * sums in pairs (int16, 16 a pair of blocks) and the scales of each eight blocks in the kernel's
     * order; NULL otherwise (and where memory for them was short: the kernel then goes row by row) */
    int8_t *qp;
    int16_t *c16;
    float *dp;
    /* `acts_gg`'s, for GGUF blocks on the AVX-512 VNNI build and a prompt's rows (GG_TILE_MIN or more): each
     * pair of rows' codes plus 128 (unsigned), their 4-byte groups interleaved (row 2p's, then 2p + 1's), and
     * the pair's scales and sums per 32 side by side; NULL otherwise (the kernel then takes rows in pairs) */
    uint8_t *gu;
    float *gd, *gs;
    /* `acts_gg`'s, for the AVX-512 VNNI build's products on nibbles (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS,
     * MXFP4) and one row (decoding): its codes in the order those kernels take them, each four blocks' inputs
     * 0-15 then 16-31 (`g32_x`), and for the types with a table of values (IQ4_NL, IQ4_XS, MXFP4) -128 times
     * the sums of each lane's 8 codes (`g32_dot`); NULL otherwise (a few rows of a prompt, or memory short: the
     * kernels then permute and sum x themselves) */
    int8_t *gn;
    int32_t *gb;
    /* inputs that share one scale: QB, or 256 (GGUF's super-block types, as ggml's q8_K: `acts_alloc`'s QB,
     * `lin_acts_alloc` sets it before the rows are filled), d still given per QB, the same for each 8 */
    int64_t kb;
} Acts;

/* acts_alloc's buffers may be NULL where memory is short: acts_ok says whether all three are there
 * (acts_free takes either) */
Acts acts_alloc(int64_t M, int64_t I, int64_t g);
int acts_ok(const Acts *a);
void acts_fill(Acts *a, const float *x);
void acts_fill_row(Acts *a, const float *x, int64_t m); /* row m of x alone: rows may be filled in parallel */
void acts_free(Acts *a);
void acts_fp4(Acts *a); /* after acts_fill: the MXFP4 kernel's layout of the rows (qp, c16, dp) */
void acts_gg(Acts *a, int64_t t); /* after acts_fill: the GGUF tile kernel's layout of the rows (gu, gd, gs) */

/* block b of y (M, O) = x @ W.T: ROWS rows for int8, float32 and bfloat16 weights (`i8_blocks(O)`
 * blocks), I4_BLOCK rows for int4 (O / I4_BLOCK blocks); the integer ones read x from `a` */
int64_t i8_blocks(int64_t O);
void i8_block(const int8_t *q, const float *scale, int64_t O, const Acts *a, int64_t b, float *y);
void i4_block(const uint8_t *p, const float *sz, int64_t O, const Acts *a, int64_t b, float *y);
void f32_block(const float *x, const float *w, float *y, int64_t M, int64_t O, int64_t I, int64_t b);
void bf16_block(const float *x, const uint16_t *w, float *y, int64_t M, int64_t O, int64_t I, int64_t b);
/* MXFP4 blocks (O, I/32, 16) and e8m0 exponents (O, I/32): ROWS rows too, from x's codes in a */
void fp4_block(const uint8_t *w, const uint8_t *e, int64_t O, const Acts *a, int64_t b, float *y);
/* FP8 (e4m3) codes (O, I), one byte each, with float32 scales per g x g block of the weight,
 * (ceil(O/g), ceil(I/g)): ROWS rows, against float32 x (DeepSeek-V3's and Kimi-K2's experts) */
void fp8_block(const float *x, const uint8_t *w, const float *s, float *y, int64_t M, int64_t O, int64_t I, int64_t g,
               int64_t b);
/* GGUF's blocks of ggml type t (gemv_ggml.c): ROWS rows (`i8_blocks(O)` blocks) from x's codes and xsum (groups
 * of QB) in a; gg_row_bytes: one row's bytes (0: a type not computed here, or I not whole blocks) */
void gg_block(int64_t t, const uint8_t *w, int64_t O, int64_t I, const Acts *a, int64_t b, float *y);
int64_t gg_row_bytes(int64_t t, int64_t I);
int64_t gg_x_block(int64_t t); /* the inputs each scale of x covers for type t (Acts.kb) */
/* x's row quantized as acts_fill_row does, one scale per kb inputs (a multiple of QB dividing I) */
void q8_row_wide(const float *xr, int64_t I, int64_t Ip, int64_t kb, int8_t *q, float *d);
/* block b of y (O) = x (I) @ W for a float32 or bfloat16 (`bf16`) weight laid out (I, O), in-major:
 * IO_STRIP output columns, `io_blocks(O)` of them */
#define IO_STRIP 1024
int64_t io_blocks(int64_t O);
void io_block(const float *x, const void *w, int bf16, int64_t O, int64_t I, int64_t b, float *y);

void rmsnorm_f32(const float *x, const float *w, float eps, float *y, int64_t M, int64_t D);
/* `attend_decode_f32` in two parts: q rotated into qr (H, Dh), k rotated and v copied into the
 * caches at `pos` (the first R dims rotated); then one head's attention over positions t0..n-1
 * into out (p: n scores a head; sinks NULL or H logits). The caches hold float16 where h16 (kv_get). */
void attend_rotate(const float *q, const float *k, const float *v, const float *cos, const float *sin, void *kc,
                   void *vc, int64_t H, int64_t G, int64_t Dh, int64_t R, int64_t S, int64_t pos, float *qr, int h16);
void attend_head(const float *qr, const void *kc, const void *vc, int64_t H, int64_t G, int64_t Dh, int64_t S,
                 int64_t t0, int64_t n, float scale, const float *sinks, float *p, float *out, int64_t h, int h16);
/* the first position a query at pos sees: its chunk's first (chunk > 0), the window's (window > 0: that
 * many positions, itself included), or 0 */
static inline int64_t first_seen(int64_t window, int64_t chunk, int64_t pos) {
    if (chunk > 0) return pos - pos % chunk;
    return window > 0 && window <= pos ? pos + 1 - window : 0;
}

#define ROW_GROUP 4 /* a prompt's rows that share each key's and value's load (attend_rows_head) */
/* attend_head for head h of a prompt's nr rows (positions pos0..; queries qr (nr, H, Dh), keys of Dh
 * and values of Dv (Dh where decoding's attend_head gives the same sums), out (nr, H * Dv)), ROW_GROUP
 * rows sharing each position's key and value loads; window or chunk (0: none) as decoding's; p:
 * ROW_GROUP * (pos0 + nr) floats */
void attend_rows_head(const float *qr, const void *kc, const void *vc, int64_t H, int64_t G, int64_t Dh, int64_t Dv,
                      int64_t S, int64_t pos0, int64_t nr, int64_t window, int64_t chunk, float scale,
                      const float *sinks, float *p, float *out, int64_t h, int h16);
/* attend.c's pieces of latent attention (decode_step.c) */
void rope_rotate(const float *x, const float *cos, const float *sin, int64_t R, int interleave, float *y);
void mla_head(const float *ql, const float *qr, const float *latents, const float *rots, int64_t L, int64_t R,
              int64_t rs, const int32_t *idx, int64_t n, float scale, float *p, float *out);
/* DeepSeek sparse attention's pieces (decode_abi.h's `Indexer`) */
void layernorm_f32(const float *x, const float *w, const float *b, float eps, float *y, int64_t D);
float index_score(const float *iq, const float *iw, int64_t Hi, int64_t Di, float ds, const float *k);
/* q . k over n float32 values, as attention's kernels sum it (attend.c) */
float dot_f32_n(const float *a, const float *b, int64_t n);
/* the module's Di ** -0.5, rounded to float32 as torch rounds the scalar */
static inline float index_dim_scale(int64_t Di) { return (float)(1.0 / sqrt((double)Di)); }
int64_t choose_top(const float *sc, int64_t n, int64_t k, int32_t *idx, float *scratch);
void moe_combine_f32(float *x, const float *const *ys, const float *w, int64_t K, int64_t D);

#endif
