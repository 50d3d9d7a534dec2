"""kt-sft command line: `doctor` (what this machine can run), `prepare` (a model directory that
transformers / LLaMA-Factory load with the routed experts on the CPU engine) and `demo` (LoRA on a random MoE
layer's experts, checked against the reference)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from . import capabilities
from .nn.experts import KTExperts
from .ops.reference import LoraWeights, moe_experts_reference


def _mem_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return float("nan")


def doctor(_args) -> int:
    caps = capabilities()
    print(f"CPU features     : {', '.join(k for k, v in caps['cpu'].items() if v) or 'none of AVX2/AVX-512/AMX'}")
    print(f"kernel sets      : {', '.join(caps['runnable_kernels'])} (in use: {caps['kernels']})")
    print(f"engine threads   : {caps['threads']} (pinned: {caps['pinned']})")
    print(f"memory           : {_mem_gb():.1f} GiB")
    print(f"GPU              : {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    if caps["kernels"] is None:
        print("This CPU cannot run the expert kernels (it needs AVX2 + FMA).")
        return 1
    return 0


def demo(args) -> int:
    """Fits expert LoRA so a random MoE layer reproduces a perturbed copy of itself."""
    torch.manual_seed(0)
    E, H, I, K, T = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    gu = (torch.randn(E, 2 * I, H) / H**0.5).bfloat16()
    dn = (torch.randn(E, H, I) / I**0.5).bfloat16()
    layer = KTExperts(gu, dn)
    layer.add_lora(args.rank, alpha=2 * args.rank)
    target = KTExperts((gu.float() + 0.02 * torch.randn_like(gu.float())).bfloat16(), dn)
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K), -1)
    with torch.no_grad():
        y_target = target(x, idx, w)
    opt = torch.optim.AdamW(layer.parameters(), lr=args.lr)
    print(f"LoRA r={args.rank} on {E} experts (H={H}, I={I}, top-{K}), {T} tokens, kernels {capabilities()['kernels']}")
    first = last = None
    for step in range(args.steps):
        loss = torch.nn.functional.mse_loss(layer(x, idx, w), y_target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {last:.6f}")
    A = {p: t.detach().double() for p, t in layer.lora_A["default"].items()}
    B = {p: t.detach().double() for p, t in layer.lora_B["default"].items()}
    with torch.no_grad():
        ref = moe_experts_reference(x.double(), idx, w.double(), gu.double(), dn.double(),
                                    LoraWeights(A, B, layer.scaling["default"]))
        err = ((layer(x, idx, w).double() - ref).norm() / ref.norm()).item()
    print(f"loss {first:.6f} -> {last:.6f}; engine vs float64 reference after training: rel L2 {err:.1e}")
    return 0 if last < first and err < 1e-4 else 1


def prepare_cmd(args) -> int:
    from .integrations.prepare import prepare

    out = prepare(args.model_dir, args.out_dir, threads=args.threads, kernels=args.kernels)
    print(f"prepared {out}: load it with trust_remote_code (LLaMA-Factory: model_name_or_path: {out}, "
          "trust_remote_code: true)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kt-sft", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="report CPU features, kernel sets, threads, memory and GPU").set_defaults(fn=doctor)
    p = sub.add_parser("prepare", help="write a directory that LLaMA-Factory / transformers load with CPU experts")
    p.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors shards)")
    p.add_argument("out_dir", help="where to write the prepared directory (small: links and config)")
    p.add_argument("--threads", type=int, help="engine threads (default: all CPUs the process may use)")
    p.add_argument("--kernels", help="force a kernel set (default: the best this CPU runs)")
    p.set_defaults(fn=prepare_cmd)
    d = sub.add_parser("demo", help="train expert LoRA on a random MoE layer and check it against the reference")
    for name, default in (("experts", 16), ("hidden", 256), ("intermediate", 128), ("top-k", 4), ("tokens", 256),
                          ("rank", 8), ("steps", 60)):
        d.add_argument(f"--{name}", type=int, default=default)
    d.add_argument("--lr", type=float, default=2e-3)
    d.set_defaults(fn=demo)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
