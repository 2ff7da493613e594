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
/* decode_step.c's per-position steps that prefill.c's prompt pass shares: q, k and v's norms and
 * clipping, and the router's choice from its logits p (overwritten; choice: E floats, masked E bytes) */
void qkv_prepare(const Layer *ly, float *qkv, int64_t H, int64_t G, int64_t Dh);
void route(const Net *net, const Layer *ly, float *p, float *choice, unsigned char *masked, int64_t *ids, float *w);

#endif
