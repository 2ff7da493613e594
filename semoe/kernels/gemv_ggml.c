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
 * build decodes Q4_K, Q6_K and Q8_0 one row at a time instead, each read as one stream: `gg_row1_vnni`);
 * every output row is summed by one thread in one order (kernels.h). */
#include "kernels.h"
#include "decode_abi.h"

enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14,
       GG_IQ4_NL = 20, GG_IQ4_XS = 23, GG_MXFP4 = 39 };

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* e2m1 values times two (llama.cpp's kvalues_mxfp4), the block scale then halved */
static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float half(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* weights per block (32, or 256 for the super-block types) and the bytes of one */
static int64_t gg_block_weights(int64_t t) {
    return t == GG_Q4_K || t == GG_Q5_K || t == GG_Q6_K || t == GG_IQ4_XS ? 256 : 32;
}

static int64_t gg_block_bytes(int64_t t) {
    switch (t) {
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q5_0: return 22;
    case GG_Q5_1: return 24;
    case GG_Q8_0: return 34;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    case GG_Q6_K: return 210;
    case GG_IQ4_NL: return 18;
    case GG_IQ4_XS: return 136;
    case GG_MXFP4: return 17;
    default: return 0;
    }
}

/* bytes of one row of I weights of type t; 0 for a type not computed here or I not a whole number of blocks */
int64_t gg_row_bytes(int64_t t, int64_t I) {
    const int64_t n = gg_block_weights(t), b = gg_block_bytes(t);
    return b == 0 || I % n ? 0 : I / n * b;
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 bytes */
static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* the bytes of block k's block (a super-block for the K types and IQ4_XS) in a row of type t */
static inline const uint8_t *block_of(int64_t t, const uint8_t *row, int64_t k) {
    const int64_t per = gg_block_weights(t) / QB;
    return row + (k / per) * gg_block_bytes(t);
}

/* block k (32 weights) of a row: its half scales s[2] and offset o (weight j = s[j / 16] c_j + o) */
static void block_scales(int64_t t, const uint8_t *row, int64_t k, float *s, float *o) {
    const uint8_t *b = block_of(t, row, k);
    const int j = (int)(k % 8);
    *o = 0.0f;
    switch (t) {
    case GG_MXFP4: { /* half of 2^(e - 127), the codes being twice the e2m1 values */
        const uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23;
        float f;
        memcpy(&f, &bits, 4);
        s[0] = s[1] = f;
        return;
    }
    case GG_Q4_K:
    case GG_Q5_K: {
        int sc, m;
        k_scale_min(j, b + 4, &sc, &m);
        s[0] = s[1] = half(b) * (float)sc;
        *o = -half(b + 2) * (float)m;
        return;
    }
    case GG_Q6_K: {
        const int8_t *sc = (const int8_t *)(b + 192);
        s[0] = half(b + 208) * (float)sc[2 * j];
        s[1] = half(b + 208) * (float)sc[2 * j + 1];
        return;
    }
    case GG_IQ4_XS: {
        uint16_t sh;
        memcpy(&sh, b + 2, 2);
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        s[0] = s[1] = half(b) * (float)(ls - 32);
        return;
    }
    default: /* one half scale a block, Q4_1's and Q5_1's min after it */
        s[0] = s[1] = half(b);
        if (t == GG_Q4_1 || t == GG_Q5_1) *o = half(b + 2);
    }
}

/* block k (32 weights) of a row: codes c, half scales s[2] and offset o */
static void decode32(int64_t t, const uint8_t *row, int64_t k, int8_t *c, float *s, float *o) {
    const uint8_t *b = block_of(t, row, k);
    const int j = (int)(k % 8);
    block_scales(t, row, k, s, o);
    switch (t) {
    case GG_Q8_0: memcpy(c, b + 2, 32); return;
    case GG_Q4_0:
    case GG_Q4_1:
    case GG_IQ4_NL:
    case GG_MXFP4:
    case GG_IQ4_XS: {
        const uint8_t *qs = t == GG_IQ4_XS ? b + 8 + j * 16 : b + gg_block_bytes(t) - 16;
        const int8_t *tab = t == GG_MXFP4 ? FP4_VALUES : IQ4_VALUES;
        for (int l = 0; l < 16; l++) {
            const int lo = qs[l] & 0xF, hi = qs[l] >> 4;
            const int lut = t == GG_IQ4_NL || t == GG_MXFP4 || t == GG_IQ4_XS;
            c[l] = (int8_t)(lut ? tab[lo] : t == GG_Q4_0 ? lo - 8 : lo);
            c[l + 16] = (int8_t)(lut ? tab[hi] : t == GG_Q4_0 ? hi - 8 : hi);
        }
        return;
    }
    case GG_Q5_0:
    case GG_Q5_1: {
        const int64_t bytes = gg_block_bytes(t);
        const uint8_t *qh = b + bytes - 20, *qs = b + bytes - 16;
        uint32_t h;
        memcpy(&h, qh, 4);
        const int off = t == GG_Q5_0 ? 16 : 0;
        for (int l = 0; l < 16; l++) {
            c[l] = (int8_t)(((qs[l] & 0xF) | (((h >> l) & 1) << 4)) - off);
            c[l + 16] = (int8_t)(((qs[l] >> 4) | (((h >> (l + 16)) & 1) << 4)) - off);
        }
        return;
    }
    case GG_Q4_K:
    case GG_Q5_K: {
        const uint8_t *qs = b + (t == GG_Q4_K ? 16 : 48) + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int l = 0; l < 32; l++)
            c[l] = (int8_t)(((qs[l] >> shift) & 0xF) | (t == GG_Q5_K ? ((b[16 + l] >> j) & 1) << 4 : 0));
        return;
    }
    case GG_Q6_K: {
        const int n = j / 4, part = j % 4; /* 128-weight half n, its quarter part */
        const uint8_t *l0 = b + 64 * n + (part % 2) * 32, *h0 = b + 128 + 32 * n;
        const int lshift = (part / 2) * 4, hshift = part * 2;
        for (int l = 0; l < 32; l++) c[l] = (int8_t)((((l0[l] >> lshift) & 0xF) | (((h0[l] >> hshift) & 3) << 4)) - 32);
        return;
    }
    default: memset(c, 0, 32); s[0] = s[1] = 0.0f;
    }
}

#ifdef SEMOE_HAS_AVX2
/* 32 bytes: byte j of b's low 16 (the low nibbles) for j < 16, then the high nibbles */
static inline __m256i nibbles16(const uint8_t *b) {
    const __m128i q = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* 0x10 in byte j where bit j of the 32 bits at b is set (Q5_0's and Q5_1's fifth bits) */
static inline __m256i fifth_bits(const uint8_t *b) {
    uint32_t h;
    memcpy(&h, b, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* `decode32` with vectors: block k's 32 codes in *c */
static inline void decode32_v(int64_t t, const uint8_t *row, int64_t k, __m256i *c, float *s, float *o) {
    const uint8_t *b = block_of(t, row, k);
    const int j = (int)(k % 8);
    block_scales(t, row, k, s, o);
    switch (t) {
    case GG_Q8_0: *c = _mm256_loadu_si256((const __m256i *)(b + 2)); return;
    case GG_Q4_0:
    case GG_Q4_1: {
        const __m256i n = nibbles16(b + gg_block_bytes(t) - 16);
        *c = t == GG_Q4_0 ? _mm256_sub_epi8(n, _mm256_set1_epi8(8)) : n;
        return;
    }
    case GG_IQ4_NL:
    case GG_MXFP4:
    case GG_IQ4_XS: {
        const __m256i tab = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(t == GG_MXFP4 ? FP4_VALUES : IQ4_VALUES)));
        *c = _mm256_shuffle_epi8(tab, nibbles16(t == GG_IQ4_XS ? b + 8 + j * 16 : b + gg_block_bytes(t) - 16));
        return;
    }
    case GG_Q5_0:
    case GG_Q5_1: {
        const int64_t bytes = gg_block_bytes(t);
        const __m256i v = _mm256_or_si256(nibbles16(b + bytes - 16), fifth_bits(b + bytes - 20));
        *c = t == GG_Q5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
        return;
    }
    case GG_Q4_K:
    case GG_Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (t == GG_Q4_K ? 16 : 48) + (j / 2) * 32));
        __m256i v = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
        if (t == GG_Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1)), 4));
        }
        *c = v;
        return;
    }
    case GG_Q6_K: {
        const int n = j / 4, part = j % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * n + (part % 2) * 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        const __m256i lo = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * part), _mm256_set1_epi8(3));
        *c = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
        return;
    }
    default: *c = _mm256_setzero_si256(); s[0] = s[1] = 0.0f;
    }
}
#endif

#ifdef SEMOE_VNNI
/* The AVX-512 VNNI build's products for Q4_K, Q6_K and Q8_0 (what Q4_K_M and Q8_0 files hold): 64 weights
 * an instruction (vpdpbusd, unsigned bytes times signed), each block's integer sums in its 8 lanes, the
 * lanes scaled by their block's (or half block's) weight scale times x's, one float multiply-add per 64. */
static inline __m512i idx16(int a, int b, int c, int d) { /* four lanes each of a, b, c, d */
    return _mm512_set_epi32(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a);
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
                bx[m] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x[m]), 7));
            }
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *b0 = w + (r0 + r) * rb + k * 34, *b1 = two ? b0 + 34 : b0;
                _mm_prefetch((const char *)b0 + ROWS * rb, _MM_HINT_T0);
                _mm_prefetch((const char *)b0 + ROWS * rb + 64, _MM_HINT_T0);
                const __m512i c = _mm512_maskz_mov_epi8(keep, _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                    _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1));
                const __m512i cu = _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80));
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
    } else { /* Q6_K */
        /* the codes unsigned (0..63), their bias of 32 taken from each x-row's sums of 4 (shared by the rows) */
        const __m512i lo4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3), ones = _mm512_set1_epi8(1);
        const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
        for (int64_t sb = 0; sb < I / 256; sb++) {
            __m512 p[ROWS][MX];
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *b = w + (r0 + r) * rb + sb * 210;
                for (int l = 0; l < 210 + 63; l += 64) _mm_prefetch((const char *)b + ROWS * rb + l, _MM_HINT_T0);
                const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(half(b + 208)),
                                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
                for (int64_t m = 0; m < mn; m++)
                    p[r][m] = _mm512_mul_ps(sc, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(
                                                                     _mm256_loadu_ps(a->d + (m0 + m) * nd + sb * 8))));
            }
            for (int i = 0; i < 4; i++) { /* 64 weights: half n = i / 2 of the super-block, its quarters 2 (i % 2), +1 */
                const int n = i / 2, hi2 = i % 2;
                __m512i x[MX], bx[MX];
                for (int64_t m = 0; m < mn; m++) {
                    x[m] = _mm512_loadu_si512((const void *)(a->q + (m0 + m) * ip + sb * 256 + 64 * i));
                    bx[m] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
                                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x[m]), 5));
                }
                const __m512i ix = idx16(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3);
                for (int64_t r = 0; r < nr; r++) {
                    const uint8_t *b = w + (r0 + r) * rb + sb * 210;
                    const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * n));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
                    const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
                    const __m512i lo = _mm512_and_si512(hi2 ? _mm512_srli_epi16(ql, 4) : ql, lo4);
                    const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(h2, hi2 ? sh23 : sh01), three);
                    const __m512i c = _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4));
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
#ifndef GG_TILE_MIN
#define GG_TILE_MIN 8 /* x rows from which `gg_tile_vnni` takes a product */
#endif
/* ... and for Q4_K, whose own pairs path (`gg_rows_body`) is as fast up to 32 rows: measured on an AVX-512
 * EPYC, 1536 x 2048, 2 threads, the tile's GFLOP/s over the pairs' 0.45x at 8 rows, 0.75x at 16, 1.0x at 32,
 * 1.3x at 128 and 512 (Q6_K's and Q8_0's 1.0x at 8, 1.4x at 16, 2.1-2.5x at 128 and 512) */
#ifndef GG_TILE_MIN_Q4_K
#define GG_TILE_MIN_Q4_K 48
#endif

#ifndef GG_STREAM_AHEAD
#define GG_STREAM_AHEAD PREFETCH
#endif

/* One row of Q4_K, Q6_K or Q8_0 blocks (wr) against x row m: decoding's product. The row is read as one
 * sequential stream, a fixed distance prefetched ahead, one row after another, as the int8 kernel reads
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
            const int two = k + 1 < nb;
            const __mmask64 keep = two ? ~0ULL : 0xFFFFFFFFULL;
            const uint8_t *b0 = wr + k * 34, *b1 = two ? b0 + 34 : b0;
            _mm_prefetch((const char *)b0 + GG_STREAM_AHEAD, _MM_HINT_T0);
            const __m512i x = _mm512_maskz_loadu_epi8(keep, xq + k * QB);
            const __m512i bx = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
                                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x), 7));
            const __m512i c = _mm512_maskz_mov_epi8(keep, _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1));
            const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(half(b0) * xd[k]),
                                                 _mm256_set1_ps(two ? half(b1) * xd[k + 1] : 0.0f), 1);
            const __m512i dot = _mm512_dpbusd_epi32(bx, _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80)), x);
            f[(k >> 1) & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, f[(k >> 1) & 1]);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
    }
    if (t == GG_Q4_K) {
        const __m256i lo4 = _mm256_set1_epi8(0x0F);
        __m256 f0 = _mm256_setzero_ps(), f1 = f0, off = f0;
        for (int64_t sb = 0; sb < I / 256; sb++) {
            const uint8_t *b = wr + sb * 144;
            for (int l = 0; l < 192; l += 64) _mm_prefetch((const char *)b + GG_STREAM_AHEAD + l, _MM_HINT_T0);
            uint64_t sc, mn8;
            k_scales8(b + 4, &sc, &mn8);
            float pf[8];
            _mm256_storeu_ps(pf, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half(b)), bytes8_ps(sc)),
                                               _mm256_loadu_ps(xd + sb * 8)));
            off = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half(b + 2)), bytes8_ps(mn8)),
                                   _mm256_loadu_ps(a->xsum + m * a->groups + sb * 8), off);
            for (int i = 0; i < 4; i++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * i));
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + sb * 256 + 64 * i));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + sb * 256 + 64 * i + 32));
                const __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(q, lo4), x0);
                const __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(),
                                                       _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4), x1);
                f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(pf[2 * i]), f0);
                f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(pf[2 * i + 1]), f1);
            }
        }
        return hsum8(_mm256_add_ps(_mm256_add_ps(f0, f1), off));
    }
    /* Q6_K: gg_rows_body's, one row */
    const __m512i lo4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3), ones = _mm512_set1_epi8(1);
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < I / 256; sb++) {
        const uint8_t *b = wr + sb * 210;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)b + GG_STREAM_AHEAD + l, _MM_HINT_T0);
        const __m512 p = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_set1_ps(half(b + 208)),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))),
            _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(xd + sb * 8))));
        for (int i = 0; i < 4; i++) {
            const int n = i / 2, hi2 = i % 2;
            const __m512i x = _mm512_loadu_si512((const void *)(xq + sb * 256 + 64 * i));
            const __m512i bx = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
                                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x), 5));
            const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * n));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
            const __m512i lo = _mm512_and_si512(hi2 ? _mm512_srli_epi16(ql, 4) : ql, lo4);
            const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(h2, hi2 ? sh23 : sh01), three);
            const __m512i dot = _mm512_dpbusd_epi32(bx, _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4)), x);
            f[hi2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_permutexvar_ps(idx16(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), p), f[hi2]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(f[0], f[1]));
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
/* A prompt's rows against GGUF blocks, every type (AVX-512 VNNI build): the block's ROWS rows decoded once
 * for all of x's rows, GG_CH blocks of 32 at a time, into a tile whose 32-byte vectors hold four bytes of
 * each row twice (rows r0 r0 r1 r1 ... r3 r3); against a pair of x's rows (`acts_gg`: their codes plus 128,
 * four bytes of row 2p then four of 2p + 1, broadcast) one vpdpbusd takes 8 (row, x row) lanes of 4
 * products, eight of them a block's 32 inputs, summed exactly in int32. The block's scales then apply once
 * a block and lane (per half for Q6_K): s (D + 128 C) dx - 128 s C dx, C the block's code sum, plus
 * o xsum where the type has an offset. Where rows were taken in pairs (`gg_rows_vnni`, MX), each (row,
 * x row) paid its own scale decode and three operations per 32 inputs; here about one and a half. */
#ifndef GG_PP
#define GG_PP 4
#endif
#define GG_CH 16 /* blocks of 32 a tile: the tile in L1 (6.5 KiB), each chunk of x's rows in L2 */

static inline __attribute__((always_inline)) void gg_tile_body(int64_t t, int halves, int offs, const uint8_t *w,
                                                               int64_t rb, int64_t r0, int64_t nr, int64_t I,
                                                               const Acts *a, int64_t O, float *y) {
    const int64_t nb = I / QB, P = (a->M + 1) / 2, ip = a->Ip;
    __m256i T[GG_CH][8];
    __m256 S[GG_CH][2], B[GG_CH][2], Ov[GG_CH];
    const __m256i dlo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dhi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t k0 = 0; k0 < nb; k0 += GG_CH) {
        const int64_t kn = nb - k0 < GG_CH ? nb - k0 : GG_CH;
        for (int64_t k = 0; k < kn; k++) {
            __m256i c[ROWS];
            float s[2][ROWS], o[ROWS]; /* by half, then row: each four a vector */
            for (int r = 0; r < ROWS; r++) {
                float sr[2] = {0.0f, 0.0f};
                o[r] = 0.0f;
                if (r < nr) decode32_v(t, w + (r0 + r) * rb, k0 + k, &c[r], sr, &o[r]);
                else c[r] = _mm256_setzero_si256();
                s[0][r] = sr[0], s[1][r] = sr[1];
            }
            /* 4 x 8 groups of 4 bytes to 8 x 4, each row's group then doubled for the pair's two lanes */
            const __m256i l01 = _mm256_unpacklo_epi32(c[0], c[1]), h01 = _mm256_unpackhi_epi32(c[0], c[1]);
            const __m256i l23 = _mm256_unpacklo_epi32(c[2], c[3]), h23 = _mm256_unpackhi_epi32(c[2], c[3]);
            const __m256i v[4] = {_mm256_unpacklo_epi64(l01, l23), _mm256_unpackhi_epi64(l01, l23),
                                  _mm256_unpacklo_epi64(h01, h23), _mm256_unpackhi_epi64(h01, h23)};
            for (int g = 0; g < 4; g++) { /* v[g]: group g of rows 0-3, then group g + 4 */
                T[k][g] = _mm256_permutevar8x32_epi32(v[g], dlo);
                T[k][g + 4] = _mm256_permutevar8x32_epi32(v[g], dhi);
            }
            for (int h = 0; h < 2; h++) {
                __m256i cs = _mm256_setzero_si256();
                for (int g = 4 * h; g < 4 * h + 4; g++) cs = _mm256_dpbusd_epi32(cs, ones, T[k][g]);
                S[k][h] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s[h])), dlo);
                B[k][h] = _mm256_mul_ps(_mm256_mul_ps(S[k][h], _mm256_set1_ps(-128.0f)), _mm256_cvtepi32_ps(cs));
            }
            if (halves == 1) B[k][0] = _mm256_add_ps(B[k][0], B[k][1]); /* s the same for both halves */
            if (offs) Ov[k] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(o)), dlo);
        }
        for (int64_t p0 = 0; p0 < P; p0 += GG_PP) { /* GG_PP pairs at once: each load of the tile serves them all */
            const int64_t pn = P - p0 < GG_PP ? P - p0 : GG_PP;
            const uint8_t *xu[GG_PP];
            const double *dx2[GG_PP], *xs2[GG_PP];
            __m256 f[GG_PP];
            for (int i = 0; i < GG_PP; i++) { /* past the last pair: the last again, its sums not stored */
                const int64_t p = p0 + (i < pn ? i : pn - 1);
                xu[i] = a->gu + p * 2 * ip + k0 * QB * 2;
                dx2[i] = (const double *)(a->gd + p * 2 * nb) + k0;
                xs2[i] = (const double *)(a->gs + p * 2 * nb) + k0;
                f[i] = _mm256_setzero_ps();
            }
            for (int64_t k = 0; k < kn; k++) {
                __m256i d0[GG_PP], d1[GG_PP];
                for (int i = 0; i < GG_PP; i++) d0[i] = d1[i] = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const __m256i tg = T[k][g];
                    for (int i = 0; i < GG_PP; i++) {
                        const __m256i xg = _mm256_castpd_si256(_mm256_broadcast_sd((const double *)(xu[i] + (k * 8 + g) * 8)));
                        if (halves == 1 || g < 4) d0[i] = _mm256_dpbusd_epi32(d0[i], xg, tg);
                        else d1[i] = _mm256_dpbusd_epi32(d1[i], xg, tg);
                    }
                }
                for (int i = 0; i < GG_PP; i++) {
                    const __m256 dx = _mm256_castpd_ps(_mm256_broadcast_sd(dx2[i] + k)); /* dx of 2p, 2p + 1, ... */
                    f[i] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(d0[i]), S[k][0], B[k][0]), dx, f[i]);
                    if (halves == 2)
                        f[i] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(d1[i]), S[k][1], B[k][1]), dx, f[i]);
                    if (offs) f[i] = _mm256_fmadd_ps(Ov[k], _mm256_castpd_ps(_mm256_broadcast_sd(xs2[i] + k)), f[i]);
                }
            }
            for (int64_t i = 0; i < pn; i++) {
                float out[8];
                _mm256_storeu_ps(out, f[i]);
                const int64_t p = p0 + i;
                for (int64_t m = 2 * p; m < 2 * p + 2 && m < a->M; m++)
                    for (int64_t r = 0; r < nr; r++) {
                        float *yo = y + m * O + r0 + r;
                        *yo = (k0 ? *yo : 0.0f) + out[2 * r + (m - 2 * p)];
                    }
            }
        }
    }
}

static void gg_tile_vnni(int64_t t, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t I, const Acts *a,
                         int64_t O, float *y) {
    if (t == GG_Q6_K) gg_tile_body(t, 2, 0, w, rb, r0, nr, I, a, O, y);
    else if (t == GG_Q4_K || t == GG_Q5_K || t == GG_Q4_1 || t == GG_Q5_1) gg_tile_body(t, 1, 1, w, rb, r0, nr, I, a, O, y);
    else gg_tile_body(t, 1, 0, w, rb, r0, nr, I, a, O, y);
}
#endif

/* x's rows for `gg_tile_vnni` where there are GG_TILE_MIN or more (the AVX-512 VNNI build; elsewhere, or where
 * memory for them is short, nothing: the kernels take the rows in pairs) */
void acts_gg(Acts *a) {
#ifdef SEMOE_VNNI
    if (a->M < GG_TILE_MIN || a->groups * QB != a->I) return;
    const int64_t P = (a->M + 1) / 2, ip = a->Ip, nd = a->Ip / QB, nb = a->I / QB;
    a->gu = malloc((size_t)(P * 2 * ip));
    a->gd = malloc(sizeof(float) * (size_t)(P * 2 * nb));
    a->gs = malloc(sizeof(float) * (size_t)(P * 2 * nb));
    if (!a->gu || !a->gd || !a->gs) {
        free(a->gu);
        free(a->gd);
        free(a->gs);
        a->gu = NULL, a->gd = a->gs = NULL;
        return;
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t m[2] = {2 * p, 2 * p + 1 < a->M ? 2 * p + 1 : 2 * p}; /* an odd last row twice */
        for (int i = 0; i < 2; i++) {
            for (int64_t d = 0; d < ip / 4; d++) {
                uint32_t v;
                memcpy(&v, a->q + m[i] * ip + 4 * d, 4);
                v ^= 0x80808080u; /* each code plus 128 */
                memcpy(a->gu + p * 2 * ip + 8 * d + 4 * i, &v, 4);
            }
            for (int64_t k = 0; k < nb; k++) {
                a->gd[p * 2 * nb + 2 * k + i] = a->d[m[i] * nd + k];
                a->gs[p * 2 * nb + 2 * k + i] = a->xsum[m[i] * a->groups + k];
            }
        }
    }
#else
    (void)a;
#endif
}


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
    if (a->gu && (t != GG_Q4_K || a->M >= GG_TILE_MIN_Q4_K)) {
        gg_tile_vnni(t, w, rb, r0, nr, I, a, O, y);
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
