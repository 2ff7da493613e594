/* The structures decode_step.c's whole-step calls take, the one place they are declared: Python
 * mirrors them with ctypes in semoe/kernels/loader.py, and `semoe_abi_layout` reports each one's size
 * and its fields' offsets, which the loader checks against ctypes' before anything is called, so a
 * struct changed on one side only is an error at load, not memory read at the wrong place. */
#ifndef SEMOE_DECODE_ABI_H
#define SEMOE_DECODE_ABI_H

#include <stdint.h>

enum { W_F32 = 1, W_BF16 = 2, W_INT8 = 3, W_INT4 = 4, W_MXFP4 = 5, W_F32_IO = 6, W_BF16_IO = 7, W_FP8 = 8,
       W_GGML = 9 }; /* Lin.kind */

/* y (O) = W x (+ bias): W (O, I) float32, bfloat16, int8 codes with scales (O), int4 codes with
 * (scale, zero) pairs per group of g inputs, or MXFP4 blocks with their e8m0 exponents (uint8) in
 * place of scales (gemv.c's layouts), or FP8 (e4m3) codes with float32 scales per g x g block
 * (gemv_float.c's), or GGUF's blocks of ggml type g, rows one after another (gemv_ggml.c's); or W^T laid out (I, O), in-major, float32 or bfloat16 (gpt-oss's float experts) */
typedef struct {
    int64_t kind, O, I, g;
    const void *w;
    const float *s, *bias;
} Lin;

typedef struct {
    /* SwiGLU: gate and up (F, D) of one kind and group, down (D, F). up.O = 0: gate is gate_up (2F, D):
     * gpt-oss's clamped expert, gate j and up j the outputs 2j and 2j + 1, with its bias, down with its
     * bias; or, where `Net.halves`, SwiGLU with gate j and up j the outputs j and F + j (Llama-4) */
    Lin gate, up, down;
} Expert;

/* DeepSeek sparse attention's lightning indexer of a latent-attention layer (DeepSeek-V3.2, GLM-5): Hi
 * query heads of Di from the normed q_a by wq (Hi * Di, q_a.O), a key of Di from h by wk, normed
 * (LayerNorm with k_norm, k_bias, epsilon 1e-6), the first R dims of both rotated (pairs where
 * interleave), and Hi head weights from h by wp. A query's score of a position t is the sum over
 * heads of w_h / sqrt(Hi) * relu(q_h . k_t / sqrt(Di)); attention reads the `Latent.topk` best of the
 * positions the query sees. */
typedef struct {
    Lin wq, wk, wp;
    const float *k_norm, *k_bias;
    int64_t Hi, Di, interleave;
} Indexer;

/* DeepSeek's latent attention (MLA) of a layer, in its absorbed form over the latent cache (the
 * normed latent (L) and the rotated rotary key (R) of each position): q from h by q_b, or by q_a,
 * its norm and q_b where q_a.O > 0; H heads of nope + R values, their no-rope part taken into the
 * latent space by w_ukT (H, L, nope), the rotary part rotated; the latent and rotary key from h by
 * kv_a (L + R), the latent normed; each head's softmax over the cached positions of its scores
 * (times scale) weighs the latents, whose sum w_uv (H, dv, L) takes out to the head's values */
typedef struct {
    Lin q_a, q_b, kv_a;
    const float *q_norm, *kv_norm; /* q_a's RMSNorm weight (q_a.O values), the latent's (L) */
    float eps, scale;
    const float *w_ukT, *w_uv; /* float32 */
    int64_t nope, L, dv, interleave; /* interleave: rotary over pairs (2i, 2i + 1) */
    /* DeepSeek sparse attention: topk > 0 reads the topk positions the indexer scores best, whose
     * rotated keys of Di follow each position's rotary key in its cache (rows of R + Di); `index` NULL:
     * the layer has no indexer of its own (GLM-5's shared layers; zeros in its cache's index keys) and
     * reads the positions the last layer with one chose in the same step */
    const Indexer *index;
    int64_t topk, Di;
} Latent;

/* Gated DeltaNet linear attention of a layer (Qwen3-Next, Qwen3.5-MoE; semoe/model/linear_attention.py).
 * The input products `in`: n_in = 2, qkvz laid out per key-head group ([q dk | k dk | v per dv | z per dv],
 * per = nv / nk) and ba ([b per | a per] a group); n_in = 4, qkv ([q | k | v] over all heads), z, b, a.
 * The depthwise causal convolution conv (C, K) over q, k and v (C = 2 nk dk + nv dv channels), SiLU after;
 * keys and queries unit length (1e-6 under the root), queries over sqrt(dk); per value head the delta rule
 * with the decay exp(-exp(A_log) softplus(a + dt_bias)) and the write strength sigmoid(b); each head's
 * output RMS-normed (eps), times norm (dv) and SiLU(z); the Layer's `o` projects it out. The layer's
 * caches hold its state: kc the convolution's last K-1 inputs (C, K-1), vc each value head's state
 * (nv, dk, dv), float32; a row at position 0 starts from zeros. */
typedef struct {
    Lin in[4];
    int64_t n_in, nk, nv, dk, dv, K;
    const float *conv, *dt_bias, *A_log, *norm;
    float eps;
} DeltaNet;

/* One of DeepSeek-V4's compressors (semoe/model/compressed_attention.py's `Compressor`): every m tokens make
 * one entry of dim values, each dim the sum of the window's projections wkv under a softmax over its slots
 * of the gates wgate plus ape (m, width); with overlap, each token projects 2 dim (width), the first half
 * for the next window's entry, the second for its own, and an entry's softmax runs over 2m slots; the entry
 * RMS-normed (norm) and rotated at its window's first position. */
typedef struct {
    Lin wkv, wgate;
    const float *ape, *norm;
    int64_t m, dim, overlap;
} Compressor;

/* DeepSeek-V4's attention of a layer: q by the low rank wq_a, its norm q_norm, wq_b (H Dh), each head
 * RMS-normed without a weight; one key, also the value, by wkv, normed by kv_norm; the last 2 r dims of
 * both rotated by interleaved pairs (inv_freq, times rope_scale); a query reads its last W positions' keys,
 * and, where comp.m > 0, the compressed entries whose windows it has passed: all of them (HCA), or under
 * the lightning indexer (topk > 0, CSA) the topk best by the sum over its Hi heads of the weights (iwp's,
 * over sqrt(Hi)) times relu(q . k / sqrt(Di)), its queries of Di by iwq from the normed low rank and its
 * keys from icomp (both rotated with index_inv_freq, index_scale); a learnt sink per head joins each
 * softmax; the heads' output rotated back, then out in o_groups groups, each by its own wo_a[g] to a low
 * rank, and wo_b. The layer's caches: kc its fixed state (the window's keys by position modulo W, then
 * each compressor's tokens since its last entry and, with overlap, the first halves of its last full
 * window: decode_step.c's `v4_state`), vc its entries, a row of Dh + Di (the indexer's key after the
 * entry's) per m positions. */
typedef struct {
    Lin wq_a, wq_b, wkv, wo_b, iwq, iwp;
    const Lin *wo_a;
    const float *q_norm, *kv_norm, *sinks, *inv_freq, *index_inv_freq;
    float eps, rope_scale, index_scale;
    int64_t W, r, o_groups, Hi, Di, topk;
    Compressor comp, icomp;
} Compressed;

/* A hyper-connection around a block (semoe/model/hyper_connections.py): fn ((2 + N) N, N D) over the N
 * streams' unit-RMS row, then base and scale (3) to the pre, post and Sinkhorn-normalised comb weights;
 * `Net.hc_head`'s fn is (N, N D), its scale one value. */
typedef struct {
    Lin fn;
    const float *base, *scale;
} Hyper;

typedef struct {
    const float *attn_norm, *ffn_norm;
    float attn_eps, ffn_eps;
    int64_t n_qkv; /* q|k|v as one product or three */
    int64_t window; /* a query sees this many positions back, itself included; 0: all */
    int64_t qk_norm; /* RMSNorm of q and k after their products: 0 none, 1 over all heads, 2 per head;
                      * 3 per head after the rotation (Hunyuan); 4 the same without weights (Llama-4) */
    const float *q_norm, *k_norm; /* its weights: H * Dh and G * Dh values (1), or Dh each (2, 3) */
    int64_t norope; /* 1: q and k are neither rotated nor normed after (Llama-4's position-free layers),
                     * q scaled by the temperature where temp_floor > 0 */
    int64_t chunk; /* > 0: a query sees only the positions of its own chunk (p - p % chunk up to p) */
    float temp_scale, temp_floor; /* q times log1p(floor((p + 1) / temp_floor)) * temp_scale + 1 at position p */
    float qk_eps, clip; /* the norms' epsilon; clip > 0: q, k and v clamped to [-clip, clip] */
    const float *sinks; /* NULL, or H logits that join each head's softmax denominator */
    Lin qkv[3], o;
    const Latent *mla; /* NULL: grouped-query attention (n_qkv, qkv, the norms, window, sinks); else this */
    int64_t E; /* experts; 0: a dense SwiGLU layer in experts[0], no router */
    Lin router; /* its bias: the logits' (gpt-oss) */
    const float *correction; /* NULL, or E biases on the grouped router's choice alone (DeepSeek-V3) */
    const Expert *experts;
    const Expert *shared; /* NULL, or the shared expert, added to the routed experts' sum */
    Lin shared_gate; /* O = 1: the shared expert's output scaled by sigmoid(shared_gate h); O = 0: none */
    const DeltaNet *dn; /* NULL, or the layer's token mixer in place of attention (its `o` the output product) */
    int64_t gate; /* 1: q's product gives each head's query, then its output gate (Dh each); attention's
                   * output times sigmoid(gate) before `o` (Qwen3-Next) */
    const Compressed *v4; /* NULL, or the layer's DeepSeek-V4 attention in place of attention */
    Hyper hc_attn, hc_ffn; /* where `Net.hc` > 1: the hyper-connections around attention and the feed-forward */
    const int64_t *tid2eid; /* NULL, or (vocabulary, top_k): the experts of each token id (hash routing) */
} Layer;

typedef struct {
    int64_t L, D, H, G, Dh, R, F, E, top_k, norm_topk; /* R: rotated dims a head; F, E: the most of any layer */
    /* the routers: 0 softmax then top-k, 1 top-k then softmax, 2 grouped (DeepSeek, GLM-4.5: softmax or
     * sigmoid scores (sigmoid_scores 1; 2: sqrt(softplus), DeepSeek-V4), the best topk_group of n_group groups by their best score or best two summed), 3 the
     * top-k logits' sigmoids, which scale each chosen expert's input rather than its output (Llama-4) */
    int64_t router, sigmoid_scores, n_group, topk_group, group_top2;
    int64_t kv16; /* grouped-query attention's KV caches hold float16 (kernels.h's kv_get); else float32.
                   * Latent attention's caches are float32 either way. */
    int64_t rope_pairs; /* grouped-query attention rotates pairs (2i, 2i + 1) (ERNIE), written out as halves */
    int64_t halves; /* experts with up.O = 0 hold gate and up as the halves of gate (Llama-4), not gpt-oss's
                     * clamped pairs */
    float routed_scale; /* the chosen experts' weights times this (grouped) */
    float alpha, limit; /* clamped experts' act(g, u) = (clamp(u, +-limit) + 1) min(g, limit) sigmoid(alpha min(g, limit)) */
    int64_t limited; /* SwiGLU experts' act(g, u) = silu(min(g, limit)) clamp(u, +-limit) (DeepSeek-V4) */
    int64_t hc, hc_iters; /* residual streams (1: one, no hyper-connections) and Sinkhorn's rounds */
    float hc_eps;
    Hyper hc_head; /* the streams collapsed into one before the final norm */
    float scale, norm_eps;
    const float *norm;
    const Layer *layers;
    Lin head;
} Net;

/* The size of struct `name` ("Lin", "Expert", "Layer", "Net"), with its fields' offsets, in
 * declaration order, written to offsets[0..cap); the number of fields in *n; -1 for a name it
 * does not know. */
int64_t semoe_abi_layout(const char *name, int64_t *offsets, int64_t cap, int64_t *n);

#endif
