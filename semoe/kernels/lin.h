/* One `Lin` (decode_abi.h) of any kind as block products over M rows of x, for decode_step.c's step
 * (M = 1) and prefill.c's prompt pass: `lin_blocks` blocks of output rows, each computed for all M
 * rows by `lin_block` into y (M, O); integer kinds read x quantized in `a` (M rows), the others x
 * itself. Every row is the arithmetic of a one-row product: the block kernels loop over the rows. */
#ifndef SEMOE_LIN_H
#define SEMOE_LIN_H

#include "kernels.h"
#include "decode_abi.h"

int lin_quantized(const Lin *l);
int64_t lin_blocks(const Lin *l);
void lin_block(const Lin *l, const float *x, int64_t M, const Acts *a, float *y, int64_t b);
/* the M rows of x quantized into a for l's integer kernel, where it takes them (a zeroed otherwise);
 * *oom set where the buffers could not be had; lin_acts_done frees them either way */
void lin_acts(const Lin *l, const float *x, int64_t M, Acts *a, int *oom);
void lin_acts_done(const Lin *l, Acts *a);
void lin_acts_alloc(const Lin *l, int64_t M, Acts *a, int *oom);
/* lin_acts by the whole team (every thread calls it): M rows of two or more split over the threads */
void lin_acts_team(const Lin *l, const float *x, int64_t M, Acts *a, int *oom);
/* y (M, O) = l(x) for M rows, by the whole team (every thread calls it), its bias added */
void lin_product(const Lin *l, const float *x, int64_t M, Acts *a, float *y, int *oom);
/* decode_step.c's per-position steps that prefill.c's prompt pass shares: q, k and v's norms and
 * clipping (and rotation where attend_rotate's does not apply, the temperature at position pos), and
 * the router's choice from its logits p (overwritten; choice: E floats, masked E bytes) */
/* the indexer's key of a position as its cache keeps it, and its query heads and weights as scored
 * (decode_step.c) */
void index_key(const Latent *m, int64_t R, const float *ik, const float *cos, const float *sin, float *k);
void index_query(const Indexer *ix, int64_t R, float *iq, float *iw, const float *cos, const float *sin);
int64_t qkv_prepare(const Net *net, const Layer *ly, float *qkv, const float *cos, const float *sin, int64_t pos);
void route(const Net *net, const Layer *ly, float *p, float *choice, unsigned char *masked, int64_t *ids, float *w,
           int64_t token);

/* Gated DeltaNet's buffers for up to `rows` rows (deltanet.c), sized for the largest such layer of a Net */
typedef struct {
    float *raw, *braw, *mixed, *z, *bb, *aa, *o;
    int64_t rows;
} DnBuf;

/* the buffers for `rows` rows of net's Gated DeltaNet layers (none where it has none); 0 where memory
 * for them could not be had (dn_buf_free frees what was had, either way) */
int dn_buf_new(const Net *net, int64_t rows, DnBuf *b);
void dn_buf_free(DnBuf *b);
/* layer ly's Gated DeltaNet (`DeltaNet`) on nr normed rows h (nr, D) into out (nr, D) by the team: row r of
 * the sequence seg[r] at position pos[r] (0: its state starts from zeros), whose state is kc[seg[r]]
 * (the convolution's) and vc[seg[r]] (the delta rule's), advanced row by row in order */
void deltanet_rows(const Layer *ly, const float *h, int64_t nr, const int64_t *seg, const int64_t *pos,
                   void *const *kc, void *const *vc, DnBuf *b, Acts *a, float *out, int *oom);
/* q's product (2 H Dh: each head's query, then its gate) and k, v after it in qg, unpacked into qkv (q,
 * k, v) and gate (H Dh): a gated attention layer's (`Layer.gate`) */
void gate_unpack(int64_t H, int64_t G, int64_t Dh, const float *qg, float *qkv, float *gate);
/* att (n) times sigmoid(gate), in place */
void gate_apply(float *att, const float *gate, int64_t n);

/* DeepSeek-V4's buffers for up to `rows` rows (compressed.c), sized for the largest layer of a Net and a cache
 * of S positions: attention's (qa .. chosen) and the hyper-connections' (hx .. comb: the last `hc_rows`'
 * weights post and comb, col its collapsed inputs, y a block's outputs), a row's after another's */
typedef struct {
    float *qa, *q, *kv, *ckv, *cg, *ickv, *icg, *iq, *iw, *isc, *isel, *p, *z, *zg, *att, *grp, *tmp;
    int32_t *chosen;
    int64_t nchosen, rows;
    float *hx, *mix, *col, *y, *post, *comb;
} V4Buf;

/* the buffers for net, S positions and `rows` rows (none where it has no such layer); 0 where memory could
 * not be had (v4_buf_free frees what was had, either way) */
int v4_buf_new(const Net *net, int64_t S, int64_t rows, V4Buf *b);
void v4_buf_free(V4Buf *b);
/* layer ly's DeepSeek-V4 attention of nr normed rows h (nr, D) into out (nr, D), by the team: row r of the
 * sequence seg[r] at position pos[r], whose state is kc[seg[r]] and entries vc[seg[r]] (`Compressed`) for
 * caps[seg[r]] positions, advanced row by row in order; v4_attend: one row of one sequence */
void v4_rows(const Net *net, const Layer *ly, const float *h, int64_t nr, const int64_t *seg, const int64_t *pos,
             void *const *kc, void *const *vc, const int64_t *caps, V4Buf *b, Acts *a, float *out, int *oom);
void v4_attend(const Net *net, const Layer *ly, const float *h, float *kc, float *ent, int64_t S, int64_t pos,
               V4Buf *b, Acts *a, float *out, int *oom);
/* the hyper-connection hy's weights for nr rows of streams X (nr, N D) into b->post (nr, N) and b->comb
 * (nr, N, N), and the blocks' inputs into b->col (nr, D), by the team; `head`: `Net.hc_head`, its inputs
 * alone. hc_merge_rows: X = post y + comb^T X for each row of y (nr, D), by the team */
void hc_rows(const Net *net, const Hyper *hy, int head, const float *X, int64_t nr, V4Buf *b, Acts *a, int *oom);
void hc_merge_rows(const Net *net, const float *y, float *X, int64_t nr, V4Buf *b);

/* expert e's activation of its hidden unit j: SwiGLU's g[j] = silu(g[j]) * u[j] (g, u: the gate and up
 * outputs); where gate is gate_up (up.O = 0), into u[j]: SwiGLU of its halves g[j] and g[F + j]
 * (`Net.halves`), or gpt-oss's clamped one of g[2j] and g[2j + 1] with its bias (`Net.alpha`, `Net.limit`) */
static inline void expert_act(const Net *net, const Expert *e, float *g, float *u, int64_t j) {
    if (e->up.O == 0 && net->halves) {
        const float gv = g[j];
        u[j] = gv / (1.0f + expf(-gv)) * g[e->gate.O / 2 + j];
    } else if (e->up.O == 0) {
        const float *b = e->gate.bias, lim = net->limit;
        float gv = g[2 * j] + (b ? b[2 * j] : 0.0f), uv = g[2 * j + 1] + (b ? b[2 * j + 1] : 0.0f);
        gv = fminf(gv, lim);
        uv = fminf(fmaxf(uv, -lim), lim);
        u[j] = (uv + 1.0f) * gv * (1.0f / (1.0f + expf(-(gv * net->alpha))));
    } else if (net->limited) {
        const float gv = fminf(g[j], net->limit);
        g[j] = gv / (1.0f + expf(-gv)) * fminf(fmaxf(u[j], -net->limit), net->limit);
    } else {
        g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

#endif
