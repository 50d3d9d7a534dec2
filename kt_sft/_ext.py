"""Loads the C++ engine and turns tensors into the views it takes.

Environment variables (the only ones kt_sft reads, all here):
  KT_SFT_THREADS  engine threads (default: CPUs this process may use)
  KT_SFT_KERNELS  force a kernel set: amx | avx512 | avx512_bf16 | avx2 | reference (default: amx where the
                  CPU has it and the OS grants its tile state, else avx512_bf16, else avx512, else avx2)
  KT_SFT_PIN      1 (default) pins engine threads to CPUs, 0 leaves placement to the OS
  KT_SFT_PROFILE  N > 0: models loaded through `kt-sft prepare` print a step profile every N training forwards
  KT_SFT_RECOMPUTE_EXPERTS  1: gradient checkpointing's recompute runs the CPU experts again instead of taking
                  the pass their first forward kept (kt_sft/ops/kept_forward.py; saves host RAM)
  KT_SFT_BACKWARD_COPY  1: BF16 experts keep a second copy of their weights packed for the backward's products
                  (twice the experts' RAM, built at the first backward; a faster backward: cookbook/sizing.md)
  KT_SFT_LORA_ON_GPU  1: the expert LoRA and its gradients live on the model's GPU, where the optimizer and the
                  clipping run over them; the engine reads a CPU copy taken after each optimizer step
                  (cookbook/sizing.md: 12-16 bytes of GPU memory per LoRA value)
  KT_SFT_RECOMPUTE_AHEAD  1 (default): gradient checkpointing's recompute of a layer runs while the CPU engine
                  computes the backward of the layer after it (kt_sft/models/recompute_ahead.py); 0: in the stock
                  order, after it (one layer's recomputed activations less GPU memory)
"""
from __future__ import annotations

import logging
import numbers
import os
import threading
import warnings

import torch

try:
    from . import _C
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"kt_sft's C++ engine is not built ({e}); install the package with `pip install -e .` from its checkout."
    ) from e

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
           torch.float8_e4m3fn: "float8_e4m3fn"}


def view(t: torch.Tensor | None, name: str = "tensor"):
    """A (data_ptr, dtype, shape, tensor) view of a contiguous CPU tensor, or None. The tensor rides along so
    that a call in flight keeps it alive until its wait() returns."""
    if t is None:
        return None
    if not t.is_cpu:
        raise ValueError(f"{name} is on {t.device}; the expert engine takes CPU tensors.")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call .contiguous() on it first.")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} is {t.dtype}; the expert engine takes float32, bfloat16, int64, "
                         "int32 (packed INT4) or float8_e4m3fn tensors.")
    return (t.data_ptr(), _DTYPES[t.dtype], t.shape, t)


def _whole(n, name: str, low: int, high: int, what: str) -> int:
    """n as an int if it is a whole number in [low, high] (a count past a C int would not reach the engine's own
    check; 1.7 would become 1 there), else a ValueError saying what `name` takes."""
    whole = isinstance(n, numbers.Integral) and not isinstance(n, bool) or isinstance(n, str) and n.strip().isdigit()
    if not whole or not low <= int(n) <= high:
        raise ValueError(f"{name}={n!r} is out of range: {what}.")
    return int(n)


def _thread_count(n, name: str = "threads") -> int:
    return _whole(n, name, 0, _C.max_threads(), f"the engine takes 0 (one per CPU this process may use) to "
                  f"{_C.max_threads()} threads, a whole number; one per physical core is fastest")


def configure(threads: int | None = None, kernels: str | None = None, pin: bool | None = None,
              tile_min_rows: int | None = None) -> None:
    """Sets the engine's thread count, kernel set, pinning and the rows an expert needs in a call to use the
    tile (AMX) kernels (0: the measured default); unspecified values keep their current setting."""
    if kernels is not None and not isinstance(kernels, str):
        raise ValueError(f"kernels={kernels!r} is not a kernel set's name; choose from {', '.join(KERNEL_SETS)}.")
    with _configuring:  # two threads' calls would each keep the other's old value of what it leaves unspecified
        cur = _C.capabilities()
        _C.configure(
            cur["threads"] if threads is None else _thread_count(threads),
            cur["pin"] if pin is None else _on_off(pin, "pin"),
            (cur["kernels"] or "") if kernels is None else kernels,
            cur["tile_min_rows"] if tile_min_rows is None else _whole(
                tile_min_rows, "tile_min_rows", 0, 2**31 - 1, "it takes a whole number of rows from 1 to 2**31 - 1 "
                "(a large one keeps every expert off the tiles), or 0 for the measured default"),
        )


def lock_renewed_in_forked_children(namespace: dict, name: str) -> threading.Lock:
    """A lock stored as namespace[name], made anew in every forked child: one that another thread held at the fork
    stays held there, and the child's first use of it waited forever."""
    os.register_at_fork(after_in_child=lambda: namespace.__setitem__(name, threading.Lock()))
    return threading.Lock()


_configuring = lock_renewed_in_forked_children(globals(), "_configuring")


def _on_off(value, name: str) -> bool:
    if value not in (True, False) or not isinstance(value, (bool, int)):  # bool("0") would be True
        raise ValueError(f"{name}={value!r} is neither True nor False.")
    return bool(value)


def set_kernels(name: str | None) -> None:
    """Forces a kernel set by name (None: the best this CPU runs). For tests and benchmarks."""
    configure(kernels=name or "")


# Every kernel set the engine has (dispatch.cpp), best first; capabilities()["runnable_kernels"] says which this
# CPU runs.
KERNEL_SETS = ("amx", "avx512_bf16", "avx512", "avx2", "reference")


def capabilities() -> dict:
    """What the CPU has, which kernel sets it can run, which one is in use, threads and scratch size."""
    return _C.capabilities()


def profile_every() -> int:
    """KT_SFT_PROFILE as a count of training forwards between step-profile lines (0: off)."""
    value = os.environ.get("KT_SFT_PROFILE", "0")
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"KT_SFT_PROFILE={value!r} is not a whole number; set it to N > 0 for a step profile "
                         "line every N training forwards, or 0 for none.") from None


def require_one_process() -> None:
    """Refuses a distributed launch before any expert is read: kt_sft keeps the routed experts once, in this
    process's CPU RAM, next to one GPU. torchrun / accelerate (and LLaMA-Factory, which starts one process per
    visible GPU) would load them in every process, and DistributedDataParallel takes no module with CPU
    parameters. DeepSpeed, at any ZeRO stage, manages parameters in buffers of its own (ZeRO-3 partitions them,
    ZeRO-1/2 point them into flat buffers that its optimizer updates), which the CPU engine, reading the experts
    in place, would not follow."""
    try:
        world = int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = max(world, torch.distributed.get_world_size())
    if world > 1:
        raise ValueError(f"this is one of {world} processes of a distributed launch, but kt_sft trains with one "
                         "process and one GPU (the routed experts live once in its CPU RAM); run a single process, "
                         "e.g. CUDA_VISIBLE_DEVICES=0 llamafactory-cli train <yaml> (LLaMA-Factory starts one "
                         "process per visible GPU).")
    from transformers.integrations.deepspeed import deepspeed_config
    config = deepspeed_config()  # set by TrainingArguments(deepspeed=...), which LLaMA-Factory builds before the model
    if config is not None:
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        raise ValueError(f"DeepSpeed (ZeRO stage {stage}) manages the parameters in buffers of its own, which "
                         "kt_sft's CPU engine, reading the routed experts in place, would not follow; remove the "
                         "deepspeed setting (the experts' weights and optimizer state already live in CPU RAM).")


def _switch(name: str, default: bool = False) -> bool:
    """An on/off environment variable: 1 on, 0 off, unset (or empty) default; anything else refused, not taken
    for either."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r} is neither 0 nor 1; set it to 1 to turn it on, or 0 to turn it off.")
    return default if value == "" else value == "1"


def recompute_experts() -> bool:
    """KT_SFT_RECOMPUTE_EXPERTS=1: read on every call, so that it can change between runs in one process."""
    return _switch("KT_SFT_RECOMPUTE_EXPERTS")


def backward_copy_wanted() -> bool:
    """KT_SFT_BACKWARD_COPY=1: read at every backward, so that it can change between runs in one process."""
    return _switch("KT_SFT_BACKWARD_COPY")


def lora_on_gpu_wanted() -> bool:
    """KT_SFT_LORA_ON_GPU=1: the expert LoRA follows the model to its GPU (KTExperts.lora_home); read when the
    experts move or take an adapter."""
    return _switch("KT_SFT_LORA_ON_GPU")


def recompute_ahead() -> bool:
    """KT_SFT_RECOMPUTE_AHEAD (on unless 0): read at every checkpointed layer's call."""
    return _switch("KT_SFT_RECOMPUTE_AHEAD", default=True)


def switches() -> dict[str, bool]:
    """The on/off environment variables as they read now (a bad value raises, naming it)."""
    return {"KT_SFT_RECOMPUTE_EXPERTS": recompute_experts(), "KT_SFT_BACKWARD_COPY": backward_copy_wanted(),
            "KT_SFT_LORA_ON_GPU": lora_on_gpu_wanted(), "KT_SFT_RECOMPUTE_AHEAD": recompute_ahead()}


def _configure_from_env() -> None:
    switches()  # read at every call, checked here too: refused before any training runs
    threads = os.environ.get("KT_SFT_THREADS")
    kernels = os.environ.get("KT_SFT_KERNELS")
    pin = os.environ.get("KT_SFT_PIN")
    pinned = _switch("KT_SFT_PIN", default=True)
    if threads or kernels or pin:
        if threads and not threads.strip().isdigit():
            raise ValueError(f"KT_SFT_THREADS={threads!r} is not a whole number; set it to the engine's thread count "
                             "(0: one per CPU this process may use).")
        try:
            _C.configure(_thread_count(threads or 0, "KT_SFT_THREADS"), pinned, kernels or "", 0)
        except RuntimeError as e:  # the only setting the engine can refuse here: say where it came from
            raise RuntimeError(f"KT_SFT_KERNELS={kernels!r}: {e}") from None


# A bad KT_SFT_THREADS / KT_SFT_KERNELS / KT_SFT_PIN (or on/off switch): raised by the first experts module
# (require_settings) and reported by `kt-sft doctor`, not at import, where it took every command of the CLI down
# with a traceback.
settings_error: Exception | None = None
try:
    _configure_from_env()
except (ValueError, RuntimeError) as e:
    settings_error = e


_log = logging.getLogger("kt_sft")


def _ignored(message: str, category: type[Warning]) -> bool:
    """Whether the warnings filters drop this message wherever it is raised: the first filter not scoped to a module
    or line that matches it says "ignore" (LLaMA-Factory's DPO and KTO trainers set simplefilter("ignore") for the
    whole process)."""
    for action, text, kind, module, line in warnings.filters:
        if module is None and line == 0 and issubclass(category, kind) and (text is None or text.match(message)):
            return action == "ignore"
    return False


_logged: set[str] = set()


def warn(message: str, stacklevel: int = 1) -> None:
    """kt_sft's warnings (a slower path taken, a setting without effect, LoRA targets that miss the experts) as
    RuntimeWarnings, or, where the filters would drop every warning, on the kt_sft logger, which they do not
    silence (each message once, as the default filter shows a warning once per place)."""
    if _ignored(message, RuntimeWarning):
        if message not in _logged:
            _logged.add(message)
            _log.warning(message)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def require_settings() -> None:
    """Raises the environment's bad engine setting, if there is one (the engine keeps its defaults meanwhile)."""
    if settings_error is not None:
        raise type(settings_error)(*settings_error.args)


def _warn_if_tiles_refused() -> None:
    caps = _C.capabilities()
    if caps["cpu"]["amx_bf16"] and "amx" not in caps["runnable_kernels"]:
        warn(f"kt_sft: {caps['tiles']}.")


_warn_if_tiles_refused()
