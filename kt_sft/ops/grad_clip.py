"""Gradient-norm clipping whose norm over CPU gradients runs on the engine's threads.

The trainers clip through `torch.nn.utils.clip_grad_norm_` (transformers' Trainer via accelerate). Its norm of a
CPU tensor (`torch._foreach_norm`, one `linalg.vector_norm` per tensor) runs on one thread: over the CPU experts'
LoRA gradients of all 48 Qwen3-30B-A3B layers at r=16 (830 M float32 values) it took 372 ms per step on the GPU
machine (~9 GB/s), longer than the AdamW step over the same states (BENCHMARKS.md). Once a model holds CPU
experts, `torch.nn.utils.clip_grad_norm_` is this function: the squares of dense float32/bf16 CPU gradients are
summed by the engine's pool in float64 (fixed order: the same for any thread count), every other gradient's norm
is torch's own, and the coefficient and the scaling are torch's. The CPU gradients are multiplied only when the
coefficient is below 1 (torch multiplies them by 1.0 too, which changes nothing but costs a pass over them).
Results differ from torch's in the norm's last bits (a different summation order; a run that is chaotic in
them, like the demo's at a constant high rate, can end elsewhere), and where torch rounds: it rounds each bf16
gradient's norm to bf16 (~0.2% off) and returns a bf16 norm where every gradient is bf16 (float32 here), and its
float32 sums of squares overflow for norms above ~1.8e19, where it returns inf and zeroes the gradients (the true
norm and scaling here). The norm is float64 where a gradient is. Other norm types, and gradients torch would not
hand to a plain CPU kernel (sparse, non-contiguous, subclasses), go to torch unchanged.
"""
from __future__ import annotations

import types

import torch

from .._ext import _C, view
from .gpu_lora import wait_for_grad_uploads

_torch_clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _summed_here(g: torch.Tensor) -> bool:
    return (type(g) is torch.Tensor and g.device.type == "cpu" and g.layout == torch.strided
            and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous())


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, same arguments and result; see the module docstring."""
    wait_for_grad_uploads()  # the expert LoRA's grads on the GPU (KT_SFT_LORA_ON_GPU=1) after a raising backward
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    with_grad = [p for p in parameters if p.grad is not None]
    here = [p.grad for p in with_grad if _summed_here(p.grad)]
    if float(norm_type) != 2.0 or not here:  # (an empty generator: torch's warning says so)
        return _torch_clip_grad_norm((p for p in parameters) if generator else parameters, max_norm, norm_type,
                                     error_if_nonfinite, foreach)
    elsewhere = [p for p in with_grad if not _summed_here(p.grad)]
    device = with_grad[0].grad.device  # torch returns the total norm on the first gradient's device
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p in elsewhere) else torch.float32
    norms = [torch.tensor(_C.sum_squares([view(g, "gradient") for g in here]), dtype=torch.float64).sqrt()]
    if elsewhere:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in elsewhere], 2.0, False, foreach).double())
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms])).to(dtype)
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
