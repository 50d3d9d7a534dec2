#include "experts.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>

#include "backward_copy.h"
#include "runtime.h"

namespace kt {

namespace {

// Output columns per work item: 64 keeps a B panel (64 rows of up to 7168 BF16) in L2 and gives
// E·I/64 items, enough to spread a decode step's few experts over every thread.
constexpr int BLOCK = 64;

long ceil_div(long a, long b) { return (a + b - 1) / b; }

// Output columns per forward work item when every routed expert has at most two rows (decode): BLOCK, doubled
// up to 512 while the `experts` × column blocks still give each thread 16 items. A decode item is a few µs of
// streaming, and per-item costs (handing it out, requesting the next one's rows, LoRA's share) were ~20% of
// INT4's call on 2 threads at Layer Q: 128 gate/up and 512 down columns there ran INT4 decode 0.82-0.89 ms
// against 0.97-1.12 at 64 (BENCHMARKS.md). With 15 threads the rule keeps 64, the width measured there.
long decode_width(long experts, long cols, int threads) {
  long w = BLOCK;
  while (w < 512 && experts * ceil_div(cols, 2 * w) >= 16L * threads) w *= 2;
  return w;
}

// Columns per LoRA-grad work item: each item reads its column segment of every row of the expert (tokens
// gathered from anywhere), and 256 floats per row read 4x fewer, longer pieces than 64 (the phase took ~25%
// less on the dev machine at Layer Q, T=512), with still E·(2H+I)·2/256 items to share.
constexpr int LORA_GRAD_BLOCK = 256;

// Floats of one thread's tile: a weight-grad block (BLOCK rows of H or I) or a LoRA B grad block before its
// transpose (r rows of LORA_GRAD_BLOCK) in backward, at least BLOCK rows of LoRA-dropout input (lora_in and
// friends), and at least one row of H for combine.
long per_thread_tile(long H, long I, long r) {
  return std::max({long(BLOCK) * std::max(H, I), long(LORA_GRAD_BLOCK) * r, H});
}

struct Item {
  int kind, e, block;
};

// Rows of expert e's slots in a slot-major buffer with `ld` columns.
Rows<float> slot_rows(const float* base, const Saved& sv, int e, long ld) { return Rows<float>{nullptr, base + sv.offset[e] * ld, ld}; }
Rows<float> gathered(const std::vector<const float*>& ptrs, const Saved& sv, int e) {
  return Rows<float>{ptrs.data() + sv.offset[e], nullptr, 0};
}
int rows_of(const Saved& sv, int e) { return sv.offset[e + 1] - sv.offset[e]; }

// Counting sort of the (token, k) pairs by expert, tokens in order within an expert. A pair whose id is kNoExpert
// gets no slot (slot_of -1): it adds nothing to its token's output, and its routing weight's grad is 0 (the
// zero-computation experts of LongCat-Flash, which the Python layer adds itself).
void route(const View& idx, const View& w, int E, Saved& sv) {
  const int T = sv.T, K = sv.K;
  const int64_t* id = idx.as<int64_t>();
  const float* wt = w.as<float>();
  sv.offset.assign(E + 1, 0);
  for (long i = 0; i < long(T) * K; ++i) {
    int64_t e = id[i];
    if (e == kNoExpert) continue;
    if (e < 0 || e >= E)
      throw std::invalid_argument("top_k_index holds expert id " + std::to_string(e) + " at token " +
                                  std::to_string(i / K) + "; ids must be in [0, " + std::to_string(E) +
                                  ") for this layer's " + std::to_string(E) + " experts (or " +
                                  std::to_string(kNoExpert) + ": no expert).");
    ++sv.offset[e + 1];
  }
  for (int e = 0; e < E; ++e) sv.offset[e + 1] += sv.offset[e];
  std::vector<long> fill(sv.offset.begin(), sv.offset.end() - 1);
  sv.slot_token.resize(size_t(T) * K);
  sv.slot_w.resize(size_t(T) * K);
  sv.slot_of.resize(size_t(T) * K);
  sv.slot_src.resize(size_t(T) * K);
  for (long i = 0; i < long(T) * K; ++i) {
    if (id[i] == kNoExpert) {
      sv.slot_of[i] = -1;
      continue;
    }
    const int s = int(fill[id[i]]++);
    sv.slot_token[s] = int(i / K);
    sv.slot_src[s] = int(i);
    sv.slot_w[s] = wt[i];
    sv.slot_of[i] = s;
  }
}

// Rows of x as float32: a pointer into x itself when it is float32, else converted into `dst`.
const float* as_f32(const View& x, float* dst, Runtime& rt) {
  if (x.dtype == DType::f32) return x.as<float>();
  const long T = x.shape[0], H = x.shape[1];
  const KernelSet& ks = rt.kernels();
  rt.parallel_for(T, [&](long t, int) { ks.bf16_to_f32(H, x.as<bf16>() + t * H, dst + t * H); });
  return dst;
}

// Columns [col0, col0 + n) of row `row` of out (row-major, out.shape[1] columns) = src, in out's dtype.
void store_cols(const View& out, long row, long col0, const float* src, long n, const KernelSet& ks) {
  const long at = row * out.shape[1] + col0;
  if (out.dtype == DType::f32)
    std::memcpy(out.as<float>() + at, src, n * sizeof(float));
  else
    ks.f32_to_bf16(n, src, out.as<bf16>() + at);
}

// dst[rows, cols] (+)= src; dst float32 or bfloat16 (rounded once per accumulation, as torch does).
void accumulate_into(const View& dst, long offset, long ld, const float* src, long rows, long cols) {
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) {
      long at = offset + i * ld + j;
      if (dst.dtype == DType::f32)
        dst.as<float>()[at] += src[i * cols + j];
      else
        dst.as<bf16>()[at] = f32_to_bf16(bf16_to_f32(dst.as<bf16>()[at]) + src[i * cols + j]);
    }
}

// out[t] = Σ w_s · rows[s] over token t's slots s (w_s = 1 without slot_w), written in out's dtype. The slots are
// summed in their own order, which is the experts' (route's slots run expert by expert).
void combine(const View& out, const float* rows, long ld, const Saved& sv, const float* slot_w, Runtime& rt,
             float* per_thread) {
  const KernelSet& ks = rt.kernels();
  const int K = sv.K;
  rt.parallel_for(sv.T, [&](long t, int ith) {
    thread_local std::vector<int> slots;
    slots.assign(sv.slot_of.begin() + t * K, sv.slot_of.begin() + (t + 1) * K);
    std::sort(slots.begin(), slots.end());
    float* acc = per_thread + long(ith) * ld;
    std::fill(acc, acc + ld, 0.f);
    for (int s : slots)
      if (s >= 0) ks.axpy(ld, slot_w ? slot_w[s] : 1.f, rows + long(s) * ld, acc);
    store_cols(out, t, 0, acc, ld, ks);
  });
}

// dst[c, r] = src[r, c] for src [rows, cols]: LoRA B [out, r] goes to [r, out] so "out of rank space"
// products run in axpy form over contiguous rows, and grads of B computed as [r, out] go back.
void transpose(const float* src, long rows, long cols, float* dst, bool accumulate = false) {
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) dst[j * rows + i] = (accumulate ? dst[j * rows + i] : 0.f) + src[i * cols + j];
}

// Expert e's LoRA matrices of projection p as rows: A [r, in], B [out, r] from output row row0.
Rows<float> lora_a(const Lora& lora, int p, long e, long in) {
  return {nullptr, lora.A[p].as<float>() + e * lora.r * in, in};
}
Rows<float> lora_b(const Lora& lora, int p, long e, long out, long row0) {
  return {nullptr, lora.B[p].as<float>() + (e * out + row0) * lora.r, lora.r};
}

// Expert e's LoRA B of projection p, [out, r], into its [r, out] slot of `bt`.
void transpose_b(const Lora& lora, int p, long e, long out, float* bt) {
  transpose(lora_b(lora, p, e, out, 0).base, out, lora.r, bt + e * lora.r * out);
}

// Experts with at most this many rows in a forward apply LoRA B in dot form, reading B [out, r] in place:
// for them the transpose the axpy form needs (r·out scattered stores) costs more than the product itself.
constexpr int kLoraDotRows = 2;

// c[m, j] += s Σ_k z[m, k] B[col0 + j, k] over the n rows of expert e: projection p's LoRA B applied to the
// rank-space rows z, output columns [col0, col0 + cols); bt holds the transposed B of experts with more rows.
void lora_out(const KernelSet& ks, const Lora& lora, int p, long e, long out, int n, const float* z, const float* bt,
              long col0, int cols, float* c, long ldc) {
  const int r = lora.r;
  if (n <= kLoraDotRows)
    ks.gemm_nt_f32({n, cols, r, {nullptr, z, r}, lora_b(lora, p, e, out, col0), c, ldc, lora.scale, true});
  else
    ks.gemm_nn_f32({n, cols, r, {nullptr, z, r}, 0, false, nullptr, {nullptr, bt + e * r * out, out}, col0, c, ldc,
                    lora.scale, true});
}

// The kernel of the set for a weight format. BF16 activations may take the BF16-activation product of
// BF16, FP8 and INT4 weights; float32 activations stay exact.
void run_nt(const KernelSet& ks, const GemmNT<bf16>& g, bool bf16_act) { (bf16_act ? ks.gemm_nt_bf16_act : ks.gemm_nt_bf16)(g); }
void run_nt(const KernelSet& ks, const GemmNT<fp8_block>& g, bool bf16_act) {
  (bf16_act ? ks.gemm_nt_fp8_act : ks.gemm_nt_fp8)(g);
}
void run_nt(const KernelSet& ks, const GemmNT<int4_group>& g, bool bf16_act) {
  (bf16_act ? ks.gemm_nt_int4_act : ks.gemm_nt_int4)(g);
}
void run_nn(const KernelSet& ks, const GemmNN<bf16>& g) { ks.gemm_nn_bf16(g); }
void run_nn(const KernelSet& ks, const GemmNN<fp8_block>& g) { ks.gemm_nn_fp8(g); }
void run_nn(const KernelSet& ks, const GemmNN<int4_group>& g) { ks.gemm_nn_int4(g); }

void run_tile(const TileKernels& t, const TileNT<bf16>& g) { t.nt_bf16(g); }
void run_tile(const TileKernels& t, const TileNT<fp8_block>& g) { t.nt_fp8(g); }
void run_tile(const TileKernels& t, const TileNT<int4_group>& g) { t.nt_int4(g); }
void run_tile(const TileKernels& t, const TileNN<bf16>& g) { t.nn_bf16(g); }
void run_tile(const TileKernels& t, const TileNN<fp8_block>& g) { t.nn_fp8(g); }
void run_tile(const TileKernels& t, const TileNN<int4_group>& g) { t.nn_int4(g); }
void run_tile(const TileKernels& t, const TileNT<float>& g) { t.nt_f32(g); }
void run_tile(const TileKernels& t, const TileNN<float>& g) { t.nn_f32(g); }

// Experts whose rows take the tile kernels in this call (BF16 activations on a set with tiles, and at least
// min_rows rows: Runtime::forward_tile_rows or backward_tile_rows), and where each one's rows start in the tile
// layouts of kernels.h: rows of such an expert are padded to whole tiles; the others have none there.
struct TilePlan {
  const TileKernels* tk = nullptr;
  std::vector<long> row0;  // [E + 1]
  bool on(int e) const { return row0[e + 1] > row0[e]; }
  long rows() const { return row0.back(); }
  // Expert e's rows in a tile buffer of `cols` columns: the nt layout's tile_ld(cols) per row, the nn layout's
  // nn_ld(cols).
  template <class T>
  T* at(T* buf, int e, long cols) const { return buf + row0[e] * tile_ld(cols); }
  template <class T>
  T* at_nn(T* buf, int e, long cols) const { return buf + row0[e] * nn_ld(cols); }
};

// Output columns of a backward axpy-form work item (dy·W, reduction over K weight rows) of expert e. On the
// tile unit the item packs its weight panel, a segment of each of the K rows, which lie a page or more apart:
// 256 columns (512-byte segments) while the panel (K × width BF16) fits kPanelBytes whole, for its reuse by
// every 32-row block of activations (Layer Q); past that the panel is reduced in chunks, and the segments are
// longer: 1 KB (512 columns), or 2 KB for an expert of at most 32 rows, whose results (rows × width float32,
// re-read by every chunk) stay small. At the DeepSeek-V3 layer 64- and 128-column items read the weights at
// half the forward's rate; 1024 columns measured 5-10% faster than 512 at T = 512 (~16 rows per expert) and
// slower at T = 4096 (~128), and wider ones slower at both (BENCHMARKS.md).
int nn_width(const TilePlan& tp, int e, long K) {
  if (!tp.on(e)) return BLOCK;
  if (K * 256 * 2 <= kPanelBytes) return 256;
  return tp.row0[e + 1] - tp.row0[e] <= 32 ? 1024 : 512;
}

TilePlan plan_tiles(const Saved& sv, int E, const KernelSet& ks, bool bf16_act, int min_rows) {
  TilePlan tp;
  tp.tk = bf16_act ? ks.tiles : nullptr;
  tp.row0.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int n = rows_of(sv, e);
    tp.row0[e + 1] = tp.row0[e] + (tp.tk && n > 0 && n >= min_rows ? tile_rows(n) : 0);
  }
  return tp;
}

// LoRA on the tile unit. For an expert on tiles, the LoRA products (all but the forward's gate/up z·Bᵀ, see
// forward) run on the tile unit with BF16 operands and float32 sums, as stock PEFT runs them under bf16
// autocast (with LoRA dropout, on operands masked in float32 first: the *_dropped_on_tiles functions). The
// LoRA matrices are rounded to BF16 as the kernels read them, the rank-space rows (z = x·Aᵀ, wz = dy·B) once
// per call into the layouts of kernels.h: [tile_rows(n), r] per expert (`rank_at`: nt in the forward for down's
// z·Bᵀ; `rank_nn_at`: nn in the backward for wz·A), and transposed (`rank_t_at`: nn, [tile_rows(r), n]) as
// the A operand of the LoRA grads, which reduce over the rows. In float32 at Layer Q these products took a
// quarter of a training step (BENCHMARKS.md).
struct RankTiles {
  const TilePlan& tp;
  int r;
  bf16* rank_at(bf16* buf, int e) const { return tp.at(buf, e, r); }
  bf16* rank_nn_at(bf16* buf, int e) const { return tp.at_nn(buf, e, r); }
  // nn_ld(n) ≤ tile_rows(n) + 48, so expert e's transposed block fits at row0[e] + 48·e columns.
  bf16* rank_t_at(bf16* buf, int e) const { return buf + tile_rows(r) * (tp.row0[e] + 48L * e); }
  static size_t rank_elems(const TilePlan& tp, int r) { return size_t(tp.rows()) * nn_ld(r); }
  static size_t rank_t_elems(const TilePlan& tp, int r, int E) { return size_t(tile_rows(r)) * (tp.rows() + 48L * E); }
};

// dst (nn layout, [tile_rows(r), n]) = the transpose of an expert's n rank-space rows z [n, r], row m
// times kscale[m] when given.
void pack_rank_transposed(const TileKernels& tk, int n, int r, const float* z, const float* kscale, bf16* dst) {
  thread_local aligned_vector<float> t;
  t.resize(size_t(r) * n);
  for (int m = 0; m < n; ++m)
    for (int j = 0; j < r; ++j) t[size_t(j) * n + m] = z[long(m) * r + j] * (kscale ? kscale[m] : 1.f);
  tk.pack_nn(r, n, 0, n, Rows<float>{nullptr, t.data(), n}, dst);
}

// The experts that have rows in this call, in order.
std::vector<int> routed_experts(const Saved& sv, int E) {
  std::vector<int> routed;
  for (int e = 0; e < E; ++e)
    if (rows_of(sv, e)) routed.push_back(e);
  return routed;
}

// body(e, ith) for the experts that have rows in this call: the others have nothing to do (at decode 120 of
// Qwen3's 128), and handing each out would still cost the pool an atomic increment.
template <class Body>
void for_routed_experts(Runtime& rt, const Saved& sv, int E, Body body) {
  const std::vector<int> routed = routed_experts(sv, E);
  rt.parallel_for(long(routed.size()), [&](long i, int ith) { body(long(routed[i]), ith); });
}

// Products against expert weights (alpha 1, no A transpose), typed by the weight rows they read.
template <class T>
GemmNT<T> weight_nt(int M, int N, int K, Rows<float> a, Rows<T> b, float* c, long ldc) {
  return GemmNT<T>{M, N, K, a, b, c, ldc, 1.f, false};
}
template <class T>
TileNT<T> tile_nt(int M, int N, int K, const bf16* a, Rows<T> b, float* c, long ldc, const Upcoming& next) {
  return TileNT<T>{M, N, K, a, b, c, ldc, false, next};
}
template <class T>
TileNN<T> tile_nn(int M, int N, int K, const bf16* a, Rows<T> b, long b_off, float* c, long ldc, bool accumulate,
                  const Upcoming& next) {
  return TileNN<T>{M, N, K, a, b, b_off, c, ldc, accumulate, next};
}
template <class T>
GemmNN<T> weight_nn(int M, int N, int K, Rows<float> a, Rows<T> b, long b_off, float* c, long ldc, bool accumulate) {
  return GemmNN<T>{M, N, K, a, 0, false, nullptr, b, b_off, c, ldc, 1.f, accumulate};
}

// LoRA with dropout (lora_dropout.h) runs on row chunks that fit a thread's `buf` of `buf_floats` floats.
int chunk_rows(long buf_floats, long cols) { return int(std::max<long>(1, buf_floats / cols)); }

// The dropout hash state of row m of expert e (its routed copy t·K + k) in projection p.
uint32_t dropout_key(const Lora& lora, int p, const Saved& sv, int e, int m) {
  return dropout_row_key(lora.dropout.seed, p, uint32_t(sv.slot_src[sv.offset[e] + m]));
}

// z[m] = drop_p(a_m) · A_eᵀ for the n rows of expert e: the rank-space input of projection p's LoRA.
void lora_in(const KernelSet& ks, const Lora& lora, int p, const Saved& sv, int e, Rows<float> a, long in, float* z,
             float* buf, long buf_floats) {
  const int n = rows_of(sv, e), r = lora.r;
  const Rows<float> A = lora_a(lora, p, e, in);
  if (!lora.dropout.on()) return ks.gemm_nt_f32({n, r, int(in), a, A, z, r, 1.f, false});
  const int ch = chunk_rows(buf_floats, in);
  for (int m0 = 0; m0 < n; m0 += ch) {
    const int mc = std::min(ch, n - m0);
    for (int m = 0; m < mc; ++m)
      ks.lora_dropout(dropout_key(lora, p, sv, e, m0 + m), 0, in, lora.dropout.p, a.at(m0 + m), buf + long(m) * in,
                      false);
    ks.gemm_nt_f32({mc, r, int(in), {nullptr, buf, in}, A, z + long(m0) * r, r, 1.f, false});
  }
}

// c[m, j] += s · (wz_m · A_e)[col0 + j] ⊙ keep_p: the gradient of projection p's LoRA input, for the n rows of
// expert e (wz: their rank-space gradients, [n, r]), columns [col0, col0 + cols) of c (row stride ldc).
void lora_in_grad(const KernelSet& ks, const Lora& lora, int p, const Saved& sv, int e, const float* wz, long in,
                  long col0, int cols, float* c, long ldc, float* buf, long buf_floats) {
  const int n = rows_of(sv, e), r = lora.r;
  const Rows<float> A = lora_a(lora, p, e, in);
  if (!lora.dropout.on())
    return ks.gemm_nn_f32({n, cols, r, {nullptr, wz, r}, 0, false, nullptr, A, col0, c, ldc, lora.scale, true});
  const int ch = chunk_rows(buf_floats, cols);
  for (int m0 = 0; m0 < n; m0 += ch) {
    const int mc = std::min(ch, n - m0);
    ks.gemm_nn_f32({mc, cols, r, {nullptr, wz + long(m0) * r, r}, 0, false, nullptr, A, col0, buf, cols, lora.scale,
                    false});
    for (int m = 0; m < mc; ++m)
      ks.lora_dropout(dropout_key(lora, p, sv, e, m0 + m), col0, cols, lora.dropout.p, buf + long(m) * cols,
                      c + long(m0 + m) * ldc, true);
  }
}

// dA_e[j, col0 + c] (+)= s Σ_m (kscale_m) wz[m, j] · drop_p(a_m)[col0 + c]: projection p's LoRA A gradient,
// columns [col0, col0 + cols), over the n rows of expert e.
void lora_dA(const KernelSet& ks, const Lora& lora, int p, const Saved& sv, int e, const float* wz, const float* kscale,
             Rows<float> a, long col0, int cols, float* dst, long ldd, bool accumulate, float* buf, long buf_floats) {
  const int n = rows_of(sv, e), r = lora.r;
  if (!lora.dropout.on())
    return ks.gemm_nn_f32({r, cols, n, {nullptr, wz, r}, 0, true, kscale, a, col0, dst, ldd, lora.scale, accumulate});
  const int ch = chunk_rows(buf_floats, cols);
  for (int m0 = 0; m0 < n; m0 += ch) {
    const int mc = std::min(ch, n - m0);
    for (int m = 0; m < mc; ++m)
      ks.lora_dropout(dropout_key(lora, p, sv, e, m0 + m), col0, cols, lora.dropout.p, a.at(m0 + m) + col0,
                      buf + long(m) * cols, false);
    ks.gemm_nn_f32({r, cols, mc, {nullptr, wz + long(m0) * r, r}, 0, true, kscale ? kscale + m0 : nullptr,
                    {nullptr, buf, cols}, 0, dst, ldd, lora.scale, accumulate || m0 > 0});
  }
}

// LoRA dropout on the tile unit (experts on tiles): the masked operands are built in float32 by the set's
// lora_dropout, as lora_in / lora_in_grad / lora_dA build them, then rounded to BF16 for the tile products.
//
// z[m] = drop_p(a_m)·A_eᵀ for the n rows of expert e: a chunk of dropped rows at a time (in `buf`), packed in
// the nt layout.
void lora_in_dropped_on_tiles(const TileKernels& tk, const KernelSet& ks, const Lora& lora, int p, const Saved& sv,
                              int e, Rows<float> a, long in, float* z, float* buf, long buf_floats) {
  const int n = rows_of(sv, e), r = lora.r;
  const int ch = chunk_rows(buf_floats, in) / 16 * 16;  // ≥ 64: buf holds BLOCK rows of the widest input
  thread_local aligned_vector<bf16> packed;
  packed.resize(size_t(tile_rows(ch)) * tile_ld(in));
  for (int m0 = 0; m0 < n; m0 += ch) {
    const int mc = std::min(ch, n - m0);
    for (int m = 0; m < mc; ++m)
      ks.lora_dropout(dropout_key(lora, p, sv, e, m0 + m), 0, in, lora.dropout.p, a.at(m0 + m), buf + long(m) * in,
                      false);
    tk.pack_nt(mc, int(in), 0, in, Rows<float>{nullptr, buf, in}, packed.data());
    run_tile(tk, TileNT<float>{mc, r, int(in), packed.data(), lora_a(lora, p, e, in), z + long(m0) * r, r, false, {}});
  }
}

// c[m, j] += s · (wz_m · A_e)[col0 + j] ⊙ keep_p: wz's rows in the nn layout (wt), the product a chunk of rows at
// a time into `buf`, then masked into c.
void lora_in_grad_dropped_on_tiles(const TileKernels& tk, const KernelSet& ks, const Lora& lora, int p,
                                   const Saved& sv, int e, const bf16* wt, long in, long col0, int cols, float* c,
                                   long ldc, float* buf, long buf_floats) {
  const int n = rows_of(sv, e), r = lora.r;
  const int ch = chunk_rows(buf_floats, cols) / 16 * 16;  // ≥ 64, as above
  for (int m0 = 0; m0 < n; m0 += ch) {
    const int mc = std::min(ch, n - m0);
    run_tile(tk, TileNN<float>{mc, cols, r, wt + long(m0) * nn_ld(r), lora_a(lora, p, e, in), col0, buf, cols, false,
                               {}, lora.scale});
    for (int m = 0; m < mc; ++m)
      ks.lora_dropout(dropout_key(lora, p, sv, e, m0 + m), col0, cols, lora.dropout.p, buf + long(m) * cols,
                      c + long(m0 + m) * ldc, true);
  }
}

// dst (+)= s · t_rows · drop_p(a)[:, col0, col0 + cols) over the n rows of expert e (t_rows: its transposed
// rank-space rows in the nn layout, the reduction over the rows): the dropped columns of every row first.
void lora_dA_dropped_on_tiles(const TileKernels& tk, const KernelSet& ks, const Lora& lora, int p, const Saved& sv,
                              int e, const bf16* t_rows, Rows<float> a, long col0, int cols, float* dst, long ldd,
                              bool accumulate) {
  const int n = rows_of(sv, e);
  thread_local aligned_vector<float> dropped;
  dropped.resize(size_t(n) * cols);
  for (int m = 0; m < n; ++m)
    ks.lora_dropout(dropout_key(lora, p, sv, e, m), col0, cols, lora.dropout.p, a.at(m) + col0,
                    dropped.data() + long(m) * cols, false);
  run_tile(tk, TileNN<float>{lora.r, cols, n, t_rows, Rows<float>{nullptr, dropped.data(), cols}, 0, dst, ldd,
                             accumulate, {}, lora.scale});
}

float* alloc_saved(Saved& sv, SavedBuffer& p, size_t n) {
  p = take_saved(n);
  sv.bytes += n * sizeof(float);
  return p.get();
}

}  // namespace

const char* format_name(Format f) {
  switch (f) {
    case Format::bf16: return "bf16";
    case Format::fp8_block128: return "fp8_block128";
    case Format::int4_group32: return "int4_group32";
  }
  return "?";
}

MoeExperts::MoeExperts(int E, int H, int I, const ExpertWeights& w, const Glu& glu)
    : E_(E), H_(H), I_(I), w_(w), glu_(glu) {
  if (E < 1 || H < 1 || I < 1) throw std::invalid_argument("experts need E, H and I of at least 1.");
  if (w.gate_up.empty() || w.down.empty()) throw std::invalid_argument("experts need gate_up_proj and down_proj.");
  const long bs = fp8_block::BLOCK, gs = int4_group::GROUP, SI = long(stacked()) * I;
  switch (w.gate_up.dtype) {
    case DType::bf16: format_ = Format::bf16; break;
    case DType::fp8_e4m3: format_ = Format::fp8_block128; break;
    case DType::i32: format_ = Format::int4_group32; break;
    default:
      throw std::invalid_argument(std::string("gate_up_proj is ") + dtype_name(w.gate_up.dtype) +
                                  "; expert weights must be bfloat16, float8_e4m3fn (FP8 block-128) or int32 "
                                  "(packed INT4 group-32).");
  }
  if (format_ == Format::bf16) {
    expect(w.gate_up, "gate_up_proj", DType::bf16, {E, SI, H});
    expect(w.down, "down_proj", DType::bf16, {E, H, I});
    if (!w.gate_up_scale.empty() || !w.down_scale.empty())
      throw std::invalid_argument("BF16 expert weights take no scales; pass scales only with FP8 or INT4 weights.");
  } else if (format_ == Format::fp8_block128) {
    expect(w.gate_up, "gate_up_proj", DType::fp8_e4m3, {E, SI, H});
    expect(w.down, "down_proj", DType::fp8_e4m3, {E, H, I});
    // Blocks of 128 rows, or of one row (a scale per output channel): told apart by the scales' rows, gate_up's
    // (I of them, or ceil(I/128)) or down's (H or ceil(H/128)), which differ unless I = H = 1, where both read alike.
    const auto &gus = w.gate_up_scale.shape, &ds = w.down_scale.shape;
    if ((gus.size() == 4 && gus[2] == I && I > 1) || (ds.size() == 3 && ds[1] == H && H > 1)) fp8_row_shift_ = 0;
    const long rb = 1L << fp8_row_shift_;
    expect(w.gate_up_scale, "gate_up scales", DType::f32, {E, stacked(), ceil_div(I, rb), ceil_div(H, bs)});
    expect(w.down_scale, "down scales", DType::f32, {E, ceil_div(H, rb), ceil_div(I, bs)});
  } else {
    expect(w.gate_up, "gate_up_proj (packed INT4)", DType::i32, {E, SI, ceil_div(H, 8)});
    expect(w.down, "down_proj (packed INT4)", DType::i32, {E, H, ceil_div(I, 8)});
    expect(w.gate_up_scale, "gate_up scale (weight_scale)", DType::bf16, {E, SI, ceil_div(H, gs)});
    expect(w.down_scale, "down scale (weight_scale)", DType::bf16, {E, H, ceil_div(I, gs)});
  }
  if (!w.gate_up_bias.empty()) expect_float(w.gate_up_bias, "gate_up_proj_bias", {E, SI});
  if (!(glu.alpha > 0.f) || !(glu.limit > 0.f) || !std::isfinite(glu.up_offset) || !(glu.cubic >= 0.f) ||
      !std::isfinite(glu.cubic))
    throw std::invalid_argument("the gated unit needs alpha > 0, limit > 0 (infinity: no clamp), a finite offset and "
                                "a finite cubic >= 0.");
  check_finite_weights();
}

void MoeExperts::add_bias(int e, int p, long c0, long n, int rows, float* c) const {
  if (w_.gate_up_bias.empty()) return;
  const long at = (long(e) * stacked() + stack_index(p)) * I_ + c0;
  float b[BLOCK];
  for (long j0 = 0; j0 < n; j0 += BLOCK) {  // n is a column block's width, at most BLOCK, unless a caller widens it
    const long m = std::min<long>(BLOCK, n - j0);
    for (long j = 0; j < m; ++j)
      b[j] = w_.gate_up_bias.dtype == DType::f32 ? w_.gate_up_bias.as<float>()[at + j0 + j]
                                                 : bf16_to_f32(w_.gate_up_bias.as<bf16>()[at + j0 + j]);
    for (int i = 0; i < rows; ++i)
      for (long j = 0; j < m; ++j) c[i * long(I_) + j0 + j] += b[j];
  }
}

// A NaN or infinite weight or scale, or an FP8 NaN code, would turn whole blocks of outputs and gradients into NaN
// one step later (a BF16 one as soon as a token reaches its expert); refusing them here names the expert instead.
void MoeExperts::check_finite_weights() const {
  Runtime& rt = Runtime::get();
  // per expert: -1 fine, 0 bad gate_up scale, 1 bad down scale, 2 NaN code, 3 bad gate/up weight, 4 bad down weight
  std::vector<int> bad(E_, -1);
  const long n_scale[2] = {w_.gate_up_scale.numel() / E_, w_.down_scale.numel() / E_};
  const long n_code[2] = {w_.gate_up.numel() / E_, w_.down.numel() / E_};
  rt.parallel_for(E_, [&](long e, int) {
    if (format_ == Format::bf16) {
      const View* weights[2] = {&w_.gate_up, &w_.down};
      for (int m = 0; m < 2 && bad[e] < 0; ++m) {
        const uint16_t* q = weights[m]->as<uint16_t>() + e * n_code[m];
        uint16_t special = 0;  // an all-ones exponent: Inf or NaN
        for (long i = 0; i < n_code[m]; ++i) special |= uint16_t((q[i] & 0x7F80) == 0x7F80);
        if (special) bad[e] = 3 + m;
      }
      return;
    }
    const View* scales[2] = {&w_.gate_up_scale, &w_.down_scale};
    for (int m = 0; m < 2 && bad[e] < 0; ++m)
      for (long i = 0; i < n_scale[m]; ++i) {
        const long at = e * n_scale[m] + i;
        const float v = format_ == Format::fp8_block128 ? scales[m]->as<float>()[at] : bf16_to_f32(scales[m]->as<bf16>()[at]);
        if (!std::isfinite(v)) {
          bad[e] = m;
          break;
        }
      }
    if (format_ != Format::fp8_block128 || bad[e] >= 0) return;
    const View* codes[2] = {&w_.gate_up, &w_.down};
    for (int m = 0; m < 2; ++m) {
      const uint8_t* q = codes[m]->as<uint8_t>() + e * n_code[m];
      uint8_t nan = 0;
      for (long i = 0; i < n_code[m]; ++i) nan |= uint8_t(fp8_e4m3_is_nan(q[i]));
      if (nan) bad[e] = 2;
    }
  });
  const char* what[5] = {"gate/up scales hold NaN or Inf", "down scales hold NaN or Inf",
                         "FP8 weights hold NaN codes (0x7f/0xff)", "gate/up weights hold NaN or Inf",
                         "down weights hold NaN or Inf"};
  for (int e = 0; e < E_; ++e)
    if (bad[e] >= 0)
      throw std::invalid_argument(std::string("expert ") + std::to_string(e) + "'s " + what[bad[e]] +
                                  (format_ == Format::bf16 ? "; the checkpoint is corrupt: re-download it."
                                                           : "; the checkpoint is corrupt or was quantized wrongly: "
                                                             "re-download or re-quantize it."));
}

template <class F>
void MoeExperts::with_rows(int e, int p, long row0, F&& f) const {
  const long I = I_, H = H_;
  const long out = p == DOWN ? H : I, in = p == DOWN ? I : H;
  const long stack = long(e) * stacked() + stack_index(p);
  const long first = p == DOWN ? long(e) * H : stack * I;  // projection's row 0 in its stack
  const View& data = p == DOWN ? w_.down : w_.gate_up;
  const View& scale = p == DOWN ? w_.down_scale : w_.gate_up_scale;
  switch (format_) {
    case Format::bf16:
      f(Rows<bf16>{nullptr, data.as<bf16>() + (first + row0) * in, in});
      break;
    case Format::fp8_block128: {
      const long nbi = ceil_div(in, fp8_block::BLOCK);
      const long grid = (p == DOWN ? long(e) : stack) * ceil_div(out, 1L << fp8_row_shift_) * nbi;
      f(Rows<fp8_block>{data.as<uint8_t>() + first * in, in, scale.as<float>() + grid, nbi, row0, fp8_row_shift_});
      break;
    }
    case Format::int4_group32: {
      const long words = ceil_div(in, 8), groups = ceil_div(in, int4_group::GROUP);
      f(Rows<int4_group>{data.as<uint32_t>() + first * words, words, scale.as<bf16>() + first * groups, groups, row0});
      break;
    }
  }
}

// BF16 rows are left out: read in place (dot form) or a reduction block ahead while packed (axpy form), they
// measured no faster requested a product ahead on the GPU machine, and the forward slower.
Upcoming MoeExperts::upcoming(int e, int p, long row0, long rows, long col0, long cols) const {
  Upcoming u;
  with_rows(e, p, row0, [&](const auto& b) {
    using TB = std::decay_t<decltype(b)>;
    if constexpr (std::is_same_v<TB, Rows<fp8_block>>)
      u = {reinterpret_cast<const char*>(b.q + b.row0 * b.ld + col0), b.ld, cols, rows};
    else if constexpr (std::is_same_v<TB, Rows<int4_group>>)
      u = {reinterpret_cast<const char*>(b.words + b.row0 * b.ld) + col0 / 2, b.ld * 4, (cols + 1) / 2, rows};
  });
  return u;
}

void MoeExperts::check_lora(const Lora& lora) const {
  if (!(lora.dropout.p >= 0.f && lora.dropout.p < 1.f))
    throw std::invalid_argument("LoRA dropout must be in [0, 1), got " + std::to_string(lora.dropout.p) + ".");
  const long in[3] = {H_, H_, I_}, outd[3] = {I_, I_, H_};
  const char* names[3] = {"gate", "up", "down"};
  for (int p = 0; p < 3; ++p) {
    if (lora.A[p].empty() != lora.B[p].empty())
      throw std::invalid_argument(std::string("LoRA on ") + names[p] + " needs both A and B.");
    if (lora.A[p].empty()) continue;
    if (p == GATE && !glu_.gated) throw std::invalid_argument("these experts have no gate, so no LoRA on gate.");
    if (lora.r < 1) throw std::invalid_argument("LoRA rank must be at least 1.");
    expect(lora.A[p], (std::string("lora_A of ") + names[p]).c_str(), DType::f32, {E_, lora.r, in[p]});
    expect(lora.B[p], (std::string("lora_B of ") + names[p]).c_str(), DType::f32, {E_, outd[p], lora.r});
  }
}

size_t MoeExperts::scratch_floats(long T, long K, long E, long H, long I, long r, int threads) {
  const long N = T * K;
  return size_t(2 * T * H            // x and dout as float32
                + 4 * N * I          // h, p and (backward) dg, du; forward g, u when not saved
                + N * H              // per-slot rows (forward's down, backward's dx)
                + 3 * N * r          // rank-space products
                + E * r * (2 * I + H)  // LoRA B transposed to [r, out]
                + threads * per_thread_tile(H, I, r)
                // BF16 activations in the tile layouts (kernel set amx): x or dout, h or dg and du
                + (N + 15 * E) * (nn_ld(H) + 2 * nn_ld(I)) / 2
                // LoRA's rank-space rows in BF16 (RankTiles): three per expert row, six transposed
                + (3 * (N + 15 * E) * nn_ld(r) + 6 * tile_rows(r) * (N + 63 * E)) / 2);
}

std::shared_ptr<Saved> MoeExperts::forward(const View& x, const View& idx, const View& w, const View& out,
                                           const Lora& lora, bool save) const {
  Runtime& rt = Runtime::get();
  const KernelSet& ks = rt.kernels();
  if (x.shape.size() != 2 || idx.shape.size() != 2)
    throw std::invalid_argument("hidden_states must be [T, H] and top_k_index [T, K].");
  const int T = int(x.shape[0]), K = int(idx.shape[1]);
  const long H = H_, I = I_, N = long(T) * K;
  expect_float(x, "hidden_states", {T, H});
  expect(idx, "top_k_index", DType::i64, {T, K});
  expect(w, "top_k_weights", DType::f32, {T, K});
  expect(out, "output", x.dtype, {T, H});
  check_lora(lora);
  const int r = lora.r;

  Phases phase(rt);
  phase("forward.route_inputs");
  auto sv = std::make_shared<Saved>();
  sv->T = T;
  sv->K = K;
  route(idx, w, E_, *sv);
  if (T == 0) return save ? sv : nullptr;

  Scratch& sc = rt.scratch();
  const float* X = as_f32(x, sc.get(Scratch::X, size_t(T) * H), rt);
  std::vector<const float*> xrows(N);
  for (long i = 0; i < N; ++i) xrows[i] = X + long(sv->slot_token[i]) * H;

  float* G = !glu_.gated ? nullptr : save ? alloc_saved(*sv, sv->g, N * I) : sc.get(Scratch::DG, N * I);
  float* U = save ? alloc_saved(*sv, sv->u, N * I) : sc.get(Scratch::DU, N * I);
  float* Hh = sc.get(Scratch::HH, N * I);
  float* Z[3] = {};
  const Scratch::Slot zslot[3] = {Scratch::Z0, Scratch::Z1, Scratch::Z2};
  for (int p = 0; p < 3; ++p)
    if (!lora.A[p].empty()) Z[p] = save ? alloc_saved(*sv, sv->z[p], N * r) : sc.get(zslot[p], N * r);
  float* BT = sc.get(Scratch::BT, size_t(E_) * r * (2 * I + H));
  float* bt[3] = {BT, BT + long(E_) * r * I, BT + 2L * E_ * r * I};
  const long outd[3] = {I, I, H};

  const long tile = per_thread_tile(H, I, r);
  float* per_thread = sc.get(Scratch::PER_THREAD, size_t(rt.threads()) * tile);
  const TilePlan tp = plan_tiles(*sv, E_, ks, x.dtype == DType::bf16, rt.forward_tile_rows(format_));
  bf16* XT = tp.rows() ? sc.get_bf16(Scratch::TILE0, tp.rows() * tile_ld(H)) : nullptr;
  bf16* HT = tp.rows() ? sc.get_bf16(Scratch::TILE1, tp.rows() * tile_ld(I)) : nullptr;
  // LoRA of experts on tiles (RankTiles): z = x·Aᵀ and h·A_downᵀ, and down's z·Bᵀ (z in BF16, nt layout: ZD).
  // Gate's and up's z·Bᵀ stay in float32 (the axpy form over B transposed): on tiles they measured no faster
  // at Layer Q, where their 64-column items' products are one reduction step each (BENCHMARKS.md).
  const RankTiles rk{tp, r};
  bf16* ZD = tp.rows() && r > 0 ? sc.get_bf16(Scratch::RANK_TILES, RankTiles::rank_elems(tp, r)) : nullptr;
  // z = a·Aᵀ for an expert on tiles: a's tiles (act) as the operand, or with dropout its float32 rows masked.
  auto lora_in_on_tiles = [&](int p, int e, const bf16* act, Rows<float> rows, long in, int ith) {
    const int n = rows_of(*sv, e);
    float* z = Z[p] + sv->offset[e] * r;
    if (lora.dropout.on())
      lora_in_dropped_on_tiles(*tp.tk, ks, lora, p, *sv, e, rows, in, z, per_thread + ith * tile, tile);
    else
      run_tile(*tp.tk, TileNT<float>{n, r, int(in), act, lora_a(lora, p, e, in), z, r, false, {}});
    if (p == DOWN) tp.tk->pack_nt(n, r, 0, r, Rows<float>{nullptr, z, r}, rk.rank_at(ZD, e));
  };

  // Rank-space inputs of gate/up, B transposed to [r, out] so "out of rank space" products run in axpy form
  // with contiguous rows (experts with more than kLoraDotRows rows; down's only off tiles), and x in the tile
  // layout for experts on tiles.
  phase("forward.pack_x_lora_in");
  // Gate's and up's z = x·Aᵀ run on tiles for experts on them with more than kLoraDotRows rows; with fewer the
  // float32 dot form computes them without rounding A's panels to BF16 each call. When no expert's z runs on tiles
  // (decode, float32 activations, sets without tiles), each (expert, projection) is its own work item, so that a few
  // routed experts' B transposes and rank-space products spread over the threads: at Layer Q INT4 decode (8 experts,
  // 15 threads) the phase took 0.019-0.022 ms against 0.027-0.034 one item per expert (BENCHMARKS.md). Otherwise an
  // expert's x tiles feed its gate and up, so the expert is one item.
  const std::vector<int> routed = routed_experts(*sv, E_);
  auto z_on_tiles = [&](int e) { return tp.on(e) && rows_of(*sv, e) > kLoraDotRows; };
  auto z_of = [&](int p, int e, int ith) {
    if (z_on_tiles(e))
      lora_in_on_tiles(p, e, tp.at(XT, e, H), gathered(xrows, *sv, e), H, ith);
    else
      lora_in(ks, lora, p, *sv, e, gathered(xrows, *sv, e), H, Z[p] + sv->offset[e] * r, per_thread + ith * tile,
              tile);
  };
  auto pack_x = [&](int e) {
    if (tp.on(e)) tp.tk->pack_nt(rows_of(*sv, e), int(H), 0, H, gathered(xrows, *sv, e), tp.at(XT, e, H));
  };
  auto lora_inputs = [&](int p, int e, int ith) {
    if (lora.A[p].empty()) return;
    if (rows_of(*sv, e) > kLoraDotRows && (p != DOWN || !tp.on(e))) transpose_b(lora, p, e, outd[p], bt[p]);
    if (p != DOWN) z_of(p, e, ith);
  };
  if (std::none_of(routed.begin(), routed.end(), z_on_tiles)) {
    rt.parallel_for(long(routed.size()) * 3, [&](long i, int ith) {
      const int e = routed[i / 3], p = int(i % 3);
      if (p == GATE) pack_x(e);  // read by the next phase's products only
      lora_inputs(p, e, ith);
    });
  } else {
    rt.parallel_for(long(routed.size()), [&](long i, int ith) {
      const int e = routed[i];
      pack_x(e);
      for (int p = GATE; p <= DOWN; ++p) lora_inputs(p, e, ith);
    });
  }

  const bool decode = std::all_of(routed.begin(), routed.end(), [&](int e) { return rows_of(*sv, e) <= 2; });
  const long gw = decode ? decode_width(long(routed.size()), I, rt.threads()) : BLOCK;
  const long gate_up_blocks = ceil_div(I, gw);
  const long gate_up_items = long(routed.size()) * gate_up_blocks;
  auto gate_up_of = [&](long it) {
    return std::pair<int, long>{routed[it / gate_up_blocks], (it % gate_up_blocks) * gw};
  };
  const bool bf16_act = x.dtype == DType::bf16;
  // c[m, j] = act_m · W_p[row0 + j] for expert e's rows and `cols` weight rows of projection p (K columns): the
  // tile product on the call's BF16 copy `tiles` of the activations when e is on tiles, else the set's kernel
  // on their float32 rows `act`. The tile product requests `next`, the weights of the thread's next product,
  // sums the segment `f32` too, and streams its results with `stream` (TileNT).
  auto project = [&](int e, int p, long row0, int cols, int K, const bf16* tiles, Rows<float> act, float* c,
                     long ldc, const Upcoming& next, const TileF32& f32 = {}, bool stream = false) {
    const int n = rows_of(*sv, e);
    with_rows(e, p, row0, [&](const auto& rows) {
      if (tp.on(e)) {
        auto g = tile_nt(n, cols, K, tiles, rows, c, ldc, next);
        g.f32 = f32;
        g.stream = stream;
        run_tile(*tp.tk, g);
      } else {
        run_nt(ks, weight_nt(n, cols, K, act, rows, c, ldc), bf16_act);
      }
    });
  };
  auto gate_up_rows = [&](long it, int p) {
    const auto [e, i0] = gate_up_of(it);
    return upcoming(e, p, i0, std::min<long>(gw, I - i0), 0, H);
  };
  // Gate's rows of a block, then up's, requesting `after` (the thread's next item's rows) during up's product.
  auto gate_up_item = [&](long it, const Upcoming& after) {
    const auto [e, i0] = gate_up_of(it);
    const int n = rows_of(*sv, e), ib = int(std::min<long>(gw, I - i0));
    float* dst[2] = {G, U};
    for (int p = first_proj(); p <= UP; ++p) {
      float* c = dst[p] + sv->offset[e] * I + i0;
      const Upcoming next = p == UP ? after : gate_up_rows(it, UP);
      project(e, p, i0, ib, int(H), tp.at(XT, e, H), gathered(xrows, *sv, e), c, I, next);
      if (Z[p]) lora_out(ks, lora, p, e, I, n, Z[p] + sv->offset[e] * r, bt[p], i0, ib, c, I);
      add_bias(e, p, i0, ib, n, c);
    }
    for (int m = 0; m < n; ++m) {
      long o = (sv->offset[e] + m) * I + i0;
      ks.glu(ib, G ? G + o : nullptr, U + o, Hh + o, glu_);
    }
    if (tp.on(e)) tp.tk->pack_nt(n, int(I), i0, ib, slot_rows(Hh, *sv, e, I), tp.at(HT, e, I));
  };
  auto lora_in_down = [&](int e, int ith) {
    if (tp.on(e))
      lora_in_on_tiles(DOWN, e, tp.at(HT, e, I), slot_rows(Hh, *sv, e, I), I, ith);
    else
      lora_in(ks, lora, DOWN, *sv, e, slot_rows(Hh, *sv, e, I), I, Z[DOWN] + sv->offset[e] * r, per_thread + ith * tile,
              tile);
  };

  // Down per (expert, BLOCK columns) into per-slot rows [N, H], then the weighted sum per token (`combine`). The
  // rows are the backward's dx scratch, so training's peak is unchanged; inference holds N·H floats of scratch
  // too. The items run expert by expert, so an expert's h stays in cache across its column blocks. The other
  // form this replaced (down and the weighted sum per block of output columns, every routed expert in the item,
  // no slot rows) read every expert's h again for each block and, with a few experts, gave the pool few items:
  // on the GPU test machine this form's down was 2x faster at Layer Q, T = 8192, 1.4x at the DeepSeek-V3 layer,
  // T = 4096, and faster at every size measured down to decode (Layer Q, 15 threads: 0.125 against 0.158 ms,
  // INT4, T = 1; 0.50-0.52 against 0.63-0.65, T = 4; 4.4-5.4 against 6.1-6.7, T = 64-200; BENCHMARKS.md). The
  // slot rows are streamed past the caches on tiles (nothing reads them before combine): Layer Q's phase 8-11 ms
  // against 11-14 stored through them at T = 2048, 23-31 against 35-40 at T = 8192.
  float* Y = sc.get(Scratch::SLOT_ROWS, size_t(N) * H);
  const long dw = decode ? decode_width(long(routed.size()), H, rt.threads()) : BLOCK;
  const long blocks = ceil_div(H, dw);
  const long down_items = long(routed.size()) * blocks;
  auto block_of = [&](long it) { return std::pair<int, long>{routed[it / blocks], (it % blocks) * dw}; };
  auto down_rows = [&](long it) {
    const auto [e, h0] = block_of(it);
    return upcoming(e, DOWN, h0, std::min<long>(dw, H - h0), 0, I);
  };
  // Down's product for expert e's rows and `cols` output columns from h0 into c (row stride ldc), LoRA included:
  // on tiles z·Bᵀ is the product's last reduction block, so c is stored once, streamed past the caches.
  auto down_item = [&](long it, const Upcoming& next) {
    const auto [e, h0] = block_of(it);
    const int cols = int(std::min<long>(dw, H - h0));
    float* c = Y + sv->offset[e] * H + h0;
    const bool lora_on_tiles = Z[DOWN] && tp.on(e);
    const TileF32 lora_seg =
        lora_on_tiles ? TileF32{rk.rank_at(ZD, e), lora_b(lora, DOWN, e, H, h0), r, lora.scale} : TileF32{};
    project(e, DOWN, h0, cols, int(I), tp.at(HT, e, I), slot_rows(Hh, *sv, e, I), c, H, next, lora_seg, true);
    if (Z[DOWN] && !lora_on_tiles)
      lora_out(ks, lora, DOWN, e, H, rows_of(*sv, e), Z[DOWN] + sv->offset[e] * r, bt[DOWN], h0, cols, c, H);
  };

  if (decode) {
    // One phase instead of three: an expert's down items start once its own gate/up items and h·A_downᵀ are done
    // (the thread that finishes the expert's last gate/up item computes the latter), not once every expert's are,
    // behind two barriers and the tail of the gate/up items. Items are handed out in order, so a down item is taken
    // only after every gate/up item has been: the items it waits on are running, or claimed next by a thread
    // running an earlier gate/up item, and gate/up items never wait. On the GPU test machine (Layer Q decode, 15
    // threads) BF16, INT4 and FP8 calls took 11-13% less (BENCHMARKS.md).
    phase("forward.gate_up_down");
    const size_t n = routed.size();
    std::unique_ptr<std::atomic<long>[]> left(new std::atomic<long>[n]);  // gate/up items of an expert not done
    std::unique_ptr<std::atomic<bool>[]> ready(new std::atomic<bool>[n]);
    for (size_t i = 0; i < n; ++i) left[i] = gate_up_blocks, ready[i] = false;
    std::atomic<bool> failed{false};  // waiting threads give up once an item threw (the pool rethrows it)
    rt.parallel_for_ahead(gate_up_items + down_items, [&](long it, long next_it, int ith) {
      const Upcoming next = next_it < 0               ? Upcoming{}
                            : next_it < gate_up_items ? gate_up_rows(next_it, first_proj())
                                                      : down_rows(next_it - gate_up_items);
      try {
        if (it < gate_up_items) {
          const long i = it / gate_up_blocks;
          gate_up_item(it, next);
          if (left[i].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            if (Z[DOWN]) lora_in_down(routed[i], ith);
            ready[i].store(true, std::memory_order_release);
          }
          return;
        }
        const long d = it - gate_up_items, i = d / blocks;
        auto settled = [&] {
          return ready[i].load(std::memory_order_acquire) || failed.load(std::memory_order_relaxed);
        };
        // Spinning as the pool's threads do, then yielding: with more threads than free cores the item waited on
        // may need this core.
        if (!spin_until(settled))
          while (!settled()) std::this_thread::yield();
        if (!ready[i].load(std::memory_order_acquire)) return;  // an item threw
        down_item(d, next);
      } catch (...) {
        failed = true;
        throw;
      }
    });
  } else {
    phase("forward.gate_up");
    rt.parallel_for_ahead(gate_up_items, [&](long it, long next_it, int) {
      gate_up_item(it, next_it >= 0 ? gate_up_rows(next_it, first_proj()) : Upcoming{});
    });
    phase("forward.lora_in_down");
    if (Z[DOWN])
      for_routed_experts(rt, *sv, E_, [&](long e, int ith) { lora_in_down(int(e), ith); });
    phase("forward.down_slots");
    rt.parallel_for_ahead(down_items, [&](long it, long next_it, int) {
      down_item(it, next_it >= 0 ? down_rows(next_it) : Upcoming{});
    });
  }
  phase("forward.combine");
  combine(out, Y, H, *sv, sv->slot_w.data(), rt, per_thread);
  return save ? sv : nullptr;
}

}  // namespace kt

namespace kt {

void MoeExperts::backward(const Saved& sv, const View& x, const View& dout, const Lora& lora, const Grads& gr,
                          const BackwardCopy& copy) const {
  Runtime& rt = Runtime::get();
  const KernelSet& ks = rt.kernels();
  const int T = sv.T, K = sv.K, r = lora.r;
  const long H = H_, I = I_, N = long(T) * K;
  const float s = lora.scale;
  expect_float(x, "hidden_states", {T, H});
  expect(dout, "grad_output", x.dtype, {T, H});
  expect(gr.dx, "grad_hidden_states", x.dtype, {T, H});
  expect(gr.dw, "grad_top_k_weights", DType::f32, {T, K});
  check_lora(lora);
  const long in[3] = {H, H, I}, outd[3] = {I, I, H};
  for (int p = 0; p < 3; ++p) {
    if (T > 0 && !sv.z[p] != lora.A[p].empty())
      throw std::invalid_argument("backward must get the same LoRA projections as the forward it follows.");
    if (!gr.dA[p].empty()) expect(gr.dA[p], "grad of lora_A", DType::f32, {E_, r, in[p]});
    if (!gr.dB[p].empty()) expect(gr.dB[p], "grad of lora_B", DType::f32, {E_, outd[p], r});
  }
  if (format_ != Format::bf16 && (!gr.d_gate_up.empty() || !gr.d_down.empty()))
    throw std::invalid_argument(std::string("full-parameter training of ") + format_name(format_) +
                                " expert weights is not supported; load the experts in BF16 to train them.");
  const long SI = long(stacked()) * I;
  if (!gr.d_gate_up.empty()) expect_float(gr.d_gate_up, "grad of gate_up_proj", {E_, SI, H});
  if (!gr.d_down.empty()) expect_float(gr.d_down, "grad of down_proj", {E_, H, I});
  if (!gr.d_gate_up_bias.empty()) {
    if (w_.gate_up_bias.empty()) throw std::invalid_argument("a gate_up bias grad was asked of experts without one.");
    expect(gr.d_gate_up_bias, "grad of gate_up_proj_bias", DType::f32, {E_, SI});
  }
  if (!copy.empty()) check_backward_copy(*this, copy);
  // An axpy-form tile product's weight segments packed ahead: projection p's (and `second`'s) from column col0,
  // which is a multiple of 32 (items start at multiples of nn_width, 256 or more, on tiles).
  auto packed_from = [&](auto& g, int e, int p, int second, long col0) {
    if (copy.empty()) return;
    g.packed[0] = backward_copy_at(*this, copy, e, p, col0);
    if (second >= 0) g.packed[1] = backward_copy_at(*this, copy, e, second, col0);
    g.packed_blocks = backward_copy_blocks(*this, p);
  };
  Phases phase(rt);
  phase("backward.inputs");
  // LoRA grads of experts that got no token are zeros, or get nothing added (the others are written below).
  for (int e = 0; e < E_; ++e) {
    if (T > 0 && rows_of(sv, e)) continue;
    for (int p = 0; p < 3; ++p) {
      if (!gr.dA[p].empty() && !gr.acc_A[p])
        std::fill_n(gr.dA[p].as<float>() + long(e) * r * in[p], long(r) * in[p], 0.f);
      if (!gr.dB[p].empty() && !gr.acc_B[p])
        std::fill_n(gr.dB[p].as<float>() + long(e) * outd[p] * r, outd[p] * long(r), 0.f);
    }
  }
  if (T == 0) return;

  Scratch& sc = rt.scratch();
  const float* X = as_f32(x, sc.get(Scratch::X, size_t(T) * H), rt);
  const float* D = as_f32(dout, sc.get(Scratch::DOUT, size_t(T) * H), rt);
  std::vector<const float*> xrows(N), drows(N);
  for (long i = 0; i < N; ++i) {
    xrows[i] = X + long(sv.slot_token[i]) * H;
    drows[i] = D + long(sv.slot_token[i]) * H;
  }
  const float* G = sv.g.get();
  const float* U = sv.u.get();
  float* Hh = sc.get(Scratch::HH, N * I);
  float* P = sc.get(Scratch::P, N * I);
  float* dG = sc.get(Scratch::DG, N * I);
  float* dU = sc.get(Scratch::DU, N * I);
  float* dXs = sc.get(Scratch::SLOT_ROWS, N * H);
  // Rank-space products of the backward: zb = dout·Bd (down), wz[GATE] = dg·Bg, wz[UP] = du·Bu.
  float* wz[3] = {sc.get(Scratch::Z0, N * r), sc.get(Scratch::Z1, N * r), sc.get(Scratch::Z2, N * r)};
  float* BT = sc.get(Scratch::BT, size_t(E_) * r * (2 * I + H));
  float* bt[3] = {BT, BT + long(E_) * r * I, BT + 2L * E_ * r * I};
  const long tile = per_thread_tile(H, I, r);
  float* per_thread = sc.get(Scratch::PER_THREAD, size_t(rt.threads()) * tile);
  const bool lora_on[3] = {!lora.A[GATE].empty(), !lora.A[UP].empty(), !lora.A[DOWN].empty()};
  const TilePlan tp = plan_tiles(sv, E_, ks, x.dtype == DType::bf16, rt.backward_tile_rows());
  bf16* DT = tp.rows() ? sc.get_bf16(Scratch::TILE0, tp.rows() * nn_ld(H)) : nullptr;
  bf16* GT = tp.rows() ? sc.get_bf16(Scratch::TILE1, tp.rows() * nn_ld(I)) : nullptr;
  bf16* UT = tp.rows() ? sc.get_bf16(Scratch::TILE2, tp.rows() * nn_ld(I)) : nullptr;
  // For experts whose LoRA runs on tiles (RankTiles): wz in the nn layout (WT), and transposed the A operands
  // of the LoRA grads: wz (with the routing weight for down) for dA (WZ_T), z (likewise) for dB (Z_T).
  const RankTiles rk{tp, r};
  bf16 *WT[3] = {}, *WZ_T[3] = {}, *Z_T[3] = {};
  if (tp.rows() && r > 0) {
    const size_t per = RankTiles::rank_elems(tp, r), per_t = RankTiles::rank_t_elems(tp, r, E_);
    bf16* buf = sc.get_bf16(Scratch::RANK_TILES, 3 * per + 6 * per_t);
    for (int p = 0; p < 3; ++p) {
      WT[p] = buf + p * per;
      WZ_T[p] = buf + 3 * per + p * per_t;
      Z_T[p] = buf + 3 * per + (3 + p) * per_t;
    }
  }
  // wz = dy·B of an expert whose LoRA runs on tiles (dy: its activation tiles in the nn layout, K columns),
  // into float32 rows and the nn layout.
  auto rank_grad_on_tiles = [&](int p, int e, const bf16* dy, long K) {
    const int n = rows_of(sv, e);
    float* z = wz[p] + sv.offset[e] * r;
    run_tile(*tp.tk, TileNN<float>{n, r, int(K), dy, lora_b(lora, p, e, K, 0), 0, z, r, false, {}});
    tp.tk->pack_nn(n, r, 0, r, Rows<float>{nullptr, z, r}, rk.rank_nn_at(WT[p], e));
  };
  // c += s·(wz·A)[:, col0, col0 + cols): the gradient of projection p's LoRA input (in columns of it).
  auto lora_in_grad_of = [&](int p, int e, long in, long col0, int cols, float* c, long ldc, int ith) {
    const int n = rows_of(sv, e);
    if (tp.on(e) && lora.dropout.on())
      lora_in_grad_dropped_on_tiles(*tp.tk, ks, lora, p, sv, e, rk.rank_nn_at(WT[p], e), in, col0, cols, c, ldc,
                                    per_thread + ith * tile, tile);
    else if (tp.on(e))
      run_tile(*tp.tk, TileNN<float>{n, cols, r, rk.rank_nn_at(WT[p], e), lora_a(lora, p, e, in), col0, c, ldc, true, {},
                                     s});
    else
      lora_in_grad(ks, lora, p, sv, e, wz[p] + sv.offset[e] * r, in, col0, cols, c, ldc, per_thread + ith * tile, tile);
  };

  phase("backward.pack_dout_lora");
  for_routed_experts(rt, sv, E_, [&](long e, int) {
    const int n = rows_of(sv, int(e));
    if (tp.on(int(e))) {
      tp.tk->pack_nn(n, int(H), 0, H, gathered(drows, sv, int(e)), tp.at_nn(DT, int(e), H));
      if (lora_on[DOWN]) rank_grad_on_tiles(DOWN, int(e), tp.at_nn(DT, int(e), H), H);
      return;
    }
    for (int p = 0; p < 3; ++p)
      if (lora_on[p]) transpose_b(lora, p, e, outd[p], bt[p]);
    if (lora_on[DOWN])
      ks.gemm_nt_f32({n, r, int(H), gathered(drows, sv, int(e)), {nullptr, bt[DOWN] + e * r * H, H},
                      wz[DOWN] + sv.offset[e] * r, r, 1.f, false});
  });

  // p = dout·Wd (+ s·zb·Ad): the gradient of h before the routing weight; h recomputed from g, u.
  phase("backward.dout_down");
  const long max_blocks = ceil_div(I, BLOCK);  // column blocks of an expert's items, at most
  std::vector<float> dw_parts(N * max_blocks);
  std::vector<Item> items;
  for (int e = 0; e < E_; ++e)
    if (rows_of(sv, e))
      for (int b = 0; b < ceil_div(I, nn_width(tp, e, H)); ++b) items.push_back({0, e, b});
  // The weight panel of an item (K rows from projection p's first, its block of columns), to request while the
  // thread's current product runs: only where `fit` such panels fit together in kPanelBytes, this one and the
  // next (at Layer Q the dx panels, K = I; dout·W_down's, K = H, got slower requested, or narrowed to fit, on the
  // GPU machine). The fused dx's gate and up panels (adjacent rows of gate_up_proj, K = 2I) are asked for with
  // fit 1: Layer Q's 256-column items (2 × 768 KB) measured no slower than 128-column items that fit twice.
  auto panel_of = [&](long it, int p, long out, long K, int fit) {
    const int e = items[it].e, width = nn_width(tp, e, K);
    const long c0 = long(items[it].block) * width;
    if (fit * K * width * 2 > kPanelBytes) return Upcoming{};
    return upcoming(e, p, 0, K, c0, std::min<long>(width, out - c0));
  };
  rt.parallel_for_ahead(long(items.size()), [&](long it, long next_it, int ith) {
    const int e = items[it].e, n = rows_of(sv, e), width = nn_width(tp, e, H);
    const long i0 = long(items[it].block) * width;
    const int ib = int(std::min<long>(width, I - i0));
    float* c = P + sv.offset[e] * I + i0;
    with_rows(e, DOWN, 0, [&](const auto& rows) {
      if (tp.on(e)) {
        auto g = tile_nn(n, ib, int(H), tp.at_nn(DT, e, H), rows, i0, c, I, false,
                         next_it >= 0 ? panel_of(next_it, DOWN, I, H, 2) : Upcoming{});
        packed_from(g, e, DOWN, -1, i0);
        run_tile(*tp.tk, g);
      } else
        run_nn(ks, weight_nn(n, ib, int(H), gathered(drows, sv, e), rows, i0, c, I, false));
    });
    if (lora_on[DOWN]) lora_in_grad_of(DOWN, e, I, i0, ib, c, I, ith);
    // The slots' work on this block while it is in cache (a pass of its own re-read ~300 MB at Layer Q):
    // h = glu(g, u); this block's share of d w = <p, h>; dh = w·p; dg, du through glu(g, u).
    for (int m = 0; m < n; ++m) {
      const long slot = sv.offset[e] + m, o = slot * I + i0;
      const float* g = G ? G + o : nullptr;
      ks.glu(ib, g, U + o, Hh + o, glu_);
      dw_parts[slot * max_blocks + items[it].block] = ks.dot(ib, P + o, Hh + o);
      ks.scale(ib, sv.slot_w[slot], P + o);
      ks.glu_backward(ib, g, U + o, P + o, G ? dG + o : nullptr, dU + o, glu_);
    }
    if (tp.on(e)) {  // dg, du of these columns in the tile layout for dx, from cache too
      if (G) tp.tk->pack_nn(n, int(I), i0, ib, slot_rows(dG, sv, e, I), tp.at_nn(GT, e, I));
      tp.tk->pack_nn(n, int(I), i0, ib, slot_rows(dU, sv, e, I), tp.at_nn(UT, e, I));
    }
  });

  // d w per slot: its blocks' shares summed in block order (the same sum whatever thread computed each); 0 for the
  // pairs routed to no expert.
  phase("backward.dw_sum");
  for (long i = 0; i < N; ++i)
    if (sv.slot_of[i] < 0) gr.dw.as<float>()[i] = 0.f;
  for_routed_experts(rt, sv, E_, [&](long e, int) {
    const int blocks = int(ceil_div(I, nn_width(tp, int(e), H)));
    for (long slot = sv.offset[e]; slot < sv.offset[e + 1]; ++slot) {
      float sum = 0.f;
      for (int b = 0; b < blocks; ++b) sum += dw_parts[slot * max_blocks + b];
      gr.dw.as<float>()[sv.slot_src[slot]] = sum;
    }
  });

  // The gate/up bias grads: each expert's dg and du rows summed, in slot order.
  if (!gr.d_gate_up_bias.empty()) {
    phase("backward.bias_grad");
    for_routed_experts(rt, sv, E_, [&](long e, int) {
      float* db = gr.d_gate_up_bias.as<float>() + e * SI;
      for (long slot = sv.offset[e]; slot < sv.offset[e + 1]; ++slot) {
        if (G) ks.axpy(I, 1.f, dG + slot * I, db);
        ks.axpy(I, 1.f, dU + slot * I, db + stack_index(UP) * I);
      }
    });
  }

  // LoRA's rank-space rows of dg and du: wz[GATE] = dg·Bg, wz[UP] = du·Bu (reductions over all of I); on tiles,
  // the A operands of the LoRA grads too.
  phase("backward.lora_dg_du");
  if (lora_on[GATE] || lora_on[UP] || lora_on[DOWN])
    for_routed_experts(rt, sv, E_, [&](long e, int) {
      const int n = rows_of(sv, int(e));
      const float* dgu[2] = {dG, dU};
      const bf16* dgu_t[2] = {GT, UT};
      for (int p = GATE; p <= UP; ++p)
        if (lora_on[p] && tp.on(int(e)))
          rank_grad_on_tiles(p, int(e), tp.at_nn(dgu_t[p], int(e), I), I);
        else if (lora_on[p])
          ks.gemm_nt_f32({n, r, int(I), slot_rows(dgu[p], sv, int(e), I),
                          {nullptr, bt[p] + e * r * I, I}, wz[p] + sv.offset[e] * r, r, 1.f, false});
      if (!tp.on(int(e))) return;
      const float* w = sv.slot_w.data() + sv.offset[e];
      // Only the operands of the grads wanted (a frozen A or B has none).
      for (int p = 0; p < 3; ++p) {
        if (!lora_on[p]) continue;
        const float* kscale = p == DOWN ? w : nullptr;
        if (!gr.dA[p].empty())
          pack_rank_transposed(*tp.tk, n, r, wz[p] + sv.offset[e] * r, kscale, rk.rank_t_at(WZ_T[p], int(e)));
        if (!gr.dB[p].empty())
          pack_rank_transposed(*tp.tk, n, r, sv.z[p].get() + sv.offset[e] * r, kscale, rk.rank_t_at(Z_T[p], int(e)));
      }
    });

  // dx per slot = dg·Wg + du·Wu (+ s·wz·A), then summed over each token's k. For an expert on tiles (without
  // dropout, whose masks differ per projection) one tile product sums all four terms: its panel holds Wg's
  // and Wu's rows, then s·Ag's and s·Au's, so C is stored once instead of added into three more times. Without a
  // gate, dx = du·Wu (+ s·wz·Au).
  phase("backward.dx");
  const bool fuse_dx = !lora.dropout.on() && glu_.gated;
  auto dx_width = [&](int e) { return nn_width(tp, e, fuse_dx ? 2 * I : I); };
  items.clear();
  for (int e = 0; e < E_; ++e)
    if (rows_of(sv, e))
      for (int b = 0; b < ceil_div(H, dx_width(e)); ++b) items.push_back({0, e, b});
  rt.parallel_for_ahead(long(items.size()), [&](long it, long next_it, int ith) {
    const int e = items[it].e, n = rows_of(sv, e), width = dx_width(e);
    const long h0 = long(items[it].block) * width;
    const int hb = int(std::min<long>(width, H - h0));
    float* c = dXs + sv.offset[e] * H + h0;
    if (fuse_dx && tp.on(e)) {
      const Upcoming next = next_it >= 0 ? panel_of(next_it, GATE, H, 2 * I, 1) : Upcoming{};
      with_rows(e, GATE, 0, [&](const auto& gate) {
        with_rows(e, UP, 0, [&](const auto& up) {
          // One format per expert: the rows are always of one type (the check only prunes instantiations).
          if constexpr (std::is_same_v<std::decay_t<decltype(gate)>, std::decay_t<decltype(up)>>) {
            auto g = tile_nn(n, hb, int(I), tp.at_nn(GT, e, I), gate, h0, c, H, false, next);
            g.second = {tp.at_nn(UT, e, I), up, int(I)};
            g.stream = true;  // dx_sum reads the slot rows (N·H floats) after they have left the cache
            packed_from(g, e, GATE, UP, h0);
            for (int p = GATE; p <= UP; ++p)
              if (lora_on[p]) g.f32[p] = {rk.rank_nn_at(WT[p], e), lora_a(lora, p, e, H), r, s};
            run_tile(*tp.tk, g);
          }
        });
      });
      return;
    }
    float* dgu[2] = {dG, dU};
    const bf16* dgu_t[2] = {GT, UT};
    for (int p = first_proj(); p <= UP; ++p) {
      // Gate's panel, then up's of the same columns, then the next item's first panel.
      const Upcoming next = p != UP       ? panel_of(it, UP, H, I, 2)
                            : next_it >= 0 ? panel_of(next_it, first_proj(), H, I, 2)
                                           : Upcoming{};
      const bool add = p != first_proj();  // into gate's terms
      with_rows(e, p, 0, [&](const auto& rows) {
        if (tp.on(e)) {
          auto g = tile_nn(n, hb, int(I), tp.at_nn(dgu_t[p], e, I), rows, h0, c, H, add, next);
          packed_from(g, e, p, -1, h0);
          run_tile(*tp.tk, g);
        } else
          run_nn(ks, weight_nn(n, hb, int(I), slot_rows(dgu[p], sv, e, I), rows, h0, c, H, add));
      });
      if (lora_on[p]) lora_in_grad_of(p, e, H, h0, hb, c, H, ith);
    }
  });
  phase("backward.dx_sum");
  combine(gr.dx, dXs, H, sv, nullptr, rt, per_thread);

  phase("backward.weight_grads");
  // Weight gradients (LoRA overwritten or, where flagged, added into; base accumulated): kinds index the work
  // items of one parallel phase.
  enum { dA_DOWN, dB_DOWN, dA_GU, dB_GU, dW_DOWN, dW_GU };  // LoRA kinds first (kind < dW_DOWN)
  auto wants_dA = [&](int p) { return lora_on[p] && !gr.dA[p].empty(); };
  items.clear();
  for (int e = 0; e < E_; ++e) {
    if (!rows_of(sv, e)) continue;
    for (int p = 0; p < 3; ++p) {
      if (!lora_on[p]) continue;
      const long nb_in = ceil_div(in[p], LORA_GRAD_BLOCK), nb_out = ceil_div(outd[p], LORA_GRAD_BLOCK);
      // Gate's and up's A grads read the same columns of the same x rows: one item computes both (the second
      // product finds the rows in cache), listed at gate's place, or up's when gate has none.
      if (!gr.dA[p].empty() && (p != UP || !wants_dA(GATE)))
        for (int b = 0; b < nb_in; ++b) items.push_back({p == DOWN ? dA_DOWN : dA_GU, e, b});
      if (!gr.dB[p].empty())
        for (int b = 0; b < nb_out; ++b) items.push_back({p == DOWN ? dB_DOWN : dB_GU + 16 * p, e, b});
    }
    if (!gr.d_down.empty())
      for (int b = 0; b < ceil_div(H, BLOCK); ++b) items.push_back({dW_DOWN, e, b});
    if (!gr.d_gate_up.empty())
      for (int p = first_proj(); p <= UP; ++p)
        for (int b = 0; b < ceil_div(I, BLOCK); ++b) items.push_back({dW_GU + 16 * p, e, b});
  }
  // On tiles the grads reduce over the expert's rows with the transposed rank-space rows as the A operand and
  // the activations' rows as B: x (unless dropout masks it) and dout as the BF16 rows they came in as, dg and du
  // from their tiles.
  std::vector<const bf16*> xb;
  if (tp.rows() && r > 0 && !lora.dropout.on() && (wants_dA(GATE) || wants_dA(UP))) {
    xb.resize(N);
    for (long i = 0; i < N; ++i) xb[i] = x.as<bf16>() + long(sv.slot_token[i]) * H;
  }
  // dst (r rows, ldd apart) (+)= s · t_rows · act[:, c0, c0 + cols) over the expert's n rows.
  auto grad_on_tiles = [&](int e, const bf16* t_rows, const auto& act, long c0, int cols, float* dst, long ldd,
                           bool accumulate) {
    using TB = std::remove_const_t<std::remove_pointer_t<decltype(act.base)>>;
    run_tile(*tp.tk, TileNN<TB>{r, cols, rows_of(sv, e), t_rows, act, c0, dst, ldd, accumulate, {}, s});
  };
  rt.parallel_for(long(items.size()), [&](long it, int ith) {
    const int kind = items[it].kind % 16, p = items[it].kind / 16, e = items[it].e, n = rows_of(sv, e);
    const long c0 = long(items[it].block) * (kind < dW_DOWN ? LORA_GRAD_BLOCK : BLOCK);
    float* tmp = per_thread + long(ith) * tile;
    const float* w = sv.slot_w.data() + sv.offset[e];
    float* dgu[2] = {dG, dU};
    const bf16* dgu_t[2] = {GT, UT};
    if (kind < dW_DOWN && tp.on(e)) {
      const long out = kind == dA_DOWN ? I : kind == dB_DOWN || kind == dA_GU ? H : I;
      const int cb = int(std::min<long>(LORA_GRAD_BLOCK, out - c0));
      switch (kind) {
        case dA_DOWN:
          if (lora.dropout.on())
            lora_dA_dropped_on_tiles(*tp.tk, ks, lora, DOWN, sv, e, rk.rank_t_at(WZ_T[DOWN], e), slot_rows(Hh, sv, e, I),
                                     c0, cb, gr.dA[DOWN].as<float>() + long(e) * r * I + c0, I, gr.acc_A[DOWN]);
          else
            grad_on_tiles(e, rk.rank_t_at(WZ_T[DOWN], e), slot_rows(Hh, sv, e, I), c0, cb,
                          gr.dA[DOWN].as<float>() + long(e) * r * I + c0, I, gr.acc_A[DOWN]);
          break;
        case dB_DOWN:
          grad_on_tiles(e, rk.rank_t_at(Z_T[DOWN], e), Rows<bf16>{nullptr, tp.at_nn(DT, e, H), nn_ld(H)}, c0, cb, tmp,
                        cb, false);
          transpose(tmp, r, cb, gr.dB[DOWN].as<float>() + (long(e) * H + c0) * r, gr.acc_B[DOWN]);
          break;
        case dA_GU:
          for (int q = GATE; q <= UP; ++q)
            if (wants_dA(q) && lora.dropout.on())
              lora_dA_dropped_on_tiles(*tp.tk, ks, lora, q, sv, e, rk.rank_t_at(WZ_T[q], e), gathered(xrows, sv, e), c0,
                                       cb, gr.dA[q].as<float>() + long(e) * r * H + c0, H, gr.acc_A[q]);
            else if (wants_dA(q))
              grad_on_tiles(e, rk.rank_t_at(WZ_T[q], e), Rows<bf16>{xb.data() + sv.offset[e], nullptr, 0}, c0, cb,
                            gr.dA[q].as<float>() + long(e) * r * H + c0, H, gr.acc_A[q]);
          break;
        case dB_GU:
          grad_on_tiles(e, rk.rank_t_at(Z_T[p], e), Rows<bf16>{nullptr, tp.at_nn(dgu_t[p], e, I), nn_ld(I)}, c0, cb, tmp,
                        cb, false);
          transpose(tmp, r, cb, gr.dB[p].as<float>() + (long(e) * I + c0) * r, gr.acc_B[p]);
          break;
      }
      return;
    }
    switch (kind) {
      case dA_DOWN: {  // dAd[j, i] = s Σ_m w_m zb[m, j] drop(h)[m, i]
        const int cb = int(std::min<long>(LORA_GRAD_BLOCK, I - c0));
        lora_dA(ks, lora, DOWN, sv, e, wz[DOWN] + sv.offset[e] * r, w, slot_rows(Hh, sv, e, I), c0, cb,
                gr.dA[DOWN].as<float>() + long(e) * r * I + c0, I, gr.acc_A[DOWN], tmp, tile);
        break;
      }
      case dB_DOWN: {  // dBd[h, j] = s Σ_m w_m zd[m, j] dout[m, h], computed as [j, h] then transposed
        const int cb = int(std::min<long>(LORA_GRAD_BLOCK, H - c0));
        ks.gemm_nn_f32({r, cb, n, slot_rows(sv.z[DOWN].get(), sv, e, r), 0, true, w, gathered(drows, sv, e), c0, tmp,
                        cb, s, false});
        transpose(tmp, r, cb, gr.dB[DOWN].as<float>() + (long(e) * H + c0) * r, gr.acc_B[DOWN]);
        break;
      }
      case dA_GU: {  // dAp[j, h] = s Σ_m wz[m, j] drop(x)[m, h], for gate and up
        const int cb = int(std::min<long>(LORA_GRAD_BLOCK, H - c0));
        for (int q = GATE; q <= UP; ++q)
          if (wants_dA(q))
            lora_dA(ks, lora, q, sv, e, wz[q] + sv.offset[e] * r, nullptr, gathered(xrows, sv, e), c0, cb,
                    gr.dA[q].as<float>() + long(e) * r * H + c0, H, gr.acc_A[q], tmp, tile);
        break;
      }
      case dB_GU: {  // dBp[i, j] = s Σ_m zp[m, j] dp[m, i], computed as [j, i] then transposed
        const int cb = int(std::min<long>(LORA_GRAD_BLOCK, I - c0));
        ks.gemm_nn_f32({r, cb, n, slot_rows(sv.z[p].get(), sv, e, r), 0, true, nullptr, slot_rows(dgu[p], sv, e, I), c0,
                        tmp, cb, s, false});
        transpose(tmp, r, cb, gr.dB[p].as<float>() + (long(e) * I + c0) * r, gr.acc_B[p]);
        break;
      }
      case dW_DOWN: {  // dWd[h, i] += Σ_m w_m dout[m, h] h[m, i]
        const int cb = int(std::min<long>(BLOCK, H - c0));
        ks.gemm_nn_f32({cb, int(I), n, gathered(drows, sv, e), c0, true, w, slot_rows(Hh, sv, e, I), 0, tmp, I, 1.f, false});
        accumulate_into(gr.d_down, (long(e) * H + c0) * I, I, tmp, cb, I);
        break;
      }
      case dW_GU: {  // dWp[i, h] += Σ_m dp[m, i] x[m, h]
        const int cb = int(std::min<long>(BLOCK, I - c0));
        ks.gemm_nn_f32({cb, int(H), n, slot_rows(dgu[p], sv, e, I), c0, true, nullptr, gathered(xrows, sv, e), 0, tmp, H,
                        1.f, false});
        accumulate_into(gr.d_gate_up, ((long(e) * stacked() + stack_index(p)) * I + c0) * H, H, tmp, cb, H);
        break;
      }
    }
  });
}

}  // namespace kt
