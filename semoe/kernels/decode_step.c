/* A whole decoding step of one sequence in one call, for a model whose weights are all in memory:
 * per layer the attention norm, the q/k/v products and attention (or latent attention in the
 * absorbed form, `Latent`), the output product and the residual,
 * the feed-forward norm, the router's product, softmax and top-k, the chosen SwiGLU experts (or
 * gpt-oss's clamped ones, or the layer's dense SwiGLU) and their weighted sum into the residual, and
 * the shared expert where there is one; then the final norm and the
 * output product. The same block kernels as gemv.c's products, all inside one OpenMP parallel
 * region: the threads split each product's blocks of rows (and the top-k experts' blocks together)
 * and meet at a barrier between the parts, where one thread does the few serial steps. A step
 * through Python calls each kernel in turn, a few hundred calls and small torch ops, which on a
 * 2-core CPU cost a tenth to a fifth of a 4-bit token's time.
 *
 * Every value is the arithmetic of the plan's kernel-by-kernel step (semoe/decode/plan.py) except
 * where the plan uses torch's ops: the routers' softmax and sigmoid, the SiLU and the clamped
 * activation of float experts, the shared expert's sum, which here use this file's expf and order,
 * so the logits agree to float32 rounding, not to the bit (tests bound the difference).
 */
#include "lin.h"

int lin_quantized(const Lin *l) {
    return l->kind == W_INT8 || l->kind == W_INT4 || l->kind == W_MXFP4 || l->kind == W_GGML;
}

int64_t lin_blocks(const Lin *l) {
    switch (l->kind) {
    case W_INT4: return l->O / I4_BLOCK;
    case W_F32_IO:
    case W_BF16_IO: return io_blocks(l->O);
    default: return i8_blocks(l->O);
    }
}

void lin_block(const Lin *l, const float *x, int64_t M, const Acts *a, float *y, int64_t b) {
    switch (l->kind) {
    case W_F32: f32_block(x, (const float *)l->w, y, M, l->O, l->I, b); break;
    case W_BF16: bf16_block(x, (const uint16_t *)l->w, y, M, l->O, l->I, b); break;
    case W_INT8: i8_block((const int8_t *)l->w, l->s, l->O, a, b, y); break;
    case W_MXFP4: fp4_block((const uint8_t *)l->w, (const uint8_t *)l->s, l->O, a, b, y); break;
    case W_F32_IO:
    case W_BF16_IO:
        for (int64_t m = 0; m < M; m++) io_block(x + m * l->I, l->w, l->kind == W_BF16_IO, l->O, l->I, b, y + m * l->O);
        break;
    case W_FP8: fp8_block(x, (const uint8_t *)l->w, l->s, y, M, l->O, l->I, l->g, b); break;
    case W_GGML: gg_block(l->g, (const uint8_t *)l->w, l->O, l->I, a, b, y); break;
    default: i4_block((const uint8_t *)l->w, l->s, l->O, a, b, y);
    }
}

/* the M rows of x quantized for l's integer kernel, where it takes them; *oom set where its buffers could not be
 * allocated (every thread reads it after the barrier that ends the `single` this runs in, so the
 * team skips the products together and the call returns the error) */
void lin_acts(const Lin *l, const float *x, int64_t M, Acts *a, int *oom) {
    lin_acts_alloc(l, M, a, oom);
    if (lin_quantized(l) && !*oom) acts_fill(a, x);
    if (l->kind == W_MXFP4 && !*oom) acts_fp4(a);
    if (l->kind == W_GGML && !*oom) acts_gg(a, l->g);
}

/* lin_acts in three parts for a team: the buffers (by one thread), the rows (split over the threads)
 * and MXFP4's layout (by one): a prompt's many rows are quantized in parallel */
void lin_acts_alloc(const Lin *l, int64_t M, Acts *a, int *oom) {
    memset(a, 0, sizeof(*a)); /* freed whether or not the allocation went through */
    if (!lin_quantized(l)) return;
    /* int4: the sums of its groups of inputs; GGUF's blocks: of each 32 (their offsets' and mins' share) */
    *a = acts_alloc(M, l->I, l->kind == W_INT4 ? l->g : l->kind == W_GGML ? QB : 0);
    if (l->kind == W_GGML) a->kb = gg_x_block(l->g);
    if (!acts_ok(a)) *oom = 1;
}

void lin_acts_team(const Lin *l, const float *x, int64_t M, Acts *a, int *oom) {
    if (M < 2) {
#pragma omp single
        lin_acts(l, x, M, a, oom);
        return;
    }
#pragma omp single
    lin_acts_alloc(l, M, a, oom);
    const int64_t rows = *oom || !lin_quantized(l) ? 0 : M;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) acts_fill_row(a, x, m);
    if (l->kind == W_MXFP4 && !*oom) {
#pragma omp single
        acts_fp4(a);
    }
    if (l->kind == W_GGML && !*oom) {
#pragma omp single
        acts_gg(a, l->g);
    }
}

void lin_acts_done(const Lin *l, Acts *a) {
    if (lin_quantized(l)) acts_free(a);
}



/* y (M, O) = l(x) for M rows x (M, I) by the whole team (every thread calls it; a points at one Acts
 * they share), its bias added */
void lin_product(const Lin *l, const float *x, int64_t M, Acts *a, float *y, int *oom) {
    lin_acts_team(l, x, M, a, oom);
    const int64_t nb = *oom ? 0 : lin_blocks(l);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; b++) lin_block(l, x, M, a, y, b);
#pragma omp single
    {
        lin_acts_done(l, a);
        if (l->bias && !*oom)
            for (int64_t m = 0; m < M; m++)
                for (int64_t i = 0; i < l->O; i++) y[m * l->O + i] += l->bias[i];
    }
}

typedef struct { /* the step's buffers */
    float *h, *qkv, *qr, *att, *tmp, *p, *probs, *choice, *hg, *hu, *ys, *w, gate;
    float *hin, *ones; /* experts whose input the router's weights scale: their inputs (K, D), K ones */
    float *qa, *qb, *kv, *qn, *qrot, *qlat, *olat, *attm; /* latent attention's (NULL without) */
    float *iq, *ik, *iw, *isc, *isel; /* the indexer's query heads, key, head weights, scores and their copy */
    int32_t *chosen; /* the positions the last indexer of the step chose (nchosen of them), in order */
    int64_t nchosen;
    unsigned char *masked;
    const Expert **ex; /* the experts a feed-forward pass runs */
    const float **yp;
    int64_t *ids;
    Acts a, *ax, *ah;
    float *qg, *ag; /* a gated attention layer's products (q and its gate, k, v) and its gate */
    DnBuf dn; /* Gated DeltaNet's, for one row */
    V4Buf v4; /* DeepSeek-V4's attention and hyper-connections' */
    int64_t token; /* the step's token id (hash routing) */
    int oom; /* an allocation during the step failed: its results are not to be used */
} Work;

/* The outputs y_k (s->ys + k D) of the experts ks[0..n) of the K in s->ex (0..n-1 where ks is NULL; set by
 * the caller, of one kind and width), by the team, their blocks of rows shared out together: SwiGLU's
 * y = down(silu(gate h) * up h), gpt-oss's y = down(act(gate_up h + b_gu)) + b_d (`Expert`, `Net.alpha`)
 * as gemv.c's `clamped_swiglu_q` computes it, or SwiGLU of gate_up's halves. hg holds 2F values an
 * expert: gate (or gate_up) outputs; the activation is written in place (SwiGLU) or into hu (of
 * gate_up). `scaled`: expert k's input is h * w_k (Llama-4's router). Each output is its expert's alone,
 * every row summed by one thread in one order: computed in several calls, the same bits as in one. */
static void experts_out(const Net *net, const int64_t *ks, int64_t n, const float *w, const float *h, int64_t D,
                        int64_t F, Work *s, int scaled) {
    const Expert *const *ex = s->ex;
#define KK(j) (ks ? ks[j] : (j))
    const Expert *first = ex[KK(0)];
    const int fused = first->up.O == 0;
#define IN(k) (scaled ? s->hin + (k) * D : h)
#pragma omp single
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = KK(j);
        if (scaled) /* the module's x * w, rounded to float32 */
            for (int64_t i = 0; i < D; i++) s->hin[k * D + i] = h[i] * w[k];
        lin_acts(&ex[k]->gate, IN(k), 1, &s->ax[k], &s->oom);
    }
    int64_t nb = s->oom ? 0 : lin_blocks(&first->gate);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n * nb; t++) {
        const int64_t k = KK(t / nb);
        lin_block(&ex[k]->gate, IN(k), 1, &s->ax[k], s->hg + k * 2 * F, t % nb);
        if (!fused) lin_block(&ex[k]->up, IN(k), 1, &s->ax[k], s->hu + k * F, t % nb);
    }
#undef IN
    int64_t Fe = s->oom ? 0 : fused ? first->gate.O / 2 : first->gate.O;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n * Fe; t++) {
        const int64_t k = KK(t / Fe);
        expert_act(net, ex[k], s->hg + k * 2 * F, s->hu + k * F, t % Fe);
    }
#define DOWN_IN(k) (fused ? s->hu + (k) * F : s->hg + (k) * 2 * F)
#pragma omp single
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = KK(j);
        lin_acts_done(&ex[k]->gate, &s->ax[k]);
        lin_acts(&ex[k]->down, DOWN_IN(k), 1, &s->ah[k], &s->oom);
    }
    nb = s->oom ? 0 : lin_blocks(&first->down);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n * nb; t++) {
        const int64_t k = KK(t / nb);
        lin_block(&ex[k]->down, DOWN_IN(k), 1, &s->ah[k], s->ys + k * D, t % nb);
    }
#undef DOWN_IN
#pragma omp single
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = KK(j);
        lin_acts_done(&ex[k]->down, &s->ah[k]);
        s->yp[k] = s->ys + k * D;
        const float *b = ex[k]->down.bias;
        if (b)
            for (int64_t i = 0; i < D; i++) s->ys[k * D + i] += b[i];
    }
#undef KK
}

/* x += sum_k w_k y_k over the K outputs `experts_out` left (x += sum_k y_k where `scaled`), by the team */
static void experts_sum(int64_t K, const float *w, float *x, int64_t D, Work *s, int scaled) {
#pragma omp single
    if (!s->oom) moe_combine_f32(x, s->yp, scaled ? s->ones : w, K, D);
}

/* x += sum_k w_k y_k over the K experts in s->ex: `experts_out` of all, then `experts_sum` */
static void experts(const Net *net, int64_t K, const float *w, const float *h, float *x, int64_t D, int64_t F,
                    Work *s, int scaled) {
    experts_out(net, NULL, K, w, h, D, F, s, scaled);
    experts_sum(K, w, x, D, s, scaled);
}

static void work_free(Work *s);

/* the step's buffers for a cache of S positions; NULL where memory for them could not be had */
static Work *work_new(const Net *net, int64_t S) {
    const int64_t D = net->D, H = net->H, G = net->G, Dh = net->Dh, F = net->F;
    const int64_t Kmax = net->top_k > 1 ? net->top_k : 1;
    Work *s = calloc(1, sizeof(Work));
    if (!s) return NULL;
    s->h = malloc(sizeof(float) * (size_t)D);
    s->qkv = malloc(sizeof(float) * (size_t)((H + 2 * G) * Dh));
    s->qr = malloc(sizeof(float) * (size_t)(H * Dh));
    s->att = malloc(sizeof(float) * (size_t)(H * Dh));
    s->tmp = malloc(sizeof(float) * (size_t)D);
    s->p = malloc(sizeof(float) * (size_t)(S * H));
    s->probs = malloc(sizeof(float) * (size_t)(net->E > 1 ? net->E : 1));
    s->choice = malloc(sizeof(float) * (size_t)(net->E > 1 ? net->E : 1));
    s->masked = malloc((size_t)(net->E > 1 ? net->E : 1));
    s->ex = malloc(sizeof(Expert *) * (size_t)Kmax);
    s->hg = malloc(sizeof(float) * (size_t)(Kmax * 2 * F));
    s->hu = malloc(sizeof(float) * (size_t)(Kmax * F));
    s->ys = malloc(sizeof(float) * (size_t)(Kmax * D));
    s->w = malloc(sizeof(float) * (size_t)Kmax);
    s->hin = malloc(sizeof(float) * (size_t)(Kmax * D));
    s->ones = malloc(sizeof(float) * (size_t)Kmax);
    for (int64_t k = 0; s->ones && k < Kmax; k++) s->ones[k] = 1.0f;
    s->yp = malloc(sizeof(float *) * (size_t)Kmax);
    s->ids = malloc(sizeof(int64_t) * (size_t)Kmax);
    s->ax = malloc(sizeof(Acts) * (size_t)Kmax);
    s->ah = malloc(sizeof(Acts) * (size_t)Kmax);
    s->qg = malloc(sizeof(float) * (size_t)((2 * H + 2 * G) * Dh));
    s->ag = malloc(sizeof(float) * (size_t)(H * Dh));
    const Latent *m = NULL;
    for (int64_t l = 0; net->layers && l < net->L && !m; l++) m = net->layers[l].mla;
    int mla_ok = 1;
    if (m) {
        const int64_t R = net->R;
        s->qa = malloc(sizeof(float) * (size_t)(m->q_a.O > 0 ? m->q_a.O : 1));
        s->qb = malloc(sizeof(float) * (size_t)(H * (m->nope + R)));
        s->kv = malloc(sizeof(float) * (size_t)(m->L + R));
        s->qn = malloc(sizeof(float) * (size_t)(H * m->nope));
        s->qrot = malloc(sizeof(float) * (size_t)(H * R));
        s->qlat = malloc(sizeof(float) * (size_t)(H * m->L));
        s->olat = malloc(sizeof(float) * (size_t)(H * m->L));
        s->attm = malloc(sizeof(float) * (size_t)(H * m->dv));
        mla_ok = s->qa && s->qb && s->kv && s->qn && s->qrot && s->qlat && s->olat && s->attm;
        const Indexer *ix = NULL;
        for (int64_t l = 0; net->layers && l < net->L && !ix; l++)
            ix = net->layers[l].mla ? net->layers[l].mla->index : NULL;
        if (ix) {
            s->iq = malloc(sizeof(float) * (size_t)(ix->Hi * ix->Di));
            s->ik = malloc(sizeof(float) * (size_t)ix->Di);
            s->iw = malloc(sizeof(float) * (size_t)ix->Hi);
            s->isc = malloc(sizeof(float) * (size_t)S);
            s->isel = malloc(sizeof(float) * (size_t)S);
            s->chosen = malloc(sizeof(int32_t) * (size_t)S);
            mla_ok = mla_ok && s->iq && s->ik && s->iw && s->isc && s->isel && s->chosen;
        }
    }
    if (!v4_buf_new(net, S, 1, &s->v4) || !dn_buf_new(net, 1, &s->dn) || !s->qg || !s->ag || !mla_ok || !s->h || !s->qkv || !s->qr || !s->att ||
        !s->tmp || !s->p || !s->probs || !s->choice || !s->masked || !s->ex || !s->hg || !s->hu || !s->ys || !s->w ||
        !s->hin || !s->ones || !s->yp || !s->ids || !s->ax || !s->ah) {
        work_free(s);
        return NULL;
    }
    return s;
}

static void work_free(Work *s) {
    free(s->h), free(s->qkv), free(s->qr), free(s->att), free(s->tmp), free(s->p), free(s->probs);
    free(s->choice), free(s->masked), free(s->ex);
    free(s->qa), free(s->qb), free(s->kv), free(s->qn), free(s->qrot), free(s->qlat), free(s->olat), free(s->attm);
    free(s->iq), free(s->ik), free(s->iw), free(s->isc), free(s->isel), free(s->chosen);
    free(s->hg), free(s->hu), free(s->ys), free(s->w), free(s->hin), free(s->ones), free(s->yp), free(s->ids);
    free(s->ax), free(s->ah), free(s->qg), free(s->ag);
    dn_buf_free(&s->dn);
    v4_buf_free(&s->v4);
    free(s);
}

/* q, k, v (H, G, G heads of Dh) of the position pos as the module prepares them before rotary: norms
 * over all heads, clipping, norms per head, in that order. A layer without rotary stops there, q
 * times its temperature where it has one. Where attend_rotate's rotation by halves does not apply
 * (interleaved pairs, or norms after the rotation), q and k are rotated here with the position's
 * cos/sin, then normed; returns the dims attend_rotate still rotates (net->R or 0). */
int64_t qkv_prepare(const Net *net, const Layer *ly, float *qkv, const float *cos, const float *sin, int64_t pos) {
    const int64_t H = net->H, G = net->G, Dh = net->Dh, R = net->R;
    float *q = qkv, *k = qkv + H * Dh;
    if (ly->qk_norm == 1) {
        rmsnorm_f32(q, ly->q_norm, ly->qk_eps, q, 1, H * Dh);
        rmsnorm_f32(k, ly->k_norm, ly->qk_eps, k, 1, G * Dh);
    }
    if (ly->clip > 0)
        for (int64_t i = 0; i < (H + 2 * G) * Dh; i++) qkv[i] = fminf(fmaxf(qkv[i], -ly->clip), ly->clip);
    if (ly->qk_norm == 2) {
        rmsnorm_f32(q, ly->q_norm, ly->qk_eps, q, H, Dh);
        rmsnorm_f32(k, ly->k_norm, ly->qk_eps, k, G, Dh);
    }
    if (ly->norope) {
        if (ly->temp_floor > 0) { /* the module's float32 ops: log1p(floor((p + 1) / floor)) * scale + 1 */
            const float t = log1pf(floorf(((float)pos + 1.0f) / ly->temp_floor)) * ly->temp_scale + 1.0f;
            for (int64_t i = 0; i < H * Dh; i++) q[i] = q[i] * t;
        }
        return 0;
    }
    if (!net->rope_pairs && ly->qk_norm < 3) return R;
    float row[R];
    for (int64_t h = 0; h < H + G; h++) {
        rope_rotate(qkv + h * Dh, cos, sin, R, (int)net->rope_pairs, row);
        memcpy(qkv + h * Dh, row, sizeof(float) * (size_t)R);
    }
    if (ly->qk_norm >= 3) { /* 4: without weights (q_norm, k_norm NULL) */
        rmsnorm_f32(q, ly->q_norm, ly->qk_eps, q, H, Dh);
        rmsnorm_f32(k, ly->k_norm, ly->qk_eps, k, G, Dh);
    }
    return 0;
}

/* grouped-query attention from the normed row s->h to the output product in s->tmp, by the team:
 * k and v written at pos of the layer's caches (G, S, Dh) */
static void gqa_attend(const Net *net, const Layer *ly, void *kc, void *vc, int64_t S, int64_t pos,
                       const float *cos, const float *sin, Work *s) {
    const int64_t H = net->H, G = net->G, Dh = net->Dh, n = pos + 1;
    for (int64_t j = 0, off = 0; j < ly->n_qkv; off += ly->qkv[j].O, j++)
        lin_product(&ly->qkv[j], s->h, 1, &s->a, (ly->gate ? s->qg : s->qkv) + off, &s->oom);
#pragma omp single
    {
        if (ly->gate) gate_unpack(H, G, Dh, s->qg, s->qkv, s->ag);
        const int64_t R = qkv_prepare(net, ly, s->qkv, cos, sin, pos);
        attend_rotate(s->qkv, s->qkv + H * Dh, s->qkv + (H + G) * Dh, cos, sin, kc, vc, H, G, Dh, R, S, pos, s->qr,
                      (int)net->kv16);
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++)
        attend_head(s->qr, kc, vc, H, G, Dh, S, first_seen(ly->window, ly->chunk, pos), n, net->scale,
                    ly->sinks, s->p, s->att, h, (int)net->kv16);
    if (ly->gate) {
#pragma omp single
        gate_apply(s->att, s->ag, H * Dh);
    }
    lin_product(&ly->o, s->att, 1, &s->a, s->tmp, &s->oom);
}

/* the indexer's key of the normed row h into k (Di) as the cache keeps it: from wk's product in ik,
 * normed, its first R dims rotated with the position's cos/sin; zeros for a layer without an indexer */
void index_key(const Latent *m, int64_t R, const float *ik, const float *cos, const float *sin, float *k) {
    const Indexer *ix = m->index;
    if (!ix) {
        memset(k, 0, sizeof(float) * (size_t)m->Di);
        return;
    }
    float row[ix->Di];
    layernorm_f32(ik, ix->k_norm, ix->k_bias, 1e-6f, row, ix->Di);
    memcpy(k, row, sizeof(float) * (size_t)ix->Di);
    rope_rotate(row, cos, sin, R, (int)ix->interleave, k);
}

/* the indexer's query heads iq (Hi * Di, wq's product) rotated in place, and its head weights iw (Hi,
 * wp's product) over sqrt(Hi), as `index_score` takes them */
void index_query(const Indexer *ix, int64_t R, float *iq, float *iw, const float *cos, const float *sin) {
    float row[R];
    for (int64_t h = 0; h < ix->Hi; h++) {
        rope_rotate(iq + h * ix->Di, cos, sin, R, (int)ix->interleave, row);
        memcpy(iq + h * ix->Di, row, sizeof(float) * (size_t)R);
    }
    const float ws = (float)(1.0 / sqrt((double)ix->Hi)); /* the module's Hi ** -0.5 */
    for (int64_t h = 0; h < ix->Hi; h++) iw[h] = iw[h] * ws;
}

/* latent attention (`Latent`) from the normed row s->h to the output product in s->tmp, by the team:
 * the latent and rotary key written at pos of the layer's caches (S, L) and (S, R), or, under
 * DeepSeek sparse attention, (S, R + Di) with the indexer's key after the rotary key; then every
 * position's score by the indexer and attention over the topk best (`Latent.topk`) */
static void latent_attend(const Net *net, const Latent *m, const Lin *o, float *latents, float *rots, int64_t S,
                          int64_t pos, const float *cos, const float *sin, Work *s) {
    const int64_t H = net->H, R = net->R, nope = m->nope, L = m->L, dv = m->dv, Q = nope + R;
    const int64_t rs = R + (m->topk ? m->Di : 0); /* a position's row in the rotary cache */
    const Indexer *ix = m->index;
    if (m->q_a.O) {
        lin_product(&m->q_a, s->h, 1, &s->a, s->qa, &s->oom);
#pragma omp single
        rmsnorm_f32(s->qa, m->q_norm, m->eps, s->qa, 1, m->q_a.O);
        lin_product(&m->q_b, s->qa, 1, &s->a, s->qb, &s->oom);
    } else {
        lin_product(&m->q_b, s->h, 1, &s->a, s->qb, &s->oom);
    }
    lin_product(&m->kv_a, s->h, 1, &s->a, s->kv, &s->oom);
    if (ix) {
        lin_product(&ix->wq, s->qa, 1, &s->a, s->iq, &s->oom);
        lin_product(&ix->wk, s->h, 1, &s->a, s->ik, &s->oom);
        lin_product(&ix->wp, s->h, 1, &s->a, s->iw, &s->oom);
    }
#pragma omp single
    {
        rmsnorm_f32(s->kv, m->kv_norm, m->eps, latents + pos * L, 1, L);
        rope_rotate(s->kv + L, cos, sin, R, (int)m->interleave, rots + pos * rs);
        if (m->topk) index_key(m, R, s->ik, cos, sin, rots + pos * rs + R);
        if (ix) index_query(ix, R, s->iq, s->iw, cos, sin);
        for (int64_t h = 0; h < H; h++) {
            memcpy(s->qn + h * nope, s->qb + h * Q, sizeof(float) * (size_t)nope);
            rope_rotate(s->qb + h * Q + nope, cos, sin, R, (int)m->interleave, s->qrot + h * R);
        }
    }
    if (ix && !s->oom) { /* every position's score, then the best topk (a layer without an indexer reads them) */
        const float ds = index_dim_scale(ix->Di);
#pragma omp for schedule(static)
        for (int64_t t = 0; t <= pos; t++) s->isc[t] = index_score(s->iq, s->iw, ix->Hi, ix->Di, ds, rots + t * rs + R);
#pragma omp single
        s->nchosen = choose_top(s->isc, pos + 1, m->topk, s->chosen, s->isel);
    }
    const int32_t *idx = m->topk ? s->chosen : NULL;
    const int64_t n = m->topk ? s->nchosen : pos + 1;
    const int64_t nl = i8_blocks(L), nv = i8_blocks(dv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * nl; t++) /* each head's no-rope query into the latent space */
        f32_block(s->qn + t / nl * nope, m->w_ukT + t / nl * L * nope, s->qlat + t / nl * L, 1, L, nope, t % nl);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++)
        mla_head(s->qlat + h * L, s->qrot + h * R, latents, rots, L, R, rs, idx, n, m->scale, s->p + h * S,
                 s->olat + h * L);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * nv; t++) /* each head's latent sum out to its values */
        f32_block(s->olat + t / nv * L, m->w_uv + t / nv * dv * L, s->attm + t / nv * dv, 1, dv, L, t % nv);
    lin_product(o, s->attm, 1, &s->a, s->tmp, &s->oom);
}

/* layer l up to its feed-forward, by the team: the attention (k and v, or the latent and rotary
 * key, written at pos of the layer's caches kc, vc), its residual, the feed-forward norm into s->h
 * and, for an MoE layer, the router's choice into s->ids and s->w */
static void layer_attend(const Net *net, int64_t l, float *x, void *kc, void *vc, int64_t S, int64_t pos,
                         const float *cos, const float *sin, Work *s) {
    const int64_t D = net->D, hc = net->hc > 1;
    const Layer *ly = net->layers + l;
    if (hc) { /* the streams: the embedding's copies before the first layer, collapsed into attention's input */
#pragma omp single
        for (int64_t n = 1; l == 0 && n < net->hc; n++) memcpy(x + n * D, x, sizeof(float) * (size_t)D);
        hc_rows(net, &ly->hc_attn, 0, x, 1, &s->v4, &s->a, &s->oom);
    }
#pragma omp single
    rmsnorm_f32(hc ? s->v4.col : x, ly->attn_norm, ly->attn_eps, s->h, 1, D);
    if (ly->v4)
        v4_attend(net, ly, s->h, (float *)kc, (float *)vc, S, pos, &s->v4, &s->a, s->tmp, &s->oom);
    else if (ly->dn) { /* the state in place of the caches: one row of one sequence */
        const int64_t seg = 0;
        void *kcs[1] = {kc}, *vcs[1] = {vc};
        deltanet_rows(ly, s->h, 1, &seg, &pos, kcs, vcs, &s->dn, &s->a, s->tmp, &s->oom);
    } else if (ly->mla)
        latent_attend(net, ly->mla, &ly->o, (float *)kc, (float *)vc, S, pos, cos, sin, s); /* float32 always */
    else
        gqa_attend(net, ly, kc, vc, S, pos, cos, sin, s);
    if (hc) {
        hc_merge_rows(net, s->tmp, x, s->oom ? 0 : 1, &s->v4);
        hc_rows(net, &ly->hc_ffn, 0, x, 1, &s->v4, &s->a, &s->oom);
    } else {
#pragma omp single
        for (int64_t i = 0; i < D; i++) x[i] = x[i] + s->tmp[i];
    }
#pragma omp single
    rmsnorm_f32(hc ? s->v4.col : x, ly->ffn_norm, ly->ffn_eps, s->h, 1, D);
    if (ly->E) {
        lin_product(&ly->router, s->h, 1, &s->a, s->probs, &s->oom);
#pragma omp single
        if (!s->oom) route(net, ly, s->probs, s->choice, s->masked, s->ids, s->w, s->token);
        else
            for (int64_t k = 0; k < net->top_k; k++) s->ids[k] = 0, s->w[k] = 0.0f; /* unused: the call fails */
    } else {
#pragma omp single
        {
            s->ids[0] = 0;
            s->w[0] = 1.0f; /* y * 1 is y: x + y, the module's own sum */
        }
    }
}

/* the outputs of the layer's chosen experts ks[0..n) (indices into the router's choice; all K where
 * ks is NULL), by the team */
static void layer_ffn_part(const Net *net, int64_t l, const int64_t *ks, int64_t n, Work *s) {
    const Layer *ly = net->layers + l;
#pragma omp single
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = ks ? ks[j] : j;
        s->ex[k] = ly->experts + s->ids[k];
    }
    experts_out(net, ks, n, s->w, s->h, net->D, net->F, s, ly->E && net->router == 3);
}

/* the chosen experts' outputs (every one computed by `layer_ffn_part`) summed into x, then the shared
 * expert's, by the team */
static void layer_ffn_done(const Net *net, int64_t l, float *x, Work *s) {
    const Layer *ly = net->layers + l;
    const int64_t K = ly->E ? net->top_k : 1, hc = net->hc > 1;
    float *y = hc ? s->v4.y : x; /* with hyper-connections the block's output, merged into the streams after */
    if (hc) {
#pragma omp single
        memset(y, 0, sizeof(float) * (size_t)net->D);
    }
    experts_sum(K, s->w, y, net->D, s, ly->E && net->router == 3);
    if (ly->shared) {
        if (ly->shared_gate.O) lin_product(&ly->shared_gate, s->h, 1, &s->a, &s->gate, &s->oom);
#pragma omp single
        {
            s->gate = ly->shared_gate.O ? 1.0f / (1.0f + expf(-s->gate)) : 1.0f;
            s->ex[0] = ly->shared;
        }
        experts(net, 1, &s->gate, s->h, y, net->D, net->F, s, 0);
    }
    if (hc) hc_merge_rows(net, y, x, s->oom ? 0 : 1, &s->v4);
}

/* layer l's feed-forward on s->h, by the team: the chosen experts (layer_attend's) or the dense one,
 * then the shared expert, scaled by its gate where it has one */
static void layer_ffn(const Net *net, int64_t l, float *x, Work *s) {
    layer_ffn_part(net, l, NULL, net->layers[l].E ? net->top_k : 1, s);
    layer_ffn_done(net, l, x, s);
}

/* the final norm and the output product into logits, by the team */
static void head(const Net *net, float *x, float *logits, Work *s) {
    if (net->hc > 1) hc_rows(net, &net->hc_head, 1, x, 1, &s->v4, &s->a, &s->oom);
#pragma omp single
    rmsnorm_f32(net->hc > 1 ? s->v4.col : x, net->norm, net->norm_eps, s->h, 1, net->D);
    lin_product(&net->head, s->h, 1, &s->a, logits, &s->oom);
}

/* One step at position `pos`: x (D) holds the token's embedding (x has room for N D, the residual's
 * streams, where `Net.hc` = N > 1); kc, vc the L layers' caches (G, S, Dh each), written at pos; cos, sin
 * (Dh) the position's rotary tables; logits (V) out; token: its id (hash routing). Returns 0,
 * or -1 where memory for the step's buffers could not be had (x, the caches and logits are then
 * not to be used). */
int decode_step(const Net *net, float *x, void *const *kc, void *const *vc, int64_t S, int64_t pos,
                const float *cos, const float *sin, float *logits, int threads, int64_t token) {
    Work *s = work_new(net, S);
    if (!s) return -1;
    s->token = token;
#pragma omp parallel num_threads(threads)
    {
        for (int64_t l = 0; l < net->L; l++) {
            layer_attend(net, l, x, kc[l], vc[l], S, pos, cos, sin, s);
            layer_ffn(net, l, x, s);
        }
        head(net, x, logits, s);
    }
    int rc = s->oom ? -1 : 0;
    work_free(s);
    return rc;
}

/* The same step in parts, for experts that arrive during it (the caller reads the chosen ones
 * between the parts and points the layer's `experts` at them): per layer `decode_attend`, which
 * writes the router's choice (top_k ids and weights; a dense layer's is expert 0 of weight 1), then
 * `decode_ffn`; after the last layer `decode_head`. `decode_work` makes the buffers the parts share
 * for a cache of S positions (`decode_work_free` frees them; NULL where memory could not be had).
 * The same arithmetic as `decode_step`; each part returns 0, or -1 where an allocation failed. */
Work *decode_work(const Net *net, int64_t S) { return work_new(net, S); }

void decode_work_free(Work *s) { work_free(s); }

int decode_attend(const Net *net, Work *s, int64_t l, float *x, void *kc, void *vc, int64_t S, int64_t pos,
                  const float *cos, const float *sin, int64_t *ids, float *w, int threads, int64_t token) {
    s->oom = 0;
    s->token = token;
#pragma omp parallel num_threads(threads)
    layer_attend(net, l, x, kc, vc, S, pos, cos, sin, s);
    const int64_t K = net->layers[l].E ? net->top_k : 1;
    for (int64_t k = 0; k < K; k++) ids[k] = s->ids[k], w[k] = s->w[k];
    return s->oom ? -1 : 0;
}

int decode_ffn(const Net *net, Work *s, int64_t l, float *x, int threads) {
    s->oom = 0;
#pragma omp parallel num_threads(threads)
    layer_ffn(net, l, x, s);
    return s->oom ? -1 : 0;
}

/* `decode_ffn` in two or more calls, for a step that computes the experts it holds while others are
 * read: `decode_experts` the outputs of the chosen experts ks[0..n) (indices into `decode_attend`'s
 * choice, whose `experts` entries the caller has pointed), as many calls as it takes until every one is
 * computed once; then `decode_ffn_done` sums them into x and adds the shared expert. The same bits as
 * `decode_ffn`. Each returns 0, or -1 where an allocation failed. */
int decode_experts(const Net *net, Work *s, int64_t l, const int64_t *ks, int64_t n, int threads) {
    s->oom = 0;
#pragma omp parallel num_threads(threads)
    layer_ffn_part(net, l, ks, n, s);
    return s->oom ? -1 : 0;
}

int decode_ffn_done(const Net *net, Work *s, int64_t l, float *x, int threads) {
    s->oom = 0;
#pragma omp parallel num_threads(threads)
    layer_ffn_done(net, l, x, s);
    return s->oom ? -1 : 0;
}

int decode_head(const Net *net, Work *s, float *x, float *logits, int threads) {
    s->oom = 0;
#pragma omp parallel num_threads(threads)
    head(net, x, logits, s);
    return s->oom ? -1 : 0;
}
