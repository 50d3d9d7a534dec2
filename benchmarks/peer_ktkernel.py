"""Benchmark adapter for the reference peer kt-kernel 0.7.2 (DESIGN.md §6): its CPU SFT MoE with LoRA, on BF16,
FP8 block-128 or RAWINT4 group-32 experts.

Only kt-kernel's public Python API is called (`KTMoEWrapper(mode="sft", method=...)` with AMXBF16_SFT, AMXFP8_SFT
or RAWINT4_SFT, and the weight containers of `kt_kernel.sft`); none of its code is copied here. kt_kernel is
imported lazily and found on PYTHONPATH, e.g. a `pip install --no-deps --target` of its wheel, or the subset
kt_kernel/ (amx + avx512_bf16 extension files only) + kt_kernel.libs/ + gguf. It also imports safetensors,
numpy, pyyaml and packaging, which must be installed.

    ok, why = available()                                   # or available("AMXFP8_SFT" / "RAWINT4_SFT")
    peer = make_peer(gate_up, down, K, r, alpha, threads)   # loads and repacks the weights once (setup)
    peer = make_peer(None, None, K, r, alpha, threads, quantized=q)  # q: a kt_sft.formats.QuantizedExperts
    y = peer.forward(x, top_k_index, top_k_weights)        # bf16 [T, H]; saves for backward
    dx, dw = peer.backward(grad_out)                       # bf16 [T, H], float32 [T, K]
    peer.grad_A["gate"], peer.grad_B["down"], ...          # LoRA grads of that backward (bf16, overwritten)

It computes kt_sft.ops.reference's formula with LoRA on gate, up and down, s = alpha / r:
    g = x Wgᵀ + s (x Agᵀ) Bgᵀ,  u = x Wuᵀ + s (x Auᵀ) Buᵀ,  h = silu(g)·u,  y = h Wdᵀ + s (h Adᵀ) Bdᵀ,
    out[t] = Σ_k w[t,k] · y_{e(t,k)}[t]
LoRA layouts are ours: A[p] [E, r, in_p], B[p] [E, out_p, r].

Gaps against kt_sft (state them next to any number measured through this adapter):
- It runs only where kt-kernel ships these SFT kernels: its `amx` and `avx512_bf16` builds (each has all
  three), which need AVX512F/BW/VNNI/VBMI + AVX512_BF16. Its avx2 and other avx512 builds have none. kt-kernel's
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
- T per call is bounded by max_tokens (its chunked_prefill_size, sized at make_peer); it prints a few
  "Creating ..." lines per peer.
Quantized experts (make_peer(..., quantized=q); both frozen-base LoRA only, every expert on the CPU):
- fp8 -> AMXFP8_SFT. Its constructor refuses H or I not multiples of 128 (ours allows partial edge blocks).
  It takes per-expert e4m3fn [out, in] codes with float32 weight_scale_inv per 128x128 block, the checkpoint's
  convention and ours (W = q * scale), so codes and scales pass through as views. Its kernel decodes FP8 to
  BF16. Its training config insists on share_backward_bb for FP8, set here: backward repacks the transposed
  weights into one process-wide pool owned by one layer at a time, so a loop over a single layer pays that
  once while a model's layer-by-layer backward pays it per layer (per its upstream C++; not measured).
- int4 -> RAWINT4_SFT (class AMXInt4_KGroup_SFT_MOE). It refuses LoRA rank != 8, dropout, and H or I not
  multiples of 32. It takes uint8 [E, out, in/2] (low nibble = even column, stored q + 8, i.e.
  compressed-tensors' int32 words read as little-endian bytes, as its own checkpoint loader does) and bf16
  scales [E, out, in/32]: our words and scales, bytes unchanged, with gate and up split. Its training config
  insists on share_backward_bb off (backward decodes the packed weights).
- Measured on the AMX machine (E8 H256 I256 K2 T64 r8), against kt_sft's reference on the dequantized experts:
  relative error of y, dx, dw and the LoRA grads 4-7e-3 for BF16 and FP8 alike; RAWINT4 y 1.3e-2, dw 1.4e-2,
  dx 7e-3 (its INT4 forward takes activations as int8 with a scale per 32 values, per its upstream tests).
  Against the unquantized weights y is off by 4.6e-2 (FP8) and 1.6e-1 (INT4): it runs on our codes.
"""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys

import torch

METHOD = "AMXBF16_SFT"
# Its method for each of our quantized formats, and the extension class (kt_kernel_ext.moe) behind each method:
# a build can lack one, and its wrapper only says so once constructed (after the thread pool exists).
FORMAT_METHODS = {"fp8": "AMXFP8_SFT", "int4": "RAWINT4_SFT"}
_EXT_CLASSES = {"AMXBF16_SFT": "AMXBF16_SFT_MOE", "AMXFP8_SFT": "AMXFP8_SFT_MOE",
                "RAWINT4_SFT": "AMXInt4_KGroup_SFT_MOE"}
# kt_kernel.sft functions that check the loaded build's kernel and weight-layout tags for the quantized methods:
# the layouts our conversions below produce are the ones these tags name.
_RUNTIME_CHECKS = {"AMXFP8_SFT": "get_fp8_runtime", "RAWINT4_SFT": "get_rawint4_runtime"}
# kt-kernel's own requirement for its avx512_bf16 build (the amx build needs these plus AMX).
_NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16")
_PROJ_DIMS = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}  # (in, out) of each projection
_pool_threads: int | None = None  # threads of the process-wide CPUInfer pool, once created
# Each peer gets its own layer index: the FP8 backward pool is process-wide and reused when the same layer
# index used it last, so two FP8 peers both numbered 0 would share stale backward weights.
_layer_ids = itertools.count()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available(method: str = METHOD) -> tuple[bool, str]:
    """(True, "kt-kernel <version>, <build> build") when its SFT MoE `method` (AMXBF16_SFT, AMXFP8_SFT or
    RAWINT4_SFT) can run here, else (False, why)."""
    if method not in _EXT_CLASSES:
        return False, f"this adapter drives {sorted(_EXT_CLASSES)}, not {method!r}"
    if importlib.util.find_spec("kt_kernel") is None:
        return False, "kt_kernel is not importable (put kt-kernel 0.7.2's wheel contents on PYTHONPATH)"
    flags = _cpu_flags()
    missing = [f for f in _NEEDED_FLAGS if f not in flags and f.replace("_", "") not in flags]
    if missing:  # checked before import: a forced avx512 build would die of SIGILL, not raise
        return False, ("kt-kernel's SFT MoE kernels exist only in its amx/avx512_bf16 builds; "
                       f"this CPU lacks {', '.join(missing)}")
    try:
        import kt_kernel
    except Exception as e:  # a missing dependency (gguf, safetensors...) or a wrong-Python extension
        return False, f"import kt_kernel failed: {type(e).__name__}: {e}"
    if not hasattr(kt_kernel.kt_kernel_ext.moe, _EXT_CLASSES[method]):
        return False, f"kt-kernel's loaded '{kt_kernel.__cpu_variant__}' build has no {_EXT_CLASSES[method]}"
    kernel = ""
    if method in _RUNTIME_CHECKS:
        try:
            from kt_kernel import sft
            rt = getattr(sft, _RUNTIME_CHECKS[method])()
        except (ImportError, RuntimeError) as e:  # RuntimeError names the mismatching kernel/layout tag
            return False, f"kt-kernel {method}: {type(e).__name__}: {e}"
        kernel = f", {method} kernel {rt.kernel}, layout {rt.weight_layout}"
    return True, f"kt-kernel {kt_kernel.__version__}, {kt_kernel.__cpu_variant__} build{kernel}"


def fp8_peer_weights(q) -> dict:
    """Fields of its BlockFP8ExpertWeights from our fp8 QuantizedExperts: per-expert lists of e4m3fn gate/up
    [I, H] and down [H, I], and float32 scales [out/128, in/128]. Views of q (it copies them at load)."""
    E, H, I = q.shape
    if q.format != "fp8" or q.gate_up.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected fp8 QuantizedExperts with float8_e4m3fn codes, got {q.format} {q.gate_up.dtype}")
    if H % 128 or I % 128:  # its AMXFP8_SFT refuses these; saying so here is before any pool or wrapper exists
        raise ValueError(f"kt-kernel's AMXFP8_SFT needs H and I divisible by 128, got H={H} I={I}")
    gu, gu_s = q.gate_up.contiguous(), q.gate_up_scale.to(torch.float32).contiguous()
    dn, dn_s = q.down.contiguous(), q.down_scale.to(torch.float32).contiguous()
    return {"gate_proj": [gu[e, :I] for e in range(E)], "gate_scale": [gu_s[e, 0] for e in range(E)],
            "up_proj": [gu[e, I:] for e in range(E)], "up_scale": [gu_s[e, 1] for e in range(E)],
            "down_proj": [dn[e] for e in range(E)], "down_scale": [dn_s[e] for e in range(E)]}


def int4_peer_weights(q) -> dict:
    """Fields of its RAWINT4ExpertWeights from our int4 QuantizedExperts: uint8 gate/up [E, I, H/2] and down
    [E, H, I/2], and bf16 scales [E, I, H/32] / [E, H, I/32]. Our int32 words hold column j in bits 4*(j%8)
    as q+8; read as little-endian bytes that is column j in byte j//2, low nibble for even j, still q+8: the
    layout it takes (its own loader converts compressed-tensors checkpoints with the same byte view)."""
    _, H, I = q.shape
    if q.format != "int4" or q.gate_up.dtype != torch.int32:
        raise ValueError(f"expected int4 QuantizedExperts with int32 words, got {q.format} {q.gate_up.dtype}")
    if H % 32 or I % 32:  # its RAWINT4_SFT refuses these (and then no word is padded)
        raise ValueError(f"kt-kernel's RAWINT4_SFT needs H and I divisible by 32, got H={H} I={I}")
    if sys.byteorder != "little":
        raise ValueError("the int32 -> byte view below assumes a little-endian host")
    gu = q.gate_up.contiguous().view(torch.uint8)  # [E, 2I, H/2]
    dn = q.down.contiguous().view(torch.uint8)     # [E, H, I/2]
    gu_s = q.gate_up_scale.to(torch.bfloat16)
    # Gate and up are separate tensors there: these slices span experts, so .contiguous() copies them.
    return {"gate_proj": gu[:, :I].contiguous(), "gate_scale": gu_s[:, :I].contiguous(),
            "up_proj": gu[:, I:].contiguous(), "up_scale": gu_s[:, I:].contiguous(),
            "down_proj": dn.contiguous(), "down_scale": q.down_scale.to(torch.bfloat16).contiguous()}


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
    """One MoE layer's routed experts in kt-kernel's SFT MoE (BF16, FP8 or RAWINT4 base), LoRA rank r on
    gate/up/down."""

    def __init__(self, gate_up, down, K, r, alpha, threads, max_tokens=8192, seed=0, quantized=None):
        global _pool_threads
        from kt_kernel import KTMoEWrapper

        if _pool_threads is not None and threads != _pool_threads:
            raise ValueError(f"kt-kernel's thread pool already runs {_pool_threads} threads in this process; "
                             f"it cannot be rebuilt with {threads}")
        self.method = METHOD if quantized is None else FORMAT_METHODS.get(quantized.format)
        if self.method is None:
            raise ValueError(f"no kt-kernel SFT method for expert format {quantized.format!r}")
        if quantized is None:
            E, two_i, H = gate_up.shape
            I = two_i // 2
        else:
            E, H, I = quantized.shape
            if gate_up is not None and tuple(gate_up.shape) != (E, 2 * I, H):
                raise ValueError(f"gate_up {list(gate_up.shape)} does not match the quantized experts {[E, 2 * I, H]}")
        if self.method == "RAWINT4_SFT" and r != 8:  # its RAWINT4_SFT (v1) takes rank 8 only
            raise ValueError(f"kt-kernel's RAWINT4_SFT supports LoRA rank 8 only, got r={r}")
        # Converted before the wrapper exists, so a refused shape raises before its thread pool is created.
        qweights = None
        if self.method == "AMXFP8_SFT":
            qweights = fp8_peer_weights(quantized)
        elif self.method == "RAWINT4_SFT":
            qweights = int4_peer_weights(quantized)
        dims = {"H": H, "I": I}
        self.wrapper = KTMoEWrapper(
            layer_idx=next(_layer_ids), num_experts=E, num_experts_per_tok=K, hidden_size=H,
            moe_intermediate_size=I, gpu_experts_mask=None, num_gpu_experts=0,  # every expert on the CPU
            cpuinfer_threads=threads, threadpool_count=1,  # one pool, no NUMA split
            weight_path="",  # unused: the weights come from tensors
            chunked_prefill_size=max_tokens, method=self.method, mode="sft", lora_rank=r, lora_alpha=alpha)
        _pool_threads = threads
        experts = torch.arange(E, dtype=torch.int64)
        if self.method == "AMXFP8_SFT":
            from kt_kernel.sft import BlockFP8ExpertWeights
            # Read when the weights load: its training config requires it on for FP8 (see the module notes).
            self.wrapper.share_backward_bb = True
            self.wrapper.load_block_fp8_weights(BlockFP8ExpertWeights(**qweights, block_size=(128, 128)), experts)
        elif self.method == "RAWINT4_SFT":
            from kt_kernel.sft import RAWINT4ExpertWeights
            self.wrapper.load_rawint4_weights(RAWINT4ExpertWeights(**qweights, group_size=32), experts)
        else:
            # Its layout is separate gate [E,I,H], up [E,I,H], down [E,H,I]: gate rows first in ours.
            self.wrapper.load_weights_from_tensors(
                gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down.contiguous(), experts)
        del qweights  # it has copied them into its own packed layout
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


def make_peer(gate_up, down, K, r, alpha, threads, max_tokens=8192, seed=0, quantized=None) -> KTKernelPeer:
    """gate_up bf16 [E,2I,H] (gate rows first), down bf16 [E,H,I]; or quantized, a kt_sft.formats.QuantizedExperts
    ("fp8" -> AMXFP8_SFT, "int4" -> RAWINT4_SFT, rank 8 only), whose codes it runs on (gate_up/down are then
    unused and may be None). Call available(method) first; its refusals of a shape or rank raise ValueError."""
    return KTKernelPeer(gate_up, down, K, r, alpha, threads, max_tokens, seed, quantized)
