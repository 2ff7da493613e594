/* DeepSeek-V4's parts of decode_step.c's step (decode_abi.h's `Compressed` and `Hyper`): one row's
 * compressed attention over a sequence's state, and the hyper-connections around each block. The
 * arithmetic of semoe/model/compressed_attention.py and hyper_connections.py in float32, in this file's
 * order and with C's expf, cosf and sinf, so values agree with the modules' to float32 rounding. */
#include "lin.h"

/* where a layer's fixed state lies in its kc (`Compressed`): the window's W keys, then the compressor's
 * tokens since its last entry (projections, then gates, m each of its width) and, with overlap, the
 * first halves of its last full window (projections, then gates with ape added, m of dim); then the
 * same for the indexer's compressor */
typedef struct {
    float *win, *pkv, *pg, *okv, *og, *ipkv, *ipg, *iokv, *iog;
} V4State;

static int64_t comp_width(const Compressor *c) { return (c->overlap ? 2 : 1) * c->dim; }

static float *comp_slots(const Compressor *c, float *p, float **kv, float **g, float **okv, float **og) {
    if (!c->m) return p;
    const int64_t wd = comp_width(c);
    *kv = p, p += c->m * wd, *g = p, p += c->m * wd;
    if (c->overlap) *okv = p, p += c->m * c->dim, *og = p, p += c->m * c->dim;
    return p;
}

static V4State v4_state(const Compressed *c, int64_t Dh, float *kc) {
    V4State st = {0};
    float *p = kc + c->W * Dh;
    st.win = kc;
    p = comp_slots(&c->comp, p, &st.pkv, &st.pg, &st.okv, &st.og);
    if (c->topk) comp_slots(&c->icomp, p, &st.ipkv, &st.ipg, &st.iokv, &st.iog);
    return st;
}

int64_t v4_fixed_floats(const Compressed *c, int64_t Dh) {
    int64_t n = c->W * Dh;
    const Compressor *cs[2] = {&c->comp, c->topk ? &c->icomp : NULL};
    for (int i = 0; i < 2; i++)
        if (cs[i] && cs[i]->m) n += 2 * cs[i]->m * comp_width(cs[i]) + (cs[i]->overlap ? 2 * cs[i]->m * cs[i]->dim : 0);
    return n;
}

/* the last 2 r of x's d values rotated by interleaved pairs at position pos (`rotate_pairs`), or back */
static void rotate_tail(float *x, int64_t d, int64_t r, const float *inv_freq, float scale, int64_t pos, int inverse) {
    float *t = x + d - 2 * r;
    for (int64_t i = 0; i < r; i++) {
        const float a = (float)pos * inv_freq[i], c = cosf(a) * scale, s = (inverse ? -sinf(a) : sinf(a)) * scale;
        const float e = t[2 * i], o = t[2 * i + 1];
        t[2 * i] = e * c - o * s;
        t[2 * i + 1] = o * c + e * s;
    }
}

/* a token's projections kv and gates g (its width each) into the compressor's slot for position pos;
 * where pos closes a window, its entry (dim values) into ent, normed and rotated at the window's first
 * position, and, with overlap, this window's first halves kept for the next one. tmp: dim floats */
static void comp_push(const Compressor *c, const float *kv, const float *g, float *pkv, float *pg, float *okv, float *og,
                      float *ent, int64_t pos, int64_t r, const float *inv_freq, float scale, float eps, float *tmp) {
    const int64_t m = c->m, d = c->dim, wd = comp_width(c), slot = pos % m;
    memcpy(pkv + slot * wd, kv, sizeof(float) * (size_t)wd);
    memcpy(pg + slot * wd, g, sizeof(float) * (size_t)wd);
    if ((pos + 1) % m) return;
    const int64_t half = c->overlap ? d : 0, first = pos + 1 - m; /* this window's own half, its first position */
    for (int64_t i = 0; i < d; i++) {
        float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
        for (int64_t s = 0; s < m; s++) mx = fmaxf(mx, pg[s * wd + half + i] + c->ape[s * wd + half + i]);
        if (c->overlap && first > 0)
            for (int64_t s = 0; s < m; s++) mx = fmaxf(mx, og[s * d + i]);
        for (int64_t s = 0; c->overlap && first > 0 && s < m; s++) {
            const float e = expf(og[s * d + i] - mx);
            sum += e, acc += e * okv[s * d + i];
        }
        for (int64_t s = 0; s < m; s++) {
            const float e = expf(pg[s * wd + half + i] + c->ape[s * wd + half + i] - mx);
            sum += e, acc += e * pkv[s * wd + half + i];
        }
        tmp[i] = acc / sum;
    }
    rmsnorm_f32(tmp, c->norm, eps, ent, 1, d);
    rotate_tail(ent, d, r, inv_freq, scale, first, 0);
    if (c->overlap)
        for (int64_t s = 0; s < m; s++)
            for (int64_t i = 0; i < d; i++) {
                okv[s * d + i] = pkv[s * wd + i];
                og[s * d + i] = pg[s * wd + i] + c->ape[s * wd + i];
            }
}

int v4_buf_new(const Net *net, int64_t S, V4Buf *b) {
    memset(b, 0, sizeof(*b));
    const Compressed *c = NULL;
    for (int64_t l = 0; net->layers && l < net->L && !c; l++) c = net->layers[l].v4;
    const int64_t N = net->hc > 1 ? net->hc : 0, D = net->D;
    if (!c && !N) return 1;
    int ok = 1;
#define GET(f, n) ok = ok && ((b->f = malloc(sizeof(float) * (size_t)((n) > 0 ? (n) : 1))) != NULL)
    if (c) {
        int64_t Hi = 0, Di = 0, width = 1, o = 1;
        for (int64_t l = 0; l < net->L; l++) {
            const Compressed *x = net->layers[l].v4;
            if (!x) continue;
            if (x->topk && x->Hi * x->Di > Hi * Di) Hi = x->Hi, Di = x->Di;
            if (x->comp.m && 2 * x->comp.dim > width) width = 2 * x->comp.dim;
            if (x->topk && 2 * x->icomp.dim > width) width = 2 * x->icomp.dim;
            if (x->o_groups * x->wo_a[0].O > o) o = x->o_groups * x->wo_a[0].O;
        }
        GET(qa, c->wq_a.O), GET(q, net->H * net->Dh), GET(kv, net->Dh), GET(ckv, width), GET(cg, width);
        GET(iq, Hi * Di), GET(iw, Hi), GET(isc, S), GET(isel, S), GET(p, net->H * (S + c->W)), GET(z, o);
        GET(att, net->H * net->Dh), GET(tmp, width);
        ok = ok && ((b->chosen = malloc(sizeof(int32_t) * (size_t)(S > 0 ? S : 1))) != NULL);
    }
    if (N) GET(hx, N * D), GET(mix, (2 + N) * N), GET(col, D), GET(y, D), GET(post, N), GET(comb, N * N);
#undef GET
    return ok;
}

void v4_buf_free(V4Buf *b) {
    free(b->qa), free(b->q), free(b->kv), free(b->ckv), free(b->cg), free(b->iq), free(b->iw), free(b->isc);
    free(b->isel), free(b->p), free(b->z), free(b->att), free(b->tmp), free(b->chosen);
    free(b->hx), free(b->mix), free(b->col), free(b->y), free(b->post), free(b->comb);
    memset(b, 0, sizeof(*b));
}

/* q . k over n values, in 8 partial sums added in a fixed order */
static float dot8(const float *q, const float *k, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += q[i + j] * k[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += q[i] * k[i];
    return s;
}

/* one head's attention: its query q (Dh) over the window's keys (positions lo..pos, by position modulo W)
 * and the entries idx[0..n) (rows of rs), with its sink, into out (Dh); p: room for the logits */
static void v4_head(const float *q, const float *win, int64_t W, int64_t lo, int64_t pos, const float *ent, int64_t rs,
                    const int32_t *idx, int64_t n, int64_t Dh, float sink, float *p, float *out) {
    const float sc = (float)(1.0 / sqrt((double)Dh));
    const int64_t nw = pos - lo + 1;
    float mx = sink;
    for (int64_t t = 0; t < nw; t++) mx = fmaxf(mx, p[t] = dot8(q, win + (lo + t) % W * Dh, Dh) * sc);
    for (int64_t j = 0; j < n; j++) mx = fmaxf(mx, p[nw + j] = dot8(q, ent + idx[j] * rs, Dh) * sc);
    float sum = expf(sink - mx);
    for (int64_t t = 0; t < nw + n; t++) sum += (p[t] = expf(p[t] - mx));
    memset(out, 0, sizeof(float) * (size_t)Dh);
    for (int64_t t = 0; t < nw + n; t++) {
        const float w = p[t] / sum, *k = t < nw ? win + (lo + t) % W * Dh : ent + idx[t - nw] * rs;
        for (int64_t i = 0; i < Dh; i++) out[i] += w * k[i];
    }
}

void v4_attend(const Net *net, const Layer *ly, const float *h, float *kc, float *ent, int64_t S, int64_t pos,
               V4Buf *b, Acts *a, float *out, int *oom) {
    const Compressed *c = ly->v4;
    const int64_t H = net->H, Dh = net->Dh, r = c->r, Di = c->topk ? c->Di : 0, rs = Dh + Di;
    lin_product(&c->wq_a, h, 1, a, b->qa, oom);
#pragma omp single
    rmsnorm_f32(b->qa, c->q_norm, c->eps, b->qa, 1, c->wq_a.O);
    lin_product(&c->wq_b, b->qa, 1, a, b->q, oom);
    lin_product(&c->wkv, h, 1, a, b->kv, oom);
    if (c->topk) {
        lin_product(&c->iwq, b->qa, 1, a, b->iq, oom);
        lin_product(&c->iwp, h, 1, a, b->iw, oom);
    }
#pragma omp single
    if (!*oom) {
        V4State st = v4_state(c, Dh, kc);
        rmsnorm_f32(b->q, NULL, c->eps, b->q, H, Dh);
        for (int64_t hh = 0; hh < H; hh++) rotate_tail(b->q + hh * Dh, Dh, r, c->inv_freq, c->rope_scale, pos, 0);
        float *k = st.win + pos % c->W * Dh;
        rmsnorm_f32(b->kv, c->kv_norm, c->eps, k, 1, Dh);
        rotate_tail(k, Dh, r, c->inv_freq, c->rope_scale, pos, 0);
        if (c->topk) {
            for (int64_t hh = 0; hh < c->Hi; hh++)
                rotate_tail(b->iq + hh * Di, Di, r, c->index_inv_freq, c->index_scale, pos, 0);
            const float ws = (float)(1.0 / sqrt((double)c->Hi));
            for (int64_t hh = 0; hh < c->Hi; hh++) b->iw[hh] = b->iw[hh] * ws;
        }
    }
    /* the compressors: each token's projections (a product each, by the team), pushed in order */
    const Compressor *cs[2] = {c->comp.m ? &c->comp : NULL, c->topk ? &c->icomp : NULL};
    for (int i = 0; i < 2; i++) {
        if (!cs[i]) continue;
        lin_product(&cs[i]->wkv, h, 1, a, b->ckv, oom);
        lin_product(&cs[i]->wgate, h, 1, a, b->cg, oom);
#pragma omp single
        if (!*oom) {
            V4State st = v4_state(c, Dh, kc);
            const int64_t row = (pos + 1) / cs[i]->m - 1; /* the entry this token closes, where it closes one */
            float *e = ent + (row > 0 ? row : 0) * rs + (i ? Dh : 0);
            comp_push(cs[i], b->ckv, b->cg, i ? st.ipkv : st.pkv, i ? st.ipg : st.pg, i ? st.iokv : st.okv,
                      i ? st.iog : st.og, e, pos, r, i ? c->index_inv_freq : c->inv_freq,
                      i ? c->index_scale : c->rope_scale, c->eps, b->tmp);
        }
    }
    const int64_t n = c->comp.m ? (pos + 1) / c->comp.m : 0; /* the entries whose windows the query has passed */
    if (c->topk && n > c->topk && !*oom) {
        const float ds = index_dim_scale(Di);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) b->isc[t] = index_score(b->iq, b->iw, c->Hi, Di, ds, ent + t * rs + Dh);
#pragma omp single
        b->nchosen = choose_top(b->isc, n, c->topk, b->chosen, b->isel);
    } else {
#pragma omp single
        {
            for (int64_t t = 0; t < n; t++) b->chosen[t] = (int32_t)t;
            b->nchosen = n;
        }
    }
    const int64_t lo = pos + 1 > c->W ? pos + 1 - c->W : 0, room = S + c->W;
    const int64_t heads = *oom ? 0 : H;
    float *win = kc;
#pragma omp for schedule(static)
    for (int64_t hh = 0; hh < heads; hh++)
        v4_head(b->q + hh * Dh, win, c->W, lo, pos, ent, rs, b->chosen, b->nchosen, Dh, c->sinks[hh], b->p + hh * room,
                b->att + hh * Dh);
#pragma omp single
    for (int64_t hh = 0; hh < heads; hh++) rotate_tail(b->att + hh * Dh, Dh, r, c->inv_freq, c->rope_scale, pos, 1);
    const int64_t I = H * Dh / c->o_groups, R = c->wo_a[0].O;
    for (int64_t g = 0; g < c->o_groups; g++) lin_product(&c->wo_a[g], b->att + g * I, 1, a, b->z + g * R, oom);
    lin_product(&c->wo_b, b->z, 1, a, out, oom);
}

/* the unit-RMS row of the N streams X (N D) into b->hx, and fn's product of it into b->mix, by the team */
static void hc_mixes(const Net *net, const Hyper *hy, const float *X, V4Buf *b, Acts *a, int *oom) {
#pragma omp single
    rmsnorm_f32(X, NULL, net->norm_eps, b->hx, 1, net->hc * net->D);
    lin_product(&hy->fn, b->hx, 1, a, b->mix, oom);
}

static float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* sum_i w_i X_i into col (D) */
static void hc_collapse(const float *w, const float *X, int64_t N, int64_t D, float *col) {
    for (int64_t i = 0; i < D; i++) {
        float acc = 0.0f;
        for (int64_t n = 0; n < N; n++) acc += w[n] * X[n * D + i];
        col[i] = acc;
    }
}

void hc_pre(const Net *net, const Hyper *hy, const float *X, V4Buf *b, Acts *a, int *oom) {
    const int64_t N = net->hc, D = net->D;
    hc_mixes(net, hy, X, b, a, oom);
#pragma omp single
    if (!*oom) {
        float *m = b->mix, pre[N], *post = b->post, *comb = b->comb;
        const float eps = net->hc_eps, *base = hy->base, *sc = hy->scale;
        for (int64_t i = 0; i < N; i++) {
            pre[i] = sigm(m[i] * sc[0] + base[i]) + eps;
            post[i] = 2.0f * sigm(m[N + i] * sc[1] + base[N + i]);
        }
        for (int64_t i = 0; i < N; i++) { /* each row's softmax, plus eps */
            float *row = comb + i * N, mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < N; j++) mx = fmaxf(mx, row[j] = m[2 * N + i * N + j] * sc[2] + base[2 * N + i * N + j]);
            for (int64_t j = 0; j < N; j++) sum += (row[j] = expf(row[j] - mx));
            for (int64_t j = 0; j < N; j++) row[j] = row[j] / sum + eps;
        }
        for (int64_t it = 0; it < 2 * net->hc_iters - 1; it++) { /* columns, then rows and columns alternately */
            const int cols = it % 2 == 0;
            for (int64_t u = 0; u < N; u++) {
                float sum = 0.0f;
                for (int64_t v = 0; v < N; v++) sum += cols ? comb[v * N + u] : comb[u * N + v];
                for (int64_t v = 0; v < N; v++) {
                    float *e = cols ? comb + v * N + u : comb + u * N + v;
                    *e = *e / (sum + eps);
                }
            }
        }
        hc_collapse(pre, X, N, D, b->col);
    }
}

void hc_merge(const Net *net, const float *y, float *X, V4Buf *b) {
    const int64_t N = net->hc, D = net->D;
    memcpy(b->hx, X, sizeof(float) * (size_t)(N * D));
    for (int64_t j = 0; j < N; j++)
        for (int64_t i = 0; i < D; i++) {
            float acc = 0.0f;
            for (int64_t n = 0; n < N; n++) acc += b->comb[n * N + j] * b->hx[n * D + i];
            X[j * D + i] = b->post[j] * y[i] + acc;
        }
}

void hc_head(const Net *net, const float *X, V4Buf *b, Acts *a, int *oom) {
    hc_mixes(net, &net->hc_head, X, b, a, oom);
#pragma omp single
    if (!*oom) {
        float pre[net->hc];
        for (int64_t n = 0; n < net->hc; n++)
            pre[n] = sigm(b->mix[n] * net->hc_head.scale[0] + net->hc_head.base[n]) + net->hc_eps;
        hc_collapse(pre, X, net->hc, net->D, b->col);
    }
}
