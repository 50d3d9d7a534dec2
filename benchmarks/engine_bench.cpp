// Inference forwards (decode at T = 1, or T tokens) of one layer through MoeExperts::forward from C++, with no
// Python or torch in the process: each call routes every token to a fresh random expert set, as decode does, so
// the weights come from RAM. Prints the median call of each round and, for the last, the engine's phases. Random
// weights (INT4 codes / FP8 codes / BF16 values with constant scales), LoRA of rank r on all three projections.
// Several formats (comma-separated) are one layer each, called in turn on the same routes: each format's median
// call, and each later format's time as a share of the first's over adjacent calls (median), a ratio that a slow
// spell of a shared machine moves far less than it moves rounds run one after another. Phases: one format only.
//   cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DKT_SFT_ENGINE_BENCH=ON
//         -Dpybind11_DIR=$(python3 -m pybind11 --cmakedir) && ninja -C build/bench engine_bench   (one command)
//   build/bench/engine_bench [threads] [bf16|fp8|int4[,...]] [T] [S|Q|DS] [tile_min_rows] [expert sets]
//   (defaults: all CPUs, int4, 1, Q, 0 = the engine's default; 1 << 20 keeps every expert off the tiles; 40: the
//   40 calls of a round cycle through that many random expert sets, so 1 keeps one set's weights in cache and
//   tells a call's time from its reads from RAM)
// KT_SFT_KERNELS picks the kernel set as for the Python package.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moe/experts.h"
#include "moe/runtime.h"

using namespace kt;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

View view(void* p, DType d, std::vector<int64_t> shape) {
  View v;
  v.data = p;
  v.dtype = d;
  v.shape = std::move(shape);
  v.present = true;
  return v;
}

struct Shape {
  long H, I, E, K, r;
};

Shape shape_named(const std::string& s) {
  if (s == "S") return {1024, 512, 16, 4, 8};
  if (s == "DS") return {7168, 2048, 256, 8, 16};
  return {2048, 768, 128, 8, 16};  // Q: Qwen3-30B-A3B
}

// The layer's weights in one format, filled with random codes or values and constant scales.
struct Weights {
  std::vector<uint32_t> words[2];
  std::vector<uint8_t> codes[2];
  std::vector<bf16> values[2], scale16[2];
  std::vector<float> scale32[2];
  ExpertWeights views;

  Weights(const std::string& format, const Shape& s, std::mt19937& rng) {
    const long rows[2] = {2 * s.I, s.H}, cols[2] = {s.H, s.I};  // gate_up [E, 2I, H], down [E, H, I]
    View w[2], sc[2];
    for (int p = 0; p < 2; ++p) {
      const long n = s.E * rows[p] * cols[p];
      if (format == "int4") {
        words[p].resize(n / 8);
        for (auto& x : words[p]) x = rng();
        scale16[p].assign(n / 32, f32_to_bf16(0.003f));
        w[p] = view(words[p].data(), DType::i32, {s.E, rows[p], cols[p] / 8});
        sc[p] = view(scale16[p].data(), DType::bf16, {s.E, rows[p], cols[p] / 32});
      } else if (format == "fp8") {
        codes[p].resize(n);
        for (auto& x : codes[p]) x = uint8_t(rng() & 0xF7);  // never 0x7F / 0xFF (NaN)
        scale32[p].assign(n / (128 * 128), 0.003f);
        w[p] = view(codes[p].data(), DType::fp8_e4m3, {s.E, rows[p], cols[p]});
        sc[p] = p == 0 ? view(scale32[p].data(), DType::f32, {s.E, 2, s.I / 128, s.H / 128})
                       : view(scale32[p].data(), DType::f32, {s.E, s.H / 128, s.I / 128});
      } else {
        values[p].resize(n);
        for (auto& x : values[p]) x = f32_to_bf16(float(int(rng() % 200) - 100) * 1e-4f);
        w[p] = view(values[p].data(), DType::bf16, {s.E, rows[p], cols[p]});
      }
    }
    views = {w[0], w[1], sc[0], sc[1], {}};  // no gate/up bias
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 0;
  std::vector<std::string> formats;
  for (std::string rest = argc > 2 ? argv[2] : "int4"; !rest.empty();) {
    const size_t comma = rest.find(',');
    formats.push_back(rest.substr(0, comma));
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
  }
  const long T = argc > 3 ? atol(argv[3]) : 1;
  const Shape s = shape_named(argc > 4 ? argv[4] : "Q");
  for (const auto& format : formats)
    if (format != "bf16" && format != "fp8" && format != "int4") {
      std::fprintf(stderr, "formats must be bf16, fp8 or int4 (comma-separated), got %s\n", format.c_str());
      return 2;
    }
  const char* kernels = getenv("KT_SFT_KERNELS");
  Runtime::get().configure(threads, true, kernels ? kernels : "", argc > 5 ? atoi(argv[5]) : 0);
  std::mt19937 rng(3);
  std::vector<std::unique_ptr<Weights>> weights;
  std::vector<std::unique_ptr<MoeExperts>> experts;
  for (const auto& format : formats) {
    weights.push_back(std::make_unique<Weights>(format, s, rng));
    experts.push_back(std::make_unique<MoeExperts>(int(s.E), int(s.H), int(s.I), weights.back()->views));
  }
  // One LoRA per format: called in turn on the same route, a shared one would be in cache for every format but
  // the first (8 experts' LoRA at Layer Q: 4.3 MB), which each reads from RAM in a model. B is zero: the
  // products run all the same, and the outputs stay the base's.
  struct LoraStore {
    std::vector<float> A[3], B[3];
    Lora lora;
  };
  std::vector<std::unique_ptr<LoraStore>> loras;
  const long in[3] = {s.H, s.H, s.I}, out[3] = {s.I, s.I, s.H};
  for (size_t f = 0; f < formats.size(); ++f) {
    auto& l = *loras.emplace_back(std::make_unique<LoraStore>());
    l.lora.r = int(s.r);
    l.lora.scale = 2.f;
    for (int p = 0; p < 3; ++p) {
      l.A[p].resize(s.E * s.r * in[p]);
      for (auto& x : l.A[p]) x = float(int(rng() % 200) - 100) * 1e-4f;
      l.B[p].assign(s.E * out[p] * s.r, 0.f);
      l.lora.A[p] = view(l.A[p].data(), DType::f32, {s.E, s.r, in[p]});
      l.lora.B[p] = view(l.B[p].data(), DType::f32, {s.E, out[p], s.r});
    }
  }
  std::vector<bf16> x(T * s.H), y(T * s.H);
  for (auto& v : x) v = f32_to_bf16(float(int(rng() % 200) - 100) * 0.01f);
  std::vector<float> route_w(T * s.K, 1.f / float(s.K));
  std::vector<std::vector<int64_t>> routes(40);
  const size_t sets = std::clamp(argc > 6 ? atoi(argv[6]) : 40, 1, 40);
  std::vector<int64_t> perm(s.E);
  for (size_t i = 0; i < routes.size(); ++i)
    if (i >= sets)
      routes[i] = routes[i % sets];
    else
      for (long t = 0; t < T; ++t) {
        for (long e = 0; e < s.E; ++e) perm[e] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        routes[i].insert(routes[i].end(), perm.begin(), perm.begin() + s.K);
      }

  Runtime& rt = Runtime::get();
  const size_t F = formats.size();
  auto call = [&](size_t f, std::vector<int64_t>& route) {
    const double t0 = now();
    experts[f]->forward(view(x.data(), DType::bf16, {T, s.H}), view(route.data(), DType::i64, {T, s.K}),
                        view(route_w.data(), DType::f32, {T, s.K}), view(y.data(), DType::bf16, {T, s.H}),
                        loras[f]->lora, false);
    return (now() - t0) * 1e3;
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const int rounds = 4;
  for (int round = 0; round < rounds; ++round) {
    // Phases are the runtime's, summed over every format: printed for one format only.
    rt.set_profiling(F == 1 && round == rounds - 1);
    rt.phase_seconds(true);
    std::vector<std::vector<double>> ms(F), ratio(F);
    for (auto& route : routes) {
      double first = 0;
      for (size_t f = 0; f < F; ++f) {
        const double t = call(f, route);
        ms[f].push_back(t);
        if (f == 0)
          first = t;
        else
          ratio[f].push_back(t / first);
      }
    }
    std::printf("T=%ld, %d threads, kernels %s:", T, rt.threads(), rt.kernels().name);
    for (size_t f = 0; f < F; ++f) {
      std::printf(" %s median call %.3f ms", formats[f].c_str(), median(ms[f]));
      if (f > 0) std::printf(" (%.3f of %s's, median of adjacent calls)", median(ratio[f]), formats[0].c_str());
      std::printf(f + 1 < F ? ";" : "");
    }
    if (F == 1 && round == rounds - 1)
      for (const auto& [phase, seconds] : rt.phase_seconds(true))
        std::printf(" | %s %.3f", phase.c_str(), seconds / double(routes.size()) * 1e3);
    std::printf("\n");
  }
}
