"""Shared experts computed on the GPU while the CPU engine computes the routed experts of the same MoE block.

A DeepSeek-style block (DeepSeek-V2/V3, Kimi-K2, GLM-4.5) routes its input, calls the routed experts, then the
shared experts on the block's input, and adds the two. Our routed experts hold the host until the CPU engine is
done, so in that order the GPU idles through the engine and the engine then waits for the shared experts' GPU
work. Here a forward pre-hook on the block queues the shared experts first, on a side CUDA stream (they need
only the block's input), and the block's own call to them returns that result after making the caller's stream
wait for the side stream: the engine's input copy waits for the caller's stream only (the router), so the GPU
computes the shared experts while the CPU computes the routed ones. Autograd runs each op's backward on the
stream its forward ran on and synchronizes streams where gradients cross them; a recomputed forward (gradient
checkpointing) goes through the same hooks.

The backward is not overlapped this way: the engine's backward is the later node of the two branches, so
autograd runs it first, with the shared experts' backward queued behind it (README, "How the engine works").

On a CPU device the same reordering runs without streams (nothing to overlap), which keeps the logic tested.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one per device, shared by every block


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class SharedExpertsOverlap:
    """Installed on one MoE block: `launch` is the block's forward pre-hook, `forward` replaces the shared
    experts module's forward on the instance (its parameters and names, hence adapters, are untouched)."""

    def __init__(self, block: nn.Module, attribute: str):
        self.attribute = attribute
        self.shared = shared = getattr(block, attribute)
        self.run = shared.forward  # the module's own forward, bound
        self.pending = None  # (block input, shared output, side stream or None) of the block call in flight
        shared.forward = self.forward
        self.handle = block.register_forward_pre_hook(self.launch)

    def launch(self, block, args):
        self.pending = None
        x = args[0] if args else None
        if getattr(block, self.attribute) is not self.shared:  # replaced since (a wrapper): the stock order
            self.remove()
            return
        if not isinstance(x, torch.Tensor):
            return
        if x.device.type != "cuda":
            self.pending = (x, self.shared(x), None)
            return
        side = side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            out = self.shared(x)
        x.record_stream(side)  # x's memory must outlive the side stream's reads of it
        self.pending = (x, out, side)

    def forward(self, x, *args, **kwargs):
        pending, self.pending = self.pending, None
        if pending is None:  # queued by launch() itself, or a call outside the block's forward
            return self.run(x, *args, **kwargs)
        x0, out, side = pending
        if x is not x0 or args or kwargs:
            self.remove()
            warnings.warn("kt_sft: this model's MoE block calls its shared experts on something other than the "
                          "block's input; their overlap with the CPU experts is turned off.", RuntimeWarning)
            return self.run(x, *args, **kwargs)
        if side is not None:
            caller = torch.cuda.current_stream(x.device)
            caller.wait_stream(side)
            out.record_stream(caller)  # out was allocated on the side stream and is used on the caller's
        return out

    def remove(self):
        self.handle.remove()
        self.shared.forward = self.run
        self.pending = None


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
