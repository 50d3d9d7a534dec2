// One tile product of one expert timed on one thread, its BF16 weights hot in the caches: the rate of the tile
// kernels themselves at a given number of activation rows M (an expert's tokens), apart from memory and
// threads. `nt` is the forward's dot form (x·Wᵀ, W [N, K] read in place), `nn` the backward's axpy form (dy·W,
// W [K, N] packed into a panel on the way), `nnp` the same with W packed ahead as the backward copy stores it
// (moe/backward_copy.h): nn against nnp is what packing the panel costs (on AMX both time direct_nn at M = 1-3).
// Each M prints the median call and GFLOP/s over its M rows; rows that leave the last 16-row tile part empty show
// what padding costs.
//   cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DKT_SFT_ENGINE_BENCH=ON
//         -Dpybind11_DIR=$(python3 -m pybind11 --cmakedir) && ninja -C build/bench tile_bench   (one command)
//   taskset -c 1 build/bench/tile_bench nt 1536 2048 16,24,32,36,40,48 [reps]    (Layer Q's gate/up)
// KT_SFT_KERNELS picks the kernel set (one with tiles: amx or avx512_bf16), as for the Python package.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/dispatch.h"
#include "moe/backward_copy.h"

using namespace kt;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: tile_bench nt|nn|nnp N K M[,M...] [reps]\n");
    return 2;
  }
  const std::string form = argv[1];
  const int N = std::atoi(argv[2]), K = std::atoi(argv[3]), reps = argc > 5 ? std::atoi(argv[5]) : 200;
  const char* want = std::getenv("KT_SFT_KERNELS");
  const KernelSet& ks = select_kernels(want ? want : "");
  if (!ks.tiles || (form != "nt" && form != "nn" && form != "nnp")) {
    std::fprintf(stderr, "kernel set %s has no tile products, or the form is not nt|nn|nnp\n", ks.name);
    return 2;
  }
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> value(-0.1f, 0.1f);
  std::vector<bf16> w(long(N) * K);
  for (auto& x : w) x = f32_to_bf16(value(rng));
  // W [K, N] in the backward copy's layout (moe/backward_copy.h), reduced over its K rows.
  const long kblocks = (K + 31) / 32;
  std::vector<bf16> packed(form == "nnp" ? backward_copy_elems(K, N) : 0);
  for (long kc = 0; kc < kblocks && form == "nnp"; ++kc) pack_backward_block(w.data(), K, N, kc, packed.data());
  std::printf("%s, N=%d K=%d, kernels %s, one thread, median of %d calls\n", form.c_str(), N, K, ks.name, reps);
  for (std::string list = argv[4]; !list.empty();) {
    const size_t comma = list.find(',');
    const int M = std::atoi(list.substr(0, comma).c_str());
    list = comma == std::string::npos ? "" : list.substr(comma + 1);
    std::vector<float> x(long(M) * K);
    for (auto& v : x) v = value(rng);
    Rows<float> rows;
    rows.base = x.data();
    rows.ld = K;
    std::vector<float> c(long(M) * N);
    std::vector<bf16> a;
    auto call = [&] {
      if (form == "nt") {
        TileNT<bf16> g{};
        g.M = M, g.N = N, g.K = K, g.a = a.data(), g.c = c.data(), g.ldc = N;
        g.b.base = w.data(), g.b.ld = K;
        ks.tiles->nt_bf16(g);
      } else {
        TileNN<bf16> g{};
        g.M = M, g.N = N, g.K = K, g.a = a.data(), g.c = c.data(), g.ldc = N, g.b_off = 0;
        g.b.base = w.data(), g.b.ld = N;
        if (form == "nnp") g.packed[0] = packed.data(), g.packed_blocks = kblocks;
        ks.tiles->nn_bf16(g);
      }
    };
    if (form == "nt") {
      a.resize(tile_rows(M) * tile_ld(K));
      ks.tiles->pack_nt(M, K, 0, K, rows, a.data());
    } else {
      a.resize(tile_rows(M) * nn_ld(K));
      ks.tiles->pack_nn(M, K, 0, K, rows, a.data());
    }
    std::vector<double> seconds;
    for (int r = 0; r <= reps; ++r) {  // the first call warms the caches
      const auto t0 = std::chrono::steady_clock::now();
      call();
      if (r) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(seconds.begin(), seconds.begin() + reps / 2, seconds.end());
    const double s = seconds[reps / 2];
    std::printf("M=%d: %.1f us, %.0f GFLOP/s\n", M, s * 1e6, 2.0 * M * N * K / s / 1e9);
  }
  return 0;
}
