// FP8 and INT4 weights in the dot form on vdpbf16ps (experts off the tiles: decode, a few rows), for the sets with
// AVX-512 BF16 (avx512_bf16, amx) and activations that came in as BF16 (KernelSet::gemm_nt_fp8_act,
// gemm_nt_int4_act). Both formats' values are exact in BF16 (INT4: −8..7; FP8 e4m3: 3 mantissa bits, and its
// subnormals are normal BF16 numbers, as is INT4's code + 136), so a step decodes a row's weights into BF16 vectors
// (FP8: 64 into two, by table lookups; INT4: 128 into four, by masks) and multiplies them in pairs with the
// activations, which were reordered once per call to meet them; the float32
// forms (gemm_nt_int4_split, gemm_nt_fused) convert 16 codes per step and need two FMAs for what one vdpbf16ps does.
// x is exact in BF16 already; h = silu(g)·u is rounded as the model's own BF16 dtype would (tests/tolerances.py:
// BF16_DOT). Included after kernel_body.h by the two sets' files, compiled with -mavx512bf16 (INT4), and by
// fp8_bf16_dot.cpp (KT_FP8_BF16_DOT defined), compiled with -mavx512vbmi besides: FP8's byte lookups need AVX-512
// VBMI (Zen 4, Sapphire Rapids; not Cooper Lake), so the sets take that product only where CPUID has it.
#pragma once
#include <cstring>
#include <type_traits>

namespace {

// INT4: 0x4300 | n is the BF16 of 128 + n, so a nibble n is made a BF16 value by a mask and an OR (one ternary-logic
// instruction, on either vector port) where a table lookup sat on port 5. The decoded value is the code (n − 8)
// plus kBias = 136, which each product's sums take back off in one vector per step and activation row (bf16_dot's
// `bias`: −136 × the sum of the BF16 activations that lane meets). The float32 sums then carry magnitudes up to
// 136/|code| times the exact terms': each term's rounding stays below 136 × 2⁻²⁴ ≈ 8e-6 of its activation, under a
// four-hundredth of the BF16 rounding the activation itself took (tests/tolerances.py: BF16_DOT). On the GPU test
// machine's Xeon the dot form ran 15-24% faster per thread from cache, 50% from RAM, and 25-45% faster fifteen
// at once, than with the lookups (BENCHMARKS.md).
// - Steps of 128 weights (one or two activation rows): a step's 64 bytes as 32 words, word j holding codes 4j ..
//   4j + 3, one per nibble; vector v takes nibble v of every word, nibbles 2 and 3 brought down by byte shuffles
//   (port 5) so that shifts and vdpbf16ps are not all on port 0. Float32 lane i of the product sums codes 8i ..
//   8i + 7, so lanes 4g .. 4g + 3 belong to the step's group g.
// - Steps of 64 (blocks of four rows, where the 128-weight step's registers spilled: 11% slower on Zen 4): a step's
//   32 bytes widened to words, the low nibbles giving the even-indexed codes and the bytes shifted right by 4 the
//   odd ones. Lane i sums codes 4i .. 4i + 3: lanes 0-7 are the first group's, 8-15 the second's.
template <int Step>
struct Int4Steps {
  using Weights = int4_group;
  using Cursor = Int4Cursor<Simd>;
  // The next block's codes requested into L1: into L2 the dot form ran 10-20% slower from RAM (Zen 4, one and two
  // threads; BENCHMARKS.md).
  static constexpr int kRequestLocality = 3;
  // The next block only: 8 KB on, one thread read 2048-code rows 5-8% slower from RAM and 768-code rows no faster
  // (Zen 4, quantized_dot_probe; BENCHMARKS.md).
  static constexpr long kAheadBytes = 0;
  static constexpr int kStep = Step;
  static constexpr float kBias = 136.f;
  __m512i low4 = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  // Each word's high byte moved to its low byte (byte indexes 1, 3, .. 15 of a 128-bit lane), 0x80 zeroing its high.
  static constexpr uint64_t kLow = 0x8007800580038001, kHigh = 0x800F800D800B8009;
  __m512i high_byte = _mm512_set_epi64(kHigh, kLow, kHigh, kLow, kHigh, kLow, kHigh, kLow);
  static constexpr int kMaskOr = 0xEA;  // ternary logic (A & B) | C
  static int column(int lane) {
    if constexpr (Step == 128) return 4 * (lane % 32) + lane / 32;
    return lane < 32 ? 2 * lane : 2 * (lane - 32) + 1;
  }
  void weights(const Cursor& c, long s, int len, __m512i (&w)[Step / 32]) const {
    if constexpr (Step == 128) {
      const __m512i z = _mm512_maskz_loadu_epi8(len == 128 ? ~0ull : (1ull << (len / 2)) - 1, c.codes() + s * 64);
      const __m512i z4 = _mm512_srli_epi16(z, 4);
      w[0] = _mm512_ternarylogic_epi32(z, low4, magic, kMaskOr);
      w[1] = _mm512_ternarylogic_epi32(z4, low4, magic, kMaskOr);
      w[2] = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(z, high_byte), low4, magic, kMaskOr);
      w[3] = _mm512_or_si512(_mm512_shuffle_epi8(z4, high_byte), magic);
    } else {
      const __m256i bytes = _mm256_maskz_loadu_epi8(len == 64 ? ~0u : (1u << (len / 2)) - 1, c.codes() + s * 32);
      const __m512i z = _mm512_cvtepu8_epi16(bytes);
      w[0] = _mm512_ternarylogic_epi32(z, low4, magic, kMaskOr);
      w[1] = _mm512_or_si512(_mm512_srli_epi16(z, 4), magic);
    }
  }
  static __m512 scales(const Cursor& c, long s, int len) {
    constexpr int kGroups = Step / 32;
    // Fixed-size copies in the whole steps: with a run-time size GCC copied through the stack at every step. The
    // groups past a short step's end get scale 0 (their codes and activations are zeros).
    uint64_t bits = 0;
    if (len == Step)
      std::memcpy(&bits, c.sc + kGroups * s, 2 * kGroups);
    else
      std::memcpy(&bits, c.sc + kGroups * s, size_t(len / 32) * 2);
    // Group g's BF16 scale (bytes 2g, 2g + 1) as the high half of its float32 lanes: one byte shuffle within each
    // 128-bit lane.
    const __m512i place = Step == 128 ? _mm512_set_epi32(0x0706FFFF, 0x0706FFFF, 0x0706FFFF, 0x0706FFFF, 0x0504FFFF,
                                                         0x0504FFFF, 0x0504FFFF, 0x0504FFFF, 0x0302FFFF, 0x0302FFFF,
                                                         0x0302FFFF, 0x0302FFFF, 0x0100FFFF, 0x0100FFFF, 0x0100FFFF,
                                                         0x0100FFFF)
                                      : _mm512_set_epi32(0x0302FFFF, 0x0302FFFF, 0x0302FFFF, 0x0302FFFF, 0x0302FFFF,
                                                         0x0302FFFF, 0x0302FFFF, 0x0302FFFF, 0x0100FFFF, 0x0100FFFF,
                                                         0x0100FFFF, 0x0100FFFF, 0x0100FFFF, 0x0100FFFF, 0x0100FFFF,
                                                         0x0100FFFF);
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi64(int64_t(bits)), place));
  }
};

#ifdef KT_FP8_BF16_DOT
// FP8 e4m3: a step's 64 codes index two 128-entry byte tables (the high and low bytes of each magnitude's BF16;
// vpermi2b reads an index's low 7 bits, so the sign bit is ignored there and ORed into the high byte), and the
// bytes interleave into words within each 16-byte lane: w0 holds codes 16L .. 16L + 7 of lane L, w1 codes
// 16L + 8 .. 16L + 15. All 64 share one block scale (blocks of 128 columns).
struct Fp8Steps {
  using Weights = fp8_block;
  using Cursor = Fp8Cursor<Simd>;
  // The next block's codes requested into L2: FP8 rows read twice INT4's bytes per weight, and requested into L1
  // the dot form read them from RAM at ~13 GB/s per thread against 19-22 into L2 (Zen 4; BENCHMARKS.md).
  static constexpr int kRequestLocality = 2;
  // Blocks at least 8 KB on are requested: down's rows (768 codes at Layer Q) made a block's reduction shorter than
  // a read from RAM takes, and one thread read them at 13.5-14.2 G weights/s against 17.2-20.2 this way (Zen 4,
  // quantized_dot_probe 2048 768; 2048-code rows, whose next block is 8 KB already, the same; BENCHMARKS.md).
  static constexpr long kAheadBytes = 8192;
  static constexpr int kStep = 64;
  static constexpr float kBias = 0.f;
  __m512i hi[2], lo[2];
  Fp8Steps() {
    alignas(64) uint8_t h[128], l[128];
    for (int m = 0; m < 128; ++m) {
      const bf16 b = kt::f32_to_bf16(kt::fp8_e4m3_to_f32(uint8_t(m)));  // exact: 3 mantissa bits
      h[m] = uint8_t(b >> 8), l[m] = uint8_t(b);
    }
    for (int t = 0; t < 2; ++t) hi[t] = _mm512_load_si512(h + 64 * t), lo[t] = _mm512_load_si512(l + 64 * t);
  }
  static int column(int lane) { return 16 * (lane % 32 / 8) + 8 * (lane / 32) + lane % 8; }
  void weights(const Cursor& c, long s, int len, __m512i (&w)[2]) const {
    const __m512i codes = _mm512_maskz_loadu_epi8(len == 64 ? ~0ull : (1ull << len) - 1, c.q + s * 64);
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi[0], codes, hi[1]), codes,
                                                _mm512_set1_epi8(char(0x80)), 0xF8);  // h | (codes & 0x80)
    const __m512i l = _mm512_permutex2var_epi8(lo[0], codes, lo[1]);
    w[0] = _mm512_unpacklo_epi8(l, h);
    w[1] = _mm512_unpackhi_epi8(l, h);
  }
  static __m512 scales(const Cursor& c, long s, int) { return _mm512_set1_ps(c.sc[s * 64 / fp8_block::BLOCK]); }
};
#endif

// Activation row x (K values) as BF16 in the steps' order (lane i of each step holds column Codec::column(i); zeros
// past K), and for a codec with kBias the float32 vector per step that takes the bias back off its products: lane l
// of a product sums words 2l and 2l + 1 of each of the step's vectors, so lane l of `bias` is −kBias × their
// activations' sum (a vdpbf16ps of each vector with ones).
// bf16_dot_activations' word order (its comment says how it reads). Outside that function: clang rejects a struct
// local to its lambda that reads the function's constexpr V.
template <int V>
struct alignas(64) DotLanes {
  int16_t idx[V][32];
  __mmask32 from[V][V / 2];
};

template <class Codec>
void bf16_dot_activations(const float* x, long K, bf16* dst, float* bias) {
  constexpr int V = Codec::kStep / 32;  // BF16 vectors per step
  // Vector v's word j comes from word column & 63 of source pair column / 64, blended in by a mask.
  static const auto order = [] {
    DotLanes<V> o;
    for (int v = 0; v < V; ++v) {
      for (int p = 0; p < V / 2; ++p) o.from[v][p] = 0;
      for (int j = 0; j < 32; ++j) {
        const int col = Codec::column(32 * v + j);
        o.idx[v][j] = int16_t(col & 63);
        o.from[v][col / 64] |= __mmask32(1u << j);
      }
    }
    return o;
  }();
  for (long k = 0; k < K; k += Codec::kStep) {
    const int len = int(std::min<long>(Codec::kStep, K - k));
    __m512i src[V];
    for (int q = 0; q < V; ++q) {
      __m512 f[2];
      for (int h = 0; h < 2; ++h) {
        const int n = std::max(0, std::min(16, len - 32 * q - 16 * h));
        f[h] = _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), x + k + 32 * q + 16 * h);
      }
      const __m512bh b = _mm512_cvtne2ps_pbh(f[1], f[0]);
      src[q] = reinterpret_cast<const __m512i&>(b);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) {
      const __m512i idx = _mm512_load_si512(order.idx[v]);
      __m512i out = _mm512_setzero_si512();
      for (int p = 0; p < V / 2; ++p)
        out = _mm512_mask_mov_epi16(out, order.from[v][p], _mm512_permutex2var_epi16(src[2 * p], idx, src[2 * p + 1]));
      _mm512_storeu_si512(dst + k + 32 * v, out);
      if constexpr (Codec::kBias != 0.f) {
        const __m512i ones = _mm512_set1_epi16(0x3F80);
        sum = _mm512_dpbf16_ps(sum, reinterpret_cast<const __m512bh&>(out), reinterpret_cast<const __m512bh&>(ones));
      }
    }
    if constexpr (Codec::kBias != 0.f)
      _mm512_storeu_ps(bias + k / Codec::kStep * 16, _mm512_mul_ps(sum, _mm512_set1_ps(-Codec::kBias)));
  }
}

// MR activation rows × NR weight rows per block, every step's float32 sums scaled once; a last block of one or two
// rows (MR = 4) takes a block of its own size instead of repeating a row.
template <class Codec, int MR, int NR>
void bf16_dot(const Codec& codec, const GemmNT<typename Codec::Weights>& g) {
  using Cursor = typename Codec::Cursor;
  constexpr int V = Codec::kStep / 32;
  constexpr bool biased = Codec::kBias != 0.f;
  const long steps = (g.K + Codec::kStep - 1) / Codec::kStep;
  thread_local isa_vector<bf16> xs;
  thread_local isa_vector<float> bias;
  xs.resize(size_t(g.M) * steps * Codec::kStep);
  if constexpr (biased) bias.resize(size_t(g.M) * steps * 16);
  for (int i = 0; i < g.M; ++i)
    bf16_dot_activations<Codec>(g.a.at(i), g.K, xs.data() + long(i) * steps * Codec::kStep,
                                biased ? bias.data() + long(i) * steps * 16 : nullptr);
  // The block requested while one computes is `ahead` blocks on (Codec::kAheadBytes, for one or two activation
  // rows: with four a block computes long enough, and FP8 forwards at 4 rows per expert ran ~8% slower so), the
  // blocks before the first of those at the start.
  const long block_bytes = NR * Cursor::code_bytes(g.K), ahead_bytes = MR <= 2 ? Codec::kAheadBytes : 0;
  const int ahead = int(std::min<long>(4, std::max<long>(1, (ahead_bytes + block_bytes - 1) / block_bytes)));
  for (int n = NR; n < std::min(ahead * NR, g.N); ++n) {
    const char* row = cursor<Simd>(g.b, n).codes();
    for (long l = 0; l < Cursor::code_bytes(g.K); l += 64) __builtin_prefetch(row + l, 0, Codec::kRequestLocality);
  }
  for (int n0 = 0; n0 < g.N; n0 += NR) {
    const int nr = std::min(NR, g.N - n0);
    Cursor cur[NR], next[NR];
    const int nn = std::min(NR, g.N - n0 - ahead * NR);
    for (int j = 0; j < NR; ++j) cur[j] = cursor<Simd>(g.b, n0 + std::min(j, nr - 1));
    for (int j = 0; j < nn; ++j) next[j] = cursor<Simd>(g.b, n0 + ahead * NR + j);
    NextBlockRequests<Cursor, Codec::kRequestLocality> requests(next, nn, g.K, steps);
    // Activation rows m0 .. m0 + mr of this weight block, MB at a time (MB a compile-time constant).
    auto block = [&](int m0, int mr, auto mb_c) {
      constexpr int MB = decltype(mb_c)::value;
      const bf16* a[MB];
      const float* b[MB];
      for (int i = 0; i < MB; ++i) {
        const long row = m0 + std::min(i, mr - 1);
        a[i] = xs.data() + row * steps * Codec::kStep;
        b[i] = biased ? bias.data() + row * steps * 16 : nullptr;
      }
      __m512 acc[MB][NR];
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
      // One step: `len` (kStep but in a row's last step) is a constant in the loop over the whole steps, so that
      // the loads' masks and the scales' widths are settled at compile time there (GCC had kept a test and a jump
      // per row and step). GPU test machine, Layer Q decode, 15 threads, in undisturbed rounds: INT4 0.35-0.37 of
      // BF16's time against 0.37-0.40 (BENCHMARKS.md).
      auto step = [&](long s, auto len_c) {
        const int len = len_c;
        requests.segment();
        // Unrolled whole, so that acc stays in registers: GCC kept it on the stack otherwise (a load and a store
        // around every FMA), which ran INT4 decode's gate/up ~3x slower on the GPU test machine's Xeon (BENCHMARKS.md).
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
          __m512i w[V];
          codec.weights(cur[j], s, len, w);
          const __m512 sv = Codec::scales(cur[j], s, len);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            __m512 seg = biased ? _mm512_load_ps(b[i] + s * 16) : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) {
              const __m512i x = _mm512_load_si512(a[i] + s * Codec::kStep + 32 * v);
              seg = _mm512_dpbf16_ps(seg, reinterpret_cast<const __m512bh&>(w[v]),
                                     reinterpret_cast<const __m512bh&>(x));
            }
            acc[i][j] = _mm512_fmadd_ps(seg, sv, acc[i][j]);
          }
        }
      };
      const long whole = g.K / Codec::kStep;
      for (long s = 0; s < whole; ++s) step(s, std::integral_constant<int, Codec::kStep>());
      if (whole < steps) step(whole, int(g.K - whole * Codec::kStep));
      // Over the whole block, so that no loop bound is known only at run time: otherwise acc needs a copy in
      // memory, which GCC kept by storing every accumulator at every step.
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j)
          if (i < mr && j < nr)
            store_out(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, _mm512_reduce_add_ps(acc[i][j]), g.accumulate);
    };
    for (int m0 = 0; m0 < g.M; m0 += MR) {
      const int mr = std::min(MR, g.M - m0);
      if constexpr (MR == 4) {
        if (mr == 1) {
          block(m0, mr, std::integral_constant<int, 1>());
          continue;
        }
        if (mr == 2) {
          block(m0, mr, std::integral_constant<int, 2>());
          continue;
        }
      }
      block(m0, mr, std::integral_constant<int, MR>());
    }
  }
}

// Any number of activation rows: one or two alone, else four at a time and at most kDotRows per pass over the
// weights, so the thread's reordered copy of them stays small (64 rows of DeepSeek-V3's H = 7168: 0.9 MB). On the
// dev machine (Zen 4, 2 threads) INT4 this way was faster than widening tiles of weights to float32 for reuse
// (gemm_nt) at every size tried, up to 64 rows per expert (Layer Q INT4 inference forwards with tiles off, T = 64 ..
// 1024: 41-437 ms against 67-485). Four rows a block decode each weight half as often as two: one thread from RAM,
// 3-16 rows, INT4 19-33% and FP8 3-24% faster than two-row blocks (Zen 4; BENCHMARKS.md), while two rows alone run
// best as a block of two. One activation row (decode) takes 4 weight rows per pass over the step: on Zen 5 (2
// threads, Layer Q decode, six alternated rounds) INT4 calls took 1.02-1.50 ms against 1.31-1.75 with 8 rows
// (gate/up's products 17-30% faster), FP8 1.17-1.81 against 1.43-2.07.
// `Few` is the codec for one or two rows, `Many` for blocks of four.
constexpr int kDotRows = 64;
template <class Few, class Many = Few>
void gemm_nt_bf16_dot_rows(const GemmNT<typename Few::Weights>& g) {
  static const Few few;
  static const Many many;
  if (g.M == 1) return bf16_dot<Few, 1, 4>(few, g);
  if (g.M == 2) return bf16_dot<Few, 2, 4>(few, g);
  for (int m0 = 0; m0 < g.M; m0 += kDotRows) {
    GemmNT<typename Few::Weights> part = g;
    part.M = std::min(kDotRows, g.M - m0);
    if (g.a.ptrs)
      part.a.ptrs = g.a.ptrs + m0;
    else
      part.a.base = g.a.base + m0 * g.a.ld;
    part.c = g.c + m0 * g.ldc;
    bf16_dot<Many, 4, 4>(many, part);
  }
}

#ifndef KT_FP8_BF16_DOT
// INT4 needs whole groups (a step's scales are read four groups at a time).
void gemm_nt_int4_act(const GemmNT<int4_group>& g) {
  if (g.K % int4_group::GROUP) return gemm_nt<int4_group>(g);
  gemm_nt_bf16_dot_rows<Int4Steps<128>, Int4Steps<64>>(g);
}

// FP8 rows of one or two activation rows here, more in the float32 form (decoded once per block for all rows).
void gemm_nt_fp8_act_decode(const GemmNT<fp8_block>& g) {
  (g.M <= 2 ? kt::gemm_nt_fp8_bf16_dot : gemm_nt<fp8_block>)(g);
}

// The BF16-activation products of FP8 and INT4 rows for a set with AVX-512 BF16: FP8's where the CPU has VBMI,
// else its float32 form; with fp8_decode_only, for one or two rows only (on the GPU test machine's Xeon, FP8 here
// was 7% faster in decode and 13% slower at ~4 rows per expert than the float32 form; on Zen 4 faster at both).
void use_quantized_bf16_dot(kt::KernelSet& s, bool fp8_decode_only) {
  s.gemm_nt_int4_act = gemm_nt_int4_act;
  if (__builtin_cpu_supports("avx512vbmi"))
    s.gemm_nt_fp8_act = fp8_decode_only ? gemm_nt_fp8_act_decode : kt::gemm_nt_fp8_bf16_dot;
}
#endif

}  // namespace
