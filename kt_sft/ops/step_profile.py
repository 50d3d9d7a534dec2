"""Where a training step goes, for users of the stock trainers: with KT_SFT_PROFILE=N, a kt_sft model loaded
through `kt-sft prepare` prints every N training forwards one line splitting the wall time since the previous
training forward began (one micro-batch: forward, backward and, at the end of an accumulation window, the
optimizer step) into the CPU experts' forward (checkpoint recomputes included) and backward, the transfers to
and from them, and the rest, during which the CPU engine is idle (GPU compute, optimizer, Python, data).
The engine and the GPU run in turn, so the rest is what overlapping them could hide.
"""
from __future__ import annotations

import sys
import time

from torch import nn

from .timing import engine_seconds, reset_engine_seconds


class StepProfile:
    """A forward pre-hook on the top-level model: each training forward closes the previous cycle."""

    def __init__(self, every: int, out=None):
        self.every = every
        self.out = out
        self.cycles = 0
        self.t0 = None

    def __call__(self, module: nn.Module, args, kwargs):
        if not module.training:
            return
        now = time.perf_counter()
        if self.t0 is not None:
            self.cycles += 1
            if self.cycles % self.every == 0:
                self.report(now - self.t0, engine_seconds())
        reset_engine_seconds()
        self.t0 = now

    def report(self, wall: float, engine: dict) -> None:
        ms = {k: v * 1e3 for k, v in engine.items()}
        rest = wall * 1e3 - ms["forward"] - ms["backward"] - ms["transfer"]
        print(f"kt_sft step {self.cycles}: {wall * 1e3:.0f} ms = CPU experts forward {ms['forward']:.0f} + backward "
              f"{ms['backward']:.0f} + transfers {ms['transfer']:.0f} + engine idle {rest:.0f} "
              f"(GPU compute, optimizer, Python, data)", file=self.out or sys.stderr, flush=True)


def attach_step_profile(model: nn.Module, every: int, out=None) -> StepProfile | None:
    """Reports every `every` training forwards of model (0: none)."""
    if every <= 0:
        return None
    profile = StepProfile(every, out)
    model.register_forward_pre_hook(profile, with_kwargs=True)
    return profile
