// One MoE layer's routed experts: E experts of SwiGLU with optional LoRA on gate, up and down.
//
// Legend: T tokens, H hidden, I intermediate, E experts, K top-k, r LoRA rank, N = T·K routed rows
// ("slots"), sorted by expert so each expert's rows are contiguous.
//
// Weights are held once, in the transformers 5.x fused layout, which is also the kernel layout:
// gate_up [E, 2I, H] (gate rows first) and down [E, H, I], row-major, in one of three formats (below).
// Forward reads them as x·Wᵀ (dot form); backward reads the very same rows as dy·W (axpy form): no
// transposed copy, unless the caller hands backward one (BackwardCopy, backward_copy.h: opt-in, 2× the RAM).
// Quantized weights stay quantized; the kernels decode tiles as they go.
//
// Per expert e, with s the LoRA scale:
//   g = x Wgᵀ + s (x Agᵀ) Bgᵀ + bg,  u = x Wuᵀ + s (x Auᵀ) Buᵀ + bu,  h = glu(g, u),  y = h Wdᵀ + s (h Adᵀ) Bdᵀ
// with glu the gated unit of kernels.h (silu(g)·u unless the experts are built with another Glu) and bg, bu the
// optional gate/up bias (GPT-OSS); a down bias is the caller's to add (it only shifts y). Experts without a gate
// (Glu::gated false, Nemotron-H's) have no g: h = relu(u)², and the stacks below hold up's rows alone (I where 2I
// is written), so gate_up is then up_proj [E, I, H].
//   out[t] = Σ_k w[t,k] · y_{e(t,k)}[t]
// LoRA: A_p [E, r, in_p], B_p [E, out_p, r], float32; any projection may have none.
#pragma once
#include <memory>
#include <vector>

#include "../kernels/kernels.h"
#include "lora_dropout.h"
#include "saved_pool.h"
#include "view.h"

namespace kt {

enum Proj { GATE = 0, UP = 1, DOWN = 2 };

const char* format_name(Format f);

// The expert weights as the caller holds them (the engine keeps views, never copies). The format follows
// from gate_up's dtype:
//   bfloat16       gate_up [E, 2I, H], down [E, H, I]; no scales
//   float8_e4m3fn  same shapes; scales float32 [E, 2, ceil(I/128), ceil(H/128)] (gate's blocks, then up's)
//                  and [E, ceil(H/128), ceil(I/128)]
//   int32 (INT4)   gate_up [E, 2I, ceil(H/8)], down [E, H, ceil(I/8)] packed words; scales bfloat16
//                  [E, 2I, ceil(H/32)] and [E, H, ceil(I/32)]
// gate_up_bias: none, or float32|bfloat16 [E, 2I] (gate's first), whatever the weights' format.
struct ExpertWeights {
  View gate_up, down, gate_up_scale, down_scale, gate_up_bias;
};

struct Lora {
  int r = 0;
  float scale = 0.f;
  View A[3], B[3];
  LoraDropout dropout;  // on the inputs of A (x for gate and up, h for down); training only
};

// Gradients: base-weight grads (float32 or bfloat16) ACCUMULATE into what they are given, as param.grad
// does across micro-batches (they are the size of the weights, so no second buffer is made for them);
// dx, dw and the LoRA A/B grads (float32) are OVERWRITTEN, experts without tokens getting zeros, so
// the caller need not zero-fill LoRA-sized buffers every step; a LoRA grad flagged in acc_A / acc_B is
// added into instead (gradient accumulation straight into param.grad).
struct Grads {
  View dx, dw;
  View dA[3], dB[3];
  bool acc_A[3] = {}, acc_B[3] = {};
  View d_gate_up, d_down;
  View d_gate_up_bias;  // float32 [E, 2I], accumulated as the base grads (any format: the bias is not quantized)
};

// The weights packed once more for the backward's products (backward_copy.h), or none (both absent).
struct BackwardCopy {
  View gate_up, down;
  bool empty() const { return gate_up.empty(); }
};

// The expert id of a (token, k) pair that no routed expert computes: LongCat-Flash's zero-computation experts,
// whose output (the token itself, weighted) the Python layer adds.
constexpr int64_t kNoExpert = -1;

// What forward keeps for backward (one layer, one step): routing, g and u, and the LoRA rank
// projections. Nothing here aliases the shared scratch.
struct Saved {
  int T = 0, K = 0;
  // offset: each expert's first slot, long so that slot × row width (r, I, H) never overflows; slot indices
  // themselves fit int (the Python layer refuses T·K ≥ 2^31).
  std::vector<long> offset;  // [E+1]
  std::vector<int> slot_token, slot_src, slot_of;  // [N], [N] (its t·K + k), [T*K]
  std::vector<float> slot_w;
  SavedBuffer g, u, z[3];
  size_t bytes = 0;
};

class MoeExperts {
 public:
  // Checks shapes and dtypes; quantized weights must have finite scales and (FP8) no NaN codes.
  MoeExperts(int E, int H, int I, const ExpertWeights& weights, const Glu& glu = {});
  int E() const { return E_; }
  Format format() const { return format_; }
  int H() const { return H_; }
  int I() const { return I_; }
  const ExpertWeights& weights() const { return w_; }
  const Glu& glu() const { return glu_; }
  // Projections in gate_up's stack per expert (gate and up, or up alone), and projection p's place in it.
  int stacked() const { return glu_.gated ? 2 : 1; }
  int stack_index(int p) const { return glu_.gated ? p : 0; }
  // The first projection read from x: GATE, or UP without a gate.
  int first_proj() const { return glu_.gated ? GATE : UP; }

  // x [T, H] float32|bfloat16, idx [T, K] int64, w [T, K] float32, out [T, H] same dtype as x.
  // With save, returns what backward needs; without (inference), returns null and keeps nothing.
  std::shared_ptr<Saved> forward(const View& x, const View& idx, const View& w, const View& out, const Lora& lora,
                                 bool save) const;
  // dout [T, H] same dtype as x.
  // copy: BF16 weights only; checked against these experts' shapes.
  void backward(const Saved& saved, const View& x, const View& dout, const Lora& lora, const Grads& grads,
                const BackwardCopy& copy = {}) const;

  // Scratch floats a call with these sizes uses (the formula of the README's workspace section).
  static size_t scratch_floats(long T, long K, long E, long H, long I, long r, int threads);

 private:
  void check_lora(const Lora& lora) const;
  void check_finite_weights() const;
  // Calls f(rows) with expert e's projection p as kernel rows (Rows<bf16|fp8_block|int4_group>), kernel
  // row 0 being the projection's row `row0`.
  template <class F>
  void with_rows(int e, int p, long row0, F&& f) const;
  // Expert e's rows [row0, row0 + rows) of projection p, columns [col0, col0 + cols), as the bytes (their
  // codes) that a tile product requests ahead for the product its thread runs next; none for BF16 weights.
  Upcoming upcoming(int e, int p, long row0, long rows, long col0, long cols) const;
  int E_, H_, I_;
  // Adds expert e's gate (p = GATE) or up bias, columns [c0, c0 + n), to each of `rows` rows of c (ld I).
  void add_bias(int e, int p, long c0, long n, int rows, float* c) const;
  Format format_;
  int fp8_row_shift_ = 7;  // FP8: log2 of the weight rows a scale row covers (Rows<fp8_block>::row_shift)
  ExpertWeights w_;
  Glu glu_;
};

}  // namespace kt
