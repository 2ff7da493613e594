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

#endif
