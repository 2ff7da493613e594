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

int v4_buf_new(const Net *net, int64_t S, int64_t rows, V4Buf *b) {
    memset(b, 0, sizeof(*b));
    const Compressed *c = NULL;
    for (int64_t l = 0; net->layers && l < net->L && !c; l++) c = net->layers[l].v4;
    const int64_t N = net->hc > 1 ? net->hc : 0, D = net->D, M = rows;
    b->rows = rows;
    if (!c && !N) return 1;
    int ok = 1;
#define GET(f, n) ok = ok && ((b->f = malloc(sizeof(float) * (size_t)((n) > 0 ? (n) : 1))) != NULL)
    if (c) {
        int64_t Hi = 0, Di = 0, width = 1, iwidth = 1, o = 1, qa = 1;
        for (int64_t l = 0; l < net->L; l++) {
            const Compressed *x = net->layers[l].v4;
            if (!x) continue;
            if (x->topk && x->Hi * x->Di > Hi * Di) Hi = x->Hi, Di = x->Di;
            if (x->comp.m && 2 * x->comp.dim > width) width = 2 * x->comp.dim;
            if (x->topk && 2 * x->icomp.dim > iwidth) iwidth = 2 * x->icomp.dim;
            if (x->o_groups * x->wo_a[0].O > o) o = x->o_groups * x->wo_a[0].O;
            if (x->wq_a.O > qa) qa = x->wq_a.O;
        }
        GET(qa, M * qa), GET(q, M * net->H * net->Dh), GET(kv, M * net->Dh), GET(ckv, M * width), GET(cg, M * width);
        GET(ickv, M * iwidth), GET(icg, M * iwidth), GET(iq, M * Hi * Di), GET(iw, M * Hi), GET(isc, S), GET(isel, S);
        GET(p, net->H * (S + c->W)), GET(z, M * o), GET(zg, M * o), GET(att, M * net->H * net->Dh), GET(grp, M * net->H * net->Dh);
        GET(tmp, width > iwidth ? width : iwidth);
        ok = ok && ((b->chosen = malloc(sizeof(int32_t) * (size_t)(S > 0 ? S : 1))) != NULL);
    }
    if (N) GET(hx, M * N * D), GET(mix, M * (2 + N) * N), GET(col, M * D), GET(y, M * D), GET(post, M * N),
        GET(comb, M * N * N);
#undef GET
    return ok;
}

void v4_buf_free(V4Buf *b) {
    free(b->qa), free(b->q), free(b->kv), free(b->ckv), free(b->cg), free(b->ickv), free(b->icg), free(b->iq);
    free(b->iw), free(b->isc), free(b->isel), free(b->p), free(b->z), free(b->zg), free(b->att), free(b->grp), free(b->tmp);
    free(b->chosen), free(b->hx), free(b->mix), free(b->col), free(b->y), free(b->post), free(b->comb);
    memset(b, 0, sizeof(*b));
}

/* one head's attention: its query q (Dh) over the window's keys (positions lo..pos, by position modulo W)
 * and the entries idx[0..n) (rows of rs), with its sink, into out (Dh); p: room for the logits */
static void v4_head(const float *q, const float *win, int64_t W, int64_t lo, int64_t pos, const float *ent, int64_t rs,
                    const int32_t *idx, int64_t n, int64_t Dh, float sink, float *p, float *out) {
    const float sc = (float)(1.0 / sqrt((double)Dh));
    const int64_t nw = pos - lo + 1;
    float mx = sink;
    for (int64_t t = 0; t < nw; t++) mx = fmaxf(mx, p[t] = dot_f32_n(q, win + (lo + t) % W * Dh, Dh) * sc);
    for (int64_t j = 0; j < n; j++) mx = fmaxf(mx, p[nw + j] = dot_f32_n(q, ent + idx[j] * rs, Dh) * sc);
    float sum = expf(sink - mx);
    for (int64_t t = 0; t < nw + n; t++) sum += (p[t] = expf(p[t] - mx));
    memset(out, 0, sizeof(float) * (size_t)Dh);
    for (int64_t t = 0; t < nw + n; t++) {
        const float w = p[t] / sum, *k = t < nw ? win + (lo + t) % W * Dh : ent + idx[t - nw] * rs;
        for (int64_t i = 0; i < Dh; i++) out[i] += w * k[i];
    }
}

/* row r of v4_rows at position pos of its sequence (state kc, entries ent, S positions): its query and key
 * prepared, the key and both compressors' tokens pushed, the entries it reads chosen, and each head's
 * attention into b->att's row r rotated back, by the team */
static void v4_row(const Net *net, const Compressed *c, int64_t r, float *kc, float *ent, int64_t S, int64_t pos,
                   V4Buf *b, int *oom) {
    const int64_t H = net->H, Dh = net->Dh, rr = c->r, Di = c->topk ? c->Di : 0, rs = Dh + Di;
    float *q = b->q + r * H * Dh, *iq = b->iq + r * c->Hi * Di, *iw = b->iw + r * c->Hi, *att = b->att + r * H * Dh;
#pragma omp single
    if (!*oom) {
        V4State st = v4_state(c, Dh, kc);
        rmsnorm_f32(q, NULL, c->eps, q, H, Dh);
        for (int64_t hh = 0; hh < H; hh++) rotate_tail(q + hh * Dh, Dh, rr, c->inv_freq, c->rope_scale, pos, 0);
        float *k = st.win + pos % c->W * Dh;
        rmsnorm_f32(b->kv + r * Dh, c->kv_norm, c->eps, k, 1, Dh);
        rotate_tail(k, Dh, rr, c->inv_freq, c->rope_scale, pos, 0);
        if (c->comp.m) { /* the token's projections into the compressors, each entry its window closes written */
            const int64_t row = (pos + 1) / c->comp.m - 1, w = comp_width(&c->comp);
            comp_push(&c->comp, b->ckv + r * w, b->cg + r * w, st.pkv, st.pg, st.okv, st.og,
                      ent + (row > 0 ? row : 0) * rs, pos, rr, c->inv_freq, c->rope_scale, c->eps, b->tmp);
        }
        if (c->topk) {
            const int64_t row = (pos + 1) / c->icomp.m - 1, w = comp_width(&c->icomp);
            comp_push(&c->icomp, b->ickv + r * w, b->icg + r * w, st.ipkv, st.ipg, st.iokv, st.iog,
                      ent + (row > 0 ? row : 0) * rs + Dh, pos, rr, c->index_inv_freq, c->index_scale, c->eps, b->tmp);
            for (int64_t hh = 0; hh < c->Hi; hh++)
                rotate_tail(iq + hh * Di, Di, rr, c->index_inv_freq, c->index_scale, pos, 0);
            const float ws = (float)(1.0 / sqrt((double)c->Hi));
            for (int64_t hh = 0; hh < c->Hi; hh++) iw[hh] = iw[hh] * ws;
        }
    }
    const int64_t n = c->comp.m ? (pos + 1) / c->comp.m : 0; /* the entries whose windows the query has passed */
    if (c->topk && n > c->topk && !*oom) {
        const float ds = index_dim_scale(Di);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) b->isc[t] = index_score(iq, iw, c->Hi, Di, ds, ent + t * rs + Dh);
#pragma omp single
        b->nchosen = choose_top(b->isc, n, c->topk, b->chosen, b->isel);
    } else {
#pragma omp single
        {
            for (int64_t t = 0; t < n; t++) b->chosen[t] = (int32_t)t;
            b->nchosen = n;
        }
    }
    const int64_t lo = pos + 1 > c->W ? pos + 1 - c->W : 0, room = S + c->W, heads = *oom ? 0 : H;
#pragma omp for schedule(static)
    for (int64_t hh = 0; hh < heads; hh++)
        v4_head(q + hh * Dh, kc, c->W, lo, pos, ent, rs, b->chosen, b->nchosen, Dh, c->sinks[hh], b->p + hh * room,
                att + hh * Dh);
#pragma omp single
    for (int64_t hh = 0; hh < heads; hh++) rotate_tail(att + hh * Dh, Dh, rr, c->inv_freq, c->rope_scale, pos, 1);
}

void v4_rows(const Net *net, const Layer *ly, const float *h, int64_t nr, const int64_t *seg, const int64_t *pos,
             void *const *kc, void *const *vc, const int64_t *caps, V4Buf *b, Acts *a, float *out, int *oom) {
    const Compressed *c = ly->v4;
    const int64_t H = net->H, Dh = net->Dh;
    lin_product(&c->wq_a, h, nr, a, b->qa, oom);
#pragma omp single
    rmsnorm_f32(b->qa, c->q_norm, c->eps, b->qa, nr, c->wq_a.O);
    lin_product(&c->wq_b, b->qa, nr, a, b->q, oom);
    lin_product(&c->wkv, h, nr, a, b->kv, oom);
    if (c->comp.m) {
        lin_product(&c->comp.wkv, h, nr, a, b->ckv, oom);
        lin_product(&c->comp.wgate, h, nr, a, b->cg, oom);
    }
    if (c->topk) {
        lin_product(&c->icomp.wkv, h, nr, a, b->ickv, oom);
        lin_product(&c->icomp.wgate, h, nr, a, b->icg, oom);
        lin_product(&c->iwq, b->qa, nr, a, b->iq, oom);
        lin_product(&c->iwp, h, nr, a, b->iw, oom);
    }
    for (int64_t r = 0; r < nr; r++) /* in order: a row reads the state the rows before it left */
        v4_row(net, c, r, (float *)kc[seg[r]], (float *)vc[seg[r]], caps[seg[r]], pos[r], b, oom);
    const int64_t I = H * Dh / c->o_groups, R = c->wo_a[0].O, GR = c->o_groups * R;
    for (int64_t g = 0; g < c->o_groups; g++) {
#pragma omp single
        for (int64_t r = 0; r < nr; r++) memcpy(b->grp + r * I, b->att + r * H * Dh + g * I, sizeof(float) * (size_t)I);
        lin_product(&c->wo_a[g], b->grp, nr, a, b->zg, oom); /* (nr, R) */
#pragma omp single
        for (int64_t r = 0; r < nr; r++) memcpy(b->z + r * GR + g * R, b->zg + r * R, sizeof(float) * (size_t)R);
    }
    lin_product(&c->wo_b, b->z, nr, a, out, oom);
}

void v4_attend(const Net *net, const Layer *ly, const float *h, float *kc, float *ent, int64_t S, int64_t pos,
               V4Buf *b, Acts *a, float *out, int *oom) {
    const int64_t seg = 0;
    void *kcs[1] = {kc}, *vcs[1] = {ent};
    v4_rows(net, ly, h, 1, &seg, &pos, kcs, vcs, &S, b, a, out, oom);
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

/* a hyper-connection's pre (N), post (N) and Sinkhorn-normalised comb (N N) from its mixes m */
static void hc_weights(const Net *net, const Hyper *hy, const float *m, float *pre, float *post, float *comb) {
    const int64_t N = net->hc;
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
}

void hc_rows(const Net *net, const Hyper *hy, int head, const float *X, int64_t nr, V4Buf *b, Acts *a, int *oom) {
    const int64_t N = net->hc, D = net->D, Mw = head ? N : (2 + N) * N;
#pragma omp single
    rmsnorm_f32(X, NULL, net->norm_eps, b->hx, nr, N * D);
    lin_product(&hy->fn, b->hx, nr, a, b->mix, oom);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < (*oom ? 0 : nr); r++) {
        float pre[N];
        const float *m = b->mix + r * Mw;
        if (head)
            for (int64_t n = 0; n < N; n++) pre[n] = sigm(m[n] * hy->scale[0] + hy->base[n]) + net->hc_eps;
        else
            hc_weights(net, hy, m, pre, b->post + r * N, b->comb + r * N * N);
        hc_collapse(pre, X + r * N * D, N, D, b->col + r * D);
    }
}

void hc_merge_rows(const Net *net, const float *y, float *X, int64_t nr, V4Buf *b) {
    const int64_t N = net->hc, D = net->D;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nr; r++) {
        const float *post = b->post + r * N, *comb = b->comb + r * N * N, *yr = y + r * D;
        float *Xr = X + r * N * D, *old = b->hx + r * N * D;
        memcpy(old, Xr, sizeof(float) * (size_t)(N * D));
        for (int64_t j = 0; j < N; j++)
            for (int64_t i = 0; i < D; i++) {
                float acc = 0.0f;
                for (int64_t n = 0; n < N; n++) acc += comb[n * N + j] * old[n * D + i];
                Xr[j * D + i] = post[j] * yr[i] + acc;
            }
    }
}
