/* decode_abi.h's layouts, for the loader's check against its ctypes mirrors (semoe/kernels/loader.py):
 * each structure's size and its fields' offsets, by name. */
#include "lin.h"

#include <stddef.h>

#define FIELDS(T, ...)                                                                                            \
    if (!strcmp(name, #T)) {                                                                                      \
        const int64_t offs[] = {__VA_ARGS__};                                                                     \
        *n = (int64_t)(sizeof(offs) / sizeof(offs[0]));                                                           \
        for (int64_t i = 0; i < *n && i < cap; i++) offsets[i] = offs[i];                                         \
        return (int64_t)sizeof(T);                                                                                \
    }
#define OFF(T, f) (int64_t) offsetof(T, f)

int64_t semoe_abi_layout(const char *name, int64_t *offsets, int64_t cap, int64_t *n) {
    FIELDS(Lin, OFF(Lin, kind), OFF(Lin, O), OFF(Lin, I), OFF(Lin, g), OFF(Lin, w), OFF(Lin, s), OFF(Lin, bias))
    FIELDS(Expert, OFF(Expert, gate), OFF(Expert, up), OFF(Expert, down))
    FIELDS(Latent, OFF(Latent, q_a), OFF(Latent, q_b), OFF(Latent, kv_a), OFF(Latent, q_norm), OFF(Latent, kv_norm),
           OFF(Latent, eps), OFF(Latent, scale), OFF(Latent, w_ukT), OFF(Latent, w_uv), OFF(Latent, nope),
           OFF(Latent, L), OFF(Latent, dv), OFF(Latent, interleave), OFF(Latent, index), OFF(Latent, topk),
           OFF(Latent, Di))
    FIELDS(Indexer, OFF(Indexer, wq), OFF(Indexer, wk), OFF(Indexer, wp), OFF(Indexer, k_norm), OFF(Indexer, k_bias),
           OFF(Indexer, Hi), OFF(Indexer, Di), OFF(Indexer, interleave))
    FIELDS(Layer, OFF(Layer, attn_norm), OFF(Layer, ffn_norm), OFF(Layer, attn_eps), OFF(Layer, ffn_eps),
           OFF(Layer, n_qkv), OFF(Layer, window), OFF(Layer, qk_norm), OFF(Layer, q_norm), OFF(Layer, k_norm),
           OFF(Layer, norope), OFF(Layer, chunk), OFF(Layer, temp_scale), OFF(Layer, temp_floor), OFF(Layer, qk_eps),
           OFF(Layer, clip), OFF(Layer, sinks), OFF(Layer, qkv), OFF(Layer, o), OFF(Layer, mla), OFF(Layer, E),
           OFF(Layer, router), OFF(Layer, correction), OFF(Layer, experts), OFF(Layer, shared), OFF(Layer, shared_gate),
           OFF(Layer, dn), OFF(Layer, gate), OFF(Layer, v4), OFF(Layer, hc_attn), OFF(Layer, hc_ffn), OFF(Layer, tid2eid))
    FIELDS(Compressor, OFF(Compressor, wkv), OFF(Compressor, wgate), OFF(Compressor, ape), OFF(Compressor, norm),
           OFF(Compressor, m), OFF(Compressor, dim), OFF(Compressor, overlap))
    FIELDS(Compressed, OFF(Compressed, wq_a), OFF(Compressed, wq_b), OFF(Compressed, wkv), OFF(Compressed, wo_b),
           OFF(Compressed, iwq), OFF(Compressed, iwp), OFF(Compressed, wo_a), OFF(Compressed, q_norm),
           OFF(Compressed, kv_norm), OFF(Compressed, sinks), OFF(Compressed, inv_freq), OFF(Compressed, index_inv_freq),
           OFF(Compressed, eps), OFF(Compressed, rope_scale), OFF(Compressed, index_scale), OFF(Compressed, W),
           OFF(Compressed, r), OFF(Compressed, o_groups), OFF(Compressed, Hi), OFF(Compressed, Di), OFF(Compressed, topk),
           OFF(Compressed, comp), OFF(Compressed, icomp))
    FIELDS(Hyper, OFF(Hyper, fn), OFF(Hyper, base), OFF(Hyper, scale))
    FIELDS(DeltaNet, OFF(DeltaNet, in), OFF(DeltaNet, n_in), OFF(DeltaNet, nk), OFF(DeltaNet, nv), OFF(DeltaNet, dk),
           OFF(DeltaNet, dv), OFF(DeltaNet, K), OFF(DeltaNet, conv), OFF(DeltaNet, dt_bias), OFF(DeltaNet, A_log),
           OFF(DeltaNet, norm), OFF(DeltaNet, eps))
    FIELDS(Net, OFF(Net, L), OFF(Net, D), OFF(Net, H), OFF(Net, G), OFF(Net, Dh), OFF(Net, R), OFF(Net, F), OFF(Net, E),
           OFF(Net, top_k), OFF(Net, norm_topk), OFF(Net, router), OFF(Net, sigmoid_scores), OFF(Net, n_group),
           OFF(Net, topk_group), OFF(Net, group_top2), OFF(Net, kv16), OFF(Net, rope_pairs), OFF(Net, halves), OFF(Net, routed_scale),
           OFF(Net, alpha),
           OFF(Net, limit), OFF(Net, limited), OFF(Net, hc), OFF(Net, hc_iters), OFF(Net, hc_eps), OFF(Net, hc_head),
           OFF(Net, scale), OFF(Net, norm_eps),
           OFF(Net, norm), OFF(Net, layers), OFF(Net, head))
    *n = 0;
    return -1;
}
