"""Where a training step goes, for users of the stock trainers: with KT_SFT_PROFILE=N, a kt_sft model loaded
through `kt-sft prepare` prints every N training forwards one line splitting the wall time since the previous
training forward began (one micro-batch: forward, backward and, at the end of an accumulation window, the
optimizer step) into the CPU experts' forward (checkpoint recomputes included) and backward, the transfers to
and from them, the wait for the GPU work that produces their inputs, and the rest, during which neither the
engine nor a wait for the GPU runs (optimizer, Python, data, GPU work nobody waited for). The engine and the
GPU run in turn, so the GPU wait is what overlapping them could hide. A second line splits the engine's time into
its phases (gate/up, down, dx, weight gradients, ...), summed over the model's layers.
"""
from __future__ import annotations

import sys
import time

import torch
from torch import nn

from .timing import engine_phases, engine_seconds, profile_engine_phases, reset_engine_seconds


def host_rss_gib(key: str = "VmRSS") -> float:
    """The process's resident memory (VmHWM: its peak) in GiB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 2**20
    except (OSError, StopIteration):
        return float("nan")


class StepProfile:
    """A forward pre-hook on the model's decoder stack: each training forward (in training mode, with grad) closes
    the previous cycle; an evaluation forward drops it."""

    def __init__(self, every: int, out=None):
        self.every = every
        self.out = out
        self.cycles = 0
        self.t0 = None

    def __call__(self, module: nn.Module, args, kwargs):
        if not module.training:  # an evaluation between steps: the cycle it interrupts would count it as training
            self.t0 = None
            return
        if not torch.is_grad_enabled():  # a pass inside a step (DPO's reference model with the adapter disabled)
            return
        now = time.perf_counter()
        if self.t0 is not None:
            self.cycles += 1
            if self.cycles % self.every == 0:
                self.report(now - self.t0, engine_seconds(), engine_phases())
        reset_engine_seconds()
        engine_phases(reset=True)
        self.t0 = now

    def report(self, wall: float, engine: dict, phases: dict) -> None:
        ms = {k: v * 1e3 for k, v in engine.items()}
        rest = wall * 1e3 - sum(ms.values())
        # Allocated: the tensors' peak; reserved: what the caching allocator holds (the CUDA context comes on top).
        gpu = (f"GPU peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
               f"{torch.cuda.max_memory_reserved() / 2**30:.2f} reserved, " if torch.cuda.is_initialized() else "")
        print(f"kt_sft step {self.cycles}: {wall * 1e3:.0f} ms = CPU experts forward {ms['forward']:.0f} + backward "
              f"{ms['backward']:.0f} + transfers {ms['transfer']:.0f} + GPU wait {ms['gpu']:.0f} + rest {rest:.0f} "
              f"(optimizer, Python, data); {gpu}host RSS {host_rss_gib():.1f} GiB", file=self.out or sys.stderr,
              flush=True)
        if phases:
            print("  engine phases (ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items()),
                  file=self.out or sys.stderr, flush=True)


def attach_step_profile(model: nn.Module, every: int, out=None) -> StepProfile | None:
    """Reports every `every` training forwards of model (0: none). The hook sits on the decoder stack that the
    causal-LM model calls as a module: under LLaMA-Factory the top-level model's `forward` is called directly
    (PEFT's LoraModel does), which runs no hooks on it. Turns the engine's phase profile on for the process."""
    if every <= 0:
        return None
    profile = StepProfile(every, out)
    profile_engine_phases(True)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.register_forward_pre_hook(profile, with_kwargs=True)
    return profile
