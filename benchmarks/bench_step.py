"""Quick A/B probe on layer S (H=1024, I=512, E=16, K=4, r=8): one training step (fwd+bwd, T=256, median of
10) and one decode step (T=1 under no_grad, median of 300), through KTExperts. Run it alternately against two
builds to compare them on a noisy machine.

  python benchmarks/bench_step.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kt_sft  # noqa: E402
from bench_layer import make_inputs, make_layer  # noqa: E402


def main():
    E, H, I, K, T, r = 16, 1024, 512, 4, 256, 8
    gu, dn = make_layer(E, H, I, r)
    m = kt_sft.KTExperts(gu, dn)
    m.add_lora(r, 2 * r)
    x, idx, w = make_inputs(T, H, E, K)
    xg, wg, g = x.clone().requires_grad_(), w.clone().requires_grad_(), torch.randn_like(x)
    xd, idxd, wd = make_inputs(1, H, E, K, seed=3)
    steps, decode = [], []
    for _ in range(12):
        t0 = time.perf_counter()
        m(xg, idx, wg).backward(g)
        steps.append(time.perf_counter() - t0)
    with torch.no_grad():
        for _ in range(300):
            t0 = time.perf_counter()
            m(xd, idxd, wd)
            decode.append(time.perf_counter() - t0)
    ms = statistics.median(decode) * 1e3
    print(f"fwd+bwd {statistics.median(steps[2:]) * 1e3:.1f} ms  decode {ms:.3f} ms "
          f"({K * 3 * H * I * 2 / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
