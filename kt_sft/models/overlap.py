"""Shared experts computed on the GPU while the CPU engine computes the routed experts of the same MoE block, in
forward and in backward.

A DeepSeek-style block (DeepSeek-V2/V3, Kimi-K2, GLM-4.5) routes its input, calls the routed experts, then the
shared experts on the block's input, and adds the two. Our routed experts hold the host until the CPU engine is
done, so in that order the GPU idles through the engine, and the engine then waits for the shared experts' GPU
work. Here a forward pre-hook on the block hands its routed experts the shared experts' call on the block's
input (KTExperts.queue_beside): the routed experts start the engine, queue the shared experts' GPU work, and
only then wait for the engine; the block's own call to its shared experts returns that result. In backward
the engine's two autograd nodes sit on either side of the shared experts' nodes (ops/experts_function.py,
EngineCall), so the shared experts' backward is queued on the GPU while the engine computes its backward.
Everything runs on the caller's stream and in the stock order (routed experts, then shared), so results, the
RNG's use included, are the stock order's; a recomputed forward (gradient checkpointing) goes through the same
hooks. Hooks on the shared experts module itself (or on every module) would run twice, once around the early
computation and once around the block's own call: such a block keeps the stock order. On a CPU device the same
steps run in turn (the engine first: nothing to overlap). What a block call hands
over is its thread's: two threads through one block (an evaluation or generation beside training) had taken each
other's shared experts' result, computed under the other's grad mode.

LongCat-Flash's decoder layer calls its first dense MLP on its MoE block's input right after the block: that MLP is
handed over the same way, held from the block's call until the layer's own call of it (the layer's forward hook
drops what is left).
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from .._ext import warn


class SharedExpertsOverlap:
    """Installed on one MoE block: `arm` is the block's forward pre-hook and `disarm` the forward hook (run also
    when the forward raises) of the module holding the shared experts at `path` (the block itself, or LongCat-Flash's
    decoder layer); `forward` replaces the shared experts module's forward on the instance (its parameters and names,
    hence adapters, are untouched)."""

    def __init__(self, block: nn.Module, path: str, holder: nn.Module | None = None):
        self.holder, self.path = holder if holder is not None else block, path
        self.shared = shared = self.holder.get_submodule(path)
        self.experts = block.experts
        self.run = shared.forward  # the module's own forward, bound
        self.local = threading.local()  # .pending: (block input, shared output) of this thread's block call in flight
        shared.forward = self.forward
        self.handles = (block.register_forward_pre_hook(self.arm),
                        self.holder.register_forward_hook(self.disarm, always_call=True))

    def arm(self, block, args):
        self.local.pending = None
        if self.holder.get_submodule(self.path) is not self.shared or block.experts is not self.experts:
            self.remove()  # replaced since (a wrapper): the stock order
            return
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and not _hooked(self.shared):
            self.experts.queue_beside(lambda: self.start(x))

    def start(self, x):
        # Through the module's call, so that its own hooks wrap the computation; forward() finds nothing
        # pending yet and runs it.
        self.local.pending = (x, self.shared(x))

    def disarm(self, holder, args, output):
        self.experts.queue_beside(None)
        self.local.pending = None

    def forward(self, x, *args, **kwargs):
        pending, self.local.pending = getattr(self.local, "pending", None), None
        if pending is None:  # the routed experts did not run first, or a call outside the block's forward
            return self.run(x, *args, **kwargs)
        x0, out = pending
        if x is not x0 and not args and not kwargs and _same_tokens(x, x0):
            # The block's input flattened to rows of tokens (Hy3's block calls its shared experts so): they compute
            # each token alone, so their result on the block's input, flattened the same way, is theirs on x.
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if x is not x0 or args or kwargs:
            self.remove()
            warn("kt_sft: this model's MoE block calls its shared experts on something other than the "
                 "block's input; their overlap with the CPU experts is turned off.")
            return self.run(x, *args, **kwargs)
        return out

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.shared.forward = self.run
        self.experts.queue_beside(None)
        self.local.pending = None


def _same_tokens(x: torch.Tensor, x0: torch.Tensor) -> bool:
    """Whether x is the block input x0 viewed with its tokens flattened or regrouped: the same memory, token by
    token (the last dimension kept whole)."""
    return x.shape[-1] == x0.shape[-1] and x.numel() == x0.numel() and x.data_ptr() == x0.data_ptr() and \
        x.dtype == x0.dtype and x.is_contiguous() and x0.is_contiguous()


def _hooked(module: nn.Module) -> bool:
    """Whether a call of module runs forward hooks or pre-hooks: its own, or ones registered for every module
    (torch.nn.modules.module.register_module_forward_hook and its pre-hook twin)."""
    every = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or every._global_forward_hooks
                or every._global_forward_pre_hooks)


def overlap_shared_experts(model: nn.Module, attribute: str | None) -> int:
    """Installs SharedExpertsOverlap on every MoE block whose `attribute` holds shared experts next to engine
    experts; returns how many. attribute: MoEArchitecture.shared_experts (None: nothing to do)."""
    from ..nn.experts import KTExperts

    if attribute is None:
        return 0
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), KTExperts)
              and isinstance(getattr(m, attribute, None), nn.Module)]
    for block in blocks:
        SharedExpertsOverlap(block, attribute)
    return len(blocks)


def overlap_dense_beside(model: nn.Module, path: str | None) -> int:
    """Installs SharedExpertsOverlap for the module at `path` of every decoder layer that calls it on its MoE block's
    input right after the block (MoEArchitecture.dense_beside: LongCat-Flash's mlps.0); returns how many."""
    from ..nn.experts import KTExperts

    if path is None:
        return 0
    count = 0
    for layer in model.modules():
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue
        blocks = [m for m in layer.children() if isinstance(getattr(m, "experts", None), KTExperts)]
        if len(blocks) == 1:
            SharedExpertsOverlap(blocks[0], path, holder=layer)
            count += 1
    return count


def installed_overlaps(model: nn.Module) -> list[SharedExpertsOverlap]:
    """The SharedExpertsOverlap objects on model's blocks (each replaced its shared experts' forward)."""
    return [m.forward.__self__ for m in model.modules()
            if isinstance(getattr(m.forward, "__self__", None), SharedExpertsOverlap)]
