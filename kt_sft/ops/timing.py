"""Wall time spent inside the CPU engine (for a call that runs while Python goes on: from its start to its
result), accumulated per phase (forward, backward), in moving tensors to and from it (transfer: device copies
and dtype casts of inputs, outputs and gradients), and waiting for the GPU work that produces its inputs (gpu),
for step profiles. Phases are exclusive: a timer nested in another (the GPU wait inside a transfer) takes its
time out of the outer one.

Read with `engine_seconds()`, reset with `reset_engine_seconds()`; a perf_counter pair per call (~0.1 µs).

Inside the engine, `profile_engine_phases(True)` makes every call add the wall time of each of its phases
(forward.gate_up, backward.dx, ...: the work-split phases of README's "How the engine works") to a profile read
with `engine_phases()`: two clock reads per phase, nothing while it is off.
"""
from __future__ import annotations

import threading
import time

from .._ext import _C

# The process's totals: a training step's engine time comes from autograd's device threads too (an inference
# thread's beside it, an API server's workers, is counted alike).
_SECONDS = {"forward": 0.0, "backward": 0.0, "transfer": 0.0, "gpu": 0.0}
_ADDING = threading.Lock()  # the sums are read-modify-writes, which two threads' spans could interleave
_THREAD = threading.local()  # .open: the phases this thread is timing, innermost last (another thread's spans
# are not part of them: inference calls from an API server's workers, autograd's device thread); .uncounted:
# how many `uncounted` blocks this thread is in


def _open() -> list[str]:
    try:
        return _THREAD.open
    except AttributeError:
        _THREAD.open = []
        return _THREAD.open


class engine_timer:  # noqa: N801 - used as `with engine_timer(phase):`; a class costs less per call than a generator
    __slots__ = ("phase", "t0")

    def __init__(self, phase: str):
        self.phase = phase

    def __enter__(self):
        self.t0 = time.perf_counter()
        _open().append(self.phase)

    def __exit__(self, *exc):
        _open().pop()
        add_engine_seconds(self.phase, time.perf_counter() - self.t0)
        return False


def add_engine_seconds(phase: str, spent: float) -> None:
    """Adds a span to phase (engine_timer's, or one timed outside it: an engine call that ran while Python went
    on); an open outer phase gives the time up."""
    if getattr(_THREAD, "uncounted", 0):
        return
    opened = _open()
    with _ADDING:
        _SECONDS[phase] += spent
        if opened:
            _SECONDS[opened[-1]] -= spent


class uncounted:  # noqa: N801 - used as `with uncounted():`
    """Inside, this thread's timed phases add nothing: work run beside an engine call whose wait adds its whole
    span (a transfer or GPU wait there overlaps the engine's time and would count twice). Other threads' spans
    still count."""
    __slots__ = ()

    def __enter__(self):
        _THREAD.uncounted = getattr(_THREAD, "uncounted", 0) + 1

    def __exit__(self, *exc):
        _THREAD.uncounted -= 1
        return False


def engine_seconds() -> dict:
    return dict(_SECONDS)


def reset_engine_seconds() -> None:
    with _ADDING:
        for k in _SECONDS:
            _SECONDS[k] = 0.0


def profile_engine_phases(on: bool) -> None:
    """Turns the engine's per-phase profile on or off (it keeps what it has)."""
    _C.set_phase_profile(on)


def engine_phases(reset: bool = False) -> dict:
    """Seconds per engine phase since the last reset, in the order the phases first ran (empty while off)."""
    return dict(_C.phase_seconds(reset))
