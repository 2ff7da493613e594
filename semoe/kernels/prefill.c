/* A prompt's feed-forward, one layer at a time for all its positions (the torch-free runner's prompt
 * pass, inference/torch_free/prompt_prefill.py): every expert the prompt chose in a layer runs once over all the
 * positions that chose it, so its weights are read from storage once a layer for the whole prompt and
 * from memory once per PREFILL_ROWS positions, instead of once per position.
 *
 * The caller runs the positions' attention and router (`prefill_attend`: the products over many
 * rows at once, then each row's attention over the positions up to its own, grouped-query or
 * latent), then:
 *   prefill_norm      h (T, D) = the layer's feed-forward norm of x (T, D);
 *   prefill_experts   s (T, D) += w * expert(h) for every (position, k) whose expert is in a list
 *                     (expert(w * h) where the router's weights scale the input),
 *                     as many times as the experts the cache holds at once require (s starts at 0);
 *   prefill_finish    x += s, then the shared expert (times its gate) where the layer has one.
 * A dense layer's feed-forward is its expert 0, chosen by every position with weight 1.
 *
 * Each product is a block kernel over many rows (lin.h); each row's arithmetic is a one-row
 * product's, so an expert's output equals the decoding step's. The routed experts' sum is taken in
 * the order of the list rather than of each position's top-k, so x agrees with token-by-token
 * decoding to float32 rounding, not to the bit (tests bound the difference). */
#include <omp.h>

#include "lin.h"

#define PREFILL_ROWS 64 /* rows of one expert computed together: bounds its buffers */

void prefill_norm(const Net *net, int64_t l, const float *x, float *h, int64_t T) {
    const Layer *ly = net->layers + l;
    rmsnorm_f32(x, ly->ffn_norm, ly->ffn_eps, h, T, net->D);
}

typedef struct {
    float *hb, *hg, *hu, *yb; /* PREFILL_ROWS rows: inputs (D), gate (2F), activation (F), outputs (D) */
    int64_t *rows; /* (position * K + k) of the positions that chose the expert */
    Acts a;
    int oom;
} Rows;

/* expert e on n rows p->hb into p->yb, by the team: decode_step.c's `experts` for one expert over
 * n rows (SwiGLU, or gpt-oss's clamped activation of gate_up with its biases) */
static void expert_rows(const Net *net, const Expert *e, int64_t n, Rows *p) {
    const int64_t Og = e->gate.O;
    const int fused = e->up.O == 0;
    const int64_t Fe = fused ? Og / 2 : Og;
    lin_acts_team(&e->gate, p->hb, n, &p->a, &p->oom);
    int64_t nb = p->oom ? 0 : lin_blocks(&e->gate);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        lin_block(&e->gate, p->hb, n, &p->a, p->hg, b);
        if (!fused) lin_block(&e->up, p->hb, n, &p->a, p->hu, b);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (p->oom ? 0 : n * Fe); t++) {
        const int64_t m = t / Fe;
        expert_act(net, e, p->hg + m * Og, p->hu + m * Fe, t % Fe);
    }
#pragma omp single
    lin_acts_done(&e->gate, &p->a);
    if (!p->oom) lin_product(&e->down, fused ? p->hu : p->hg, n, &p->a, p->yb, &p->oom); /* n rows of Fe */
}

/* latent attention's buffers for PREFILL_ROWS rows (decode_step.c's `latent_attend` for one); for its
 * expanded form also each head's keys ke (H, P, nope + R) and values ve (H, P, dv) of the P = pos0 + T
 * positions and the rows' queries qe (PREFILL_ROWS, H, nope + R) */
typedef struct {
    float *qa, *qb, *kv, *qn, *qrot, *qlat, *olat, *attv;
    float *ke, *ve, *qe;
    float *iq, *ik, *iw; /* the indexer's query heads, key and head weights of the rows (DeepSeek sparse attention) */
} LatentRows;

/* The expanded form's most bytes (its keys and values) for a layer's prompt; past it, the
 * absorbed form (decoding's), which needs none. `prefill_expand_limit` sets it and returns the one
 * before (tests take both forms). */
static int64_t expand_limit = (int64_t)256 << 20;

int64_t prefill_expand_limit(int64_t bytes) {
    int64_t before = expand_limit;
    expand_limit = bytes;
    return before;
}

static int latent_rows_new(const Net *net, const Latent *m, int64_t P, int expand, LatentRows *b) {
    const int64_t H = net->H, R = net->R, M = PREFILL_ROWS, Dk = m->nope + R;
    b->qa = malloc(sizeof(float) * (size_t)(M * (m->q_a.O > 0 ? m->q_a.O : 1)));
    b->qb = malloc(sizeof(float) * (size_t)(M * H * (m->nope + R)));
    b->kv = malloc(sizeof(float) * (size_t)(M * (m->L + R)));
    if (m->index) {
        b->iq = malloc(sizeof(float) * (size_t)(M * m->index->Hi * m->index->Di));
        b->ik = malloc(sizeof(float) * (size_t)(M * m->index->Di));
        b->iw = malloc(sizeof(float) * (size_t)(M * m->index->Hi));
        if (!b->iq || !b->ik || !b->iw) return 0;
    }
    if (expand && (int64_t)sizeof(float) * H * P * (Dk + m->dv) <= expand_limit) {
        b->ke = malloc(sizeof(float) * (size_t)(H * P * Dk));
        b->ve = malloc(sizeof(float) * (size_t)(H * P * m->dv));
        b->qe = malloc(sizeof(float) * (size_t)(M * H * Dk));
        if (b->ke && b->ve && b->qe) return b->qa && b->qb && b->kv;
        free(b->ke), free(b->ve), free(b->qe); /* short of memory: the absorbed form */
        b->ke = b->ve = b->qe = NULL;
    }
    b->qn = malloc(sizeof(float) * (size_t)(M * H * m->nope));
    b->qrot = malloc(sizeof(float) * (size_t)(M * H * R));
    b->qlat = malloc(sizeof(float) * (size_t)(M * H * m->L));
    b->olat = malloc(sizeof(float) * (size_t)(M * H * m->L));
    b->attv = malloc(sizeof(float) * (size_t)(M * H * m->dv));
    return b->qa && b->qb && b->kv && b->qn && b->qrot && b->qlat && b->olat && b->attv;
}

static void latent_rows_free(LatentRows *b) {
    free(b->qa), free(b->qb), free(b->kv), free(b->qn), free(b->qrot), free(b->qlat), free(b->olat), free(b->attv);
    free(b->ke), free(b->ve), free(b->qe), free(b->iq), free(b->ik), free(b->iw);
}

/* positions e0..e1-1 of the latents (S, L) and rotary keys (S, R) expanded, by the team, into each
 * head's keys (w_uk times the latent, from w_ukT (L, nope) as it is, then the rotary key) and values
 * (w_uv times the latent) */
static void latent_expand(const Latent *m, int64_t H, int64_t R, const float *latents, const float *rots, int64_t e0,
                          int64_t e1, int64_t P, LatentRows *b) {
    const int64_t L = m->L, nope = m->nope, dv = m->dv, Dk = nope + R, n = e1 - e0, nv = i8_blocks(dv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * nv; t++)
        f32_block(latents + e0 * L, m->w_uv + t / nv * dv * L, b->ve + (t / nv * P + e0) * dv, n, dv, L, t % nv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * n; t++) {
        const int64_t hd = t / n, pos = e0 + t % n;
        float *k = b->ke + (hd * P + pos) * Dk;
        for (int64_t c = 0; c < io_blocks(nope); c++)
            io_block(latents + pos * L, m->w_ukT + hd * L * nope, 0, nope, L, c, k);
        memcpy(k + nope, rots + pos * R, sizeof(float) * (size_t)R);
    }
}

/* latent attention of nr normed rows h into att (nr, H * dv), by the team, row r at position pos[r] of
 * the sequence whose latents (S, L) and rotary keys (S, R) are lat[seg[r]], rot[seg[r]]: each row's q,
 * latent and rotary key as `latent_attend` makes them, over the rows at once; the latents and rotary
 * keys of all nr positions are written before any row attends, each row over the positions up to its
 * own. Expanded (b->ke, one sequence alone, its rows at consecutive positions): the positions'
 * latents taken out to each head's keys and values once (all earlier positions' too at the first
 * rows, `first`), then attention as grouped-query attention's with a group a head: nope + R products a
 * score and dv a value, where the absorbed form (decoding's, with no room for the expanded keys) takes
 * L + R and L (per head: qn and qlat, olat and attv are (H, nr, .)). P: the expanded keys' positions;
 * p: ROW_GROUP * Smax floats a thread. */
static void latent_rows(const Net *net, const Latent *m, const float *h, int64_t nr, const int64_t *seg,
                        const int64_t *pos, void *const *lat, void *const *rot, int first, int64_t P,
                        const float *cos, const float *sin, int64_t Rc, LatentRows *b, float *p, int64_t Smax,
                        int32_t *choices, float *att, Acts *a, int *oom) {
    const int64_t H = net->H, R = net->R, nope = m->nope, L = m->L, dv = m->dv, Q = nope + R;
    const int64_t rs = R + (m->topk ? m->Di : 0); /* a position's row in the rotary cache */
    const Indexer *ix = m->index;
    if (m->q_a.O) {
        lin_product(&m->q_a, h, nr, a, b->qa, oom);
#pragma omp single
        rmsnorm_f32(b->qa, m->q_norm, m->eps, b->qa, nr, m->q_a.O);
        lin_product(&m->q_b, b->qa, nr, a, b->qb, oom);
    } else {
        lin_product(&m->q_b, h, nr, a, b->qb, oom);
    }
    lin_product(&m->kv_a, h, nr, a, b->kv, oom);
    if (ix) {
        lin_product(&ix->wq, b->qa, nr, a, b->iq, oom);
        lin_product(&ix->wk, h, nr, a, b->ik, oom);
        lin_product(&ix->wp, h, nr, a, b->iw, oom);
    }
    if (*oom) return;
    const int expanded = b->ke != NULL;
    float *pt = p + (int64_t)omp_get_thread_num() * ROW_GROUP * Smax; /* this thread's scores */
#pragma omp single
    for (int64_t r = 0; r < nr; r++) {
        const float *kv = b->kv + r * (L + R), *qb = b->qb + r * H * Q;
        float *latents = (float *)lat[seg[r]], *rots = (float *)rot[seg[r]];
        rmsnorm_f32(kv, m->kv_norm, m->eps, latents + pos[r] * L, 1, L);
        rope_rotate(kv + L, cos + r * Rc, sin + r * Rc, R, (int)m->interleave, rots + pos[r] * rs);
        if (m->topk)
            index_key(m, R, ix ? b->ik + r * ix->Di : NULL, cos + r * Rc, sin + r * Rc, rots + pos[r] * rs + R);
        if (ix) index_query(ix, R, b->iq + r * ix->Hi * ix->Di, b->iw + r * ix->Hi, cos + r * Rc, sin + r * Rc);
        for (int64_t hd = 0; hd < H; hd++) {
            float *qn = expanded ? b->qe + (r * H + hd) * Q : b->qn + (hd * nr + r) * nope;
            memcpy(qn, qb + hd * Q, sizeof(float) * (size_t)nope);
            rope_rotate(qb + hd * Q + nope, cos + r * Rc, sin + r * Rc, R, (int)m->interleave,
                        expanded ? qn + nope : b->qrot + (r * H + hd) * R);
        }
    }
    if (expanded) {
        latent_expand(m, H, R, (const float *)lat[0], (const float *)rot[0], first ? 0 : pos[0], pos[0] + nr, P, b);
#pragma omp for schedule(static)
        for (int64_t hd = 0; hd < H; hd++)
            attend_rows_head(b->qe, b->ke, b->ve, H, H, Q, dv, P, pos[0], nr, 0, 0, m->scale, NULL, pt, att, hd, 0);
        return;
    }
    if (ix) { /* each row's scores of the positions it sees (its sequence's, its own included), the best topk */
        const float ds = index_dim_scale(ix->Di);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < nr; r++) {
            const float *rots = (const float *)rot[seg[r]], *iq = b->iq + r * ix->Hi * ix->Di, *iw = b->iw + r * ix->Hi;
            for (int64_t t = 0; t <= pos[r]; t++) pt[t] = index_score(iq, iw, ix->Hi, ix->Di, ds, rots + t * rs + R);
            choose_top(pt, pos[r] + 1, m->topk, choices + r * m->topk, pt + Smax);
        }
    }
    const int64_t nl = i8_blocks(L), nv = i8_blocks(dv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * nl; t++) /* each head's no-rope queries into the latent space */
        f32_block(b->qn + t / nl * nr * nope, m->w_ukT + t / nl * L * nope, b->qlat + t / nl * nr * L, nr, L, nope,
                  t % nl);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < nr * H; t++) {
        const int64_t r = t / H, hd = t % H;
        const int64_t seen = pos[r] + 1, n = m->topk && m->topk < seen ? m->topk : seen;
        mla_head(b->qlat + (hd * nr + r) * L, b->qrot + (r * H + hd) * R, (const float *)lat[seg[r]],
                 (const float *)rot[seg[r]], L, R, rs, m->topk ? choices + r * m->topk : NULL, n, m->scale, pt,
                 b->olat + (hd * nr + r) * L);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * nv; t++) /* each head's latent sums out to its values */
        f32_block(b->olat + t / nv * nr * L, m->w_uv + t / nv * dv * L, b->attv + t / nv * nr * dv, nr, dv, L, t % nv);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nr; r++)
        for (int64_t hd = 0; hd < H; hd++)
            memcpy(att + (r * H + hd) * dv, b->attv + (hd * nr + r) * dv, sizeof(float) * (size_t)dv);
}

/* Layer l's attention and router for the T rows of a step, as `decode_attend` runs them position after
 * position: the rows of nseg sequences, sequence i's segs[3i + 2] rows (consecutive in x) at its
 * positions segs[3i + 1].. of its layer caches kc[i], vc[i] of segs[3i] positions each ((G, S, Dh)
 * keys and values; latent attention: latents (S, L) and rotary keys (S, R)), written there. A prompt
 * is one sequence of many rows; a batch of decoding sequences, one row each. x (T, D) gets the
 * attention's residual, ids and w (T, K) each row's choice (a dense layer's: expert 0 of weight 1).
 * The norms and products take PREFILL_ROWS rows at once, whichever sequences they are of; then the
 * rows are prepared and rotated (their k and v written), and each attends over its sequence's
 * positions up to its own (a sequence's consecutive rows a few at a time sharing each position's key
 * and value). cos, sin: (T, Rc) the rows' rotary tables. choices: (T, topk) int32 under DeepSeek sparse
 * attention (each row's chosen positions, written by a layer with an indexer, read by the shared ones
 * after it), else NULL. Returns 0; -1 where memory was short (or choices is missing). */
/* rows r0 .. r0 + nr's choice of experts (ids, w: K a row) from their router logits probs (nr, E), by the
 * token ids where the layer hashes; a dense layer's expert 0 of weight 1 */
static void route_rows(const Net *net, const Layer *ly, float *probs, int64_t r0, int64_t nr, int64_t *ids, float *w,
                       int64_t K, float *choice, unsigned char *masked, const int64_t *tokens) {
    for (int64_t r = 0; r < nr; r++) {
        int64_t *ir = ids + (r0 + r) * K;
        float *wr = w + (r0 + r) * K;
        if (ly->E)
            route(net, ly, probs + r * ly->E, choice, masked, ir, wr, tokens ? tokens[r0 + r] : -1);
        else
            ir[0] = 0, wr[0] = 1.0f;
    }
}

/* prefill_attend of a layer of a model with hyper-connections (DeepSeek-V4): x (T, N D) the rows' streams (before
 * the first layer, each row's embedding in its first D); each block of rows collapsed into attention's input,
 * its attention (`v4_rows`, each row from the state its sequence's rows before it left) merged back, then
 * collapsed into the feed-forward's input hf (T, D), normed, and routed (by `tokens` where the layer hashes) */
static int hc_prefill_attend(const Net *net, int64_t l, float *x, int64_t T, void *const *kc, void *const *vc,
                             const int64_t *segs, int64_t nseg, const int64_t *tokens, int64_t *ids, float *w,
                             int64_t K, float *hf, int threads) {
    const Layer *ly = net->layers + l;
    const int64_t D = net->D, N = net->hc, R = PREFILL_ROWS, E = ly->E > 0 ? ly->E : 1;
    int64_t Smax = 1;
    for (int64_t i = 0; i < nseg; i++) Smax = segs[3 * i] > Smax ? segs[3 * i] : Smax;
    V4Buf b;
    Acts a;
    float *h = malloc(sizeof(float) * (size_t)(R * D)), *tmp = malloc(sizeof(float) * (size_t)(R * D));
    float *probs = malloc(sizeof(float) * (size_t)(R * E)), *choice = malloc(sizeof(float) * (size_t)E);
    unsigned char *masked = malloc((size_t)E);
    int64_t *seg = malloc(sizeof(int64_t) * (size_t)(2 * T + 1)), *pos = seg + T;
    int64_t *caps = malloc(sizeof(int64_t) * (size_t)(nseg + 1));
    int oom = !v4_buf_new(net, Smax, R, &b) || !(h && tmp && probs && choice && masked && seg && caps && hf);
    for (int64_t i = 0, r = 0; !oom && i < nseg; i++) {
        caps[i] = segs[3 * i];
        for (int64_t j = 0; j < segs[3 * i + 2] && r < T; j++, r++) seg[r] = i, pos[r] = segs[3 * i + 1] + j;
    }
    for (int64_t r = 0; l == 0 && !oom && r < T; r++) /* the streams: copies of the embedding */
        for (int64_t n = 1; n < N; n++) memcpy(x + (r * N + n) * D, x + r * N * D, sizeof(float) * (size_t)D);
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < T && !oom; r0 += R) {
        const int64_t nr = T - r0 < R ? T - r0 : R;
        float *X = x + r0 * N * D;
        hc_rows(net, &ly->hc_attn, 0, X, nr, &b, &a, &oom);
#pragma omp single
        rmsnorm_f32(b.col, ly->attn_norm, ly->attn_eps, h, nr, D);
        v4_rows(net, ly, h, nr, seg + r0, pos + r0, kc, vc, caps, &b, &a, tmp, &oom);
        hc_merge_rows(net, tmp, X, oom ? 0 : nr, &b);
        hc_rows(net, &ly->hc_ffn, 0, X, nr, &b, &a, &oom);
#pragma omp single
        rmsnorm_f32(b.col, ly->ffn_norm, ly->ffn_eps, hf + r0 * D, nr, D);
        if (ly->E) lin_product(&ly->router, hf + r0 * D, nr, &a, probs, &oom);
#pragma omp single
        if (!oom) route_rows(net, ly, probs, r0, nr, ids, w, K, choice, masked, tokens);
    }
    free(h), free(tmp), free(probs), free(choice), free(masked), free(seg), free(caps);
    v4_buf_free(&b);
    return oom ? -1 : 0;
}

int prefill_attend(const Net *net, int64_t l, float *x, int64_t T, void *const *kc, void *const *vc,
                   const int64_t *segs, int64_t nseg, const float *cos, const float *sin, int64_t Rc, int64_t *ids,
                   float *w, int64_t K, int32_t *choices, const int64_t *tokens, float *hf, int threads) {
    if (net->hc > 1)
        return hc_prefill_attend(net, l, x, T, kc, vc, segs, nseg, tokens, ids, w, K, hf, threads);
    const Layer *ly = net->layers + l;
    const Latent *m = ly->mla;
    const int64_t D = net->D, H = net->H, G = net->G, Dh = net->Dh, R = PREFILL_ROWS;
    const int64_t Q = m ? 1 : (H + 2 * G) * Dh, A = H * (m ? m->dv : Dh);
    const int64_t E = ly->E > 0 ? ly->E : 1;
    int64_t Smax = 1, np = 0, starts[PREFILL_ROWS + 1];
    for (int64_t i = 0; i < nseg; i++) Smax = segs[3 * i] > Smax ? segs[3 * i] : Smax;
    const int64_t Qg = Q + (ly->gate ? H * Dh : 0); /* a gated layer's row of products: q's gate too */
    float *h = malloc(sizeof(float) * (size_t)(R * D)), *qkv = malloc(sizeof(float) * (size_t)(R * Qg));
    float *part = malloc(sizeof(float) * (size_t)(R * Qg)), *att = malloc(sizeof(float) * (size_t)(R * A));
    float *gate = ly->gate ? malloc(sizeof(float) * (size_t)(R * H * Dh)) : NULL;
    DnBuf dn = {0};
    float *tmp = malloc(sizeof(float) * (size_t)(R * D)), *qr = malloc(sizeof(float) * (size_t)(R * H * Dh));
    float *p = malloc(sizeof(float) * (size_t)(threads * ROW_GROUP * Smax));
    float *probs = malloc(sizeof(float) * (size_t)(R * E)), *choice = malloc(sizeof(float) * (size_t)E);
    int64_t *seg = malloc(sizeof(int64_t) * (size_t)(2 * T + 1)), *pos = seg + T;
    unsigned char *masked = malloc((size_t)E);
    LatentRows lb = {0};
    Acts a;
    int oom = !(h && qkv && part && att && tmp && qr && p && probs && choice && masked && seg) || (ly->gate && !gate);
    oom = oom || (ly->dn && !dn_buf_new(net, R, &dn));
    for (int64_t i = 0, r = 0; !oom && i < nseg; i++)
        for (int64_t j = 0; j < segs[3 * i + 2] && r < T; j++, r++) seg[r] = i, pos[r] = segs[3 * i + 1] + j;
    /* the expanded form for one sequence's prompt alone; a decoding row attends in the absorbed form,
     * alone or beside others, so that its bits do not depend on what shares its step */
    /* (DeepSeek sparse attention: each row's own choice of positions, in decoding's absorbed form) */
    oom = oom || (m && !latent_rows_new(net, m, segs[1] + T, nseg == 1 && T > 1 && !m->topk, &lb));
    oom = oom || (m && m->topk && !choices);
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < T && !oom; r0 += R) {
        const int64_t nr = T - r0 < R ? T - r0 : R;
#pragma omp single
        rmsnorm_f32(x + r0 * D, ly->attn_norm, ly->attn_eps, h, nr, D);
        if (ly->dn) /* the rows of each sequence in order from its state; the output product is the mixer's */
            deltanet_rows(ly, h, nr, seg + r0, pos + r0, kc, vc, &dn, &a, tmp, &oom);
        else if (m)
            latent_rows(net, m, h, nr, seg + r0, pos + r0, kc, vc, r0 == 0, segs[1] + T, cos + r0 * Rc, sin + r0 * Rc,
                        Rc, &lb, p, Smax, m->topk ? choices + r0 * m->topk : NULL, att, &a, &oom); /* float32 caches */
        const int gqa = !m && !ly->dn;
        for (int64_t j = 0, off = 0; gqa && j < ly->n_qkv; off += ly->qkv[j].O, j++) {
            lin_product(&ly->qkv[j], h, nr, &a, part, &oom);
#pragma omp single
            for (int64_t m = 0; m < nr; m++)
                memcpy(qkv + m * Qg + off, part + m * ly->qkv[j].O, sizeof(float) * (size_t)ly->qkv[j].O);
        }
        if (gqa && !oom) {
#pragma omp single
            { /* every row's k and v into its caches before any row attends; the runs of a sequence's rows */
                if (ly->gate) /* each row's q, k, v at the stride Q, its gate apart */
                    for (int64_t r = 0; r < nr; r++) {
                        memcpy(part, qkv + r * Qg, sizeof(float) * (size_t)Qg);
                        gate_unpack(H, G, Dh, part, qkv + r * Q, gate + r * H * Dh);
                    }
                np = 0;
                for (int64_t r = 0; r < nr; r++) {
                    float *row = qkv + r * Q;
                    const int64_t i = seg[r0 + r];
                    if (r == 0 || i != seg[r0 + r - 1]) starts[np++] = r;
                    const float *cr = cos + (r0 + r) * Rc, *sr = sin + (r0 + r) * Rc;
                    attend_rotate(row, row + H * Dh, row + (H + G) * Dh, cr, sr, kc[i], vc[i], H, G, Dh,
                                  qkv_prepare(net, ly, row, cr, sr, pos[r0 + r]), segs[3 * i], pos[r0 + r],
                                  qr + r * H * Dh,
                                  (int)net->kv16);
                }
                starts[np] = nr;
            }
            float *pt = p + (int64_t)omp_get_thread_num() * ROW_GROUP * Smax;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < np * H; u++) {
                const int64_t a0 = starts[u / H], i = seg[r0 + a0];
                attend_rows_head(qr + a0 * H * Dh, kc[i], vc[i], H, G, Dh, Dh, segs[3 * i], pos[r0 + a0],
                                 starts[u / H + 1] - a0, ly->window, ly->chunk, net->scale, ly->sinks, pt,
                                 att + a0 * A, u % H, (int)net->kv16);
            }
            if (ly->gate) {
#pragma omp single
                gate_apply(att, gate, nr * H * Dh);
            }
        }
        if (!ly->dn) lin_product(&ly->o, att, nr, &a, tmp, &oom);
#pragma omp single
        {
            for (int64_t i = 0; i < nr * D; i++) x[r0 * D + i] = x[r0 * D + i] + tmp[i];
            rmsnorm_f32(x + r0 * D, ly->ffn_norm, ly->ffn_eps, h, nr, D);
        }
        if (ly->E) lin_product(&ly->router, h, nr, &a, probs, &oom);
#pragma omp single
        if (!oom) route_rows(net, ly, probs, r0, nr, ids, w, K, choice, masked, tokens);
    }
    free(h), free(qkv), free(part), free(att), free(tmp), free(qr), free(p), free(probs), free(choice), free(masked);
    free(seg), free(gate);
    dn_buf_free(&dn);
    latent_rows_free(&lb);
    return oom ? -1 : 0;
}

/* The final norm and the output product of n rows x (n, D) into logits (n, V), by the team: each row
 * as `decode_head` computes it. Returns 0; -1 where memory was short. */
int prefill_head(const Net *net, const float *x, int64_t n, float *logits, int threads) {
    const int64_t D = net->D, N = net->hc > 1 ? net->hc : 1;
    float *h = malloc(sizeof(float) * (size_t)(PREFILL_ROWS * D));
    V4Buf b = {0};
    Acts a;
    int oom = !h || (N > 1 && !v4_buf_new(net, 1, PREFILL_ROWS, &b));
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < n && !oom; r0 += PREFILL_ROWS) {
        const int64_t nr = n - r0 < PREFILL_ROWS ? n - r0 : PREFILL_ROWS;
        if (N > 1) hc_rows(net, &net->hc_head, 1, x + r0 * N * D, nr, &b, &a, &oom); /* the streams collapsed */
#pragma omp single
        rmsnorm_f32(N > 1 ? b.col : x + r0 * D, net->norm, net->norm_eps, h, nr, D);
        lin_product(&net->head, h, nr, &a, logits + r0 * net->head.O, &oom);
    }
    free(h);
    v4_buf_free(&b);
    return oom ? -1 : 0;
}

/* y (n, O) = one product `l` of n rows x (n, I), its bias added, by the team: the products' arithmetic
 * outside a layer (a multi-token-prediction layer's input projection). Returns 0; -1 where memory was short. */
int lin_rows(const Lin *l, const float *x, int64_t n, float *y, int threads) {
    Acts a;
    int oom = 0;
#pragma omp parallel num_threads(threads)
    lin_product(l, x, n, &a, y, &oom);
    return oom ? -1 : 0;
}

static int rows_new(const Net *net, int64_t T, int64_t K, Rows *p) {
    const int64_t D = net->D, F = net->F, R = PREFILL_ROWS;
    memset(p, 0, sizeof(*p));
    p->hb = malloc(sizeof(float) * (size_t)(R * D));
    p->yb = malloc(sizeof(float) * (size_t)(R * D));
    p->hg = malloc(sizeof(float) * (size_t)(R * 2 * F));
    p->hu = malloc(sizeof(float) * (size_t)(R * F));
    p->rows = malloc(sizeof(int64_t) * (size_t)(T * K + 1));
    return p->hb && p->yb && p->hg && p->hu && p->rows;
}

static void rows_free(Rows *p) {
    free(p->hb), free(p->yb), free(p->hg), free(p->hu), free(p->rows);
}

/* s (T, D) += w * expert(h) over the (position, k) of ids (T, K) whose expert is one of list[0..n)
 * (pointed at in the layer's `experts`; a dense layer: list {0}). 0, or -1 where memory was short. */
int prefill_experts(const Net *net, int64_t l, const float *h, float *s, int64_t T, const int64_t *ids,
                    const float *w, const int64_t *list, int64_t n, int threads) {
    const Layer *ly = net->layers + l;
    const int64_t D = net->D, K = ly->E ? net->top_k : 1;
    const int scaled = ly->E && net->router == 3;
    Rows p;
    if (!rows_new(net, T, K, &p)) return rows_free(&p), -1;
    int64_t count = 0;
#pragma omp parallel num_threads(threads)
    for (int64_t i = 0; i < n && !p.oom; i++) {
#pragma omp barrier /* every thread is done with the last expert's count before it is taken again */
#pragma omp single
        {
            count = 0;
            for (int64_t t = 0; t < T * K; t++)
                if (ids[t] == list[i]) p.rows[count++] = t;
        }
        for (int64_t r0 = 0; r0 < count && !p.oom; r0 += PREFILL_ROWS) {
            const int64_t nr = count - r0 < PREFILL_ROWS ? count - r0 : PREFILL_ROWS;
#pragma omp for schedule(static)
            for (int64_t j = 0; j < nr; j++) {
                const int64_t t = p.rows[r0 + j];
                if (scaled) /* the router's weight scales the expert's input (decode_step.c's `experts`) */
                    for (int64_t c = 0; c < D; c++) p.hb[j * D + c] = h[t / K * D + c] * w[t];
                else
                    memcpy(p.hb + j * D, h + t / K * D, sizeof(float) * (size_t)D);
            }
            expert_rows(net, ly->experts + list[i], nr, &p);
            /* an expert's rows are distinct positions (a position chooses an expert once): split over the team */
#pragma omp for schedule(static)
            for (int64_t j = 0; j < (p.oom ? 0 : nr); j++) {
                const int64_t t = p.rows[r0 + j];
                float *st = s + t / K * D, wt = scaled ? 1.0f : w[t];
                for (int64_t c = 0; c < D; c++) st[c] += p.yb[j * D + c] * wt;
            }
        }
    }
    int rc = p.oom ? -1 : 0;
    rows_free(&p);
    return rc;
}

/* prefill_finish with hyper-connections: the block's output s (the routed experts' sum, then the shared expert's
 * added) merged into the streams x (T, N D) by the weights their collapse into h gave (made again from x) */
static int hc_prefill_finish(const Net *net, const Layer *ly, float *x, const float *h, float *s, int64_t T,
                             int threads) {
    const int64_t D = net->D, N = net->hc;
    Rows p;
    V4Buf b;
    int oom = !rows_new(net, 1, 1, &p) || !v4_buf_new(net, 1, PREFILL_ROWS, &b);
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < T && !oom && !p.oom; r0 += PREFILL_ROWS) {
        const int64_t nr = T - r0 < PREFILL_ROWS ? T - r0 : PREFILL_ROWS;
        if (ly->shared) { /* the shared expert, as decoding adds it after the routed sum */
#pragma omp single
            memcpy(p.hb, h + r0 * D, sizeof(float) * (size_t)(nr * D));
            expert_rows(net, ly->shared, nr, &p);
#pragma omp single
            for (int64_t j = 0; j < nr && !p.oom; j++) {
                const float *yj = p.yb + j * D, one = 1.0f;
                moe_combine_f32(s + (r0 + j) * D, &yj, &one, 1, D);
            }
        }
        hc_rows(net, &ly->hc_ffn, 0, x + r0 * N * D, nr, &b, &p.a, &oom);
        hc_merge_rows(net, s + r0 * D, x + r0 * N * D, oom || p.oom ? 0 : nr, &b);
    }
    oom = oom || p.oom;
    rows_free(&p);
    v4_buf_free(&b);
    return oom ? -1 : 0;
}

/* x (T, D) += s, then the layer's shared expert on h, times sigmoid(shared_gate h) where it has a
 * gate, as decoding adds it. 0, or -1 where memory was short. */
int prefill_finish(const Net *net, int64_t l, float *x, const float *h, float *s, int64_t T, int threads) {
    const Layer *ly = net->layers + l;
    const int64_t D = net->D;
    if (net->hc > 1)
        return hc_prefill_finish(net, ly, x, h, s, T, threads);
    for (int64_t i = 0; i < T * D; i++) x[i] = x[i] + s[i];
    if (!ly->shared) return 0;
    Rows p;
    float gate[PREFILL_ROWS];
    if (!rows_new(net, 1, 1, &p)) return rows_free(&p), -1;
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < T && !p.oom; r0 += PREFILL_ROWS) {
        const int64_t nr = T - r0 < PREFILL_ROWS ? T - r0 : PREFILL_ROWS;
#pragma omp single
        memcpy(p.hb, h + r0 * D, sizeof(float) * (size_t)(nr * D));
        expert_rows(net, ly->shared, nr, &p);
        if (ly->shared_gate.O && !p.oom) lin_product(&ly->shared_gate, p.hb, nr, &p.a, gate, &p.oom);
#pragma omp single
        for (int64_t j = 0; j < nr && !p.oom; j++) {
            float g = ly->shared_gate.O ? 1.0f / (1.0f + expf(-gate[j])) : 1.0f;
            const float *yj = p.yb + j * D;
            moe_combine_f32(x + (r0 + j) * D, &yj, &g, 1, D);
        }
    }
    int rc = p.oom ? -1 : 0;
    rows_free(&p);
    return rc;
}
