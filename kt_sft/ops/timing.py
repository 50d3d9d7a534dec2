"""Wall time spent inside the CPU engine, accumulated per phase (forward, backward), and in moving tensors to and
from it (transfer: device copies and dtype casts of inputs, outputs and gradients), for step profiles.

Read with `engine_seconds()`, reset with `reset_engine_seconds()`; a perf_counter pair per call (~0.1 µs).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

_SECONDS = {"forward": 0.0, "backward": 0.0, "transfer": 0.0}


@contextmanager
def engine_timer(phase: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _SECONDS[phase] += time.perf_counter() - t0


def engine_seconds() -> dict:
    return dict(_SECONDS)


def reset_engine_seconds() -> None:
    for k in _SECONDS:
        _SECONDS[k] = 0.0
