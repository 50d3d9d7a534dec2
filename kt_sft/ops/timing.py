"""Wall time spent inside the CPU engine, accumulated per phase (forward, backward), in moving tensors to and
from it (transfer: device copies and dtype casts of inputs, outputs and gradients), and waiting for the GPU
work that produces its inputs (gpu), for step profiles. Phases are exclusive: a timer nested in another
(the GPU wait inside a transfer) takes its time out of the outer one.

Read with `engine_seconds()`, reset with `reset_engine_seconds()`; a perf_counter pair per call (~0.1 µs).
"""
from __future__ import annotations

import time

_SECONDS = {"forward": 0.0, "backward": 0.0, "transfer": 0.0, "gpu": 0.0}
_OPEN: list[str] = []  # the phases being timed, innermost last


class engine_timer:  # noqa: N801 - used as `with engine_timer(phase):`; a class costs less per call than a generator
    __slots__ = ("phase", "t0")

    def __init__(self, phase: str):
        self.phase = phase

    def __enter__(self):
        self.t0 = time.perf_counter()
        _OPEN.append(self.phase)

    def __exit__(self, *exc):
        _OPEN.pop()
        spent = time.perf_counter() - self.t0
        _SECONDS[self.phase] += spent
        if _OPEN:
            _SECONDS[_OPEN[-1]] -= spent
        return False


def engine_seconds() -> dict:
    return dict(_SECONDS)


def reset_engine_seconds() -> None:
    for k in _SECONDS:
        _SECONDS[k] = 0.0
