"""Where the tile (AMX) kernels start to pay: Layer Q shape at growing T (rows per expert = T·K/E), ours with
the experts on tiles from the fewest rows (tile_min_rows 1; the default kernel set: amx, or avx512_bf16's tiles on
vdpbf16ps) against the same kernel set with the tiles off (its other kernels, what runs below the thresholds;
`--baseline avx512`: the float32 avx512 set, as measured before the quantized dot forms existed), side by side in
one run: the inference forward, the training forward and its backward. The smallest rows per expert at which tiles
win for each is what Runtime::forward_tile_rows and backward_tile_rows take (csrc/moe/runtime.h). --format fp8|int4
measures quantized experts, whose tile path decodes each weight row to BF16 first. Needs a CPU with AMX or AVX-512
BF16.

  python benchmarks/bench_tiles.py --T 1,16,32,64,128,256,512 [--format bf16|fp8|int4] [--rounds N]
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
    return dict(fwd=f, bwd=b, infer=inference_ms(m, lambda: (x, idx, w), reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="1,16,32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="the whole sweep this many times, in turn")
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8", "int4"), help="the experts' format")
    ap.add_argument("--baseline", default="dot", choices=("dot", "avx512"),
                    help="dot: the amx set with tiles off; avx512: the float32 avx512 set")
    args = ap.parse_args()
    caps = kt_sft.capabilities()
    if not caps["tiles_in_use"]:
        raise SystemExit(f"no tile kernels here: {caps['tiles']}")
    tiles = caps["kernels"]
    s = SHAPES["Q"]
    E, H, I, K, r = s["E"], s["H"], s["I"], s["K"], s["r"]
    gu, dn = make_layer(E, H, I, r)
    q = quantized(args.format, gu, dn)
    # tile_min_rows 1: on AMX every expert on tiles; on the emulated set forwards from 2 rows (INT4 4), backwards
    # from 1. 1 << 20: none.
    base = (tiles, 1 << 20) if args.baseline == "dot" else ("avx512", 0)
    print(f"Layer Q {args.format}, kernel set {tiles}, {caps['threads']} threads; ms (median of {args.reps}); "
          f"each pair: tiles / {args.baseline} (ratio = {args.baseline} / tiles)")
    print(f"{'round':>5s} {'T':>5s} {'rows/expert':>11s} {'inference':>22s} {'training forward':>22s} "
          f"{'backward':>22s}")
    for rnd in range(1, args.rounds + 1):
        for T in map(int, args.T.split(",")):
            x, idx, w = make_inputs(T, H, E, K)
            got = []
            for ks, min_rows in ((tiles, 1), base):
                kt_sft.configure(kernels=ks, tile_min_rows=min_rows)
                got.append(bench_ours(experts_module(gu, dn, q), x, idx, w, r, args.reps))
            cells = [f"{a:7.2f} / {b:7.2f} {b / a:5.2f}" for a, b in
                     ((got[0][k], got[1][k]) for k in ("infer", "fwd", "bwd"))]
            print(f"{rnd:5d} {T:5d} {T * K / E:11.2f} " + " ".join(f"{c:>22s}" for c in cells))
    kt_sft.configure(kernels="", tile_min_rows=0)


if __name__ == "__main__":
    main()
