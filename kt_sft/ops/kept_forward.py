"""The routed experts' first pass kept for gradient checkpointing's recompute.

Reentrant gradient checkpointing (LLaMA-Factory's choice) runs every checkpointed layer's forward twice per
step: once without grad, then again in backward, with grad, to build the graph. The CPU engine's forward is
most of a layer's time, so a forward that runs without grad in training mode (that first pass) keeps what the
engine saved for backward and its result. The recompute takes them instead of running the engine again when
its inputs are the same (compared exactly, on the CPU copies the engine takes anyway) and so is everything
else that shaped the result: LoRA rank, scale and dropout seed (checkpointing restores the RNG the seed is
drawn from), and the weights, by storage and version counter (an optimizer step in between bumps them).
Anything else runs the engine as before. One pass is kept per module; one that no recompute takes (a no-grad
forward in training mode outside checkpointing) is dropped by the module's next forward. A module whose
recompute found other inputs MISSES_BEFORE_OFF times in a row (a nondeterministic op upstream) stops keeping,
with a warning: keeping costs its first pass the saving of g/u.

Cost: host RAM for each layer between its two passes, the saved g/u (2·T·K·I·4 bytes) plus copies of x and y
(cookbook/sizing.md). KT_SFT_RECOMPUTE_EXPERTS=1 turns it off: the recompute then runs the engine again. A pass
is also not kept, with a warning (once per process), when keeping it would leave less host RAM than
reserve_bytes() available to the process (MemAvailable, or its cgroup's limit net of its use): the first passes
of all layers pile up until backward, and running out of RAM gets the process killed with its trained weights.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import torch

from .._ext import _C, recompute_experts

MISSES_BEFORE_OFF = 3
_GIB = 1 << 30


class KeptForward(NamedTuple):
    x: torch.Tensor  # the inputs as the engine took them
    idx: torch.Tensor
    w: torch.Tensor
    setting: tuple  # setting_of() at the time
    out: torch.Tensor  # the engine's result, which no caller holds
    saved: Any  # the engine's state for backward


def keeps_forward(training: bool) -> bool:
    """Whether a forward that builds no graph keeps its pass: in training mode, with grad off, unless turned off."""
    return training and not torch.is_grad_enabled() and not recompute_experts()


def kept_bytes(tokens: int, k: int, intermediate: int, rank: int, x: torch.Tensor) -> int:
    """Host RAM a kept pass holds: g and u (and LoRA's rank-space inputs) in float32, copies of x and the result."""
    return 4 * tokens * k * (2 * intermediate + 3 * rank) + 2 * x.numel() * x.element_size()


def reserve_bytes(total: int) -> int:
    """Host RAM left free when keeping passes: the rest of the step (the optimizer's temporaries, data) needs some."""
    return max(2 * _GIB, total // 20)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_headroom(proc: str, cgroup: str) -> tuple[int, int] | None:
    """(limit − use net of reclaimable file cache, limit) of this process's memory cgroup (v2, else v1), or None
    where memory is not limited or cannot be read."""
    paths = {}  # controller ("" for v2's unified hierarchy) → this process's cgroup path
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2].strip().lstrip("/")
    tries = []
    if "" in paths:
        tries.append((os.path.join(cgroup, paths[""]), "memory.max", "memory.current", "inactive_file"))
    if "memory" in paths:
        tries.append((os.path.join(cgroup, "memory", paths["memory"]), "memory.limit_in_bytes",
                      "memory.usage_in_bytes", "total_inactive_file"))
    for base, limit_file, usage_file, cache_key in tries:
        stat = (_read(f"{base}/memory.stat") or "").split()
        try:
            limit, used = int(_read(f"{base}/{limit_file}")), int(_read(f"{base}/{usage_file}"))
            cache = int(dict(zip(stat[::2], stat[1::2])).get(cache_key, 0))
        except (TypeError, ValueError):  # absent, or "max" (v2's unlimited)
            continue
        if limit < 1 << 60:  # above: v1's unlimited
            return limit - max(used - cache, 0), limit
    return None


def host_headroom(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(bytes of host RAM this process may still take, the total they are part of), the tighter of the machine's
    MemAvailable and its cgroup's limit; None where neither can be read."""
    info = dict(line.split(":", 1) for line in (_read(f"{proc}/meminfo") or "").splitlines() if ":" in line)
    found = []
    try:
        found.append((int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024))
    except (KeyError, ValueError, IndexError):
        pass
    group = _cgroup_headroom(proc, cgroup)
    if group:
        found.append(group)
    return min(found) if found else None


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
        warnings.warn(f"kt_sft: {available / _GIB:.1f} GiB of host RAM available; keeping the CPU experts' first pass "
                      f"for gradient checkpointing's recompute ({nbytes / _GIB:.2f} GiB per layer) would leave less "
                      f"than {reserve_bytes(total) / _GIB:.1f} GiB, so layers past this point run the engine again "
                      "in the recompute (slower, same gradients). Free host RAM or shorten cutoff_len to get the "
                      "time back; KT_SFT_RECOMPUTE_EXPERTS=1 stops keeping passes altogether.", RuntimeWarning)
    return False


def setting_of(module, lora_params, lora) -> tuple:
    """What besides the inputs shapes a forward's result: lora (rank, scale, (dropout p, seed)) and the identity
    and version of every weight it reads."""
    weights = (module.gate_up_proj, module.down_proj, *(p for p in lora_params if p is not None))
    return lora, tuple((t.data_ptr(), t._version) for t in weights)


def own(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it shares the caller's storage (which the caller may change before the recompute)."""
    return t.clone() if t.data_ptr() == source.data_ptr() else t


def matches(kept: KeptForward, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, setting: tuple) -> bool:
    return kept.setting == setting and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in ((kept.idx, idx), (kept.w, w), (kept.x, x)))
