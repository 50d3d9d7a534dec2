"""The expert LoRA on a GPU (KT_SFT_LORA_ON_GPU=1): the CPU copies the engine reads, the gradients it writes.

Why: clipping and AdamW over the experts' LoRA states are passes bound by memory (AdamW moves 28 bytes per
value). In CPU RAM they took 5–12 ms per Qwen3-30B-A3B layer and step on the GPU test machine, in turn with the
engine, whose threads need the same memory; in GPU memory they take a fraction of a millisecond. The price is
up to 16 bytes of GPU memory per LoRA value (the value, its grad, AdamW's two moments; 12 measured at the
step's peak) and 8 of pinned host memory (the two buffers below) instead of 16 bytes of host RAM
(cookbook/sizing.md).

- engine_tensors: each GPU matrix's pinned float32 copy, taken again when the matrix changed since: its
  storage, its version counter (a load, an in-place edit), or the process's optimizer steps (a fused optimizer
  bumps no version counter; writes through `.data`, which bump none either, are seen at the next optimizer step
  only: write through the parameter under torch.no_grad()). prefetch queues those copies right after an
  optimizer step (KTExperts' step hook, layer by layer in the order the forward needs them), so that they run
  while the next forward's first layers compute; engine_tensors then only waits for its own. The engine reads
  the copy; nothing writes it while an engine call of its module runs (a step comes after the backward that
  reads it).
- grad_buffer / hand_grad: per matrix a pinned float32 buffer that the engine writes the grad into; hand_grad
  copies it up without waiting (into param.grad, or added to the grad an earlier micro-batch left there) and
  records an event, which the buffer's next use waits for. A backward that raises after a layer's upload leaves
  it unwaited by the compute stream until the next optimizer step or clipping (wait_for_grad_uploads): drop such
  grads with zero_grad() (set_to_none, the default) rather than zeroing them in place, and read them in code of
  your own only after one of those.

Both kinds of copies run on a side stream: on the compute stream, 70 MB per Qwen3-30B-A3B layer each way would
queue ~2 ms of PCIe time ahead of the next layer's attention, which the engine waits for. The side stream first
waits for what the compute stream has queued (the optimizer's update, an earlier use of the grad), and the
compute stream waits for the grads' uploads at the end of the backward that made them (an autograd callback),
before any clipping or optimizer step reads them. They still share the GPU's copy engines with the layers' own
transfers: in bench_model at 16 layers the rest of the step grew by about what the optimizer saved, through
`llamafactory-cli train` at 4 layers it did not (BENCHMARKS.md, "The expert LoRA on the GPU").
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .._ext import lock_renewed_in_forked_children, warn

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
# Two threads' first uses would each make one, their copies then unordered.
_side_streams_lock = lock_renewed_in_forked_children(globals(), "_side_streams_lock")


def _queue_on_side(device: torch.device) -> torch.cuda.Stream:
    """The stream the LoRA's copies to and from device run on (one per device, made at its first use), after the
    work its compute stream has queued so far."""
    with _side_streams_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


# Per device, the last grad upload that the end of its backward has not made the compute stream wait for yet: a
# backward that raised runs no callbacks, and a caller that goes on (skipping a bad batch) must not step on grads
# still being copied.
_unwaited: dict[torch.device, torch.cuda.Event] = {}


def wait_for_grad_uploads(*_) -> None:
    """Makes each device's current stream wait for the grads' uploads left unwaited (every optimizer's step runs
    this first, and so does clip_grad_norm_; fp16's GradScaler.unscale_, which reads the grads before either, does
    not: after a raising backward under fp16, drop the grads with zero_grad())."""
    for device, event in list(_unwaited.items()):
        torch.cuda.current_stream(device).wait_event(event)
        if _unwaited.get(device) is event:
            _unwaited.pop(device, None)


register_optimizer_step_pre_hook(wait_for_grad_uploads)


def check_room(device: torch.device, moving: int, placed: int) -> None:
    """Before `moving` more float32 LoRA values go to device beside `placed` already there: raises when they do not
    fit its free memory (a clear error in place of an out-of-memory one), and warns when the grads and an
    Adam-type optimizer's two moments of all of them (12 bytes a value more) would not, which training needs at its
    first step; both lower bounds (activations come on top)."""
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    now, training = 4 * moving, 4 * moving + 12 * (placed + moving)
    if now <= free and training <= free:
        return
    what = (f"KT_SFT_LORA_ON_GPU=1: the routed experts' LoRA ({placed + moving} values so far) needs "
            f"{now / 2**30:.3g} GiB more on {device} now and {training / 2**30:.3g} GiB to train (its grads and "
            f"AdamW's state: 16 bytes per value), but {free / 2**30:.3g} GiB are free there")
    if now > free:
        raise ValueError(f"{what}; unset KT_SFT_LORA_ON_GPU to keep it in host RAM, or lower the LoRA rank.")
    warn(f"kt_sft: {what}: training would run out of GPU memory at its first optimizer step; unset "
         "KT_SFT_LORA_ON_GPU to keep the expert LoRA in host RAM, or lower the LoRA rank.")


class GpuLora:
    """One experts module's host buffers for its LoRA matrices that live on a GPU, each kept while its matrix lives
    (keyed by the matrix itself, weakly: a load that replaces the matrices frees the old buffers)."""

    def __init__(self):
        self._copies = WeakIdKeyDictionary()  # param -> (pinned copy, state it was taken at, event of that copy)
        self._grads = WeakIdKeyDictionary()  # param -> (pinned grad buffer, event of its last upload or None)
        self._prefetched: list = []  # the events of prefetch's latest copies (a stream's later event covers earlier)

    @staticmethod
    def _entry(table, param: torch.Tensor, *empty) -> tuple:
        """param's entry in table, made (a pinned float32 buffer of its shape, then `empty`) where it has none."""
        entry = table.get(param)
        if entry is None or entry[0].shape != param.shape:
            # Made by whichever call comes first: under inference_mode (a generation before training) a buffer
            # would be an inference tensor, which every later copy into it outside that mode refuses.
            with torch.inference_mode(False):
                entry = table[param] = (torch.empty(param.shape, dtype=torch.float32, pin_memory=True), *empty)
        return entry

    def _copy_changed(self, params, optimizer_steps: int) -> list:
        """Queues the copies of the params that changed since their last one; returns events that tell when
        they are done. Each copy's entry keeps its event too: a thread that finds the copy already queued by
        another (inference from several threads) waits for it there."""
        changed = {}  # param -> its state now: recorded once its copy is queued, so that a copy an error cut
        for p in params:  # short is queued again by the next call, not taken for done
            copy, state, _ = self._entry(self._copies, p, None, None)
            now = (p.data_ptr(), p._version, optimizer_steps)
            if state != now:
                changed[p] = now
        events = []
        for device in {p.device for p in changed}:
            stream = _queue_on_side(device)
            with torch.cuda.stream(stream):
                for p in changed:
                    if p.device == device:
                        self._copies[p][0].copy_(p.detach(), non_blocking=True)
            event = stream.record_event()
            for p, now in changed.items():
                if p.device == device:
                    self._copies[p] = (self._copies[p][0], now, event)
            events.append(event)
        return events

    def prefetch(self, params, optimizer_steps: int) -> None:
        """Queues the copies engine_tensors will want, without waiting for them."""
        self._prefetched = self._copy_changed(params, optimizer_steps) or self._prefetched

    def settle(self) -> None:
        """Waits for the copies prefetch queued (before the matrices move to another device, whose side stream
        would otherwise write the same buffers in no fixed order with them)."""
        for event in self._prefetched:
            event.synchronize()
        self._prefetched = []

    def release(self) -> None:
        """Frees the pinned buffers (8 bytes per LoRA value) once the matrices are back in host RAM, after the
        copies in flight (an upload's pinned source is kept by torch's host allocator until its copy is done)."""
        self.settle()
        self._copies.clear()
        self._grads.clear()

    def engine_tensors(self, params, optimizer_steps: int) -> list:
        """The float32 CPU tensors the engine reads for params (GPU matrices; the caller converts the others),
        once their copies are done, whichever call queued them."""
        self._copy_changed(params, optimizer_steps)
        entries = [self._copies[p] for p in params]
        for _, _, event in entries:
            if event is not None:
                event.synchronize()
        return [copy for copy, _, _ in entries]

    def grad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """The pinned buffer the engine writes param's grad into, once its previous upload is done."""
        buf, uploaded = self._entry(self._grads, param, None)
        if uploaded is not None:
            uploaded.synchronize()
        return buf

    def hand_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """grad (grad_buffer's, written) made param's gradient on its GPU, copied up on the side stream; runs
        inside a backward, at whose end the compute stream waits for the copy. GPU memory is taken on the compute
        stream, where the optimizer reads and frees the grads, and the side stream's use of it recorded."""
        device = param.device
        compute = torch.cuda.current_stream(device)
        stream = _queue_on_side(device)
        up = torch.empty(param.shape, dtype=torch.float32, device=device)
        with torch.cuda.stream(stream):
            up.copy_(grad, non_blocking=True)
            if param.grad is not None:
                param.grad.add_(up)
        up.record_stream(stream)
        if param.grad is None:
            param.grad = up
        else:
            param.grad.record_stream(stream)
        event = stream.record_event()
        self._grads[param] = (grad, event)
        _unwaited[device] = event

        def at_backward_end():
            # Both the stream the backward ran on and the one current where the callback runs (the caller's).
            compute.wait_event(event)
            torch.cuda.current_stream(device).wait_event(event)
            if _unwaited.get(device) is event:
                _unwaited.pop(device, None)

        torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)
