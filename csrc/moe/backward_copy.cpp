#include "backward_copy.h"

#include <string>

namespace kt {

namespace {

constexpr long kTile = 512;  // BF16 elements of a 16×32 tile

long blocks32(long n) { return (n + 31) / 32; }

// Rows [out] × columns [in] of a projection, as its copy is indexed.
void dims(const MoeExperts& m, int p, long& out, long& in) {
  out = p == DOWN ? m.H() : m.I();
  in = p == DOWN ? m.I() : m.H();
}

}  // namespace

long backward_copy_elems(long out, long in) { return 2 * blocks32(in) * blocks32(out) * kTile; }

void pack_backward_block(const bf16* w, long out, long in, long kc, bf16* matrix) {
  const long blocks = blocks32(out);
  for (long j = 0; j < 2 * blocks32(in); ++j) {
    bf16* tile = matrix + (j * blocks + kc) * kTile;
    for (int q = 0; q < 16; ++q)
      for (int s = 0; s < 16; ++s) {
        const long col = 32 * (j / 2) + 8 * (s / 4) + 4 * (j % 2) + s % 4;
        for (int t = 0; t < 2; ++t) {
          const long row = 32 * kc + 2 * q + t;
          tile[q * 32 + 2 * s + t] = row < out && col < in ? w[row * in + col] : bf16(0);
        }
      }
  }
}

long backward_copy_blocks(const MoeExperts& m, int p) {
  long out, in;
  dims(m, p, out, in);
  return blocks32(out);
}

void check_backward_copy(const MoeExperts& m, const BackwardCopy& copy) {
  if (m.format() != Format::bf16)
    throw std::invalid_argument(std::string("the backward copy is for BF16 experts, but these are ") +
                                format_name(m.format()) + "; train without KT_SFT_BACKWARD_COPY.");
  expect(copy.gate_up, "backward copy of gate_up", DType::bf16,
         {m.E(), m.stacked(), backward_copy_elems(m.I(), m.H())});
  expect(copy.down, "backward copy of down", DType::bf16, {m.E(), backward_copy_elems(m.H(), m.I())});
}

const bf16* backward_copy_at(const MoeExperts& m, const BackwardCopy& copy, int e, int p, long col0) {
  long out, in;
  dims(m, p, out, in);
  const bf16* matrix = p == DOWN ? copy.down.as<bf16>() + e * backward_copy_elems(out, in)
                                 : copy.gate_up.as<bf16>() + (long(m.stacked()) * e + m.stack_index(p)) *
                                                                    backward_copy_elems(out, in);
  return matrix + (col0 / 16) * blocks32(out) * kTile;
}

void pack_backward_copy(const MoeExperts& m, const BackwardCopy& copy, Runtime& rt) {
  check_backward_copy(m, copy);
  // One work item per (expert, projection, reduction block): its 32 rows read once, contiguously, into their
  // tiles of every block column.
  // Without a gate (up's rows alone in gate_up) gate has none.
  const long blocks[3] = {m.glu().gated ? backward_copy_blocks(m, GATE) : 0, backward_copy_blocks(m, UP),
                          backward_copy_blocks(m, DOWN)};
  const long per_expert = blocks[GATE] + blocks[UP] + blocks[DOWN];
  rt.parallel_for(m.E() * per_expert, [&](long item, int) {
    const int e = int(item / per_expert);
    long kc = item % per_expert;
    int p = GATE;
    while (kc >= blocks[p]) kc -= blocks[p++];
    long out, in;
    dims(m, p, out, in);
    const bf16* w = p == DOWN ? m.weights().down.as<bf16>() + long(e) * out * in
                              : m.weights().gate_up.as<bf16>() + (long(m.stacked()) * e + m.stack_index(p)) * out * in;
    pack_backward_block(w, out, in, kc, const_cast<bf16*>(backward_copy_at(m, copy, e, p, 0)));
  });
}

}  // namespace kt
