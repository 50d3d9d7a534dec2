"""Quick A/B probe through KTExperts: one training step (fwd+bwd, median of 10) and one decode step (T=1
under no_grad; each call routes to a different random expert set, as decode does, so that at shapes Q and DS
the weights come from RAM rather than cache (shape S's whole layer, 25 MB, may sit in a large L3); the median
over 15 rounds of the median of 40 calls) on a bench_layer shape. Run it alternately
against two builds to compare them on a noisy machine.

  python benchmarks/bench_step.py [--shape S|Q|DS] [--format bf16|fp8|int4] [--skip-train] [--r 0]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_layer import SHAPES, expert_bytes, experts_module, make_inputs, make_layer, quantized  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="S", choices=sorted(SHAPES))
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8", "int4"), help="the experts' format")
    ap.add_argument("--skip-train", action="store_true", help="decode only")
    ap.add_argument("--r", type=int, help="LoRA rank (default: the shape's; 0: no LoRA)")
    args = ap.parse_args()
    s = SHAPES[args.shape]
    E, H, I, K, T = s["E"], s["H"], s["I"], s["K"], s["T"]
    r = s["r"] if args.r is None else args.r
    gu, dn = make_layer(E, H, I, r)
    q = quantized(args.format, gu, dn)
    m = experts_module(gu, dn, q)
    if r:
        m.add_lora(r, 2 * r)
    line = f"shape {args.shape}, {args.format}, r={r}: "
    if not args.skip_train:
        x, idx, w = make_inputs(T, H, E, K)
        xg, wg, g = x.clone().requires_grad_(), w.clone().requires_grad_(), torch.randn_like(x)
        steps = []
        for _ in range(12):
            t0 = time.perf_counter()
            m(xg, idx, wg).backward(g)
            steps.append(time.perf_counter() - t0)
        line += f"fwd+bwd {statistics.median(steps[2:]) * 1e3:.1f} ms  "
    xd, _, wd = make_inputs(1, H, E, K, seed=3)
    gen = torch.Generator().manual_seed(4)
    routes = [torch.randperm(E, generator=gen)[:K].unsqueeze(0) for _ in range(40)]
    rounds = []
    m.eval()  # as inference runs: a no-grad forward in training mode would keep its pass for a recompute
    with torch.no_grad():
        for _ in range(15):
            calls = []
            for idxd in routes:
                t0 = time.perf_counter()
                m(xd, idxd, wd)
                calls.append(time.perf_counter() - t0)
            rounds.append(statistics.median(calls))
    ms = statistics.median(rounds) * 1e3
    print(line + f"decode {ms:.3f} ms ({expert_bytes(args.format, gu, dn, q) * K / E / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
