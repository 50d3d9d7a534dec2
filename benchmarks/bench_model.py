"""End-to-end benchmark: LoRA SFT steps of a Qwen3-30B-A3B-shaped model (random weights, --layers of its 48),
or of a Moonlight-16B-A3B-shaped one (--arch moonlight: DeepSeek-V3's architecture with 2 shared experts, every
layer MoE), at --seq tokens, routed experts on the CPU engine and the rest on the GPU (kt), or everything on the
GPU with stock transformers + PEFT (gpu; LoRA on attention only, since PEFT has no practical LoRA on fused
experts): the all-GPU upper bound for scale. Prints tokens/s, GPU memory, host RSS and the step split.
--no-shared-overlap runs a Moonlight block's shared experts after the engine instead of beside it;
--no-checkpointing keeps every layer's activations on the GPU instead of recomputing them (the engine's kept first
pass makes the recompute's expert forward free, but attention's runs twice and Python queues it twice).

  python benchmarks/bench_model.py --mode kt --layers 4 --seq 2048
  python benchmarks/bench_model.py --mode gpu --layers 4 --seq 2048
  python benchmarks/bench_model.py --arch moonlight --layers 4 --seq 2048 [--no-shared-overlap]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model

from kt_sft.models import use_cpu_experts
from kt_sft.models.overlap import installed_overlaps
from kt_sft.ops.step_profile import host_rss_gib
from kt_sft.ops.timing import engine_seconds, reset_engine_seconds


def qwen3_30b_a3b(layers: int) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, norm_topk_prob=True, tie_word_embeddings=False)


def moonlight_16b_a3b(layers: int) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=0, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, max_position_embeddings=8192, tie_word_embeddings=False)


ARCHS = {"qwen3": (qwen3_30b_a3b, ["q_proj", "k_proj", "v_proj", "o_proj"]),
         "moonlight": (moonlight_16b_a3b, ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])}


@contextlib.contextmanager
def quick_expert_init(min_numel: int = 1 << 26):
    """Tensor.normal_ on tensors of at least min_numel elements (the routed experts' stacks, the embeddings)
    repeats one block drawn with the same mean and std instead of drawing every value: 48 layers build in seconds
    rather than minutes of single-threaded sampling, and neither the engine's speed nor the routing (the router's
    and attention's weights are drawn in full) depends on those values."""
    draw = torch.Tensor.normal_

    def normal_(t, mean=0.0, std=1.0, *, generator=None):
        if t.numel() < min_numel:
            return draw(t, mean, std, generator=generator)
        with torch.no_grad():
            block = draw(torch.empty((1 << 22) + 4099, dtype=t.dtype), mean, std, generator=generator)
            flat, n = t.view(-1), block.numel()
            whole = flat.numel() // n
            flat[:whole * n].view(whole, n).copy_(block.expand(whole, n))
            flat[whole * n:].copy_(block[:flat.numel() - whole * n])
        return t

    torch.Tensor.normal_ = normal_
    try:
        yield
    finally:
        torch.Tensor.normal_ = draw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("kt", "gpu"), default="kt")
    ap.add_argument("--arch", choices=tuple(ARCHS), default="qwen3")
    ap.add_argument("--no-shared-overlap", action="store_true")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="keep every layer's activations (LLaMA-Factory's `disable_gradient_checkpointing: true`) "
                         "instead of reentrant checkpointing, its default")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--optim", choices=("fused", "plain"), default="fused",
                    help="AdamW as the trainers' default `adamw_torch_fused` builds it, or `adamw_torch`'s (per-tensor "
                         "loops: slow over the CPU experts' LoRA states)")
    ap.add_argument("--quick-init", action="store_true",
                    help="fill the experts and embeddings by repeating one random block (seconds, not minutes, at 48 "
                         "layers)")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    config, attention = ARCHS[args.arch]
    with quick_expert_init() if args.quick_init else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_config(config(args.layers), dtype=torch.bfloat16)
    print(f"model built in {time.perf_counter() - t0:.0f} s")
    targets = list(attention)
    if args.mode == "kt":
        use_cpu_experts(model)
        targets.append("experts")
        if args.no_shared_overlap:
            for overlap in installed_overlaps(model):
                overlap.remove()
    model = model.to("cuda")
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=args.optim == "fused")
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device="cuda")
    # Steps back to back as a trainer runs them, no synchronization in between: GPU work queued by one step (the
    # optimizer's, KT_SFT_LORA_ON_GPU's copies of the LoRA for the engine) may run on into the next, which waits
    # for it only where it needs its results. A step's time runs from its start to the next one's.
    starts, engine, optim_s = [], [], []
    for step in range(args.steps + 1):
        if step == 1:  # the first step warms up allocators and kernels
            torch.cuda.synchronize()
            allocator = torch.cuda.memory_stats()
        reset_engine_seconds()
        starts.append(time.perf_counter())
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        if step:
            optim_s.append(time.perf_counter() - t1)
            engine.append(engine_seconds())
    torch.cuda.synchronize()
    starts.append(time.perf_counter())
    # Calls into the driver's allocator while timed (each cudaFree synchronizes the device): none when the caching
    # allocator reuses what the warm-up step took.
    driver_calls = {k: torch.cuda.memory_stats()[k] - allocator[k] for k in ("num_device_alloc", "num_device_free",
                                                                              "num_alloc_retries")}
    step_s = statistics.median(b - a for a, b in zip(starts[1:], starts[2:]))
    fwd = statistics.median(e["forward"] for e in engine)
    bwd = statistics.median(e["backward"] for e in engine)
    xfer = statistics.median(e["transfer"] for e in engine)
    gpu = statistics.median(e["gpu"] for e in engine)
    opt_s = statistics.median(optim_s)
    print(f"mode {args.mode}: {args.arch}, {args.layers} layers, seq {args.seq}, LoRA r{args.rank}, targets {targets}, "
          f"{args.optim} AdamW")
    print(f"step {step_s * 1e3:.0f} ms, {args.seq / step_s:.0f} tokens/s; GPU max allocated "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (reserved {torch.cuda.max_memory_reserved() / 2**30:.2f}, "
          f"the CUDA context on top); host RSS {host_rss_gib():.1f} GiB "
          f"(peak {host_rss_gib('VmHWM'):.1f}); "
          f"GPU allocator's driver calls while timed {driver_calls}")
    if args.mode == "kt":
        other = step_s - fwd - bwd - xfer - gpu - opt_s
        recompute = "" if args.no_checkpointing else " (incl. the checkpoint recompute)"
        print(f"CPU engine: forward {fwd * 1e3:.0f} ms{recompute}, backward {bwd * 1e3:.0f} ms; "
              f"transfers to/from it {xfer * 1e3:.0f} ms; waiting for the GPU work that feeds it {gpu * 1e3:.0f} ms; "
              f"clipping + optimizer {opt_s * 1e3:.0f} ms; everything else (Python, GPU work not waited for) "
              f"{other * 1e3:.0f} ms; step / CPU engine time {step_s / (fwd + bwd):.2f}")


if __name__ == "__main__":
    main()
