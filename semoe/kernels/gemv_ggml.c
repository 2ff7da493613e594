/* Products on GGUF's quantized blocks as the file stores them (llama.cpp's ggml types), rows of the weight
 * one after another, each row ceil(I / block) blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (32 weights a
 * block, an IEEE half scale), Q4_K, Q5_K, Q6_K and IQ4_XS (256 a super-block, 6-bit or int8 sub-block scales),
 * MXFP4 (32 a block, an e8m0 exponent).
 *
 * Each block of 32 weights is decoded to 32 signed integer codes c, a scale per half of 16 (the same for all
 * types but Q6_K) and an offset o, so that weight j = s_h c_j + o. Against x quantized per 32 (`Acts`: codes
 * q, scale dx, and dx sum(q) as `xsum`), the block's share of a row's product is
 *     dx (s_0 sum_{j<16} c_j q_j + s_1 sum_{j>=16} c_j q_j) + o xsum,
 * both sums taken exactly in integers. Rows are computed ROWS at a time, sharing the loads of x (the AVX-512
 * build decodes one row at a time instead, each read as one stream: `gg_row1_vnni` for Q4_K, Q5_K, Q6_K and
 * Q8_0, `g32_row` for the other blocks of 32, `iq4xs_row`); every output row is summed by one thread in one
 * order (kernels.h). */
#include "kernels.h"
#include "decode_abi.h"

#include "ggml_blocks.h"

/* x's quantization for type t: one scale per 256 inputs for the super-block types (ggml's q8_K, whose
 * sub-blocks' integer sums are then scaled in integers), per 32 for the others (q8_0) */
int64_t gg_x_block(int64_t t) { return gg_block_weights(t); }

/* q8_row with one scale per kb inputs (I a multiple of kb, kb of QB), given for each block of QB within them */
void q8_row_wide(const float *xr, int64_t I, int64_t Ip, int64_t kb, int8_t *q, float *d) {
    memset(q, 0, (size_t)Ip);
    for (int64_t k0 = 0; k0 < I; k0 += kb) {
        float amax = 0.0f;
        for (int64_t k = k0; k < k0 + kb; k++) amax = fmaxf(amax, fabsf(xr[k]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int64_t k = k0; k < k0 + kb; k++) {
            const float v = nearbyintf(xr[k] * id);
            q[k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
        for (int64_t b = k0 / QB; b < (k0 + kb) / QB; b++) d[b] = db;
    }
    for (int64_t b = I / QB; b < Ip / QB; b++) d[b] = 0.0f;
}

/* bytes of one row of I weights of type t; 0 for a type not computed here or I not a whole number of blocks */
int64_t gg_row_bytes(int64_t t, int64_t I) {
    const int64_t n = gg_block_weights(t), b = gg_block_bytes(t);
    return b == 0 || I % n ? 0 : I / n * b;
}


#ifdef SEMOE_VNNI
/* The AVX-512 VNNI build's products for Q4_K, Q5_K, Q6_K and Q8_0 (what Q4_K_M, Q5_K_M and Q8_0 files
 * hold): 64 weights
 * an instruction (vpdpbusd, unsigned bytes times signed), each block's integer sums in its 8 lanes, the
 * lanes scaled by their block's (or half block's) weight scale times x's, one float multiply-add per 64. */
static inline __m512i idx16(int a, int b, int c, int d) { /* four lanes each of a, b, c, d */
    return _mm512_set_epi32(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a);
}
/* minus the sum of each four of x's 64 codes (16 lanes): times a code's zero, what unsigned codes' sums give back */
static inline __attribute__((always_inline)) __m512i x_sums(__m512i x) {
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x));
}

/* Q8_0's blocks b0 and b1 (b1's codes zero where keep masks them): their 64 codes plus 128, unsigned */
static inline __attribute__((always_inline)) __m512i q8_pair(const uint8_t *b0, const uint8_t *b1, __mmask64 keep) {
    const __m512i c = _mm512_maskz_mov_epi8(keep, _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
        _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1));
    return _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80));
}

/* Q6_K super-block b's 64 unsigned codes (0..63, zero 32) of step i: half i / 2, its quarters 2 (i % 2) and
 * 2 (i % 2) + 1, each quarter's two high bits put at bits 4-5 by one shift */
static inline __attribute__((always_inline)) __m512i q6k_codes(const uint8_t *b, int i) {
    const int n = i / 2, hi2 = i % 2;
    const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * n));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
    const __m512i lo = _mm512_and_si512(hi2 ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m512i hb = hi2 ? _mm512_srlv_epi16(h2, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1))
                           : _mm512_sllv_epi16(h2, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    return _mm512_or_si512(lo, _mm512_and_si512(hb, _mm512_set1_epi8(0x30)));
}

/* Q6_K super-block b's sixteen scales times x's (each x block's scale for its two sub-blocks of 16) */
static inline __attribute__((always_inline)) __m512 q6k_scales(const uint8_t *b, const float *xd8) {
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(half(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
    return _mm512_mul_ps(sc, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(xd8))));
}
/* Q4_K's and Q5_K's eight 6-bit scales (into the low 8 bytes of *sc) and mins (*mn) from their 12 bytes,
 * four at a time in 32-bit words (`k_scale_min`'s) */
static inline void k_scales8(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    const uint32_t s03 = w0 & 0x3F3F3F3Fu, m03 = w1 & 0x3F3F3F3Fu;
    const uint32_t s47 = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t m47 = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
    *sc = (uint64_t)s03 | (uint64_t)s47 << 32;
    *mn = (uint64_t)m03 | (uint64_t)m47 << 32;
}

/* IQ4_XS super-block b's eight signed 6-bit scales (`iq4xs_scale`'s), each byte's bits picked by one multishift
 * from b's 4 bytes of low bits (4 a scale, from bit 0) and 16 of high bits (2 a scale, from bit 32) */
static inline __m256 iq4xs_scales8(const uint8_t *b) {
    uint32_t lo;
    uint16_t hi;
    memcpy(&lo, b + 4, 4);
    memcpy(&hi, b + 2, 2);
    const __m128i v = _mm_cvtsi64_si128((long long)((uint64_t)lo | (uint64_t)hi << 32));
    const __m128i l4 = _mm_and_si128(_mm_multishift_epi64_epi8(_mm_set1_epi64x(0x1C1814100C080400LL), v), _mm_set1_epi8(0x0F));
    const __m128i h2 = _mm_and_si128(_mm_multishift_epi64_epi8(_mm_set1_epi64x(0x2E2C2A2826242220LL), v), _mm_set1_epi8(3));
    const __m128i s = _mm_sub_epi8(_mm_or_si128(l4, _mm_slli_epi16(h2, 4)), _mm_set1_epi8(32));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s));
}

static inline __m256 bytes8_ps(uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v))); }

#define MX 2 /* rows of x that share each decoded block of weights */

/* rows r0 .. r0 + nr of W times x rows m0 .. m0 + mn (mn <= MX) into out[r][m]; 1 where type t is computed here.
 * Inlined into `gg_rows_vnni` with nr and mn constant for the common cases, so that its loops over rows and x
 * rows unroll and the accumulators stay in registers (with runtime bounds they live on the stack) */
static inline __attribute__((always_inline)) int gg_rows_body(int64_t t, const uint8_t *w, int64_t rb, int64_t r0,
                                                              int64_t nr, int64_t I, const Acts *a, int64_t m0,
                                                              int64_t mn, float out[ROWS][MX]) {
    if (t != GG_Q4_K && t != GG_Q6_K && t != GG_Q8_0) return 0;
    const int64_t ip = a->Ip, nd = a->Ip / QB;
    __m512 acc[ROWS][MX];
    __m256 off[ROWS][MX], acc8[ROWS][MX];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < MX; m++) {
            acc[r][m] = _mm512_setzero_ps();
            off[r][m] = acc8[r][m] = _mm256_setzero_ps();
        }
    if (t == GG_Q8_0) {
        const int64_t nb = I / QB;
        for (int64_t k = 0; k < nb; k += 2) {
            const int two = k + 1 < nb; /* an odd last block: its 32 codes in the low half, zeros above */
            const __mmask64 keep = two ? ~0ULL : 0xFFFFFFFFULL;
            /* the codes made unsigned (+128), the 128 taken back from x's sums of 4 (shared by the rows) */
            __m512i x[MX], bx[MX];
            for (int64_t m = 0; m < mn; m++) {
                x[m] = _mm512_maskz_loadu_epi8(keep, a->q + (m0 + m) * ip + k * QB);
                bx[m] = _mm512_slli_epi32(x_sums(x[m]), 7);
            }
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *b0 = w + (r0 + r) * rb + k * 34, *b1 = two ? b0 + 34 : b0;
                _mm_prefetch((const char *)b0 + ROWS * rb, _MM_HINT_T0);
                _mm_prefetch((const char *)b0 + ROWS * rb + 64, _MM_HINT_T0);
                const __m512i cu = q8_pair(b0, b1, keep);
                const float d0 = half(b0), d1 = two ? half(b1) : 0.0f;
                for (int64_t m = 0; m < mn; m++) {
                    const float *dx = a->d + (m0 + m) * nd + k;
                    const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(d0 * dx[0]), _mm256_set1_ps(two ? d1 * dx[1] : 0.0f), 1);
                    const __m512i dot = _mm512_dpbusd_epi32(bx[m], cu, x[m]); /* sum c x, exactly */
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, acc[r][m]);
                }
            }
        }
    } else if (t == GG_Q4_K) { /* 256 bits a sub-block: its scale a broadcast, no lane shuffles */
        const __m256i lo4 = _mm256_set1_epi8(0x0F);
        for (int64_t sb = 0; sb < I / 256; sb++) {
            __m256 ps[ROWS], pm[ROWS];
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *b = w + (r0 + r) * rb + sb * 144;
                for (int l = 0; l < 144 + 63; l += 64) _mm_prefetch((const char *)b + ROWS * rb + l, _MM_HINT_T0);
                uint64_t sc, mn8;
                k_scales8(b + 4, &sc, &mn8);
                ps[r] = _mm256_mul_ps(_mm256_set1_ps(half(b)), bytes8_ps(sc));
                pm[r] = _mm256_mul_ps(_mm256_set1_ps(half(b + 2)), bytes8_ps(mn8));
            }
            float pf[ROWS][MX][8];
            for (int64_t m = 0; m < mn; m++) {
                const __m256 d8 = _mm256_loadu_ps(a->d + (m0 + m) * nd + sb * 8);
                const __m256 x8 = _mm256_loadu_ps(a->xsum + (m0 + m) * a->groups + sb * 8);
                for (int64_t r = 0; r < nr; r++) {
                    _mm256_storeu_ps(pf[r][m], _mm256_mul_ps(ps[r], d8));
                    off[r][m] = _mm256_fnmadd_ps(pm[r], x8, off[r][m]);
                }
            }
            for (int i = 0; i < 4; i++) {
                __m256i x0[MX], x1[MX];
                for (int64_t m = 0; m < mn; m++) {
                    x0[m] = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + m) * ip + sb * 256 + 64 * i));
                    x1[m] = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + m) * ip + sb * 256 + 64 * i + 32));
                }
                for (int64_t r = 0; r < nr; r++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(w + (r0 + r) * rb + sb * 144 + 16 + 32 * i));
                    const __m256i lo = _mm256_and_si256(q, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
                    for (int64_t m = 0; m < mn; m++) {
                        const __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0[m]);
                        const __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, x1[m]);
                        acc8[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(pf[r][m][2 * i]), acc8[r][m]);
                        acc8[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(pf[r][m][2 * i + 1]), acc8[r][m]);
                    }
                }
            }
        }
    } else { /* Q6_K: the codes unsigned (0..63), their bias of 32 taken from each x-row's sums of 4 (shared by the rows) */
        for (int64_t sb = 0; sb < I / 256; sb++) {
            __m512 p[ROWS][MX];
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *b = w + (r0 + r) * rb + sb * 210;
                for (int l = 0; l < 210 + 63; l += 64) _mm_prefetch((const char *)b + ROWS * rb + l, _MM_HINT_T0);
                for (int64_t m = 0; m < mn; m++) p[r][m] = q6k_scales(b, a->d + (m0 + m) * nd + sb * 8);
            }
            for (int i = 0; i < 4; i++) { /* 64 weights: half i / 2 of the super-block, its quarters 2 (i % 2), +1 */
                __m512i x[MX], bx[MX];
                for (int64_t m = 0; m < mn; m++) {
                    x[m] = _mm512_loadu_si512((const void *)(a->q + (m0 + m) * ip + sb * 256 + 64 * i));
                    bx[m] = _mm512_slli_epi32(x_sums(x[m]), 5);
                }
                const __m512i ix = idx16(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3);
                for (int64_t r = 0; r < nr; r++) {
                    const __m512i c = q6k_codes(w + (r0 + r) * rb + sb * 210, i);
                    for (int64_t m = 0; m < mn; m++) {
                        const __m512i dot = _mm512_dpbusd_epi32(bx[m], c, x[m]); /* sum (c - 32) x, exactly */
                        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(ix, p[r][m]), acc[r][m]);
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t m = 0; m < mn; m++)
            out[r][m] = _mm512_reduce_add_ps(acc[r][m]) + hsum8(acc8[r][m]) + hsum8(off[r][m]);
    return 1;
}

/* Bytes ahead of a row read as one stream (`gg_row1_vnni`) to prefetch */

#ifndef GG_STREAM_AHEAD
#define GG_STREAM_AHEAD PREFETCH
#endif
/* One row of Q4_K (five 0) or Q5_K (five 1: each code's fifth bit from the 32 bytes after the mins) against x
 * row m, inlined with `five` a constant so that Q4_K's loop carries none of Q5_K's work. x has one scale per
 * super-block (Acts.kb 256), so a super-block's sum is an integer: each sub-block's codes times x in pairs
 * (vpmaddubsw, at most 2 * 31 * 127), those pairs times the sub-block's 6-bit scale and summed (vpdpwssd), one
 * float multiply-add a super-block; the mins' share from x's sums per 32, in float */
static inline __attribute__((always_inline)) float k45_row(const int five, const uint8_t *wr, int64_t I, const Acts *a,
                                                           int64_t m) {
    const int8_t *xq = a->q + m * a->Ip;
    const float *xd = a->d + m * (a->Ip / QB);
    const int64_t bb = five ? 176 : 144, qs = five ? 48 : 16;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 f = _mm256_setzero_ps(), off = f;
    for (int64_t sb = 0; sb < I / 256; sb++) {
        const uint8_t *b = wr + sb * bb;
        for (int l = 0; l < bb + 48; l += 64) _mm_prefetch((const char *)b + GG_STREAM_AHEAD + l, _MM_HINT_T0);
        uint64_t sc, mn8;
        k_scales8(b + 4, &sc, &mn8);
        const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        off = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half(b + 2)), bytes8_ps(mn8)),
                               _mm256_loadu_ps(a->xsum + m * a->groups + sb * 8), off);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int i = 0; i < 4; i++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + qs + 32 * i));
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + sb * 256 + 64 * i));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + sb * 256 + 64 * i + 32));
            __m256i c0 = _mm256_and_si256(q, lo4), c1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
            if (five) { /* bit 2i of byte l: sub-block 2i's weight l; bit 2i + 1: sub-block 2i + 1's */
                c0 = _mm256_or_si256(c0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4));
                c1 = _mm256_or_si256(c1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4));
            }
            const __m256i s0 = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)((4 * i + 1) << 8 | 4 * i)));
            const __m256i s1 = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)((4 * i + 3) << 8 | (4 * i + 2))));
            acc[0] = _mm256_dpwssd_epi32(acc[0], _mm256_maddubs_epi16(c0, x0), s0);
            acc[1] = _mm256_dpwssd_epi32(acc[1], _mm256_maddubs_epi16(c1, x1), s1);
        }
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[0], acc[1])), _mm256_set1_ps(half(b) * xd[sb * 8]), f);
    }
    return hsum8(_mm256_add_ps(f, off));
}

/* One row of Q4_K, Q5_K, Q6_K or Q8_0 blocks (wr) against x row m: decoding's product. The row is
 * read as one sequential stream, a fixed distance prefetched ahead, one row after another, as the int8 kernel reads
 * its rows: four rows side by side (`gg_rows_body`, which shares each load of x between them) held 14-17
 * GB/s from memory on two threads of an AVX-512 EPYC, where the int8 kernel's one stream held 28. Two
 * accumulators each, so that the multiply-adds' latency does not bound a single row. */
static float gg_row1_vnni(int64_t t, const uint8_t *wr, int64_t I, const Acts *a, int64_t m) {
    const int8_t *xq = a->q + m * a->Ip;
    const float *xd = a->d + m * (a->Ip / QB);
    if (t == GG_Q8_0) {
        __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        const int64_t nb = I / QB;
        for (int64_t k = 0; k < nb; k += 2) {
            const int two = k + 1 < nb, acc = (k >> 1) & 1;
            const __mmask64 keep = two ? ~0ULL : 0xFFFFFFFFULL;
            const uint8_t *b0 = wr + k * 34, *b1 = two ? b0 + 34 : b0;
            _mm_prefetch((const char *)b0 + GG_STREAM_AHEAD, _MM_HINT_T0);
            const __m512i x = _mm512_maskz_loadu_epi8(keep, xq + k * QB);
            const __m512i bx = _mm512_slli_epi32(x_sums(x), 7);
            const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(half(b0) * xd[k]),
                                                 _mm256_set1_ps(two ? half(b1) * xd[k + 1] : 0.0f), 1);
            const __m512i dot = _mm512_dpbusd_epi32(bx, q8_pair(b0, b1, keep), x);
            if (acc) f[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, f[1]); /* each in a register */
            else f[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, f[0]);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
    }
    if (t == GG_Q4_K) return k45_row(0, wr, I, a, m); /* each with its own constants folded in */
    if (t == GG_Q5_K) return k45_row(1, wr, I, a, m);
    /* Q6_K: gg_rows_body's, one row */
    __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < I / 256; sb++) {
        const uint8_t *b = wr + sb * 210;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)b + GG_STREAM_AHEAD + l, _MM_HINT_T0);
        const __m512 p = q6k_scales(b, xd + sb * 8);
        for (int i = 0; i < 4; i++) {
            const __m512i x = _mm512_loadu_si512((const void *)(xq + sb * 256 + 64 * i));
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(x_sums(x), 5), q6k_codes(b, i), x);
            f[i % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                       _mm512_permutexvar_ps(idx16(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), p), f[i % 2]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
}

/* Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4 (blocks of 32 of B bytes: a scale, Q4_1's and Q5_1's min, Q5's 32
 * fifth bits, then 16 bytes of nibbles): one row as one stream, four blocks a step. One byte permute
 * (vpermt2b) gathers the four blocks' 64 bytes of nibbles, so that lanes 16i .. 16i + 15 hold block i's weights
 * 0-15 (the low nibbles) or 16-31 (the high), x's 128 codes permuted to match; another gathers the four scales.
 * Codes are unsigned (IQ4_NL's and MXFP4's table values plus 128, that 128 taken back from x's sums of 4 in
 * integers); the others' zero (8 or 16 times the scale) or min times x's block sums in float, as `decode32`'s
 * offset. A last step of fewer than four blocks reads through masks. */
#define W4(base, l) ((uint32_t)((base) + 4 * (l)) * 0x01010101u + 0x03020100u) /* bytes base + 4l .. + 3 */
static inline __attribute__((always_inline)) __m512i blocks16(int B, int off) { /* block i's 16 bytes at off */
    return _mm512_set_epi32(W4(3 * B + off, 3), W4(3 * B + off, 2), W4(3 * B + off, 1), W4(3 * B + off, 0),
                            W4(2 * B + off, 3), W4(2 * B + off, 2), W4(2 * B + off, 1), W4(2 * B + off, 0),
                            W4(B + off, 3), W4(B + off, 2), W4(B + off, 1), W4(B + off, 0),
                            W4(off, 3), W4(off, 2), W4(off, 1), W4(off, 0));
}
/* block i's byte off for its bytes 0-7 (lanes 16i ..), byte off + 1 for 8-15 */
static inline __attribute__((always_inline)) __m512i hbytes16(int B, int off) {
    const int h[4] = {off * 0x01010101, (off + 1) * 0x01010101, (B + off) * 0x01010101, (B + off + 1) * 0x01010101};
    const int g[4] = {(2 * B + off) * 0x01010101, (2 * B + off + 1) * 0x01010101, (3 * B + off) * 0x01010101,
                      (3 * B + off + 1) * 0x01010101};
    return _mm512_set_epi32(g[3], g[3], g[2], g[2], g[1], g[1], g[0], g[0], h[3], h[3], h[2], h[2], h[1], h[1], h[0], h[0]);
}
/* IQ4_NL's and MXFP4's code values plus 128 (unsigned) */
static const uint8_t IQ4_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static const uint8_t FP4_U[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};

static inline __attribute__((always_inline)) void g32_x(const int8_t *xq, const int8_t *xn, const int64_t n, __m512i *xl, __m512i *xh) {
    if (xn) { /* x in this order already (`acts_gg`): inputs 0-15 of the n blocks, then 16-31 */
        const __mmask64 h = n == 4 ? ~0ULL : (1ULL << (16 * n)) - 1;
        *xl = _mm512_maskz_loadu_epi8(h, xn);
        *xh = _mm512_maskz_loadu_epi8(h, xn + 16 * n);
    } else {
        const int64_t xb = 32 * n;
        const __mmask64 x0 = xb >= 64 ? ~0ULL : (1ULL << xb) - 1, x1 = xb >= 128 ? ~0ULL : xb > 64 ? (1ULL << (xb - 64)) - 1 : 0;
        const __m512i xa = _mm512_maskz_loadu_epi8(x0, xq), xc = _mm512_maskz_loadu_epi8(x1, xq + 64);
        *xl = _mm512_permutex2var_epi8(xa, blocks16(32, 0), xc);
        *xh = _mm512_permutex2var_epi8(xa, blocks16(32, 16), xc);
    }
}

/* the integer sums of four blocks' codes cl (inputs 0-15), ch (16-31) with x's; a table's (IQ4_NL's, IQ4_XS's,
 * MXFP4's) nibbles looked up into their values plus 128, that 128 times x's sums taken away (xb: `acts_gg`'s) */
static inline __attribute__((always_inline)) __m512i g32_dot(const uint8_t *table, __m512i cl, __m512i ch, __m512i xl, __m512i xh,
                                                             const int32_t *xb) {
    __m512i acc = _mm512_setzero_si512();
    if (table) {
        const __m512i vals = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
        cl = _mm512_shuffle_epi8(vals, cl);
        ch = _mm512_shuffle_epi8(vals, ch);
        acc = xb ? _mm512_loadu_si512((const void *)xb) : _mm512_slli_epi32(_mm512_add_epi32(x_sums(xl), x_sums(xh)), 7);
    }
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, cl, xl), ch, xh);
}

/* f plus the sums times their block's scale sx (block i's in lanes 4i .. 4i + 3) */
static inline __attribute__((always_inline)) __m512 g32_scale(__m512i dot, __m128 sx, __m512 f) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sx)), f);
}

/* blocks k .. k + n - 1 (n <= 4) of a row of type t against x row m's codes xq, scales xd and block sums xs: the
 * integer sums scaled into f, the offsets' share into *off */
static inline __attribute__((always_inline)) void g32_step(const int t, const uint8_t *b, const int8_t *xq,
                                                           const int8_t *xn, const int32_t *xb, const float *xd,
                                                           const float *xs, const int64_t n, __m512 *f, __m128 *off) {
    const int B = (int)gg_block_bytes(t), lut = t == GG_IQ4_NL || t == GG_MXFP4, five = t == GG_Q5_0 || t == GG_Q5_1;
    const int qh = t == GG_Q5_0 ? 2 : 4; /* Q5's fifth bits: byte 16i + l of the low (high) half takes bit l % 8 of
                                          * block i's byte qh + l / 8 (qh + 2 + l / 8) */
    const int64_t bytes = n * B;
    const __mmask64 w0 = bytes >= 64 ? ~0ULL : (1ULL << bytes) - 1, w1 = bytes > 64 ? (1ULL << (bytes - 64)) - 1 : 0;
    const __mmask8 s4 = (__mmask8)((1u << n) - 1);
    _mm_prefetch((const char *)b + GG_STREAM_AHEAD, _MM_HINT_T0);
    _mm_prefetch((const char *)b + GG_STREAM_AHEAD + 63, _MM_HINT_T0);
    const __m512i v0 = _mm512_maskz_loadu_epi8(w0, b), v1 = _mm512_maskz_loadu_epi8(w1, b + 64);
    __m512i xl, xh;
    g32_x(xq, xn, n, &xl, &xh);
    const __m512i q = _mm512_permutex2var_epi8(v0, blocks16(B, B - 16), v1), lo4 = _mm512_set1_epi8(0x0F);
    __m512i cl = _mm512_and_si512(q, lo4), ch = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
    if (five) {
        const __m512i bit = _mm512_set1_epi64(0x8040201008040201LL), hl = hbytes16(B, qh), hh = hbytes16(B, qh + 2);
        cl = _mm512_mask_add_epi8(cl, _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v0, hl, v1), bit), cl, _mm512_set1_epi8(16));
        ch = _mm512_mask_add_epi8(ch, _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v0, hh, v1), bit), ch, _mm512_set1_epi8(16));
    }
    const __m512i dot = g32_dot(t == GG_MXFP4 ? FP4_U : t == GG_IQ4_NL ? IQ4_U : NULL, cl, ch, xl, xh, xb);
    __m128 d;
    if (t == GG_MXFP4) { /* 2^(e - 127): e put at the top byte of each lane (the rest masked to 0), shifted to the
                          * exponent's bits (the half, as FP4_VALUES are doubled, by `g32_row`); e = 0, 2^-127 as
                          * the format has it, is taken as 0 (its weights 3e-38 at most) */
        const __m512i eidx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3 * B << 24, 2 * B << 24, B << 24, 0);
        d = _mm_castsi128_ps(_mm_srli_epi32(_mm512_castsi512_si128(_mm512_maskz_permutexvar_epi8(0x8888, eidx, v0)), 1));
    } else { /* the four scales' bytes (and Q4_1's, Q5_1's mins', 2 on) in the low 8 (16) bytes */
        const __m512i sidx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              (3 * B + 3) << 24 | (3 * B + 2) << 16 | (2 * B + 3) << 8 | (2 * B + 2),
                                              (B + 3) << 24 | (B + 2) << 16 | 3 << 8 | 2,
                                              (3 * B + 1) << 24 | (3 * B) << 16 | (2 * B + 1) << 8 | (2 * B),
                                              (B + 1) << 24 | B << 16 | 1 << 8 | 0);
        const __m128i sm = _mm512_castsi512_si128(_mm512_permutex2var_epi8(v0, sidx, v1));
        d = _mm_cvtph_ps(sm);
        const __m128 x4 = _mm_maskz_loadu_ps(s4, xs);
        if (t == GG_Q4_1 || t == GG_Q5_1) *off = _mm_fmadd_ps(_mm_cvtph_ps(_mm_srli_si128(sm, 8)), x4, *off);
        else if (!lut) *off = _mm_fmadd_ps(d, x4, *off); /* times the zero, -8 or -16, by `g32_row` */
    }
    *f = g32_scale(dot, _mm_mul_ps(d, _mm_maskz_loadu_ps(s4, xd)), *f);
}

static inline __attribute__((always_inline)) float g32_row(const int t, const uint8_t *wr, int64_t I, const Acts *a,
                                                           int64_t m) {
    const int64_t B = gg_block_bytes(t), nb = I / QB, n4 = nb / 4 * 4;
    const int8_t *xq = a->q + m * a->Ip;
    const float *xd = a->d + m * (a->Ip / QB), *xs = a->xsum + m * a->groups;
    __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 off = _mm_setzero_ps();
    const int8_t *xn = a->gn ? a->gn + m * a->Ip : NULL;
    const int32_t *xb = a->gb ? a->gb + m * a->Ip / 8 : NULL;
#define G32_AT(k) xq + (k) * QB, xn ? xn + (k) * QB : NULL, xb ? xb + (k) * 4 : NULL, xd + (k), xs + (k)
    int64_t k = 0;
    for (; k + 8 <= n4; k += 8) { /* two steps, each its own accumulator (indexed by k, they would live on the stack) */
        g32_step(t, wr + k * B, G32_AT(k), 4, &f[0], &off);
        g32_step(t, wr + (k + 4) * B, G32_AT(k + 4), 4, &f[1], &off);
    }
    if (k < n4) g32_step(t, wr + k * B, G32_AT(k), 4, &f[0], &off);
    if (n4 < nb) g32_step(t, wr + n4 * B, G32_AT(n4), nb - n4, &f[0], &off);
#undef G32_AT
    const float zero = t == GG_Q4_0 ? -8.0f : t == GG_Q5_0 ? -16.0f : 1.0f;
    return (t == GG_MXFP4 ? 0.5f : 1.0f) * _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1])) +
           zero * _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(off, off), off));
}

/* IQ4_XS: its super-block's 8 blocks of 32 have IQ4_NL's nibbles, 16 bytes each, so that each half's 64 bytes
 * are `g32_step`'s four blocks as they lie; the 8 scales from one multishift */
static float iq4xs_row(const uint8_t *wr, int64_t I, const Acts *a, int64_t m) {
    const int8_t *xq = a->q + m * a->Ip, *xn = a->gn ? a->gn + m * a->Ip : NULL;
    const int32_t *xb = a->gb ? a->gb + m * a->Ip / 8 : NULL;
    const float *xd = a->d + m * (a->Ip / QB);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < I / 256; sb++) {
        const uint8_t *b = wr + sb * 136;
        for (int l = 0; l < 136 + 48; l += 64) _mm_prefetch((const char *)b + GG_STREAM_AHEAD + l, _MM_HINT_T0);
        const __m256 p = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half(b)), iq4xs_scales8(b)), _mm256_loadu_ps(xd + sb * 8));
        for (int h = 0; h < 2; h++) {
            __m512i xl, xh;
            g32_x(xq + sb * 256 + 128 * h, xn ? xn + sb * 256 + 128 * h : NULL, 4, &xl, &xh);
            const __m512i q = _mm512_loadu_si512((const void *)(b + 8 + 64 * h));
            const __m512i dot = g32_dot(IQ4_U, _mm512_and_si512(q, lo4), _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4), xl, xh,
                                        xb ? xb + sb * 32 + 16 * h : NULL);
            f[h] = g32_scale(dot, h ? _mm256_extractf128_ps(p, 1) : _mm256_castps256_ps128(p), f[h]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
}

static float g32_row_vnni(int64_t t, const uint8_t *wr, int64_t I, const Acts *a, int64_t m) {
    switch (t) { /* each type with its constants folded in */
    case GG_Q4_0: return g32_row(GG_Q4_0, wr, I, a, m);
    case GG_Q4_1: return g32_row(GG_Q4_1, wr, I, a, m);
    case GG_Q5_0: return g32_row(GG_Q5_0, wr, I, a, m);
    case GG_Q5_1: return g32_row(GG_Q5_1, wr, I, a, m);
    case GG_IQ4_NL: return g32_row(GG_IQ4_NL, wr, I, a, m);
    case GG_IQ4_XS: return iq4xs_row(wr, I, a, m);
    default: return g32_row(GG_MXFP4, wr, I, a, m);
    }
}

static int gg_rows_vnni(int64_t t, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t I, const Acts *a,
                        int64_t m0, int64_t mn, float out[ROWS][MX]) {
    if (mn == 1) { /* decoding */
        if (t != GG_Q4_K && t != GG_Q6_K && t != GG_Q8_0) return 0;
        for (int64_t r = 0; r < nr; r++) out[r][0] = gg_row1_vnni(t, w + (r0 + r) * rb, I, a, m0);
        return 1;
    }
    if (nr == ROWS && mn == MX) return gg_rows_body(t, w, rb, r0, ROWS, I, a, m0, MX, out); /* a prompt's rows */
    return gg_rows_body(t, w, rb, r0, nr, I, a, m0, mn, out);
}
#endif


/* x rows m0 .. m0 + mn (mn <= 2) of block rows r0 .. r0 + nr into y: every type on the AVX2 (or scalar) path.
 * Inlined by `gg_rows` with the type, nr and mn constant for the common cases: the block decoder's switch
 * folds to the one type and the loops unroll, the accumulators staying in registers */
static inline __attribute__((always_inline)) void gg_rows_body2(int64_t t, const uint8_t *w, int64_t rb, int64_t r0,
                                                                int64_t nr, int64_t nb, const Acts *a, int64_t m0,
                                                                int64_t mn, int64_t O, float *y) {
    float off[ROWS][2] = {{0}};
#ifdef SEMOE_HAS_AVX2
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        __m256i c[ROWS];
        float s[ROWS][2], o[ROWS];
        for (int64_t r = 0; r < nr; r++) {
            _mm_prefetch((const char *)(w + (r0 + r) * rb + k * rb / nb) + PREFETCH, _MM_HINT_T0);
            decode32_v(t, w + (r0 + r) * rb, k, &c[r], s[r], &o[r]);
        }
        for (int64_t m = 0; m < mn; m++) {
            const int64_t mm = m0 + m;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + mm * a->Ip + k * QB));
            const float dx = a->d[mm * (a->Ip / QB) + k], xs = a->xsum[mm * a->groups + k];
            for (int64_t r = 0; r < nr; r++) {
                const __m256 sv = _mm256_set_m128(_mm_set1_ps(s[r][1] * dx), _mm_set1_ps(s[r][0] * dx));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(c[r], q)), sv, acc[r][m]);
                off[r][m] += o[r] * xs;
            }
        }
    }
    for (int64_t m = 0; m < mn; m++)
        for (int64_t r = 0; r < nr; r++) y[(m0 + m) * O + r0 + r] = hsum8(acc[r][m]) + off[r][m];
#else
    float acc[ROWS][2] = {{0}};
    int8_t c[ROWS][QB];
    float s[ROWS][2], o[ROWS];
    for (int64_t k = 0; k < nb; k++) {
        for (int64_t r = 0; r < nr; r++) decode32(t, w + (r0 + r) * rb, k, c[r], s[r], &o[r]);
        for (int64_t m = 0; m < mn; m++) {
            const int64_t mm = m0 + m;
            const int8_t *q = a->q + mm * a->Ip + k * QB;
            const float dx = a->d[mm * (a->Ip / QB) + k], xs = a->xsum[mm * a->groups + k];
            for (int64_t r = 0; r < nr; r++) {
                int32_t h0 = 0, h1 = 0;
                for (int j = 0; j < 16; j++) h0 += (int32_t)c[r][j] * q[j];
                for (int j = 16; j < 32; j++) h1 += (int32_t)c[r][j] * q[j];
                acc[r][m] += dx * (s[r][0] * (float)h0 + s[r][1] * (float)h1);
                off[r][m] += o[r] * xs;
            }
        }
    }
    for (int64_t m = 0; m < mn; m++)
        for (int64_t r = 0; r < nr; r++) y[(m0 + m) * O + r0 + r] = acc[r][m] + off[r][m];
#endif
}

#define GG_ROWS_OF(T)                                                                                         \
    case T:                                                                                                   \
        if (nr == ROWS && mn == 1) gg_rows_body2(T, w, rb, r0, ROWS, nb, a, m0, 1, O, y);                    \
        else if (nr == ROWS && mn == 2) gg_rows_body2(T, w, rb, r0, ROWS, nb, a, m0, 2, O, y);               \
        else gg_rows_body2(T, w, rb, r0, nr, nb, a, m0, mn, O, y);                                             \
        return;

static void gg_rows(int64_t t, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t nb, const Acts *a,
                    int64_t m0, int64_t mn, int64_t O, float *y) {
    switch (t) {
        GG_ROWS_OF(GG_Q4_0) GG_ROWS_OF(GG_Q4_1) GG_ROWS_OF(GG_Q5_0) GG_ROWS_OF(GG_Q5_1) GG_ROWS_OF(GG_Q8_0)
        GG_ROWS_OF(GG_Q4_K) GG_ROWS_OF(GG_Q5_K) GG_ROWS_OF(GG_Q6_K) GG_ROWS_OF(GG_IQ4_NL) GG_ROWS_OF(GG_IQ4_XS)
        GG_ROWS_OF(GG_MXFP4)
    default: gg_rows_body2(t, w, rb, r0, nr, nb, a, m0, mn, O, y);
    }
}

/* block b of y (M, O) = x @ W.T for W (O, I) of ggml type t (rows of row_bytes), x quantized in a (groups
 * of 32: its xsum); x rows two at a time, each (row, x row) summed in vector lanes, then across them */
void gg_block(int64_t t, const uint8_t *w, int64_t O, int64_t I, const Acts *a, int64_t b, float *y) {
    const int64_t r0 = b * ROWS, nr = (r0 + ROWS < O ? r0 + ROWS : O) - r0, nb = I / QB, rb = gg_row_bytes(t, I);
#ifdef SEMOE_VNNI
    float out[ROWS][MX];
    if (a->gu) { /* `acts_gg` laid the rows out: the tile takes them */
        gg_tile_vnni(t, w, rb, r0, nr, I, a, O, y);
        return;
    }
    if (t == GG_Q5_K) { /* no pairs path on this build: a few rows of x each stream the rows */
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t r = 0; r < nr; r++) y[m * O + r0 + r] = gg_row1_vnni(t, w + (r0 + r) * rb, I, a, m);
        return;
    }
    if (t != GG_Q4_K && t != GG_Q6_K && t != GG_Q8_0) { /* the blocks of 32 */
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t r = 0; r < nr; r++) y[m * O + r0 + r] = g32_row_vnni(t, w + (r0 + r) * rb, I, a, m);
        return;
    }
    if (t == GG_Q4_K || t == GG_Q6_K || t == GG_Q8_0) {
        for (int64_t m0 = 0; m0 < a->M; m0 += MX) {
            const int64_t mn = a->M - m0 < MX ? a->M - m0 : MX;
            gg_rows_vnni(t, w, rb, r0, nr, I, a, m0, mn, out);
            for (int64_t m = 0; m < mn; m++)
                for (int64_t r = 0; r < nr; r++) y[(m0 + m) * O + r0 + r] = out[r][m];
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < a->M; m0 += 2) gg_rows(t, w, rb, r0, nr, nb, a, m0, a->M - m0 < 2 ? a->M - m0 : 2, O, y);
}
