"""Gradient checkpointing's recompute of layer L−1, run while the CPU engine computes layer L's backward.

Reentrant checkpointing (LLaMA-Factory's default) runs every decoder layer's forward again at the start of that
layer's backward. On a kt_sft model that recompute is GPU work (attention, router, shared experts; the routed
experts take the pass their first forward kept, ops/kept_forward.py), and in the stock order it runs between
two engine backwards while the engine idles: 76 ms of a 16-layer Qwen3-30B-A3B step at seq 2048 on the GPU test
machine (BENCHMARKS.md, "Without gradient checkpointing"). It depends on nothing layer L's backward computes,
only on what layer L−1's first forward left, so layer L's engine backward runs it between the engine's start and
the wait for it (ops/experts_function.beside_backward), and layer L−1's checkpoint then takes that result.

How: each checkpointed layer's `_gradient_checkpointing_func` (transformers' GradientCheckpointingLayer calls
it; gradient_checkpointing_enable sets it, LLaMA-Factory to its wrapper of torch's checkpoint) is wrapped by
RecomputeAhead at the model's next forward, whoever enabled checkpointing and whenever. The wrapper hands the
checkpoint function a stand-in for the layer's call, one Pass per call, which
- in the first forward (grad off, outside backward: reentrant checkpointing's first pass) notes the RNG and
  autocast state the checkpoint restores for its recompute and its inputs, by weak reference (torch's checkpoint
  keeps them; one that lets them go, e.g. to host RAM, gets no work ahead), and links itself to the previous
  layer's Pass when its input is that pass's output (the same tensor: nothing in between, the same forward);
- in the recompute (grad on, inside backward) returns what was computed ahead, if anything was, and hands its
  inputs' gradients to the inputs the checkpoint passed it (where reentrant checkpointing reads them); else it
  computes as before.
The computation ahead restores the noted RNG and autocast state as the checkpoint does, so its results are the
recompute's bit for bit (LoRA and attention dropout included). A checkpoint function whose first pass runs with
grad (non-reentrant) notes nothing, and runs as before; so does one told not to restore the RNG
(preserve_rng_state=False), whose recompute draws other dropout masks than the first forward's.

Only an engine backward that runs beside the caller computes ahead (on a GPU, while it writes only its own
buffers: ops/experts_function.py); elsewhere the stock order stays. Cost: the GPU holds the recomputed
activations of one more layer while layer L's backward runs; out of GPU memory there, it warns and leaves this
and every later recompute to the checkpoint. KT_SFT_RECOMPUTE_AHEAD=0 turns it off.
"""
from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import NamedTuple

import torch
from torch import nn

from .._ext import recompute_ahead, warn
from ..ops import experts_function
from ..ops.kept_forward import begin_model_forward, end_model_forward, recomputing

_latest = None  # weakref to the Pass of the latest first forward (the layer the next one may follow)
_recomputed = None  # weakref to the Pass recomputed last: its layer's backward is the one running
_out_of_memory = False  # a computation ahead ran out of GPU memory: none is tried again in this process


def _alive(ref):
    return ref() if ref is not None else None


def _autocast_state() -> list:
    """(device type, enabled, dtype, cache) of each autocast torch's checkpoint restores (its device's, CPU's)."""
    kinds = ["cuda", "cpu"] if torch.amp.is_autocast_available("cuda") else ["cpu"]
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in kinds]


class _Held(NamedTuple):
    """A first forward's tensor input, by weak reference, and its version counter then."""
    ref: weakref.ref
    version: int

    def get(self) -> torch.Tensor | None:
        """The tensor, if something still holds it and it was not changed in place since."""
        t = self.ref()
        return t if t is not None and t._version == self.version else None


class Pass:
    """One call of a checkpointed layer (module docstring): its first forward, its recompute, the work ahead."""

    def __init__(self, func):
        self.func = func
        self.args = self.kwargs = self.state = self.output = self.previous = self.ahead = None

    def __call__(self, *args, **kwargs):
        global _recomputed
        if not torch.is_grad_enabled() and not recomputing() and not torch.is_inference_mode_enabled():
            # A first forward (under no_grad; one under inference_mode, a generate in training mode, is never
            # recomputed, and its tensors keep no version counter to note).
            self._note(args, kwargs)
            out = self.func(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) and out else out
            self.output = weakref.ref(first) if isinstance(first, torch.Tensor) else None
            return out
        if not (torch.is_grad_enabled() and recomputing()):
            return self.func(*args, **kwargs)
        _recomputed = weakref.ref(self)
        ahead, self.ahead = self.ahead, None
        self.args = self.kwargs = self.state = self.output = None
        if ahead is None:
            return self.func(*args, **kwargs)
        outputs, inputs = ahead
        for ours, theirs in zip(inputs, args):
            if isinstance(ours, torch.Tensor) and ours.requires_grad:
                ours.register_post_accumulate_grad_hook(functools.partial(_hand_grad, theirs))
        return outputs

    def _note(self, args, kwargs):
        global _latest, _recomputed
        latest = _alive(_latest)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if latest is not None and first is not None and first is _alive(latest.output):
            self.previous = _latest
        else:
            _recomputed = None  # a new forward: any backward noted before is over
        _latest = weakref.ref(self)
        devices = sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda}, key=str)
        self.state = (torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices], _autocast_state())
        # Tensors by weak reference: the checkpoint function keeps what its recompute needs (torch's saves them),
        # and what it lets go (one that offloads them) is not kept here either: that layer's recompute runs as before.
        self.args = tuple(_Held(weakref.ref(a), a._version) if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = kwargs

    def ready(self) -> bool:
        """Whether the recompute can run ahead: a first forward noted, not yet recomputed, its inputs still held
        and unchanged since."""
        return self.state is not None and all(a.get() is not None for a in self.args if isinstance(a, _Held))

    def compute_ahead(self):
        """The recompute, now (module docstring); once, after a first forward. Out of GPU memory (it holds one
        more layer's activations than the stock order), it leaves the recompute to the checkpoint, with a warning,
        and no later layer computes ahead."""
        global _out_of_memory
        if not self.ready():  # asked when the engine's backward started; nodes ran since
            return
        (cpu_rng, device_rngs, autocast), kwargs = self.state, self.kwargs
        args = tuple(a.get() if isinstance(a, _Held) else a for a in self.args)
        self.args = self.kwargs = self.state = None
        inputs = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
        try:
            with torch.random.fork_rng(devices=[d for d, _ in device_rngs], device_type="cuda"):
                torch.set_rng_state(cpu_rng)
                for device, rng in device_rngs:
                    torch.cuda.set_rng_state(rng, device)
                with torch.enable_grad(), _autocast(autocast):
                    outputs = self.func(*inputs, **kwargs)
        except torch.cuda.OutOfMemoryError:
            _out_of_memory = True
            warn("kt_sft: the GPU ran out of memory recomputing a checkpointed layer ahead of the CPU "
                 "engine's backward; each layer's recompute runs after it from now on (slower; "
                 "KT_SFT_RECOMPUTE_AHEAD=0 skips the attempt).")
            return
        self.ahead = outputs, inputs


def _autocast(state) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind, enabled, dtype, cache in state:
        stack.enter_context(torch.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache))
    return stack


def _hand_grad(target: torch.Tensor, leaf: torch.Tensor) -> None:
    """Moves leaf's gradient (an input of the computation ahead) to target (the checkpoint's own input)."""
    grad, leaf.grad = leaf.grad, None
    target.grad = grad if target.grad is None else target.grad + grad


def _work_ahead():
    """beside_backward's source: the recompute of the layer before the one whose backward runs, if not yet
    run (once)."""
    running = _alive(_recomputed)
    if running is None or _out_of_memory or not recompute_ahead():
        return None
    previous, running.previous = _alive(running.previous), None
    return previous.compute_ahead if previous is not None and previous.ready() else None


class RecomputeAhead:
    """A layer's checkpoint function, handed a Pass in place of the layer's call (module docstring)."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def __call__(self, func, *args, **kwargs):
        target = func.func if isinstance(func, functools.partial) else func
        layer = getattr(target, "__self__", None)
        if not isinstance(layer, nn.Module) or not recompute_ahead() or not _restores_rng(self.checkpoint, kwargs):
            return self.checkpoint(func, *args, **kwargs)
        # Bound to the layer, as the call it stands for: LLaMA-Factory's wrapper looks up the layer's parameters
        # through the function's __self__.
        run = Pass(func)

        def pass_call(_layer, *a, **k):  # a function of its own: torch.compile's checkpoint tracing reads __name__
            return run(*a, **k)

        return self.checkpoint(types.MethodType(pass_call, layer), *args, **kwargs)


def _restores_rng(checkpoint, kwargs) -> bool:
    """Whether the checkpoint restores the RNG for its recompute, as the computation ahead does: unless
    preserve_rng_state=False is passed to it, or bound in a functools.partial of it (transformers'
    gradient_checkpointing_kwargs), under wrappers that name what they wrap (functools.wraps: LLaMA-Factory's)."""
    if kwargs.get("preserve_rng_state", True) is False:
        return False
    while checkpoint is not None:
        if isinstance(checkpoint, functools.partial):
            if checkpoint.keywords.get("preserve_rng_state", True) is False:
                return False
            checkpoint = checkpoint.func
        else:
            checkpoint = getattr(checkpoint, "__wrapped__", None)
    return True


def recompute_ahead_of_the_engine(model: nn.Module) -> None:
    """Has each stack of checkpointable layers in model wrap its layers' checkpoint functions in RecomputeAhead at
    every forward (a pre-hook on the module that runs the stack), and tell the experts inside whether a recompute
    may follow that forward (ops/kept_forward.begin_model_forward; a forward hook ends it, also when it raises)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        for child in module.children():
            layers = [m for m in child if isinstance(m, GradientCheckpointingLayer)] \
                if isinstance(child, nn.ModuleList) else []
            if layers:
                module.register_forward_pre_hook(functools.partial(_wrap_checkpointing, layers))
                module.register_forward_hook(lambda m, *_: end_model_forward(m), always_call=True)
                experts_function.beside_backward(_work_ahead)


def _wrap_checkpointing(layers, module, _args) -> None:
    for layer in layers:
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if checkpoint is not None and not isinstance(checkpoint, RecomputeAhead):
            layer._gradient_checkpointing_func = RecomputeAhead(checkpoint)
    # A forward without grad builds no graph, so nothing recomputes it; with grad, a pass without grad inside is a
    # checkpoint's first (transformers' flags, or a checkpoint of the caller's own around the layers).
    begin_model_forward(module, torch.is_grad_enabled())
