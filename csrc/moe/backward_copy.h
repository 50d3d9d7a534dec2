// The backward copy: BF16 expert weights packed once more, in the tile unit's B-operand layout of the backward's
// axpy products (dx = dg·Wg + du·Wu, dh = dout·Wd). Without it every backward packs each item's weight panel from
// the rows (interleaving pairs of rows), which took about half of the backward's tile products at the DeepSeek-V3
// layer (BENCHMARKS.md). Opt-in: it doubles the experts' RAM (the peer kt-kernel keeps such a copy always).
//
// Layout of one projection's matrix W [out, in], reduced over its rows (k < out) into its columns (n < in):
// block columns j < 2·ceil(in/32) of 16 columns, reduction blocks kc < ceil(out/32) of 32 rows; tile (j, kc) is
// 512 BF16 at (j·ceil(out/32) + kc)·512, tile row q holding rows 32·kc + 2q and + 1 interleaved over its 16
// columns, zeros past `in` and `out`. A pair of block columns (32 columns from 32·(j/2)) keeps unpack_pair's
// order (tile_body.h): slot s of block column j is column 32·(j/2) + 8·(s/4) + 4·(j%2) + s%4.
//   gate_up copy [E, 2, 2·ceil(H/32)·ceil(I/32)·512]: gate's matrix [I, H], then up's ([E, 1, ...]: up's alone
//   for experts without a gate)
//   down copy    [E, 2·ceil(I/32)·ceil(H/32)·512]:    down's matrix [H, I]
#pragma once
#include "experts.h"
#include "runtime.h"

namespace kt {

// BF16 elements of one projection's packed matrix.
long backward_copy_elems(long out, long in);

// Reduction block kc (rows 32·kc .. 32·kc + 31) of the row-major matrix w [out, in] into its tiles of every block
// column of `matrix`, one projection's packed matrix in the layout above.
void pack_backward_block(const bf16* w, long out, long in, long kc, bf16* matrix);

// Packs the engine's BF16 weights into `copy` (bfloat16 tensors of the shapes above) on the engine's threads.
void pack_backward_copy(const MoeExperts& experts, const BackwardCopy& copy, Runtime& rt);

// Checks that `copy` has the shapes of these experts' copy.
void check_backward_copy(const MoeExperts& experts, const BackwardCopy& copy);

// Reduction blocks (of 32 rows) of projection p's matrix: the stride, in tiles, between its block columns.
long backward_copy_blocks(const MoeExperts& experts, int p);

// Expert e's projection p in the copy, from block column col0 / 16 on (col0 a multiple of 32).
const bf16* backward_copy_at(const MoeExperts& experts, const BackwardCopy& copy, int e, int p, long col0);

}  // namespace kt
