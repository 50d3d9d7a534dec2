"""The autograd Functions over the CPU engine: move tensors, call the engine, nothing else (STYLE.md 6). A
training call is two autograd nodes, StartEngine and EngineResult, so that GPU work queued between them runs
while the engine computes, in forward and in backward (EngineCall says how).

Gradients: x and top_k_weights are returned to autograd. LoRA A/B grads of float32 matrices (on the CPU, or on
the GPU through a pinned buffer) go straight into `param.grad` (KTExperts.lora_grad_into: a buffer the module
keeps and reuses when the grad is None, else added into the grad an earlier micro-batch left); those of other
matrices, of one given for two projections and of one with hooks are returned to autograd in the parameters'
dtype. Base-weight grads (full mode) are accumulated by the engine straight into `param.grad` (created as zeros
when missing), so a multi-GB expert stack is never materialized twice, unless hooks must see them. That is
under backward(); under torch.autograd.grad() both are returned, and backward(inputs=...) computes none that it
does not name (grad_destination).
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch

from .._ext import view
from .kept_forward import recomputing
from .timing import add_engine_seconds, engine_timer, uncounted

_ENGINE_DTYPES = (torch.float32, torch.bfloat16)
# StartEngine's inputs: call, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias (or None); then the 6 LoRA
# matrices
N_FIXED_INPUTS = 7
GATE_UP_INPUT, DOWN_INPUT, GATE_UP_BIAS_INPUT = 4, 5, 6


def to_engine(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on the CPU, contiguous, in dtype (or its own when the engine takes it, else float32). From a GPU: cast
    there, copied into pinned memory (a pageable copy goes through a staging buffer; BENCHMARKS.md "End to
    end": 35 -> 7 ms per 4-layer step), after waiting for the stream that produces t (timed as "gpu": GPU
    compute the engine waited for, not transfer)."""
    if dtype is None:
        dtype = t.dtype if t.dtype in _ENGINE_DTYPES else torch.float32
    if t.is_cpu:  # the common case of every call's LoRA matrices first: keyword .to() parsing costs microseconds
        return t.detach() if t.dtype == dtype and t.is_contiguous() else t.detach().to(dtype).contiguous()
    if t.device.type != "cuda":
        return t.detach().to(device="cpu", dtype=dtype).contiguous()
    src = t.detach().to(dtype)
    with engine_timer("gpu"):
        torch.cuda.current_stream(t.device).synchronize()
    out = torch.empty(src.shape, dtype=dtype, pin_memory=True)
    out.copy_(src, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def host_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor for an engine result bound for device: pinned when that is a GPU, so to_caller's copy is
    asynchronous (torch's pinned allocator does not hand the block out again before that copy is done)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def engine_inputs(module, x, top_k_index, top_k_weights, lora_params):
    """The call's tensors as the engine takes them: x (bf16/f32), int64 ids, float32 weights and LoRA (the
    module's engine_lora)."""
    with engine_timer("transfer"):
        lora32 = module.engine_lora(lora_params)
        ids = to_engine(top_k_index, torch.int64)
        if not module.identity_experts and bool((ids == -1).any()):  # the engine's "no expert", which only
            E = module.num_experts  # KTExperts' zero-computation experts hand it
            raise ValueError(f"top_k_index holds expert id -1; ids must be in [0, {E}) for this layer's {E} experts.")
        return to_engine(x), ids, to_engine(top_k_weights, torch.float32), lora32


def to_caller(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """An engine result (from host_empty) moved back to the caller's device and dtype (timed as transfer); the
    copy to a GPU is queued on its current stream, so later GPU work orders after it without a wait here."""
    with engine_timer("transfer"):
        return t.to(device=device, non_blocking=True).to(dtype)


INTO_GRAD, TO_CALLER, NOWHERE = "grad", "caller", "nowhere"


def grad_destination(param: torch.Tensor) -> str:
    """Where the running backward puts param's gradient: INTO_GRAD (backward(): added into param.grad), TO_CALLER
    (torch.autograd.grad(): handed back), NOWHERE (backward(inputs=...) without param, or param frozen since the
    forward). Asked of autograd's engine about param's AccumulateGrad node (a private hook of torch's); where it
    cannot answer, TO_CALLER, which is right for every caller (autograd accumulates, captures or drops it)."""
    if not param.requires_grad:
        return NOWHERE
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if will_run is None:
        return TO_CALLER
    try:
        with torch.inference_mode(False):
            accumulate = torch.autograd.graph.get_gradient_edge(param).node
        return INTO_GRAD if will_run(accumulate) else NOWHERE
    except RuntimeError:  # it does not answer for leaves while autograd.grad() runs
        return TO_CALLER


def _versions(weights, lora_params) -> tuple:
    """The version counters of what a training call's backward reads again (the weights and gate/up bias, the LoRA
    matrices): autograd's own check does not see them, as the engine keeps no saved tensors of them."""
    return tuple(t._version for t in (*weights, *lora_params) if t is not None)


def lora_views(mats):
    return [view(m, "LoRA weight") for m in mats]


def start_forward(engine, xc, idx, w, lora_r, lora_scale, lora32, save, device, dropout=(0.0, 0), now=True):
    """Starts one engine forward on prepared CPU tensors, its output bound for device: returns (out, Running),
    whose wait() gives the engine's saved state (or None). now: run it on this thread at once; else the engine's
    driver thread runs it while the caller goes on. dropout: (p, seed) of LoRA dropout (p = 0: none)."""
    out = host_empty(xc.shape, xc.dtype, device)
    t0 = time.perf_counter()
    pending = engine.forward(view(xc, "hidden_states"), view(idx, "top_k_index"), view(w, "top_k_weights"), view(out),
                             lora_r, lora_scale, lora_views(lora32), save, *dropout, now=now)
    return out, Running(pending, "forward", t0, time.perf_counter() if now else None)


class Running(NamedTuple):
    """An engine call in flight; wait() returns its result and adds its wall time to the step profile's phase
    (engine_timer's phases): from its start to its end where it ran at once (t1; what the caller did before the
    wait is not the engine's), else to the wait."""
    pending: object
    phase: str
    t0: float
    t1: float | None = None

    def wait(self):
        result = self.pending.wait()
        add_engine_seconds(self.phase, (self.t1 or time.perf_counter()) - self.t0)
        return result


def run_forward(engine, xc, idx, w, lora_r, lora_scale, lora32, save, device, dropout=(0.0, 0), beside=None):
    """One engine forward, as start_forward; beside() (GPU work to queue meanwhile) runs while the engine computes
    (runs_beside) or after it. Returns (out, saved-or-None)."""
    out, running = start_forward(engine, xc, idx, w, lora_r, lora_scale, lora32, save, device, dropout,
                                 now=beside is None or not runs_beside(device))
    if beside is not None:
        beside()
    return out, running.wait()


_beside_backward = None


def beside_backward(source) -> None:
    """source(): asked by every training call's backward that may run its engine beside the caller, before it
    starts the engine; returns work to run while the engine computes (after the GPU work between the call's two
    nodes is queued, before the wait for the engine), or None. models/recompute_ahead.py queues the recompute of
    the layer before there. One per process; None: nothing."""
    global _beside_backward
    _beside_backward = source


def runs_beside(device: torch.device) -> bool:
    """Whether work queued beside the engine runs while it computes: on a GPU; on the CPU it would compete with
    the engine for the cores, so the engine finishes first and the same steps run in turn."""
    return device.type == "cuda"


def experts_call(module, x, top_k_index, top_k_weights, lora, lora_params, beside=None):
    """The routed experts of one training forward: the engine's forward, beside() while it runs, its result.
    lora: (r, scale, (dropout p, seed))."""
    call = EngineCall(module, lora, lora_params, beside is not None and runs_beside(x.device))
    token = StartEngine.apply(call, x, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                              module.gate_up_proj_bias, *lora_params)
    if beside is not None:
        beside()
    return EngineResult.apply(call, token)


class EngineCall:
    """One training call of the engine, shared by its two autograd nodes: StartEngine (its inputs) and
    EngineResult (its output). Autograd numbers nodes in the order they are made and, of those ready, runs the
    later first; the GPU work queued between the two in forward (`beside`: a block's shared experts) makes nodes
    numbered between them. So in backward EngineResult starts the engine's backward and returns, the nodes in
    between queue their GPU work, and StartEngine waits for the engine and hands autograd its gradients: the GPU
    computes while the CPU does. concurrent: the forward's engine runs on its driver thread while Python goes on
    (else on this thread, at once; the steps run in the same order). The backward's does when it has work beside
    it (those nodes, or beside_backward's) and its writes go to buffers of this call's own."""

    def __init__(self, module, lora, lora_params, concurrent: bool):
        self.module, self.lora, self.lora_params, self.concurrent = module, lora, lora_params, concurrent
        self.xc = self.x_version = self.lora32 = self.out = self.saved = self.running = self.grads = None
        self.backward_work = None  # what the backward runs while its engine computes (beside_backward)
        self.deferred = None  # (idx, w) of a forward whose engine starts in EngineResult (StartEngine.forward)


class StartEngine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, *lora_params):
        if x.is_inference():  # as autograd refuses saving one for backward (it has no version counter to check)
            raise RuntimeError("hidden_states is an inference tensor (made under torch.inference_mode), which cannot "
                               "be saved for backward; pass a clone made outside inference_mode to train on it.")
        module = call.module
        xc, idx, w, call.lora32 = engine_inputs(module, x, top_k_index, top_k_weights, lora_params)
        r, scale, dropout = call.lora
        kept = module.take_kept(xc, idx, w, lora_params, call.lora)  # gradient checkpointing's recompute
        if kept is not None:
            call.out, call.saved = kept.out, kept.saved
        elif recomputing():
            # A recompute without a kept pass, most likely non-reentrant checkpointing's: its first pass ran with
            # grad, and its own call holds what the backward needs. The engine runs when EngineResult's forward
            # asks for the result, which that recompute's early stop never does where nothing after the experts
            # saves tensors for backward (the experts themselves save none under the checkpoint's hooks).
            call.deferred = idx, w
        else:
            call.out, call.running = start_forward(module.engine, xc, idx, w, r, scale, call.lora32, save=True,
                                                   device=x.device, dropout=dropout, now=not call.concurrent)
        call.xc = xc
        # The caller's x itself where the engine reads it in place (on the CPU, in the engine's dtype): the
        # backward reads it again, so a change in place since (which autograd's saved tensors would catch) is too.
        call.x_version = (x, x._version) if xc.data_ptr() == x.data_ptr() else None
        call.needs = ctx.needs_input_grad
        call.weights = gate_up, down, gate_up_bias
        call.versions = _versions(call.weights, lora_params)
        call.x_meta = (x.device, x.dtype)
        call.w_meta = (top_k_weights.device, top_k_weights.dtype, tuple(top_k_weights.shape))
        ctx.call = call
        return x.new_empty(0)  # the token EngineResult takes: it orders the two nodes

    @staticmethod
    def backward(ctx, _token):
        call = ctx.call
        dx, dw, lora_grads, direct, base, d_bias = call.grads
        work, call.backward_work = call.backward_work, None
        try:
            try:
                if work is not None:
                    with uncounted():  # within the engine's span, which its wait adds
                        work()
            finally:  # work that raised leaves no engine call running behind the error
                call.running.wait()
            call.running = call.grads = call.saved = None
            (dev, dt), (wdev, wdt, _) = call.x_meta, call.w_meta
            # dx and dw first: the next GPU work waits for them, and a LoRA on the GPU queues its grads' larger
            # copies after them (KTExperts.hand_lora_grad).
            dx, dw = to_caller(dx, dev, dt), to_caller(dw, wdev, wdt)
            for p, g, d in zip(call.lora_params, lora_grads, direct):
                if d:
                    call.module.hand_lora_grad(p, g, call)
        except BaseException:
            call.module.drop_lora_grads(call)
            raise
        out_lora = [None if g is None or d else g.to(device=p.device, dtype=p.dtype)
                    for p, g, d in zip(call.lora_params, lora_grads, direct)]
        bias = call.weights[2]
        d_bias = None if d_bias is None else d_bias.to(device=bias.device, dtype=bias.dtype)
        return (None, dx, None, dw, *base, d_bias, *out_lora)


class EngineResult(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, _token):
        dev, dt = call.x_meta
        if call.deferred is not None:
            (idx, w), call.deferred = call.deferred, None
            r, scale, dropout = call.lora
            call.out, call.running = start_forward(call.module.engine, call.xc, idx, w, r, scale, call.lora32,
                                                   save=True, device=dev, dropout=dropout)
        if call.running is not None:
            call.saved = call.running.wait()
            call.running = None
        ctx.call = call
        # The call holds xc for the backward, not autograd's saved tensors: under a checkpoint's saved-tensor hooks
        # a saved xc would be dropped and its recompute would run the engine's forward again.
        out, call.out = call.out, None
        return to_caller(out, dev, dt)

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        module = call.module
        if call.saved is None:
            raise RuntimeError("KTExperts backward ran twice over one forward; run the forward again instead of "
                               "retain_graph=True.")
        if torch.is_grad_enabled():  # create_graph=True: the engine's grads would carry no graph
            raise RuntimeError("KTExperts has no second derivative: its backward runs on the CPU engine outside "
                               "autograd, so a backward with create_graph=True (double backward, Hessian-vector "
                               "products) would silently miss the routed experts' terms; run it with "
                               "create_graph=False.")
        module.check_weights_in_place()  # replaced since the forward: the engine would read freed memory
        if _versions(call.weights, call.lora_params) != call.versions:
            raise RuntimeError("KTExperts: an expert weight or LoRA matrix was changed in place between this forward "
                               "and its backward (an optimizer step or a LoRA merge before backward), so the backward "
                               "would mix the forward's activations with other weights; call backward before "
                               "changing them, or run the forward again after.")
        if call.x_version is not None and call.x_version[0]._version != call.x_version[1]:
            raise RuntimeError("KTExperts: hidden_states was changed in place between this forward and its backward, "
                               "which reads it again; change a copy of it (x.clone()) instead.")
        try:
            start_backward(call, call.xc, grad_out)
            call.xc = call.x_version = None  # the engine's call holds xc until it is done
        except BaseException:
            module.drop_lora_grads(call)
            raise
        return None, grad_out.new_empty(0)


def start_backward(call: EngineCall, xc: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Starts the engine's backward of `call` (StartEngine.backward waits for it and hands its grads over)."""
    module = call.module
    dev, _ = call.x_meta
    wdev, _, wshape = call.w_meta
    dx = host_empty(xc.shape, xc.dtype, dev)
    dw = host_empty(wshape, torch.float32, wdev)
    need = call.needs
    # Straight into param.grad where backward() puts it and may (direct: overwriting a reused buffer, or adding
    # into the grad of an earlier micro-batch), else written into new tensors for autograd.
    # Returned to autograd instead: the grads of a parameter given for two projections (tied), for autograd to
    # sum (the buffer lora_grad_into keeps per parameter would take only the second), and of one with hooks:
    # tensor hooks (register_hook) see and may change the grad before it is accumulated, and post-accumulate
    # hooks then run after it on the compute stream (a LoRA on the GPU gets its direct grad on a side stream,
    # which the compute stream waits for only at the backward's end).
    lora_grads, direct, accumulate = [], [], []
    ids = [id(p) for p in call.lora_params if p is not None]
    for i, (p, p32) in enumerate(zip(call.lora_params, call.lora32)):
        where = grad_destination(p) if p is not None and need[N_FIXED_INPUTS + i] else NOWHERE
        if where == INTO_GRAD and (ids.count(id(p)) > 1 or p._backward_hooks or p._post_accumulate_grad_hooks):
            where = TO_CALLER
        target, adds = module.lora_grad_into(p, call) if where == INTO_GRAD else (None, False)
        direct.append(target is not None)
        accumulate.append(adds)
        lora_grads.append(target if target is not None else None if where == NOWHERE else torch.empty_like(p32))
    # Base weights (full mode): added by the engine into param.grad, or into zeros returned to the caller.
    base, base_out = [], []
    for param, wanted in ((module.gate_up_proj, need[GATE_UP_INPUT]), (module.down_proj, need[DOWN_INPUT])):
        where = grad_destination(param) if wanted else NOWHERE
        grad = param.grad
        if where == INTO_GRAD and (grad is not None and not (grad.is_contiguous() and grad.dtype == param.dtype) or
                                   param._backward_hooks or param._post_accumulate_grad_hooks):
            where = TO_CALLER  # a grad the engine cannot add into in place (strided, another dtype), or one that
            # hooks must see (as the LoRA's above): autograd accumulates it
        target = (module.base_grad(param) if where == INTO_GRAD else torch.zeros_like(param) if where == TO_CALLER
                  else None)
        base.append(target)
        base_out.append(target if where == TO_CALLER else None)
    d_gate_up, d_down = base
    # The gate/up bias's grad (small: [E, 2I]) is always the engine's sum into zeros, handed to autograd.
    bias = module.gate_up_proj_bias
    d_bias = (torch.zeros(bias.shape, dtype=torch.float32) if need[GATE_UP_BIAS_INPUT]
              and grad_destination(bias) != NOWHERE else None)
    with engine_timer("transfer"):
        dout = to_engine(grad_out, xc.dtype)
    r, scale, dropout = call.lora
    # Concurrent only where the engine writes nothing the caller holds until StartEngine hands it over: grads
    # added into a param.grad (accumulation, base weights) would still be changing if a node in between raised
    # and the caller went on (a zero_grad that keeps the tensors, a retried batch).
    concurrent = runs_beside(dev) and not any(accumulate) and d_gate_up is None and d_down is None
    work = _beside_backward() if concurrent and _beside_backward is not None else None
    concurrent = concurrent and (call.concurrent or work is not None)
    copy = module.backward_copy(xc.dtype)
    t0 = time.perf_counter()
    # Adding into a param.grad, the call runs now (not concurrent) under the lock that hands grads over, so
    # that another thread's hand-over into the same grad waits for it.
    with module.grads_lock() if any(accumulate) else contextlib.nullcontext():
        pending = module.engine.backward(
            call.saved, view(xc), view(dout), r, scale, lora_views(call.lora32),
            view(dx), view(dw), lora_views(lora_grads), view(d_gate_up), view(d_down), *dropout,
            now=not concurrent, lora_accumulate=accumulate, backward_copy=copy, d_gate_up_bias=view(d_bias),
        )  # the pending call holds every tensor it reads or writes (dout included) until it is done
    call.running = Running(pending, "backward", t0, None if concurrent else time.perf_counter())
    call.backward_work = work
    call.grads = dx, dw, lora_grads, direct, base_out, d_bias
