"""Gradient-norm clipping whose norm over CPU gradients runs on the engine's threads.

The trainers clip through `torch.nn.utils.clip_grad_norm_` (transformers' Trainer via accelerate). Its norm of a
CPU tensor (`torch._foreach_norm`, one `linalg.vector_norm` per tensor) runs on one thread: over the CPU experts'
LoRA gradients of all 48 Qwen3-30B-A3B layers at r=16 (830 M float32 values) it took 372 ms per step on the GPU
machine (~9 GB/s), longer than the AdamW step over the same states (BENCHMARKS.md). Once a model holds CPU
experts, `torch.nn.utils.clip_grad_norm_` is this function: the squares of dense float32/bf16 CPU gradients are
summed by the engine's pool in float64 (fixed order: the same for any thread count), every other gradient's norm
is torch's own, and the coefficient and the scaling are torch's. The CPU gradients are multiplied only when the
coefficient is below 1 (torch multiplies them by 1.0 too, which changes nothing but costs a pass over them).
Results differ from torch's in the norm's last bits only (a different summation order; a run that is chaotic in
them, like the demo's at a constant high rate, can end elsewhere), and the norm is float32 even where every
gradient is bf16. Other norm types, and gradients torch would not hand to a plain CPU kernel (sparse, non-
contiguous, subclasses), go to torch unchanged.
"""
from __future__ import annotations

import torch

from .._ext import _C, view

_torch_clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _summed_here(g: torch.Tensor) -> bool:
    return (type(g) is torch.Tensor and g.device.type == "cpu" and g.layout == torch.strided
            and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous())


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, same arguments and result; see the module docstring."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    with_grad = [p for p in parameters if p.grad is not None]
    here = [p.grad for p in with_grad if _summed_here(p.grad)]
    if float(norm_type) != 2.0 or not here:
        return _torch_clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    elsewhere = [p for p in with_grad if not _summed_here(p.grad)]
    device = with_grad[0].grad.device  # torch returns the total norm on the first gradient's device
    norms = [torch.tensor(_C.sum_squares([view(g, "gradient") for g in here]), dtype=torch.float64).sqrt()
             .to(torch.float32)]
    if elsewhere:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in elsewhere], 2.0, False, foreach).to(torch.float32))
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the gradients' total norm is {total.item()}, so they cannot be clipped; find the "
                           "non-finite loss or gradient, or pass error_if_nonfinite=False to skip this check.")
    if elsewhere:
        torch.nn.utils.clip_grads_with_norm_(elsewhere, max_norm, total, foreach)
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if not coef >= 1.0:  # a NaN coefficient multiplies too, as in torch
        torch._foreach_mul_(here, coef)
    return total


def install() -> None:
    """Makes `torch.nn.utils.clip_grad_norm_` the function above (idempotent). torch < 2.6 lacks the pieces it
    combines (get_total_norm, clip_grads_with_norm_) and keeps its own."""
    if hasattr(torch.nn.utils, "get_total_norm") and hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
