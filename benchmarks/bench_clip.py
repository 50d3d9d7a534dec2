"""Gradient clipping and AdamW over the CPU experts' LoRA states of a Qwen3-30B-A3B-shaped model (--layers of its
48, r=16: 17.3 M float32 values per layer): torch's clip_grad_norm_ against kt_sft's (kt_sft/ops/grad_clip.py),
torch's fused AdamW step, and a plain copy of the same tensors for the memory speed. Medians of 5 after a warm-up.

  python benchmarks/bench_clip.py --layers 48
"""
from __future__ import annotations

import argparse

import torch

from bench_layer import median_ms
from kt_sft.ops import grad_clip

REPS = 5


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    E, H, I, r = 128, 2048, 768, 16
    shapes = [(E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)] * args.layers  # gate, up, down
    params = [torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"{args.layers} layers: {len(params)} tensors, {n / 1e6:.0f} M values ({n * 4 / 2**30:.2f} GiB per state), "
          f"torch threads {torch.get_num_threads()}")
    copies = [torch.empty_like(p) for p in params]
    t = median_ms(lambda: torch._foreach_copy_(copies, [p.detach() for p in params]), REPS) / 1e3
    print(f"copy: {t * 1e3:.0f} ms, {n * 8 / t / 1e9:.0f} GB/s read + written")
    grads = [p.grad for p in params]
    t = median_ms(lambda: torch._foreach_norm(grads), REPS) / 1e3
    print(f"torch._foreach_norm of the grads: {t * 1e3:.0f} ms, {n * 4 / t / 1e9:.0f} GB/s")
    # A max_norm the norm stays under leaves the grads as they are; one it exceeds scales them (more traffic).
    for label, max_norm in (("under the limit", 1e9), ("clipping", 1e-9)):
        for who, clip in (("torch", grad_clip._torch_clip_grad_norm), ("kt_sft", grad_clip.clip_grad_norm_)):
            t = median_ms(lambda: clip(params, max_norm), REPS) / 1e3
            print(f"{who} clip_grad_norm_ ({label}): {t * 1e3:.0f} ms")
            for p in params:  # clipping by 1e-9 shrinks them toward zero; restore the scale for the next run
                p.grad.normal_(0, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    t = median_ms(opt.step, REPS) / 1e3  # the warm-up step allocates the optimizer's states
    print(f"fused AdamW step: {t * 1e3:.0f} ms, {n * 28 / t / 1e9:.0f} GB/s (reads p, g, m, v; writes p, m, v)")


if __name__ == "__main__":
    main()
