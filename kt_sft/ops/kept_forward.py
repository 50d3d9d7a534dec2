"""The routed experts' first pass kept for gradient checkpointing's recompute.

Reentrant gradient checkpointing (LLaMA-Factory's choice) runs every checkpointed layer's forward twice per
step: once without grad, then again in backward, with grad, to build the graph. The CPU engine's forward is
most of a layer's time, so a forward that runs without grad in training mode (that first pass) keeps what the
engine saved for backward and its result. The recompute takes them instead of running the engine again when
its inputs are the same (bit for bit, on the CPU copies the engine takes anyway) and so is everything
else that shaped the result: LoRA rank, scale and dropout seed (checkpointing restores the RNG the seed is
drawn from), and the weights, by storage and version counter (an optimizer step in between bumps them).
Anything else runs the engine as before. One pass is kept per module; one that no recompute takes is dropped by
the module's next forward. A model's forward that no recompute can follow (called without grad, as DPO's and
KTO's reference pass, an evaluation or a generation is: models/recompute_ahead.py tells, begin_model_forward)
neither keeps its passes nor drops the ones kept: a reference pass between the policy's forward and its backward had
thrown away every layer's kept pass, and its own were never taken. A module whose
recompute found other inputs MISSES_BEFORE_OFF times in a row (a nondeterministic op upstream) stops keeping,
with a warning: keeping costs its first pass the saving of g/u.

Cost: host RAM for each layer between its two passes, the saved g/u (2·T·K·I·4 bytes) plus copies of x and y
(cookbook/sizing.md). KT_SFT_RECOMPUTE_EXPERTS=1 turns it off: the recompute then runs the engine again. A pass
is also not kept, with a warning (once per process), when keeping it would leave less host RAM than
reserve_bytes() available to the process (MemAvailable, or its cgroup's limit net of its use): the first passes
of all layers pile up until backward, and running out of RAM gets the process killed with its trained weights.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from .._ext import _C, recompute_experts, warn
from .host_memory import host_headroom

MISSES_BEFORE_OFF = 3
_GIB = 1 << 30


class KeptForward(NamedTuple):
    x: torch.Tensor  # the inputs as the engine took them
    idx: torch.Tensor
    w: torch.Tensor
    setting: tuple  # setting_of() at the time
    out: torch.Tensor  # the engine's result, which no caller holds
    saved: Any  # the engine's state for backward


_model_calls = threading.local()  # .follows: [(model, whether a recompute may follow)] of the forwards running here


def begin_model_forward(model, recompute_may_follow: bool) -> None:
    """Called as a model's forward starts (a pre-hook): whether gradient checkpointing may recompute its layers,
    i.e. grad is on. end_model_forward(model) undoes it when the forward returns or raises;
    an entry of this model still there was left by a forward an interrupt ended (torch runs forward hooks on
    Exception only), and goes with everything above it."""
    follows = _model_calls.__dict__.setdefault("follows", [])
    for i, (running, _) in enumerate(follows):
        if running is model:
            del follows[i:]
            break
    follows.append((model, recompute_may_follow))


def end_model_forward(model) -> None:
    follows = getattr(_model_calls, "follows", None) or []
    for i in range(len(follows) - 1, -1, -1):
        if follows[i][0] is model:
            del follows[i:]
            return


def no_recompute_follows() -> bool:
    """Whether this forward runs inside a model's forward that no recompute can follow (begin_model_forward); a
    module called on its own (no model forward around it) may be checkpointed by its caller."""
    follows = getattr(_model_calls, "follows", None)
    return bool(follows) and not follows[-1][1]


def keeps_forward(training: bool) -> bool:
    """Whether a forward that builds no graph keeps its pass: in training mode, with grad off, where a recompute
    may follow, unless turned off; never under inference_mode (a checkpoint's first forward runs under no_grad;
    nothing recomputes an inference)."""
    return (training and not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and not recompute_experts() and not no_recompute_follows())


def kept_bytes(tokens: int, k: int, intermediate: int, rank: int, x: torch.Tensor, stacked: int = 2) -> int:
    """Host RAM a kept pass holds: g and u (u alone for experts without a gate: stacked 1) and LoRA's rank-space
    inputs in float32, copies of x and the result."""
    return 4 * tokens * k * (stacked * intermediate + 3 * rank) + 2 * x.numel() * x.element_size()


def reserve_bytes(total: int) -> int:
    """Host RAM left free when keeping passes: the rest of the step (the optimizer's temporaries, data) needs some."""
    return max(2 * _GIB, total // 20)


_warned_short = False


def room_to_keep(nbytes: int) -> bool:
    """Whether keeping a pass of nbytes leaves reserve_bytes() of host RAM; the saved-buffer pool's free buffers
    count as room (the OS counts them as used, and a kept pass takes them first). Warns the first time it is not."""
    global _warned_short
    room = host_headroom()
    if room is None:
        return True
    available, total = room
    available += _C.saved_pool_free_bytes()
    if available - nbytes >= reserve_bytes(total):
        return True
    if not _warned_short:
        _warned_short = True
        warn(f"kt_sft: {available / _GIB:.1f} GiB of host RAM available; keeping the CPU experts' first pass "
             f"for gradient checkpointing's recompute ({nbytes / _GIB:.2f} GiB per layer) would leave less "
             f"than {reserve_bytes(total) / _GIB:.1f} GiB, so layers past this point run the engine again "
             "in the recompute (slower, same gradients). Free host RAM or shorten cutoff_len to get the "
             "time back; KT_SFT_RECOMPUTE_EXPERTS=1 stops keeping passes altogether.")
    return False


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass, as gradient checkpointing's recompute does: only it may
    take a kept pass. A grad forward outside backward (after a no-grad training-mode pass that no backward
    followed, e.g. a logging pass) runs the engine, so weights changed through `.data` in between (which no
    version counter sees) cannot be missed."""
    return torch._C._current_graph_task_id() >= 0


def setting_of(module, lora_params, lora) -> tuple:
    """What besides the inputs shapes a forward's result: lora (rank, scale, (dropout p, seed)) and the identity
    and version of every weight it reads."""
    weights = (*module.engine_weights(), *(p for p in lora_params if p is not None))
    return lora, tuple((t.data_ptr(), t._version) for t in weights)


def own(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it shares the caller's storage (which the caller may change before the recompute)."""
    return t.clone() if t.data_ptr() == source.data_ptr() else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical contiguous tensors: what makes the engine's result the same (NaNs alike, −0 unlike +0).
    Compared as int64 words where they fit: torch.equal on a bf16 [2048, 2048] took 2.7 ms on the dev machine,
    as words 0.44 ms, and the recompute compares every layer's input."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:  # a view of int64 needs both
        a, b = a.view(torch.int64), b.view(torch.int64)
    return torch.equal(a, b)


def matches(kept: KeptForward, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, setting: tuple) -> bool:
    return kept.setting == setting and all(same_bits(a, b) for a, b in ((kept.idx, idx), (kept.w, w), (kept.x, x)))
