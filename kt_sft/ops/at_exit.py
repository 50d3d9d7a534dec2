"""Daemon threads that ran the experts get a moment to finish before the interpreter shuts down.

`llamafactory-cli chat` generates in a daemon thread (LLaMA-Factory's hf_engine) and returns to its prompt as the
last token arrives, while that thread is still releasing generate's tensors. When the user then types `exit`,
Python's shutdown stops daemon threads as they next take the GIL; torch releases the GIL inside a tensor's
deallocation, a frame that may not be unwound, so the stopped thread ends the process with "terminate called
without an active exception" (SIGABRT). atexit callbacks run before that stop, so joining such threads there,
briefly, lets them finish. Only threads that called the experts are waited for, at most JOIN_SECONDS in all. A
thread still generating or training (a generation cut off by Ctrl-C, a training thread) would be stopped inside torch
too: from the wait on, its next call of the experts raises SystemExit, which ends it in Python, between layers."""
from __future__ import annotations

import atexit
import threading
import time
import weakref

JOIN_SECONDS = 2.0

_callers: weakref.WeakSet = weakref.WeakSet()
_exiting = False


def note_caller() -> None:
    """Called by each forward of the experts: remembers the calling thread if it is a daemon thread that Python's
    threading started (not one it merely sees, such as autograd's device threads, which run checkpointing's
    recompute: those cannot be joined), or ends it once the interpreter exits."""
    thread = threading.current_thread()
    if thread.daemon and not isinstance(thread, threading._DummyThread):
        if _exiting:
            raise SystemExit
        if thread not in _callers:
            _callers.add(thread)


def _join_callers() -> None:
    global _exiting
    _exiting = True
    deadline = time.monotonic() + JOIN_SECONDS
    for thread in list(_callers):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_callers)
