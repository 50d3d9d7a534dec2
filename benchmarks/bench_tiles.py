"""Where the tile (AMX) kernels start to pay: Layer Q shape at growing T (rows per expert = T·K/E), ours with
every expert on tiles (kernel set amx, tile_min_rows 1) against the AVX-512 kernels, side by side in one run.
The smallest rows per expert at which tiles win for both the training step and the inference forward is the
default tile_min_rows (csrc/moe/runtime.h). --format fp8|int4 measures quantized experts, whose tile path
decodes each weight row to BF16 first (their inference forwards take tiles from 2 · tile_min_rows rows, so
from 2 rows here). Needs a CPU with AMX.

  python benchmarks/bench_tiles.py --T 16,32,64,128,256,512,2048 [--format bf16|fp8|int4]
"""
from __future__ import annotations

import argparse

from bench_layer import (SHAPES, experts_module, inference_ms, make_inputs, make_layer, ours_step, quantized,
                         train_step_ms)

import kt_sft


def bench_ours(m, x, idx, w, r, reps):
    """Ours' training step (median forward and backward ms) and inference forward on module m, LoRA of rank r."""
    fwd, bwd, drop = ours_step(m, x, idx, w, r)
    f, b = train_step_ms(fwd, bwd, drop, reps)
    return dict(fwd=f, bwd=b, infer=inference_ms(m, x, idx, w, reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="16,32,64,128,256,512,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8", "int4"), help="the experts' format")
    args = ap.parse_args()
    if "amx" not in kt_sft.capabilities()["runnable_kernels"]:
        raise SystemExit(f"no tile kernels here: {kt_sft.capabilities()['tiles']}")
    s = SHAPES["Q"]
    E, H, I, K, r = s["E"], s["H"], s["I"], s["K"], s["r"]
    gu, dn = make_layer(E, H, I, r)
    q = quantized(args.format, gu, dn)
    print(f"Layer Q {args.format}, {kt_sft.capabilities()['threads']} threads; ms (median of {args.reps}); "
          "ratio = avx512 / amx")
    print(f"{'T':>6s} {'rows/expert':>11s} {'infer amx':>10s} {'avx512':>8s} {'ratio':>6s} "
          f"{'fwd+bwd amx':>12s} {'avx512':>8s} {'ratio':>6s}")
    for T in map(int, args.T.split(",")):
        x, idx, w = make_inputs(T, H, E, K)
        got = {}
        for ks, min_rows in (("amx", 1), ("avx512", 0)):
            kt_sft.configure(kernels=ks, tile_min_rows=min_rows)
            got[ks] = bench_ours(experts_module(gu, dn, q), x, idx, w, r, args.reps)
        a, b = got["amx"], got["avx512"]
        step_a, step_b = a["fwd"] + a["bwd"], b["fwd"] + b["bwd"]
        print(f"{T:6d} {T * K / E:11.1f} {a['infer']:10.2f} {b['infer']:8.2f} {b['infer'] / a['infer']:6.2f} "
              f"{step_a:12.1f} {step_b:8.1f} {step_b / step_a:6.2f}")
    kt_sft.configure(kernels="", tile_min_rows=0)


if __name__ == "__main__":
    main()
