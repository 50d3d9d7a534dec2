// The kernel set of one ISA: a table of plain functions, filled by each ISA's file and picked at
// run time by dispatch.cpp. Everything here is float32 arithmetic on float32 activations; weights
// may be BF16 (the packed expert layout), FP8 block-128 or INT4 group-32 (quantized experts, decoded
// tile by tile inside the kernels) or float32 (LoRA matrices and activations).
//
// Legend (STYLE.md 2): M rows of the output, N columns of the output, K the reduced dimension.
#pragma once
#include <cstdint>

#include "../formats/bf16.h"
#include "../formats/fp8_block.h"
#include "../formats/int4_group.h"
#include "../moe/lora_dropout.h"
#include "aligned.h"

namespace kt {

// The experts' gated unit: h = a(g')·(u' + up_offset), g' = min(g, limit), u' = clamp(u, −limit, limit),
// a(g') = g'·sigmoid(alpha·(g' + cubic·g'³)). The defaults give SwiGLU, silu(g)·u; GPT-OSS's experts use alpha
// 1.702, limit 7 and up_offset 1; GeGLU's tanh-approximated gelu (Gemma 4), 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))),
// is alpha 2·√(2/π) and cubic 0.044715 (0.5·(1 + tanh(z)) = sigmoid(2z)).
// Experts without a gate (gated false: Nemotron-H's) compute h = relu(u)², from up alone; the other fields are unused.
struct Glu {
  float alpha = 1.f;
  float limit = __builtin_inff();
  float up_offset = 0.f;
  float cubic = 0.f;
  bool gated = true;
};

// The experts' weight format (moe/experts.h says how it follows from the weights' dtype).
enum class Format { bf16, fp8_block128, int4_group32 };

// Rows of a matrix, either strided (base + i*ld) or gathered through a pointer per row.
template <class T>
struct Rows {
  const T* const* ptrs = nullptr;
  const T* base = nullptr;
  long ld = 0;
  const T* at(long i) const { return ptrs ? ptrs[i] : base + i * ld; }
};

// Rows of a quantized weight matrix [out, in]: kernel row i is matrix row row0 + i. There is no pointer
// to a row of floats; the kernels decode row segments into float32 tiles (widen_row in kernel_body.h).
template <>
struct Rows<fp8_block> {
  const uint8_t* q = nullptr;    // row 0 of the matrix, `ld` bytes per row
  long ld = 0;
  const float* scale = nullptr;  // [ceil(out/2^row_shift), scale_ld = ceil(in/128)]
  long scale_ld = 0;
  long row0 = 0;
  // A scale row covers 2^row_shift weight rows: 7 for 128×128 blocks, 0 for one row's 128-column segments (FP8
  // published with a scale per output channel, spread over its row's segments: exact, 1/32 of the codes' bytes).
  int row_shift = 7;
};

template <>
struct Rows<int4_group> {
  const uint32_t* words = nullptr;  // row 0 of the matrix, `ld` words per row
  long ld = 0;
  const bf16* scale = nullptr;      // [out, scale_ld = ceil(in/32)]
  long scale_ld = 0;
  long row0 = 0;
};

// C[m, n] = alpha * sum_k A[m, k] * B[n, k] (+ C if accumulate).
// "Dot" form: A and B rows are both contiguous in k, as x·Wᵀ with W stored [out, in].
template <class TB>
struct GemmNT {
  int M, N, K;
  Rows<float> a;
  Rows<TB> b;
  float* c;
  long ldc;
  float alpha;
  bool accumulate;
};

// C[m, n] = alpha * sum_k A(m, k) * B[k, n] (+ C if accumulate), B rows contiguous in n.
// A(m, k) = a.at(m)[a_off + k], or with a_trans A(m, k) = a.at(k)[a_off + m] * (kscale ? kscale[k] : 1).
// "Axpy" form: dx = dy·W with W stored [out, in] (the other loop order over the same weights), and
// weight gradients dW = dyᵀ·x (a_trans).
template <class TB>
struct GemmNN {
  int M, N, K;
  Rows<float> a;
  long a_off;
  bool a_trans;
  const float* kscale;
  Rows<TB> b;
  long b_off;
  float* c;
  long ldc;
  float alpha;
  bool accumulate;
};

// Tile (AMX) products for BF16 activations. The activations are rounded to BF16 once per call into one of
// two layouts, and every weight block of the call loads them from there in place. Both hold tile_rows(M) rows
// (zeros in the padding):
//   nt ("pair-major"): tile_ld(K) columns in blocks of 16 rows × 32 columns, block (m/16, k/32) at
//      ((m/16)·tile_ld(K)/32 + k/32)·512, inside it element (m, k) at ((k%32)/2)·32 + (m%16)·2 + k%2: the tile
//      unit's B-operand layout, so the weights can be the A operand and load straight from their rows (dot
//      form, x·Wᵀ).
//   nn ("row-major"): element (m, k) at m·nn_ld(K) + k, zeros up to tile_ld(K): the A-operand layout (axpy
//      form, dy·W).
inline long tile_rows(long M) { return (M + 15) / 16 * 16; }
inline long tile_ld(long K) { return (K + 31) / 32 * 32; }
// Rows whose stride is a multiple of 4 KB put all 16 rows of an A tile in one L1 set (12 ways), so every tile
// load misses L1: such rows get one more 32-column block (never read). At the DeepSeek-V3 layer (I = 2048) the
// backward's dx ran 14% faster per FLOP with I = 2016 than 2048 (BENCHMARKS.md).
inline long nn_ld(long K) { return tile_ld(K) % 2048 ? tile_ld(K) : tile_ld(K) + 32; }

// What the thread of a tile product computes next, as bytes the product requests into L2 while its tile
// products run (`rows` runs of `len` bytes, `stride` bytes apart, from p; none when rows is 0): the next
// product's weight rows then come from L2 instead of stalling its first pass on memory.
struct Upcoming {
  const char* p = nullptr;
  long stride = 0, len = 0, rows = 0;
};

// A further reduction segment of a tile product: its own A operand (BF16, the product's layout, K columns)
// times float32 rows (LoRA's A or B) × scale, rounded to BF16 as the kernel reads them.
struct TileF32 {
  const bf16* a = nullptr;  // none when null
  Rows<float> b{};
  int K = 0;
  float scale = 1.f;
};

// C[m, n] (+)= alpha · (Σ_k A[m, k] · B[n, k] + the f32 segment's sum), A in the nt layout. B may also be
// float32 (LoRA matrices, rank-space rows): rounded to BF16 as the kernel reads it, as the quantized weights
// are decoded. With `stream` (and not accumulate), whole aligned 64-byte rows of C are written around the caches
// (no read for ownership): for results that nothing reads before they have left the cache anyway.
template <class TB>
struct TileNT {
  int M, N, K;
  const bf16* a;
  Rows<TB> b;
  float* c;
  long ldc;
  bool accumulate;
  Upcoming next;
  float alpha = 1.f;
  TileF32 f32{};
  bool stream = false;
};

// Bytes of the packed weight panel a tile_nn product keeps in the core's L2 for its reuse by every 32-row block
// of activations: a larger panel (long reduction × wide columns) is reduced in chunks of reduction blocks.
constexpr long kPanelBytes = 1L << 20;

// C[m, n] (+)= alpha · Σ_k A[m, k] · B[k, b_off + n], A in the nn layout. The reduction may go on over more
// segments, each with its own A operand (nn layout, nn_ld of its K per row) and B rows read from column b_off:
// a second matrix of B's format (`second`), then float32 rows times their own scale (`f32`, LoRA's A), so
// that one product sums what would take several passes over C. `stream` as for TileNT (where the reduction
// runs in one chunk).
template <class TB>
struct TileNN {
  int M, N, K;
  const bf16* a;
  Rows<TB> b;
  long b_off;
  float* c;
  long ldc;
  bool accumulate;
  Upcoming next;
  float alpha = 1.f;
  struct Second {
    const bf16* a = nullptr;  // none when null
    Rows<TB> b{};
    int K = 0;
  } second{};
  TileF32 f32[2]{};
  bool stream = false;
  // The B operand of the weight segments (b, then `second`) as packed once ahead of the call (the backward copy,
  // moe/backward_copy.h), or null: its tiles then load from there and only the other segments are packed on the way
  // (b and `second` stay set: on AMX products of 1-3 rows read them in place, tile_body.h direct_nn). Block column
  // j (16 columns from b_off, which is a multiple of 32) of reduction block kc is the 512-element tile at packed[s]
  // + (j·packed_blocks + kc)·512, pairs of block columns in unpack_pair's order.
  const bf16* packed[2] = {};
  long packed_blocks = 0;
};

struct TileKernels {
  // Columns [k0, k0 + klen) of an [M, K] matrix (row m at a.at(m), column k at a.at(m)[k]) rounded to BF16
  // into dst, which holds the layout's tile_rows(M) rows; rows past M get zeros, and the call whose columns end
  // at K also zero-fills the columns up to tile_ld(K). k0 is a multiple of 32.
  void (*pack_nt)(int M, int K, long k0, long klen, Rows<float> a, bf16* dst);
  void (*pack_nn)(int M, int K, long k0, long klen, Rows<float> a, bf16* dst);
  void (*nt_bf16)(const TileNT<bf16>&);
  void (*nt_fp8)(const TileNT<fp8_block>&);
  void (*nt_int4)(const TileNT<int4_group>&);
  void (*nn_bf16)(const TileNN<bf16>&);
  void (*nn_fp8)(const TileNN<fp8_block>&);
  void (*nn_int4)(const TileNN<int4_group>&);
  void (*nt_f32)(const TileNT<float>&);
  void (*nn_f32)(const TileNN<float>&);
  // The tile operations run on vdpbf16ps (avx512_bf16, no AMX): a product then pays only for rows that fill
  // much of a 16-lane vector, so forwards keep the other kernels for fewer rows (Runtime::forward_tile_rows).
  bool emulated;
};

struct KernelSet {
  const char* name;
  void (*gemm_nt_bf16)(const GemmNT<bf16>&);
  // The same product for activations that came in as BF16: may round A to BF16 (exact for x itself, and
  // h = silu(g)·u is rounded as the model's own BF16 dtype would). Float32 inputs never take this path.
  void (*gemm_nt_bf16_act)(const GemmNT<bf16>&);
  void (*gemm_nt_f32)(const GemmNT<float>&);
  void (*gemm_nn_bf16)(const GemmNN<bf16>&);
  void (*gemm_nn_f32)(const GemmNN<float>&);
  void (*gemm_nt_fp8)(const GemmNT<fp8_block>&);
  // As gemm_nt_bf16_act, for FP8 weights.
  void (*gemm_nt_fp8_act)(const GemmNT<fp8_block>&);
  void (*gemm_nn_fp8)(const GemmNN<fp8_block>&);
  void (*gemm_nt_int4)(const GemmNT<int4_group>&);
  // As gemm_nt_bf16_act, for INT4 weights.
  void (*gemm_nt_int4_act)(const GemmNT<int4_group>&);
  void (*gemm_nn_int4)(const GemmNN<int4_group>&);
  // h = glu(g, u) (Glu above); g is not read (and may be null) for a unit without a gate.
  void (*glu)(long n, const float* g, const float* u, float* h, const Glu& f);
  // Given dh: dg = dh · ∂h/∂g, du = dh · ∂h/∂u. Overwrites dg, du; without a gate only du (g, dg may be null).
  void (*glu_backward)(long n, const float* g, const float* u, const float* dh, float* dg, float* du, const Glu& f);
  void (*bf16_to_f32)(long n, const bf16* src, float* dst);
  void (*f32_to_bf16)(long n, const float* src, bf16* dst);
  // x *= alpha
  void (*scale)(long n, float alpha, float* x);
  // y += alpha * x
  void (*axpy)(long n, float alpha, const float* x, float* y);
  float (*dot)(long n, const float* a, const float* b);
  // LoRA dropout of one row (moe/lora_dropout.h): dst[j] (+)= src[j] · keep(row_key, c0 + j) / (1 − p).
  void (*lora_dropout)(uint32_t row_key, long c0, long n, float p, const float* src, float* dst, bool accumulate);
  // Null where the set has no tile products (amx: the tile unit; avx512_bf16: its operations on vdpbf16ps).
  const TileKernels* tiles;
};

const KernelSet& kernels_reference();
const KernelSet& kernels_avx2();
const KernelSet& kernels_avx512();
const KernelSet& kernels_avx512_bf16();
const KernelSet& kernels_amx();
// FP8 rows off the tiles with BF16 activations on vdpbf16ps (fp8_bf16_dot.cpp): needs AVX-512 BF16 and VBMI.
void gemm_nt_fp8_bf16_dot(const GemmNT<fp8_block>& g);

}  // namespace kt
