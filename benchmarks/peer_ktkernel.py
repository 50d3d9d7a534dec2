"""Benchmark adapter for the reference peer kt-kernel 0.7.2 (DESIGN.md §6): its CPU BF16 SFT MoE with LoRA.

Only kt-kernel's public Python API is called (`KTMoEWrapper(mode="sft", method="AMXBF16_SFT")`); none of its
code is copied here. kt_kernel is imported lazily and found on PYTHONPATH, e.g. a `pip install --no-deps
--target` of its wheel, or the subset kt_kernel/ (amx + avx512_bf16 extension files only) + kt_kernel.libs/
+ gguf. It also imports safetensors, numpy, pyyaml and packaging, which must be installed.

    ok, why = available()
    peer = make_peer(gate_up, down, K, r, alpha, threads)   # loads and repacks the weights once (setup)
    y = peer.forward(x, top_k_index, top_k_weights)        # bf16 [T, H]; saves for backward
    dx, dw = peer.backward(grad_out)                       # bf16 [T, H], float32 [T, K]
    peer.grad_A["gate"], peer.grad_B["down"], ...          # LoRA grads of that backward (bf16, overwritten)

It computes kt_sft.ops.reference's formula with LoRA on gate, up and down, s = alpha / r:
    g = x Wgᵀ + s (x Agᵀ) Bgᵀ,  u = x Wuᵀ + s (x Auᵀ) Buᵀ,  h = silu(g)·u,  y = h Wdᵀ + s (h Adᵀ) Bdᵀ,
    out[t] = Σ_k w[t,k] · y_{e(t,k)}[t]
LoRA layouts are ours: A[p] [E, r, in_p], B[p] [E, out_p, r].

Gaps against kt_sft (state them next to any number measured through this adapter):
- It runs only where kt-kernel ships a BF16 SFT kernel: its `amx` and `avx512_bf16` builds, which need
  AVX512F/BW/VNNI/VBMI + AVX512_BF16. Its avx2 and other avx512 builds have no AMXBF16_SFT_MOE. kt-kernel's
  loader picks the build from /proc/cpuinfo (or KT_KERNEL_CPU_VARIANT, which can force a build the CPU
  cannot run), so available() checks the CPU flags itself first: SIGILL would kill the whole benchmark.
- BF16 in and out: x, y, dx and the LoRA grads are bf16 (inputs are cast); routing weights and dw are float32.
  Its forward cache also keeps gate/up outputs in bf16. No rsLoRA, no LoRA dropout, base weights frozen.
- At make_peer it repacks the base weights into its own layout (and keeps extra copies for backward), so it
  holds the expert weights more than once; the caller's gate_up/down are not read afterwards.
- After LoRA weights change it repacks them on the next forward: a training step pays that once after
  the optimizer step. set_lora() does it here; a fwd/bwd loop that never calls it leaves that cost out.
- One CPUInfer thread pool per process (a kt-kernel singleton, created by the first make_peer): a later
  make_peer with other `threads` raises instead of silently timing the old pool.
- Its pool threads are pinned to the NUMA node's cores 0..threads-1 and busy-spin for 50 ms after each job;
  its task-queue thread and the Python thread are not pinned. With threads = all cores they lose whole
  scheduler slices (measured: 16 of 16 cores 3-8x slower than 15). Give it threads <= cores - 1, and time
  it last or 50 ms after other work. forward/backward put torch on one thread (see _torch_one_thread).
- T per call is bounded by max_tokens (its chunked_prefill_size, sized at make_peer); it prints one
  "Creating AMX_SFT_MOE_TP ..." line per peer.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

METHOD = "AMXBF16_SFT"
# kt-kernel's own requirement for its avx512_bf16 build (the amx build needs these plus AMX).
_NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16")
_PROJ_DIMS = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}  # (in, out) of each projection
_pool_threads: int | None = None  # threads of the process-wide CPUInfer pool, once created


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available() -> tuple[bool, str]:
    """(True, "kt-kernel <version>, <build> build") when its BF16 SFT MoE can run here, else (False, why)."""
    if importlib.util.find_spec("kt_kernel") is None:
        return False, "kt_kernel is not importable (put kt-kernel 0.7.2's wheel contents on PYTHONPATH)"
    flags = _cpu_flags()
    missing = [f for f in _NEEDED_FLAGS if f not in flags and f.replace("_", "") not in flags]
    if missing:  # checked before import: a forced avx512 build would die of SIGILL, not raise
        return False, ("kt-kernel's BF16 SFT MoE exists only in its amx/avx512_bf16 builds; "
                       f"this CPU lacks {', '.join(missing)}")
    try:
        import kt_kernel
    except Exception as e:  # a missing dependency (gguf, safetensors...) or a wrong-Python extension
        return False, f"import kt_kernel failed: {type(e).__name__}: {e}"
    if not hasattr(kt_kernel.kt_kernel_ext.moe, "AMXBF16_SFT_MOE"):
        return False, f"kt-kernel's loaded '{kt_kernel.__cpu_variant__}' build has no AMXBF16_SFT_MOE"
    return True, f"kt-kernel {kt_kernel.__version__}, {kt_kernel.__cpu_variant__} build"


@contextlib.contextmanager
def _torch_one_thread():
    """Its wrapper stages inputs and outputs with torch copies. On CPU tensors those run on torch's OpenMP
    team, whose threads then spin and take cores from its pinned workers (measured on the AMX machine,
    H1024 I512 E16 K4 r8 T=256, 2 threads: forward 28 ms with torch on 16 threads, 6-9 ms on one).
    In its real use the copies are GPU<->CPU and use no OpenMP team, so the peer runs with torch on one
    thread (the switch costs ~16 us a call)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class KTKernelPeer:
    """One MoE layer's routed experts in kt-kernel's BF16 SFT MoE, LoRA rank r on gate/up/down."""

    def __init__(self, gate_up, down, K, r, alpha, threads, max_tokens=8192, seed=0):
        global _pool_threads
        from kt_kernel import KTMoEWrapper

        if _pool_threads is not None and threads != _pool_threads:
            raise ValueError(f"kt-kernel's thread pool already runs {_pool_threads} threads in this process; "
                             f"it cannot be rebuilt with {threads}")
        E, two_i, H = gate_up.shape
        I = two_i // 2
        dims = {"H": H, "I": I}
        self.wrapper = KTMoEWrapper(
            layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
            gpu_experts_mask=None, num_gpu_experts=0,  # every expert on the CPU
            cpuinfer_threads=threads, threadpool_count=1,  # one pool, no NUMA split
            weight_path="",  # unused: the weights come from tensors
            chunked_prefill_size=max_tokens, method=METHOD, mode="sft", lora_rank=r, lora_alpha=alpha)
        _pool_threads = threads
        # Its layout is separate gate [E,I,H], up [E,I,H], down [E,H,I]: gate rows first in ours.
        self.wrapper.load_weights_from_tensors(
            gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down.contiguous(),
            torch.arange(E, dtype=torch.int64))
        # It keeps pointers to these six bf16 tensors and to their grad buffers: they must stay alive and
        # in place. A is random; B is non-zero (not PEFT's zero init) so every LoRA path does real work.
        g = torch.Generator().manual_seed(seed)
        self.lora_A = {p: (torch.randn(E, r, dims[i], generator=g) / dims[i] ** 0.5).bfloat16()
                       for p, (i, o) in _PROJ_DIMS.items()}
        self.lora_B = {p: (torch.randn(E, dims[o], r, generator=g) * 0.01).bfloat16()
                       for p, (i, o) in _PROJ_DIMS.items()}
        self.grad_A = {p: torch.zeros_like(t) for p, t in self.lora_A.items()}
        self.grad_B = {p: torch.zeros_like(t) for p, t in self.lora_B.items()}
        self.wrapper.init_lora_weights(
            **{f"{p}_lora_a": self.lora_A[p] for p in _PROJ_DIMS},
            **{f"{p}_lora_b": self.lora_B[p] for p in _PROJ_DIMS},
            **{f"grad_{p}_lora_a": self.grad_A[p] for p in _PROJ_DIMS},
            **{f"grad_{p}_lora_b": self.grad_B[p] for p in _PROJ_DIMS})
        self.scale = alpha / r

    def set_lora(self, A: dict, B: dict) -> None:
        """Copy LoRA weights in (same layouts as kt_sft.ops.reference.LoraWeights) and make it repack them."""
        with torch.no_grad():
            for p in _PROJ_DIMS:
                self.lora_A[p].copy_(A[p])
                self.lora_B[p].copy_(B[p])
        self.wrapper.update_lora_weights()

    def forward(self, x, top_k_index, top_k_weights, save_for_backward=True):
        """x [T,H], top_k_index [T,K], top_k_weights [T,K] -> bf16 [T,H]. A repeated saving forward replaces
        the saved one (its cache holds one entry per layer here)."""
        with _torch_one_thread():
            return self.wrapper.forward(x, top_k_index, top_k_weights, save_for_backward=save_for_backward)

    def backward(self, grad_out):
        """grad_out [T,H] of the last saving forward -> (dx bf16 [T,H], d top_k_weights float32 [T,K])."""
        with _torch_one_thread():
            return self.wrapper.backward(grad_out)


def make_peer(gate_up, down, K, r, alpha, threads, max_tokens=8192, seed=0) -> KTKernelPeer:
    """gate_up bf16 [E,2I,H] (gate rows first), down bf16 [E,H,I]. Call available() first."""
    return KTKernelPeer(gate_up, down, K, r, alpha, threads, max_tokens, seed)
