/* The routers' choice of experts from a row's logits (decode_abi.h's `Net.router`), shared by decode_step.c's
 * step and prefill.c's prompt pass. */
#include "lin.h"

/* the index of the largest of E values not yet in ids[0..k) and not masked (the lower index first among equals) */
static int64_t best_of(const float *v, int64_t E, const int64_t *ids, int64_t k, const unsigned char *masked) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++) {
        int taken = masked && masked[e];
        for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
        if (!taken && (best < 0 || v[e] > v[best])) best = e;
    }
    return best;
}

static void softmax_inplace(float *p, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < n; e++) mx = fmaxf(mx, p[e]);
    for (int64_t e = 0; e < n; e++) sum += (p[e] = expf(p[e] - mx));
    for (int64_t e = 0; e < n; e++) p[e] = p[e] / sum;
}

/* The router's choice from its E logits p (overwritten; `choice`: E floats of room, `masked` E
 * bytes), as `semoe.model.routing` routes: top_k ids and their weights. Softmax then top-k (renormalised
 * with norm); top-k of the logits then softmax over them, or their sigmoids; or grouped: softmax or sigmoid scores,
 * chosen on scores + correction among the best topk_group of n_group groups, or by `token`'s row of the
 * layer's hash table, weighted by their scores (renormalised with norm) times routed_scale. */
void route(const Net *net, const Layer *ly, float *p, float *choice, unsigned char *masked, int64_t *ids,
                  float *w, int64_t token) {
    const int64_t E = ly->E, K = net->top_k;
    if (net->router == 3) { /* the top-k logits' sigmoids (they scale the experts' input: `experts`) */
        for (int64_t k = 0; k < K; k++) w[k] = p[ids[k] = best_of(p, E, ids, k, NULL)];
        for (int64_t k = 0; k < K; k++) w[k] = 1.0f / (1.0f + expf(-w[k]));
        return;
    }
    if (net->router == 1) {
        for (int64_t k = 0; k < K; k++) w[k] = p[ids[k] = best_of(p, E, ids, k, NULL)];
        softmax_inplace(w, K);
        return;
    }
    if (net->router == 0 || !net->sigmoid_scores)
        softmax_inplace(p, E);
    else if (net->sigmoid_scores == 2) /* sqrt(softplus), softplus as torch's: x itself past 20 */
        for (int64_t e = 0; e < E; e++) p[e] = sqrtf(p[e] > 20.0f ? p[e] : log1pf(expf(p[e])));
    else
        for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
    const float *c = p;
    unsigned char *m = NULL; /* the experts of the groups not kept */
    if (ly->tid2eid && token >= 0) /* hash routing: the token's experts from the table, weighed by their scores */
        for (int64_t k = 0; k < K; k++) w[k] = p[ids[k] = ly->tid2eid[token * K + k]];
    else if (net->router == 2) {
        for (int64_t e = 0; e < E; e++) choice[e] = ly->correction ? p[e] + ly->correction[e] : p[e];
        c = choice;
        int64_t n = net->n_group, ge = E / n;
        if (n > 1) {
            float gs[256];
            int64_t gids[256];
            for (int64_t g = 0; g < n && g < 256; g++) {
                int64_t a = best_of(c + g * ge, ge, NULL, 0, NULL), b = -1;
                if (net->group_top2 && ge > 1) b = best_of(c + g * ge, ge, &a, 1, NULL);
                gs[g] = c[g * ge + a] + (b >= 0 ? c[g * ge + b] : 0.0f);
            }
            for (int64_t t = 0; t < net->topk_group; t++) gids[t] = best_of(gs, n, gids, t, NULL);
            m = masked;
            for (int64_t g = 0; g < n; g++) {
                int keep = 0;
                for (int64_t t = 0; t < net->topk_group; t++) keep |= gids[t] == g;
                for (int64_t e = g * ge; e < (g + 1) * ge; e++) m[e] = (unsigned char)!keep;
            }
        }
    }
    if (!ly->tid2eid || token < 0)
        for (int64_t k = 0; k < K; k++) w[k] = p[ids[k] = best_of(c, E, ids, k, m)];
    if (net->norm_topk) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) sum += w[k];
        if (net->router == 2) sum += 1e-20f;
        for (int64_t k = 0; k < K; k++) w[k] = w[k] / sum;
    }
    if (net->router == 2)
        for (int64_t k = 0; k < K; k++) w[k] = w[k] * net->routed_scale;
}
