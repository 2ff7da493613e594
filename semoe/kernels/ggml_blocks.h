/* GGUF's quantized blocks (llama.cpp's ggml types) as the kernels decode them: the types' numbers, their block
 * sizes, and each block of 32 weights decoded to signed codes, a scale per half of 16 and an offset
 * (`decode32`, `decode32_v`). Shared by the products (gemv_ggml.c) and the prompt's tile kernel
 * (gemv_ggml_tile.c). */
#ifndef SEMOE_GGML_BLOCKS_H
#define SEMOE_GGML_BLOCKS_H

#include "kernels.h"

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
static inline int64_t gg_block_weights(int64_t t) {
    return t == GG_Q4_K || t == GG_Q5_K || t == GG_Q6_K || t == GG_IQ4_XS ? 256 : 32;
}

static inline int64_t gg_block_bytes(int64_t t) {
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

/* IQ4_XS's signed 6-bit scale of sub-block j of super-block b: 4 bits from its 4 bytes, 2 from its 16 bits */
static inline int iq4xs_scale(const uint8_t *b, int j) {
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

/* the bytes of block k's block (a super-block for the K types and IQ4_XS) in a row of type t */
static inline const uint8_t *block_of(int64_t t, const uint8_t *row, int64_t k) {
    const int64_t per = gg_block_weights(t) / QB;
    return row + (k / per) * gg_block_bytes(t);
}

/* block k (32 weights) of a row: its half scales s[2] and offset o (weight j = s[j / 16] c_j + o) */
static inline void block_scales(int64_t t, const uint8_t *row, int64_t k, float *s, float *o) {
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
    case GG_IQ4_XS:
        s[0] = s[1] = half(b) * (float)iq4xs_scale(b, j);
        return;
    default: /* one half scale a block, Q4_1's and Q5_1's min after it */
        s[0] = s[1] = half(b);
        if (t == GG_Q4_1 || t == GG_Q5_1) *o = half(b + 2);
    }
}

/* block k (32 weights) of a row: codes c, half scales s[2] and offset o */
static inline void decode32(int64_t t, const uint8_t *row, int64_t k, int8_t *c, float *s, float *o) {
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
/* x rows from which `gg_tile_vnni` takes a product */
#ifndef GG_TILE_MIN
#define GG_TILE_MIN 8
#endif
/* ... and for Q4_K, whose own pairs path (gemv_ggml.c's `gg_rows_body`) is as fast up to 32 rows: measured on an
 * AVX-512 EPYC, 1536 x 2048, 2 threads, the tile's GFLOP/s over the pairs' 0.45x at 8 rows, 0.75x at 16, 1.0x at
 * 32, 1.3x at 128 and 512 (Q6_K's and Q8_0's 1.0x at 8, 1.4x at 16, 2.1-2.5x at 128 and 512) */
#ifndef GG_TILE_MIN_Q4_K
#define GG_TILE_MIN_Q4_K 48
#endif
void gg_tile_vnni(int64_t t, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t I, const Acts *a, int64_t O,
                  float *y);
#endif

#endif
