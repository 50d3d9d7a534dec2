"""The autograd Function over the CPU engine: moves tensors, calls the engine, nothing else (STYLE.md 6).

Gradients: x and top_k_weights are returned to autograd; LoRA A/B grads of float32 CPU matrices go straight
into `param.grad` (KTExperts.lora_grad_into: a buffer the module keeps and reuses when the grad is None, else
added into the grad an earlier micro-batch left), else they are returned to autograd in the parameters'
dtype; base-weight grads (full mode) are accumulated by the engine straight into `param.grad` (created as
zeros when missing), so a multi-GB expert stack is never materialized twice.
"""
from __future__ import annotations

import torch

from .._ext import view
from .timing import engine_timer

_ENGINE_DTYPES = (torch.float32, torch.bfloat16)
# x, top_k_index, top_k_weights, module, lora settings, gate_up, down; then the 6 LoRA matrices
N_FIXED_INPUTS = 7
GATE_UP_INPUT, DOWN_INPUT = 5, 6


def to_engine(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on the CPU, contiguous, in dtype (or its own when the engine takes it, else float32). From a GPU: cast
    there, copied into pinned memory (a pageable copy goes through a staging buffer; BENCHMARKS.md "End to
    end": 35 -> 7 ms per 4-layer step), after waiting for the stream that produces t (timed as "gpu": GPU
    compute the engine waited for, not transfer)."""
    if dtype is None:
        dtype = t.dtype if t.dtype in _ENGINE_DTYPES else torch.float32
    if t.is_cpu:  # the common case of every call's LoRA matrices first: keyword .to() parsing costs microseconds
        return t.detach() if t.dtype == dtype and t.is_contiguous() else t.detach().to(dtype).contiguous()
    if t.device.type != "cuda":
        return t.detach().to(device="cpu", dtype=dtype).contiguous()
    src = t.detach().to(dtype)
    with engine_timer("gpu"):
        torch.cuda.current_stream(t.device).synchronize()
    out = torch.empty(src.shape, dtype=dtype, pin_memory=True)
    out.copy_(src, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def host_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor for an engine result bound for device: pinned when that is a GPU, so to_caller's copy is
    asynchronous (torch's pinned allocator does not hand the block out again before that copy is done)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def engine_inputs(x, top_k_index, top_k_weights, lora_params):
    """The call's tensors as the engine takes them: x (bf16/f32), int64 ids, float32 weights and LoRA."""
    with engine_timer("transfer"):
        lora32 = [None if p is None else to_engine(p, torch.float32) for p in lora_params]
        return to_engine(x), to_engine(top_k_index, torch.int64), to_engine(top_k_weights, torch.float32), lora32


def to_caller(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """An engine result (from host_empty) moved back to the caller's device and dtype (timed as transfer); the
    copy to a GPU is queued on its current stream, so later GPU work orders after it without a wait here."""
    with engine_timer("transfer"):
        return t.to(device=device, non_blocking=True).to(dtype)


def lora_views(mats):
    return [view(m, "LoRA weight") for m in mats]


def run_forward(engine, xc, idx, w, lora_r, lora_scale, lora32, save, device, dropout=(0.0, 0)):
    """One engine forward on prepared CPU tensors, its output bound for device; returns (out, saved-or-None).
    dropout: (p, seed) of LoRA dropout (p = 0: none)."""
    out = host_empty(xc.shape, xc.dtype, device)
    with engine_timer("forward"):
        saved = engine.forward(
            view(xc, "hidden_states"), view(idx, "top_k_index"), view(w, "top_k_weights"), view(out),
            lora_r, lora_scale, lora_views(lora32), save, *dropout, now=True,
        ).wait()
    return out, saved


class ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, module, lora, gate_up, down, *lora_params):
        """lora: (r, scale, (dropout p, seed))."""
        xc, idx, w, lora32 = engine_inputs(x, top_k_index, top_k_weights, lora_params)
        r, scale, dropout = lora
        kept = module.take_kept(xc, idx, w, lora_params, lora)  # gradient checkpointing's recompute
        if kept is not None:
            out, saved = kept.out, kept.saved
        else:
            out, saved = run_forward(module.engine, xc, idx, w, r, scale, lora32, save=True, device=x.device,
                                     dropout=dropout)
        ctx.module = module
        ctx.lora = lora
        ctx.saved = saved
        ctx.lora32 = lora32
        ctx.lora_params = lora_params
        ctx.x_meta = (x.device, x.dtype)
        ctx.w_meta = (top_k_weights.device, top_k_weights.dtype, tuple(top_k_weights.shape))
        ctx.save_for_backward(xc)
        return to_caller(out, x.device, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (xc,) = ctx.saved_tensors
        module = ctx.module
        if ctx.saved is None:
            raise RuntimeError("KTExperts backward ran twice over one forward; run the forward again instead of "
                               "retain_graph=True.")
        dev, dt = ctx.x_meta
        wdev, wdt, wshape = ctx.w_meta
        dx = host_empty(xc.shape, xc.dtype, dev)
        dw = host_empty(wshape, torch.float32, wdev)
        need = ctx.needs_input_grad
        # Straight into param.grad where it may (direct: overwriting a reused buffer, or adding into the grad of
        # an earlier micro-batch), else written into new tensors for autograd.
        lora_grads, direct, accumulate = [], [], []
        for i, (p, p32) in enumerate(zip(ctx.lora_params, ctx.lora32)):
            wanted = p is not None and need[N_FIXED_INPUTS + i]
            target, adds = module.lora_grad_into(p) if wanted else (None, False)
            direct.append(target is not None)
            accumulate.append(adds)
            lora_grads.append(target if target is not None else torch.empty_like(p32) if wanted else None)
        d_gate_up = module.base_grad(module.gate_up_proj) if need[GATE_UP_INPUT] else None
        d_down = module.base_grad(module.down_proj) if need[DOWN_INPUT] else None
        with engine_timer("transfer"):
            dout = to_engine(grad_out, xc.dtype)  # a fresh copy when grad_out is on the GPU: keep it referenced
        with engine_timer("backward"):
            r, scale, dropout = ctx.lora
            module.engine.backward(
                ctx.saved, view(xc), view(dout), r, scale, lora_views(ctx.lora32),
                view(dx), view(dw), lora_views(lora_grads), view(d_gate_up), view(d_down), *dropout, now=True,
                lora_accumulate=accumulate,
            ).wait()
        ctx.saved = None
        for p, g, d in zip(ctx.lora_params, lora_grads, direct):
            if d:
                p.grad = g
        out_lora = [None if g is None or d else g.to(p.dtype) for p, g, d in zip(ctx.lora_params, lora_grads, direct)]
        return (to_caller(dx, dev, dt), None, to_caller(dw, wdev, wdt), None, None, None, None, *out_lora)
