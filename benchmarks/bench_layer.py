"""Layer benchmark: one MoE layer's routed experts, forward and backward with LoRA, side by side.

Compares, in one process and one run (medians of --reps after a warm-up):
  kt_sft      the CPU engine (training forward that saves for backward, backward, inference forward)
  torch       the PyTorch BF16 per-expert loop: kt_sft.ops.reference in bfloat16, autograd for backward
  kt-kernel   the peer's CPU SFT MoE (benchmarks/peer_ktkernel.py), when it is importable and runs here
and reports achieved GFLOP/s against this machine's measured matmul peak, decode bandwidth against measured
memory read bandwidth, and peak RSS against the weight bytes.

  python benchmarks/bench_layer.py --shape S            # H=1024 I=512 E=16 K=4 T=256 r=8
  python benchmarks/bench_layer.py --shape Q --T 2048   # Qwen3-30B-A3B layer, r=16
  python benchmarks/bench_layer.py --shape Q --formats bf16,fp8,int4 --skip torch   # quantized experts
  python benchmarks/bench_layer.py --shape Q --phases   # also ours' time per engine phase (forward.gate_up, ...)
  python benchmarks/bench_layer.py --shape Q --T 2048 --rounds 3   # every step timed in turn, three times over
  python benchmarks/bench_layer.py --shape DS --T 4096 --formats bf16,bf16+copy   # with KT_SFT_BACKWARD_COPY=1 too
  python benchmarks/bench_layer.py --shape GO --formats bf16,int4   # gpt-oss-120b's layer: biases, clamped unit
  python benchmarks/bench_layer.py --shape NH --formats bf16,int4   # Nemotron 3 Nano's layer: no gate, relu²

With --rounds N, ours, the peer and the PyTorch loop (every format) are timed one after another N times, and each
ratio is printed per round and as the median over rounds besides the ratio of the medians: a slow spell of a shared
machine then reaches both sides of a ratio within its round. All of them are built before the first round, so the
peer's copy of the weights is held beside ours (neither's threads take CPU time while the other's run).

The format `bf16+copy` is the BF16 layer trained with the backward copy (KT_SFT_BACKWARD_COPY=1: the weights
packed once more for the backward, twice the RAM); it is compared with ours and the peer's BF16.

With several --formats, each is measured for ours and for the peer's method of that format (AMXBF16_SFT,
AMXFP8_SFT, RAWINT4_SFT; the peer's INT4 runs LoRA rank 8 only), and decode bandwidth counts each format's
own bytes (codes + scales).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kt_sft  # noqa: E402
from kt_sft.formats import QuantizedExperts  # noqa: E402
from kt_sft.ops import timing  # noqa: E402
from kt_sft.ops.reference import GPT_OSS_GLU, RELU2, SWIGLU, LoraWeights, moe_experts_reference  # noqa: E402

SHAPES = {
    "S": dict(H=1024, I=512, E=16, K=4, T=256, r=8),
    "Q": dict(H=2048, I=768, E=128, K=8, T=2048, r=16),
    "DS": dict(H=7168, I=2048, E=256, K=8, T=512, r=16),
    # gpt-oss-120b's layer: its experts' biases and clamped unit (layer_extras) on ours and on the PyTorch loop
    "GO": dict(H=2880, I=2880, E=128, K=4, T=2048, r=16),
    # Nemotron 3 Nano 30B-A3B's layer: experts without a gate (up, relu², down; layer_extras)
    "NH": dict(H=2688, I=1856, E=128, K=6, T=2048, r=16),
}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measured_peak_gflops(threads: int) -> dict:
    """Achieved GFLOP/s of a large torch matmul (oneDNN / MKL) in fp32 and bf16 on this CPU."""
    torch.set_num_threads(threads)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        # A CPU without a native bf16 dot product runs bf16 matmul ~500x slower: probe small first.
        for n in (256, 2048):
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            ms = median_ms(lambda: a @ b, 5)
            out[str(dt).split(".")[-1]] = 2 * n**3 / ms / 1e6
            if ms > 50:
                break
    return out


def measured_read_gbps(threads: int) -> float:
    """Read bandwidth: sum over a 1 GiB float32 tensor (larger than any cache)."""
    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    ms = median_ms(lambda: x.sum(), 5)
    return x.numel() * 4 / ms / 1e6


def train_step_ms(fwd, bwd, drop, reps: int) -> tuple[float, float]:
    """Median forward and backward ms of `reps` steps after a warm-up step, each forward followed by its
    backward and then drop() (grads cleared, as a trainer does between steps): how training runs them."""
    fwd_times, bwd_times = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        bwd()
        fwd_times.append((t1 - t0) * 1e3)
        bwd_times.append((time.perf_counter() - t1) * 1e3)
        drop()
    return statistics.median(fwd_times[1:]), statistics.median(bwd_times[1:])


def inference_ms(m, inputs, reps: int) -> float:
    """Median ms of m's inference forward on inputs() (each call's x, idx, w), in eval mode as inference runs (a
    no-grad forward in training mode keeps its pass for gradient checkpointing's recompute, which costs more and
    which the next training forward with the same inputs would take instead of running the engine)."""
    was_training = m.training
    m.eval()
    try:
        with torch.no_grad():
            return median_ms(lambda: m(*inputs()), reps)
    finally:
        m.train(was_training)


def decode_ms(m, H, E, K, reps: int) -> float:
    """inference_ms of one token, each call on another of 64 routes, as decode steps go: one route over and over
    had its experts' weights partly in the caches (shape S read above the RAM's rate)."""
    routes = itertools.cycle([make_inputs(1, H, E, K, seed=3 + i) for i in range(64)])
    return inference_ms(m, lambda: next(routes), reps)


def make_layer(E, H, I, r, seed=0, stacked=2):
    """Random BF16 experts, each drawn from a generator of its own by a pool of threads: torch draws normal values
    on one thread per call, and the DeepSeek-V3 layer's 11 G weights drawn in one call (with 90 GB of float32
    temporaries beside the 22.5 GB kept) made runs of 94-122 s on the GPU test machine, 35-43 s drawn this way.
    stacked 1: up's rows alone, for experts without a gate."""
    gu = torch.empty(E, stacked * I, H, dtype=torch.bfloat16)
    dn = torch.empty(E, H, I, dtype=torch.bfloat16)

    def fill(e):
        g = torch.Generator().manual_seed(seed * E + e)
        gu[e] = torch.randn(stacked * I, H, generator=g).div_(H**0.5)
        dn[e] = torch.randn(H, I, generator=g).div_(I**0.5)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, range(E)))
    return gu, dn


def make_inputs(T, H, E, K, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, idx, w


def quantized(fmt, gu, dn, gated=True):
    return None if fmt.startswith("bf16") else QuantizedExperts.quantize(fmt, gu, dn, gated)


def layer_extras(shape: str, E: int, H: int, I: int) -> dict:
    """What a shape's experts have beside their weights, as KTExperts takes it: GPT-OSS's biases and unit, Nemotron-H's
    unit without a gate."""
    if shape == "NH":
        return dict(unit=RELU2)
    if shape != "GO":
        return {}
    g = torch.Generator().manual_seed(5)
    return dict(gate_up_proj_bias=torch.randn(E, 2 * I, generator=g), down_proj_bias=torch.randn(E, H, generator=g),
                unit=GPT_OSS_GLU)


def experts_module(gu, dn, q, extras=None) -> kt_sft.KTExperts:
    """Our experts module: the BF16 layer, or its quantized form q (from quantized()), with `extras`
    (layer_extras)."""
    return kt_sft.KTExperts(gu, dn, **(extras or {})) if q is None else kt_sft.KTExperts(q, **(extras or {}))


def expert_bytes(fmt, gu, dn, q) -> int:
    """Bytes the engine reads for all experts of the layer in a format (weights + scales)."""
    if q is None:
        return (gu.numel() + dn.numel()) * 2
    return sum(t.numel() * t.element_size() for t in (q.gate_up, q.down, q.gate_up_scale, q.down_scale))


def ours_step(m, x, idx, w, r):
    """Ours' training step on module m (LoRA of rank r added): (fwd, bwd, drop_grads)."""
    m.add_lora(r, 2 * r)
    for p in m.lora_B["default"].values():
        torch.nn.init.normal_(p, std=0.01)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    gout = torch.randn_like(x)
    state = {}

    def fwd():
        state["y"] = m(xg, idx, wg)

    def bwd():
        state["y"].backward(gout)

    def drop_grads():  # as a trainer's zero_grad(set_to_none=True) does between steps
        m.zero_grad(set_to_none=True)
        xg.grad = wg.grad = None

    return fwd, bwd, drop_grads


def with_backward_copy(step):
    """A training step whose backward runs with KT_SFT_BACKWARD_COPY=1 (read at every backward; the module keeps
    its copy while it runs, and the other modules' backwards run without)."""
    fwd, bwd, drop = step

    def bwd_copy():
        os.environ["KT_SFT_BACKWARD_COPY"] = "1"
        try:
            bwd()
        finally:
            os.environ["KT_SFT_BACKWARD_COPY"] = "0"

    return fwd, bwd_copy, drop


def ours_extras(m, step, x, idx, w, reps, phases=False):
    """Ours' inference forward on module m and, with `phases`, the engine's time per phase over training steps
    of its own (so that the profile's clock reads stay out of the timed steps)."""
    res = dict(infer=inference_ms(m, lambda: (x, idx, w), reps))
    if phases:
        fwd, bwd, drop_grads = step
        timing.profile_engine_phases(True)
        timing.engine_phases(reset=True)
        for _ in range(reps):
            fwd()
            bwd()
            drop_grads()
        res["phases"] = {k: v * 1e3 / reps for k, v in timing.engine_phases(reset=True).items()}
        timing.profile_engine_phases(False)
    return res


def torch_step(gu, dn, x, idx, w, r, extras=None):
    """The PyTorch BF16 per-expert loop's training step: (fwd, bwd, drop_grads)."""
    E, H, I = dn.shape[0], dn.shape[1], dn.shape[2]
    g = torch.Generator().manual_seed(2)
    # Per-expert LoRA leaves, as a per-expert PyTorch model holds them: slices of one stacked leaf made every
    # backward zero-fill and add up a whole [E, r, d] gradient per expert and projection (~half its time).
    extras = extras or {}
    unit = extras.get("unit", SWIGLU)
    projections = ("gate", "up", "down") if unit.gated else ("up", "down")
    A = {p: [(torch.randn(r, d, generator=g) * 0.01).bfloat16().requires_grad_() for _ in range(E)]
         for p, d in (("gate", H), ("up", H), ("down", I)) if p in projections}
    B = {p: [(torch.randn(d, r, generator=g) * 0.01).bfloat16().requires_grad_() for _ in range(E)]
         for p, d in (("gate", I), ("up", I), ("down", H)) if p in projections}
    lora = LoraWeights(A, B, 2.0)
    biases = [None if extras.get(k) is None else extras[k].bfloat16() for k in ("gate_up_proj_bias", "down_proj_bias")]
    xg = x.clone().requires_grad_()
    wg = w.bfloat16().requires_grad_()
    gout = torch.randn_like(x)
    state = {}

    def fwd():
        state["y"] = moe_experts_reference(xg, idx, wg, gu, dn, lora, 0, *biases, unit)

    def drop_grads():
        for t in [xg, wg, *(t for table in (A, B) for ts in table.values() for t in ts)]:
            t.grad = None

    return fwd, lambda: state["y"].backward(gout), drop_grads


PEER_METHODS = {"bf16": "AMXBF16_SFT", "fp8": "AMXFP8_SFT", "int4": "RAWINT4_SFT"}


def peer_step(gu, dn, q, x, idx, w, r, threads, fmt="bf16"):
    """The peer's training step for a format: ((fwd, bwd, drop), "ok"), or (None, why it cannot run here)."""
    try:
        import peer_ktkernel
    except ImportError as e:
        return None, f"benchmarks/peer_ktkernel.py not importable: {e}"
    ok, why = peer_ktkernel.available(PEER_METHODS[fmt])
    if not ok:
        return None, why
    try:
        peer = peer_ktkernel.make_peer(gu, dn, idx.shape[1], r, 2 * r, threads, quantized=q)
    except ValueError as e:  # its constraints (e.g. INT4 rank 8 only), stated by the peer
        return None, str(e)
    gout = torch.randn_like(x)
    # Every saving forward is followed by its backward: its RAWINT4 method keeps a stack of saved forwards and
    # aborts the process when saving forwards pile up.
    return (lambda: peer.forward(x, idx, w), lambda: peer.backward(gout), lambda: None), "ok"


def rss_probe(E, H, I, K, T, r, fmt="bf16") -> dict:
    """Peak RSS of a fresh process holding one engine and running forward+backward, vs the bytes of its expert
    weights in the format (quantized weights are made in place, expert by expert, as the loader does)."""
    code = f"""
import torch, kt_sft
from kt_sft.formats import QuantizedExperts
def rss(key="VmHWM"):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # restart the peak count after the imports
base = rss("VmRSS")
import os
os.environ["KT_SFT_BACKWARD_COPY"] = "1" if "{fmt}" == "bf16+copy" else "0"
if "{fmt}".startswith("bf16"):
    m = kt_sft.KTExperts(torch.empty({E}, {2 * I}, {H}, dtype=torch.bfloat16).normal_(),
                         torch.empty({E}, {H}, {I}, dtype=torch.bfloat16).normal_())
else:  # random codes filled in place (no temporaries); 0..126 avoids the FP8 NaN codes
    q = QuantizedExperts.empty("{fmt}", {E}, {H}, {I})
    for t in (q.gate_up, q.down):
        t.view(torch.uint8).random_(0, 127)
    for t in (q.gate_up_scale, q.down_scale):
        t.fill_(1e-3)
    m = kt_sft.KTExperts(q)
    wbytes = sum(t.numel() * t.element_size() for t in (q.gate_up, q.down, q.gate_up_scale, q.down_scale))
held = rss()
m.add_lora({r}, {2 * r})
x = torch.randn({T}, {H}, dtype=torch.bfloat16, requires_grad=True)
idx = torch.stack([torch.randperm({E})[:{K}] for _ in range({T})])
w = torch.rand({T}, {K}, requires_grad=True)
m(x, idx, w).backward(torch.randn({T}, {H}, dtype=torch.bfloat16))
print(base, held, rss(), kt_sft.capabilities()["scratch_bytes"], {E * 3 * H * I * 2} if "{fmt}".startswith("bf16") else wbytes)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    base, held, peak, scratch, wbytes = map(int, out)
    return dict(weight_gb=wbytes / 1e9, held_over_weights=(held - base) / wbytes,
                peak_over_weights=(peak - base) / wbytes, scratch_gb=scratch / 1e9, peak_gb=(peak - base) / 1e9)


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def measure_rounds(steps: dict, reps: int, rounds: int) -> dict:
    """Each training step of `steps` (name -> (fwd, bwd, drop)) timed in turn, `rounds` times over: name -> per round
    [fwd ms, bwd ms] (medians of `reps` steps). A slow spell of a shared machine then reaches the steps of the
    same round alike, so their ratio within a round moves less than the times do."""
    out = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fwd, bwd, drop) in steps.items():
            out[name].append(list(train_step_ms(fwd, bwd, drop, reps)))
    return out


def run_formats(formats, gu, dn, x, idx, w, r, reps, rounds, threads, skip, res, phases=False, extras=None):
    """Ours, the peer and the PyTorch loop: training steps in rounds, then ours' inference, decode and RSS per
    format. extras: layer_extras (the peer computes no GPT-OSS unit, and the RSS probe builds plain experts: both
    are left out with them)."""
    if extras:
        skip = skip | {"peer", "rss"}
    E, H, I, K = dn.shape[0], dn.shape[1], dn.shape[2], idx.shape[1]
    modules, steps = {}, {}
    for fmt in formats:
        q = quantized(fmt, gu, dn, (extras or {}).get("unit", SWIGLU).gated)
        modules[fmt] = (experts_module(gu, dn, q, extras), q)
        steps[f"ours {fmt}"] = ours_step(modules[fmt][0], x, idx, w, r)
        if fmt == "bf16+copy":
            steps[f"ours {fmt}"] = with_backward_copy(steps[f"ours {fmt}"])
            continue  # the peer's BF16 is measured under bf16
        if "peer" not in skip:
            peer_r = 8 if fmt == "int4" else r  # the peer's RAWINT4 SFT takes rank 8 only
            step, res["peer_status"][fmt] = peer_step(gu, dn, q, x, idx, w, peer_r, threads, fmt)
            res["peer"][fmt] = None
            if step:
                steps[f"peer {fmt}"] = step
    if "torch" not in skip:
        steps["torch bf16"] = torch_step(gu, dn, x, idx, w, r, extras)
    res["rounds"] = measure_rounds(steps, reps, rounds)
    for name, per_round in res["rounds"].items():
        times = dict(fwd=statistics.median(t[0] for t in per_round), bwd=statistics.median(t[1] for t in per_round))
        kind, fmt = name.split()
        if kind == "torch":
            res["torch"] = times
        else:
            res[kind][fmt] = times
    for fmt, (m, q) in modules.items():
        res["ours"][fmt].update(ours_extras(m, steps[f"ours {fmt}"], x, idx, w, reps, phases))
        if "decode" not in skip and fmt != "bf16+copy":  # inference reads no copy
            md = experts_module(gu, dn, q, extras)
            md.add_lora(r, 2 * r)
            ms = decode_ms(md, H, E, K, max(reps, 20))
            res["decode"][fmt] = dict(ms=ms, gbps=expert_bytes(fmt, gu, dn, q) * K / E / ms / 1e6)
        if "rss" not in skip:
            res["rss"][fmt] = rss_probe(E, H, I, K, x.shape[0], r, fmt)
    gc.collect()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="S", choices=sorted(SHAPES))
    for k in ("T", "r", "threads", "reps"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--formats", default="bf16", help="comma list of: bf16,fp8,int4")
    ap.add_argument("--skip", default="", help="comma list of: torch,peer,decode,rss,peak")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--phases", action="store_true", help="also time ours per engine phase (separate steps)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every training step in turn this many times; ratios per round and their median")
    args = ap.parse_args()
    s = dict(SHAPES[args.shape])
    s["T"] = args.T or s["T"]
    s["r"] = args.r or s["r"]
    threads = args.threads or kt_sft.capabilities()["threads"]
    reps = args.reps or 5
    skip = set(filter(None, args.skip.split(",")))
    formats = args.formats.split(",")
    kt_sft.configure(threads=threads)
    torch.set_num_threads(threads)
    E, H, I, K, T, r = s["E"], s["H"], s["I"], s["K"], s["T"], s["r"]
    caps = kt_sft.capabilities()
    res = dict(shape=args.shape, **s, threads=threads, kernels=caps["kernels"], cpu=cpu_name(),
               commit=git_commit(), torch_version=torch.__version__, ours={}, peer={}, peer_status={}, decode={},
               rss={})
    extras = layer_extras(args.shape, E, H, I)
    stacked = extras.get("unit", SWIGLU).stacked
    # One pass (forward, or backward in LoRA mode): three [N,H]x[H,I]-sized products, two without a gate.
    flop = 2 * (stacked + 1) * T * K * H * I
    gu, dn = make_layer(E, H, I, r, stacked=stacked)
    x, idx, w = make_inputs(T, H, E, K)
    run_formats(formats, gu, dn, x, idx, w, r, reps, args.rounds, threads, skip, res, args.phases, extras)
    if "peak" not in skip:
        res["peak_gflops"] = measured_peak_gflops(threads)
        res["read_gbps"] = measured_read_gbps(threads)
    report(res, flop)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def report(res, flop):
    print(f"\nshape {res['shape']}: T={res['T']} H={res['H']} I={res['I']} E={res['E']} K={res['K']} r={res['r']}, "
          f"{res['threads']} threads, kernels {res['kernels']}, commit {res['commit']}, torch {res['torch_version']}"
          f"\nCPU: {res['cpu']}")
    print(f"{'':12s} {'fwd ms':>9s} {'bwd ms':>9s} {'fwd+bwd':>9s} {'GFLOP/s f/b':>14s}")
    rows = [(f"ours {f}", v) for f, v in res["ours"].items()] + [(f"peer {f}", v) for f, v in res["peer"].items() if v]
    rows += [("torch bf16", res["torch"])] if res.get("torch") else []
    for name, v in rows:
        print(f"{name:12s} {v['fwd']:9.1f} {v['bwd']:9.1f} {v['fwd'] + v['bwd']:9.1f} "
              f"{flop / v['fwd'] / 1e6:6.0f}/{flop / v['bwd'] / 1e6:<6.0f}")
    for f, why in res["peer_status"].items():
        if res["peer"].get(f) is None:
            print(f"peer {f}: not measured ({why})")
    total = {name: v["fwd"] + v["bwd"] for name, v in rows}
    per_round = {name: [f + b for f, b in times] for name, times in res.get("rounds", {}).items()}
    for f in res["ours"]:
        base = total[f"ours {f}"]
        for other in (f"peer {f.split('+')[0]}", "torch bf16", "ours bf16"):
            if other in total and other != f"ours {f}":
                line = f"ours {f} vs {other} (fwd+bwd): {total[other] / base:.2f}x faster"
                if len(per_round.get(other, [])) > 1:
                    ratios = [o / b for o, b in zip(per_round[other], per_round[f"ours {f}"])]
                    line += (f"; within each round {', '.join(f'{x:.2f}' for x in ratios)}x, "
                             f"median {statistics.median(ratios):.2f}x")
                print(line)
        print(f"ours {f} inference forward: {res['ours'][f]['infer']:.1f} ms")
        if "phases" in res["ours"][f]:
            print(f"ours {f} phases, ms per step: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in res["ours"][f]["phases"].items()))
    if "peak_gflops" in res:
        peak = max(res["peak_gflops"].values())
        print(f"measured matmul peak: {res['peak_gflops']}; measured read bandwidth: {res['read_gbps']:.1f} GB/s")
        for f, o in res["ours"].items():
            print(f"ours {f}: fwd {flop / o['fwd'] / 1e6 / peak:.0%}, bwd {flop / o['bwd'] / 1e6 / peak:.0%} of the peak")
    for f, d in res["decode"].items():
        bw = f" = {d['gbps'] / res['read_gbps']:.0%} of read bandwidth" if "read_gbps" in res else ""
        print(f"decode T=1 {f}: {d['ms']:.3f} ms, {d['gbps']:.1f} GB/s of expert bytes{bw}")
    for f, q in res["rss"].items():
        print(f"RSS {f}: weights {q['weight_gb']:.2f} GB; held {q['held_over_weights']:.3f}x weights; "
              f"peak after fwd+bwd {q['peak_gb']:.2f} GB = {q['peak_over_weights']:.2f}x weights "
              f"(scratch {q['scratch_gb']:.2f} GB)")


if __name__ == "__main__":
    main()
