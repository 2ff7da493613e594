/* The tile kernel for a prompt's rows against GGUF blocks (the AVX-512 VNNI build), and the layout of x's rows
 * it reads (`acts_gg`). */
#include "ggml_blocks.h"

#ifdef SEMOE_VNNI
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

void gg_tile_vnni(int64_t t, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t I, const Acts *a,
                  int64_t O, float *y) {
    if (t == GG_Q6_K) gg_tile_body(t, 2, 0, w, rb, r0, nr, I, a, O, y);
    else if (t == GG_Q4_K || t == GG_Q5_K || t == GG_Q4_1 || t == GG_Q5_1) gg_tile_body(t, 1, 1, w, rb, r0, nr, I, a, O, y);
    else gg_tile_body(t, 1, 0, w, rb, r0, nr, I, a, O, y);
}
#endif

/* x's rows for `gg_tile_vnni` against weights of type t where there are GG_TILE_MIN or more (GG_TILE_MIN_Q4_K
 * for Q4_K); the one place that decides: where this leaves them NULL (fewer rows, another build, memory short)
 * the kernels take the rows in pairs */
void acts_gg(Acts *a, int64_t t) {
#ifdef SEMOE_VNNI
    if (a->groups * QB != a->I) return;
    if (a->M == 1 && ((gg_block_weights(t) == QB && t != GG_Q8_0) || t == GG_IQ4_XS)) { /* decoding: `g32_x`'s order */
        const int64_t ip = a->Ip, nb = a->I / QB, lut = t == GG_IQ4_NL || t == GG_IQ4_XS || t == GG_MXFP4;
        if (!(a->gn = malloc((size_t)(a->M * ip)))) return;
        if (lut && !(a->gb = malloc(sizeof(int32_t) * (size_t)(a->M * ip / 8 + 16)))) {
            free(a->gn);
            a->gn = NULL;
            return;
        }
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t k = 0; k < nb; k += 4) {
                const int64_t n = nb - k < 4 ? nb - k : 4;
                int8_t *g = a->gn + m * ip + k * QB;
                for (int64_t i = 0; i < n; i++) {
                    memcpy(g + 16 * i, a->q + m * ip + (k + i) * QB, 16);
                    memcpy(g + 16 * (n + i), a->q + m * ip + (k + i) * QB + 16, 16);
                }
                for (int64_t j = 0; lut && j < 16; j++) { /* lane j: codes 4j .. 4j + 3 of both halves */
                    int32_t s = 0;
                    for (int64_t l = 4 * j; l < 4 * j + 4 && l < 16 * n; l++) s += g[l] + g[16 * n + l];
                    a->gb[m * ip / 8 + k / 4 * 16 + j] = -128 * s;
                }
            }
        return;
    }
    if (a->M < (t == GG_Q4_K ? GG_TILE_MIN_Q4_K : GG_TILE_MIN)) return;
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
    (void)a, (void)t;
#endif
}
