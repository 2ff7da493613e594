/* Gated DeltaNet linear attention (decode_abi.h's `DeltaNet`: Qwen3-Next's and Qwen3.5-MoE's token mixer)
 * for decode_step.c's step and prefill.c's prompt pass, and the output gate of their attention layers.
 *
 * A layer on nr rows: the input products over all rows at once (the Lin kernels), unpacked into the
 * convolution's channels (q, k, v), z, b and a; the causal convolution per channel, each row after its
 * sequence's state; keys and queries made unit length; then per value head (the team splits the heads)
 * the delta rule row after row, each row from the state its sequence's last row left:
 *
 *     S <- g S;   d = beta (v - S^T k);   S <- S + k d^T;   o = S^T q
 *
 * the head's output RMS-normed, times the norm's weight and SiLU(z); the output product over all rows.
 * The arithmetic is the module's (semoe/model/linear_attention.py, `delta_rule_recurrent`) in float32
 * with this file's expf and order, so outputs agree to float32 rounding (tests bound the difference).
 */
#include "lin.h"

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's, threshold 20 */
static float silu(float x) { return x / (1.0f + expf(-x)); }

int dn_buf_new(const Net *net, int64_t rows, DnBuf *b) {
    memset(b, 0, sizeof(*b));
    int64_t C = 0, Z = 0, V = 0, W = 0;
    for (int64_t l = 0; net->layers && l < net->L; l++) {
        const DeltaNet *d = net->layers[l].dn;
        if (!d) continue;
        const int64_t c = 2 * d->nk * d->dk + d->nv * d->dv, z = d->nv * d->dv;
        C = c > C ? c : C, Z = z > Z ? z : Z, V = d->nv > V ? d->nv : V;
        W = d->n_in == 2 && c + z > W ? c + z : W;
    }
    if (!C) return 1;
    b->rows = rows;
    b->raw = malloc(sizeof(float) * (size_t)(rows * (W > 0 ? W : 1)));
    b->braw = malloc(sizeof(float) * (size_t)(rows * 2 * V));
    b->mixed = malloc(sizeof(float) * (size_t)(rows * C));
    b->z = malloc(sizeof(float) * (size_t)(rows * Z));
    b->bb = malloc(sizeof(float) * (size_t)(rows * V));
    b->aa = malloc(sizeof(float) * (size_t)(rows * V));
    b->o = malloc(sizeof(float) * (size_t)(rows * Z));
    return b->raw && b->braw && b->mixed && b->z && b->bb && b->aa && b->o;
}

void dn_buf_free(DnBuf *b) {
    free(b->raw), free(b->braw), free(b->mixed), free(b->z), free(b->bb), free(b->aa), free(b->o);
    memset(b, 0, sizeof(*b));
}

/* qkvz (per key-head group) and ba rows into the channels, z, b and a (one thread) */
static void unpack_groups(const DeltaNet *d, int64_t nr, DnBuf *b) {
    const int64_t nk = d->nk, dk = d->dk, dv = d->dv, per = d->nv / d->nk;
    const int64_t C = 2 * nk * dk + d->nv * dv, Z = d->nv * dv, W = 2 * dk + 2 * per * dv;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t g = 0; g < nk; g++) {
            const float *src = b->raw + r * (C + Z) + g * W, *ba = b->braw + r * 2 * d->nv + g * 2 * per;
            float *row = b->mixed + r * C;
            memcpy(row + g * dk, src, sizeof(float) * (size_t)dk);
            memcpy(row + nk * dk + g * dk, src + dk, sizeof(float) * (size_t)dk);
            memcpy(row + 2 * nk * dk + g * per * dv, src + 2 * dk, sizeof(float) * (size_t)(per * dv));
            memcpy(b->z + r * Z + g * per * dv, src + 2 * dk + per * dv, sizeof(float) * (size_t)(per * dv));
            memcpy(b->bb + r * d->nv + g * per, ba, sizeof(float) * (size_t)per);
            memcpy(b->aa + r * d->nv + g * per, ba + per, sizeof(float) * (size_t)per);
        }
}

/* row r's output of head hv (b->o) RMS-normed, times the norm's weight and SiLU(z) */
static void gated_norm(const DeltaNet *d, int64_t hv, int64_t r, DnBuf *b) {
    const int64_t nv = d->nv, dv = d->dv;
    float *o = b->o + r * nv * dv + hv * dv;
    const float *z = b->z + r * nv * dv + hv * dv;
    float ss = 0.0f;
    for (int64_t j = 0; j < dv; j++) ss += o[j] * o[j];
    const float inv = 1.0f / sqrtf(ss / (float)dv + d->eps);
    for (int64_t j = 0; j < dv; j++) o[j] = d->norm[j] * (o[j] * inv) * silu(z[j]);
}

/* row r's log-decay and write strength for head hv */
static void gate_of(const DeltaNet *d, int64_t hv, int64_t r, const DnBuf *b, float *la, float *beta) {
    *la = -expf(d->A_log[hv]) * softplus(b->aa[r * d->nv + hv] + d->dt_bias[hv]);
    *beta = 1.0f / (1.0f + expf(-b->bb[r * d->nv + hv]));
}

static float dot(const float *x, const float *y, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * y[i];
    return s;
}

/* head hv's delta rule on row r from state S, token by token (the recurrence) */
static void head_row(const DeltaNet *d, int64_t hv, int64_t r, float *S, DnBuf *b) {
    const int64_t nk = d->nk, dk = d->dk, dv = d->dv, nv = d->nv, C = 2 * nk * dk + nv * dv, kh = hv / (nv / nk);
    const float *row = b->mixed + r * C;
    const float *q = row + kh * dk, *k = row + nk * dk + kh * dk, *v = row + 2 * nk * dk + hv * dv;
    float la, beta, kv[dv];
    gate_of(d, hv, r, b, &la, &beta);
    const float g = expf(la);
    for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *Si = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) {
            Si[j] = Si[j] * g;
            kv[j] += Si[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) kv[j] = (v[j] - kv[j]) * beta; /* d */
    float *o = b->o + r * nv * dv + hv * dv;
    for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *Si = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) {
            Si[j] = Si[j] + ki * kv[j];
            o[j] += Si[j] * qi;
        }
    }
}

/* head hv's delta rule on the n consecutive rows r0.. of one sequence from state S in the chunked form
 * (semoe/model/linear_attention.py's `delta_rule_chunked`): with G_t the cumulative log-decay, the rows'
 * writes D solve (I + diag(beta) L) D = diag(beta) (V - diag(e^G) K S) by forward substitution, L_ts =
 * e^(G_t - G_s) k_t.k_s below the diagonal; the outputs are e^G_t S^T q_t + sum_{s<=t} e^(G_t - G_s)
 * (q_t.k_s) D_s and the state e^G_n S + sum_s e^(G_n - G_s) k_s D_s^T. S is read twice a chunk, not
 * twice a row. w: scratch of n (2 dv + 2) floats. */
static void head_chunk(const DeltaNet *d, int64_t hv, int64_t r0, int64_t n, float *S, DnBuf *b, float *w) {
    const int64_t nk = d->nk, dk = d->dk, dv = d->dv, nv = d->nv, C = 2 * nk * dk + nv * dv, kh = hv / (nv / nk);
    float *D = w, *U = w + n * dv, *G = U + n * dv, *beta = G + n;
#define Q_(t) (b->mixed + (r0 + (t)) * C + kh * dk)
#define K_(t) (b->mixed + (r0 + (t)) * C + nk * dk + kh * dk)
#define V_(t) (b->mixed + (r0 + (t)) * C + 2 * nk * dk + hv * dv)
#define O_(t) (b->o + (r0 + (t)) * nv * dv + hv * dv)
    float acc = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float la;
        gate_of(d, hv, r0 + t, b, &la, beta + t);
        G[t] = acc += la;
    }
    memset(U, 0, sizeof(float) * (size_t)(n * dv));
    for (int64_t t = 0; t < n; t++) memset(O_(t), 0, sizeof(float) * (size_t)dv);
    for (int64_t i = 0; i < dk; i++) { /* U = K S, O = Q S: each row of S once for all n rows */
        const float *Si = S + i * dv;
        for (int64_t t = 0; t < n; t++) {
            const float ki = K_(t)[i], qi = Q_(t)[i];
            float *u = U + t * dv, *o = O_(t);
            for (int64_t j = 0; j < dv; j++) u[j] += ki * Si[j], o[j] += qi * Si[j];
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const float e = expf(G[t]), *v = V_(t);
        float *dt = D + t * dv, *o = O_(t);
        for (int64_t j = 0; j < dv; j++) dt[j] = beta[t] * (v[j] - e * U[t * dv + j]), o[j] *= e;
        for (int64_t s = 0; s < t; s++) { /* forward substitution */
            const float l = beta[t] * expf(G[t] - G[s]) * dot(K_(t), K_(s), dk), *ds = D + s * dv;
            for (int64_t j = 0; j < dv; j++) dt[j] -= l * ds[j];
        }
        for (int64_t s = 0; s <= t; s++) {
            const float m = expf(G[t] - G[s]) * dot(Q_(t), K_(s), dk), *ds = D + s * dv;
            for (int64_t j = 0; j < dv; j++) o[j] += m * ds[j];
        }
    }
    const float eG = expf(G[n - 1]);
    for (int64_t t = 0; t < n; t++) U[t] = expf(G[n - 1] - G[t]); /* U's first n: the writes' decay to the end */
    for (int64_t i = 0; i < dk; i++) {
        float *Si = S + i * dv;
        for (int64_t j = 0; j < dv; j++) Si[j] *= eG;
        for (int64_t t = 0; t < n; t++) {
            const float f = U[t] * K_(t)[i], *dt = D + t * dv;
            for (int64_t j = 0; j < dv; j++) Si[j] += f * dt[j];
        }
    }
#undef Q_
#undef K_
#undef V_
#undef O_
}

/* rows of one sequence in a run this long or longer take the chunked form; shorter ones the recurrence */
static int64_t chunk_min = 2;

int64_t deltanet_chunk_min(int64_t n) {
    const int64_t was = chunk_min;
    if (n > 0) chunk_min = n;
    return was;
}

/* head hv over the nr rows in order: each run of a sequence's consecutive rows chunked (or row by row,
 * where shorter than chunk_min), each from the state its sequence's last row left; then the gated norms */
static void head_rows(const DeltaNet *d, int64_t hv, int64_t nr, const int64_t *seg, const int64_t *pos,
                      void *const *vc, DnBuf *b, float *w) {
    const int64_t dk = d->dk, dv = d->dv;
    for (int64_t r = 0, r2; r < nr; r = r2) {
        for (r2 = r + 1; r2 < nr && seg[r2] == seg[r] && pos[r2] == pos[r2 - 1] + 1; r2++) {
        }
        float *S = (float *)vc[seg[r]] + hv * dk * dv;
        if (pos[r] == 0) memset(S, 0, sizeof(float) * (size_t)(dk * dv));
        if (r2 - r >= chunk_min && w)
            head_chunk(d, hv, r, r2 - r, S, b, w);
        else
            for (int64_t t = r; t < r2; t++) head_row(d, hv, t, S, b);
        for (int64_t t = r; t < r2; t++) gated_norm(d, hv, t, b);
    }
}

void deltanet_rows(const Layer *ly, const float *h, int64_t nr, const int64_t *seg, const int64_t *pos,
                   void *const *kc, void *const *vc, DnBuf *b, Acts *a, float *out, int *oom) {
    const DeltaNet *d = ly->dn;
    const int64_t nk = d->nk, dk = d->dk, nv = d->nv, K = d->K, C = 2 * nk * dk + nv * d->dv;
    if (d->n_in == 4) {
        lin_product(&d->in[0], h, nr, a, b->mixed, oom);
        lin_product(&d->in[1], h, nr, a, b->z, oom);
        lin_product(&d->in[2], h, nr, a, b->bb, oom);
        lin_product(&d->in[3], h, nr, a, b->aa, oom);
    } else {
        lin_product(&d->in[0], h, nr, a, b->raw, oom);
        lin_product(&d->in[1], h, nr, a, b->braw, oom);
#pragma omp single
        if (!*oom) unpack_groups(d, nr, b);
    }
    const int64_t nc = *oom ? 0 : C;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < nc; ch++) { /* the causal convolution, each row after its sequence's last */
        const float *w = d->conv + ch * K;
        for (int64_t r = 0; r < nr; r++) {
            float *st = (float *)kc[seg[r]] + ch * (K - 1), *x = b->mixed + r * C + ch;
            if (pos[r] == 0) memset(st, 0, sizeof(float) * (size_t)(K - 1));
            float y = 0.0f;
            for (int64_t j = 0; j < K - 1; j++) y += w[j] * st[j];
            y += w[K - 1] * *x;
            for (int64_t j = 0; j + 1 < K - 1; j++) st[j] = st[j + 1];
            if (K > 1) st[K - 2] = *x;
            *x = silu(y);
        }
    }
    const int64_t nu = *oom ? 0 : nr * 2 * nk;
    const float qs = sqrtf((float)dk);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < nu; u++) { /* queries and keys unit length, queries over sqrt(dk) */
        float *x = b->mixed + (u / (2 * nk)) * C + (u % (2 * nk)) * dk;
        float ss = 0.0f;
        for (int64_t i = 0; i < dk; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss + 1e-6f);
        const int query = u % (2 * nk) < nk;
        for (int64_t i = 0; i < dk; i++) x[i] = query ? x[i] * inv / qs : x[i] * inv;
    }
    const int64_t nh = *oom ? 0 : nv;
    float *w = nr > 1 ? malloc(sizeof(float) * (size_t)(nr * (2 * d->dv + 2))) : NULL; /* a thread's chunk scratch */
#pragma omp for schedule(dynamic, 1)
    for (int64_t hv = 0; hv < nh; hv++) head_rows(d, hv, nr, seg, pos, vc, b, w);
    free(w);
    lin_product(&ly->o, b->o, nr, a, out, oom);
}

void gate_unpack(int64_t H, int64_t G, int64_t Dh, const float *qg, float *qkv, float *gate) {
    for (int64_t h = 0; h < H; h++) {
        memcpy(qkv + h * Dh, qg + 2 * h * Dh, sizeof(float) * (size_t)Dh);
        memcpy(gate + h * Dh, qg + (2 * h + 1) * Dh, sizeof(float) * (size_t)Dh);
    }
    memcpy(qkv + H * Dh, qg + 2 * H * Dh, sizeof(float) * (size_t)(2 * G * Dh));
}

void gate_apply(float *att, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) att[i] = att[i] * (1.0f / (1.0f + expf(-gate[i])));
}

/* Layer ly's Gated DeltaNet on one normed row h of a sequence at position pos (its states kc, vc) into
 * out (D): the kernel-by-kernel step's call (semoe/decode/plan.py), the one-call step's arithmetic.
 * Returns 0, or -1 where memory for its buffers could not be had. */
int deltanet_step(const Layer *ly, const float *h, void *kc, void *vc, int64_t pos, float *out, int threads) {
    Net one;
    memset(&one, 0, sizeof(one));
    one.L = 1, one.layers = ly;
    DnBuf b;
    int oom = !dn_buf_new(&one, 1, &b);
    const int64_t seg = 0;
    void *kcs[1] = {kc}, *vcs[1] = {vc};
    Acts a;
#pragma omp parallel num_threads(threads)
    if (!oom) deltanet_rows(ly, h, 1, &seg, &pos, kcs, vcs, &b, &a, out, &oom);
    dn_buf_free(&b);
    return oom ? -1 : 0;
}
