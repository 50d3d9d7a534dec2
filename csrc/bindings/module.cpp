// The one pybind11 module, kt_sft._C. Tensors arrive as (data_ptr, dtype, shape) tuples made by
// kt_sft/_ext.py from contiguous CPU tensors; the C++ side re-checks dtype and shape.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>

#include "../kernels/dispatch.h"
#include "../moe/backward_copy.h"
#include "../moe/experts.h"
#include "../moe/runtime.h"
#include "../moe/sum_squares.h"

namespace py = pybind11;
using namespace kt;

namespace {

View to_view(const py::object& o) {
  View v;
  if (o.is_none()) return v;
  auto t = o.cast<py::tuple>();
  v.present = true;
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  auto dt = t[1].cast<std::string>();
  if (dt == "float32")
    v.dtype = DType::f32;
  else if (dt == "bfloat16")
    v.dtype = DType::bf16;
  else if (dt == "int64")
    v.dtype = DType::i64;
  else if (dt == "int32")
    v.dtype = DType::i32;
  else if (dt == "float8_e4m3fn")
    v.dtype = DType::fp8_e4m3;
  else
    throw std::invalid_argument("tensors of dtype " + dt + " cannot cross into the expert engine.");
  v.shape = t[2].cast<std::vector<int64_t>>();
  return v;
}

Lora to_lora(int r, float scale, const py::list& mats, float dropout = 0.f, uint32_t seed = 0) {
  Lora l;
  l.r = r;
  l.scale = scale;
  l.dropout.p = dropout;
  l.dropout.seed = seed;
  if (mats.size() != 6) throw std::invalid_argument("LoRA takes [A_gate, B_gate, A_up, B_up, A_down, B_down].");
  for (int p = 0; p < 3; ++p) {
    l.A[p] = to_view(mats[2 * p]);
    l.B[p] = to_view(mats[2 * p + 1]);
  }
  return l;
}

// (gate_up copy, down copy) as views, or none.
BackwardCopy to_copy(const py::object& o) {
  if (o.is_none()) return {};
  auto t = o.cast<py::tuple>();
  if (t.size() != 2) throw std::invalid_argument("a backward copy is (gate_up copy, down copy).");
  return BackwardCopy{to_view(t[0]), to_view(t[1])};
}

// The GIL released for an engine call. Its destructor may end the thread (CPython's pthread_exit for a daemon thread
// coming back during interpreter shutdown): not noexcept, so that unwind is not std::terminate (pybind11#2215).
struct NoGil {
  PyThreadState* st = PyEval_SaveThread();
  NoGil() = default;
  NoGil(const NoGil&) = delete;
  ~NoGil() noexcept(false) { PyEval_RestoreThread(st); }
};

// A call in flight: wait() releases the GIL while the engine runs. `keep` holds every tensor view of the
// call (each view tuple carries its tensor), so dropping the caller's references cannot free memory the
// engine is still reading.
struct Pending {
  std::shared_ptr<Ticket> ticket;
  std::shared_ptr<std::shared_ptr<Saved>> result;
  py::tuple keep;
  Pending(std::shared_ptr<Ticket> t, std::shared_ptr<std::shared_ptr<Saved>> r, py::tuple k)
      : ticket(std::move(t)), result(std::move(r)), keep(std::move(k)) {}
  Pending(Pending&&) = default;
  Pending(const Pending&) = delete;
  // Dropped without wait() (an exception between a call's start and its wait): finish the call before its tensors
  // can go. Holding the GIL (engine calls never take it): given back and taken again in a destructor, which may not
  // unwind, it had aborted the process where the interpreter was shutting down (pybind11#2215).
  ~Pending() {
    if (!ticket || ticket->done()) return;
    try {
      ticket->wait();
    } catch (...) {
    }
  }
  py::object wait() {
    {
      NoGil nogil;
      ticket->wait();
    }
    keep = py::tuple();
    if (result && *result) return py::cast(*result);
    return py::none();
  }
};

// An engine call: queued for the driver thread (now = false: submit now, wait later), or run on this thread
// with the GIL released (now = true: for a caller that waits at once; the returned ticket is already done).
std::shared_ptr<Ticket> start(std::function<void()> job, bool now) {
  if (!now) return Runtime::get().queue().submit(std::move(job));
  NoGil nogil;
  return Runtime::get().queue().run_now(job);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kt_sft CPU expert engine";
  py::class_<Saved, std::shared_ptr<Saved>>(m, "Saved").def_property_readonly("bytes", [](const Saved& s) { return s.bytes; });
  py::class_<Pending>(m, "Pending").def("wait", &Pending::wait).def("done", [](Pending& p) { return p.ticket->done(); });

  py::class_<MoeExperts, std::shared_ptr<MoeExperts>>(m, "Engine")
      .def(py::init([](int E, int H, int I, py::object gu, py::object down, py::object gu_scale, py::object down_scale,
                       py::object gu_bias, float alpha, float limit, float up_offset, float cubic, bool gated) {
             ExpertWeights w{to_view(gu), to_view(down), to_view(gu_scale), to_view(down_scale), to_view(gu_bias)};
             // Construction checks quantized weights on the pool, so it runs after calls in flight.
             std::shared_ptr<MoeExperts> engine;
             const Glu glu{alpha, limit, up_offset, cubic, gated};
             start([&] { engine = std::make_shared<MoeExperts>(E, H, I, w, glu); }, true)->wait();
             return engine;
           }),
           py::arg("E"), py::arg("H"), py::arg("I"), py::arg("gate_up"), py::arg("down"),
           py::arg("gate_up_scale") = py::none(), py::arg("down_scale") = py::none(),
           py::arg("gate_up_bias") = py::none(), py::arg("glu_alpha") = 1.f,
           py::arg("glu_limit") = std::numeric_limits<float>::infinity(), py::arg("glu_up_offset") = 0.f,
           py::arg("glu_cubic") = 0.f, py::arg("glu_gated") = true,
           // The engine reads its weights by pointer: it holds their views (each carries its tensor), and every
           // call holds the engine, so a call still queued while the interpreter exits reads no freed weights.
           py::keep_alive<1, 5>(), py::keep_alive<1, 6>(), py::keep_alive<1, 7>(), py::keep_alive<1, 8>(),
           py::keep_alive<1, 9>())
      .def_property_readonly("format", [](const MoeExperts& m) { return std::string(format_name(m.format())); })
      .def("forward",
           [](std::shared_ptr<MoeExperts> self, py::object x, py::object idx, py::object w, py::object out, int r,
              float scale, py::list lora, bool save, float dropout, uint32_t seed, bool now) {
             View vx = to_view(x), vi = to_view(idx), vw = to_view(w), vo = to_view(out);
             Lora l = to_lora(r, scale, lora, dropout, seed);
             auto result = std::make_shared<std::shared_ptr<Saved>>();
             auto ticket = start([=] { *result = self->forward(vx, vi, vw, vo, l, save); }, now);
             return Pending{ticket, result, py::make_tuple(self, x, idx, w, out, lora)};
           },
           py::arg("x"), py::arg("top_k_index"), py::arg("top_k_weights"), py::arg("out"), py::arg("r"),
           py::arg("scale"), py::arg("lora"), py::arg("save"), py::arg("dropout") = 0.f, py::arg("seed") = 0u,
           py::arg("now") = false)
      .def("backward",
           [](std::shared_ptr<MoeExperts> self, std::shared_ptr<Saved> saved, py::object x, py::object dout, int r,
              float scale, py::list lora, py::object dx, py::object dw, py::list lora_grads, py::object d_gate_up,
              py::object d_down, float dropout, uint32_t seed, bool now, py::list lora_accumulate,
              py::object backward_copy, py::object d_gate_up_bias) {
             if (!saved) throw std::invalid_argument("backward needs the object a training forward returned.");
             View vx = to_view(x), vd = to_view(dout);
             Lora l = to_lora(r, scale, lora, dropout, seed);
             Lora lg = to_lora(r, scale, lora_grads);
             Grads g;
             g.dx = to_view(dx);
             g.dw = to_view(dw);
             if (!lora_accumulate.empty() && lora_accumulate.size() != 6)
               throw std::invalid_argument("lora_accumulate takes 6 flags (A and B of gate, up, down), or none.");
             for (int p = 0; p < 3; ++p) {
               g.dA[p] = lg.A[p];
               g.dB[p] = lg.B[p];
               g.acc_A[p] = !lora_accumulate.empty() && lora_accumulate[2 * p].cast<bool>();
               g.acc_B[p] = !lora_accumulate.empty() && lora_accumulate[2 * p + 1].cast<bool>();
             }
             g.d_gate_up = to_view(d_gate_up);
             g.d_down = to_view(d_down);
             g.d_gate_up_bias = to_view(d_gate_up_bias);
             const BackwardCopy copy = to_copy(backward_copy);
             auto ticket = start([=] { self->backward(*saved, vx, vd, l, g, copy); }, now);
             return Pending{ticket, nullptr,
                            py::make_tuple(self, x, dout, lora, dx, dw, lora_grads, d_gate_up, d_down,
                                           py::cast(saved), backward_copy, d_gate_up_bias)};
           },
           py::arg("saved"), py::arg("x"), py::arg("dout"), py::arg("r"), py::arg("scale"), py::arg("lora"),
           py::arg("dx"), py::arg("dw"), py::arg("lora_grads"), py::arg("d_gate_up"), py::arg("d_down"),
           py::arg("dropout") = 0.f, py::arg("seed") = 0u, py::arg("now") = false,
           py::arg("lora_accumulate") = py::list(), py::arg("backward_copy") = py::none(),
           py::arg("d_gate_up_bias") = py::none())
      .def("pack_backward_copy",
           [](std::shared_ptr<MoeExperts> self, py::object copy) {
             const BackwardCopy c = to_copy(copy);
             if (c.empty()) throw std::invalid_argument("pack_backward_copy takes (gate_up copy, down copy).");
             // On the pool, after calls in flight (they may read the copy being rewritten).
             start([&] { pack_backward_copy(*self, c, Runtime::get()); }, true)->wait();
           },
           py::arg("copy"))
      .def_property_readonly("E", &MoeExperts::E)
      .def_property_readonly("H", &MoeExperts::H)
      .def_property_readonly("I", &MoeExperts::I);

  m.def("backward_copy_elems", &backward_copy_elems, py::arg("out"), py::arg("in"));
  m.def("configure", [](int threads, bool pin, const std::string& kernels, int tile_min_rows) {
    py::gil_scoped_release nogil;
    Runtime::get().configure(threads, pin, kernels, tile_min_rows);
  });
  m.def("max_threads", &max_threads);
  m.def("capabilities", [] {
    CpuFeatures f = cpu_features();
    Runtime& rt = Runtime::get();
    // The settings are read under their lock with the GIL released, and the dict built after: building Python
    // objects can run the GC's finalizers, which may hand the GIL to a thread that then waits on this lock.
    const KernelSet* ks = nullptr;
    int fwd_bf16 = 0, fwd_fp8 = 0, fwd_int4 = 0, bwd = 0, tile_min_rows = 0, threads = 0;
    bool pinned = false, pin = true;
    size_t scratch_bytes = 0;
    {
      py::gil_scoped_release nogil;
      auto settings = rt.settings_lock();
      try {
        ks = &rt.kernels();
      } catch (const std::exception&) {
      }
      if (ks && ks->tiles) {
        fwd_bf16 = rt.forward_tile_rows(Format::bf16);
        fwd_fp8 = rt.forward_tile_rows(Format::fp8_block128);
        fwd_int4 = rt.forward_tile_rows(Format::int4_group32);
        bwd = rt.backward_tile_rows();
      }
      tile_min_rows = rt.tile_min_rows();
      threads = rt.threads();
      pinned = rt.pool().pinned();
      pin = rt.pin_requested();
      scratch_bytes = rt.scratch().bytes();
    }
    py::dict d;
    d["cpu"] = py::dict(py::arg("avx2_fma") = f.avx2_fma, py::arg("avx512") = f.avx512,
                        py::arg("avx512_bf16") = f.avx512_bf16, py::arg("amx_bf16") = f.amx_bf16);
    d["runnable_kernels"] = runnable_kernel_sets();
    d["kernels"] = ks ? py::object(py::str(ks->name)) : py::object(py::none());
    std::string tiles = tiles_status();  // empty: the AMX tile unit is granted
    if (ks && ks->tiles) {
      const std::string use =
          "used for BF16 activations of experts with at least so many rows in a call (forward: BF16 weights " +
          std::to_string(fwd_bf16) + ", FP8 " + std::to_string(fwd_fp8) + ", INT4 " + std::to_string(fwd_int4) +
          "; backward: " + std::to_string(bwd) + ")";
      const std::string why_no_amx = tiles.empty() ? "" : "; " + tiles;
      tiles = ks->tiles->emulated
                  ? "the tile unit's operations on AVX-512 BF16 instructions (kernel set " + std::string(ks->name) +
                        why_no_amx + "), " + use
                  : "available (kernel set amx), " + use;
    } else if (tiles.empty()) {
      tiles = "available (kernel set amx), not in use";
    }
    d["tiles"] = tiles;
    d["tiles_in_use"] = ks && ks->tiles;  // the kernel set has tile products (BF16 activations take them)
    d["tile_min_rows"] = tile_min_rows;
    d["threads"] = threads;
    d["pinned"] = pinned;
    d["pin"] = pin;  // the setting: pinned may be false where the OS refused it or threads > CPUs
    d["scratch_bytes"] = scratch_bytes;
    return d;
  });
  m.def("sum_squares", [](const py::list& tensors) {
    std::vector<View> views;
    for (const auto& t : tensors) views.push_back(to_view(py::reinterpret_borrow<py::object>(t)));
    py::gil_scoped_release nogil;  // the list (hence the tensors) stays alive in the caller meanwhile
    return sum_squares(views);
  });
  m.def("scratch_floats", &MoeExperts::scratch_floats);
  m.def("saved_pool_allocations", &saved_pool_allocations);
  m.def("saved_pool_free_bytes", &saved_pool_free_bytes);
  m.def("saved_pool_release", &saved_pool_release);
  m.def("set_phase_profile", [](bool on) { Runtime::get().set_profiling(on); });
  m.def("phase_seconds", [](bool reset) { return Runtime::get().phase_seconds(reset); });
}
