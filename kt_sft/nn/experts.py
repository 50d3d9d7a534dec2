"""KTExperts: drop-in for a transformers 5.x experts module, with the routed experts on the CPU engine.

Call: forward(hidden_states [T,H], top_k_index [T,K] int64, top_k_weights [T,K]) -> [T,H] on the input's
device and dtype. The expert weights are CPU tensors in the fused layout (gate_up_proj [E,2I,H],
down_proj [E,H,I]) held once: the engine reads them in place, `.to(device)` / `.cuda()` leave them on the CPU,
and in full mode the optimizer updates them in place. The expert LoRA stays on the CPU too, unless
KT_SFT_LORA_ON_GPU=1 puts it on the model's GPU (lora_home: the optimizer and the clipping then run there).

Formats: BF16 weights are parameters (trainable in full mode). FP8 block-128 and INT4 group-32 weights (a
kt_sft.formats.QuantizedExperts given as the first argument) are buffers that stay in their own precision;
LoRA trains on top of them, and full-parameter training of them is refused.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import sys
import threading
import weakref
from typing import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .._ext import (_C, backward_copy_wanted, lock_renewed_in_forked_children, lora_on_gpu_wanted, require_settings,
                    view, warn)
from ..formats import EXPERT_FORMATS, QuantizedExperts, check_fused_layout
from ..ops import grad_clip, host_memory
from ..ops.at_exit import note_caller
from ..ops.experts_function import engine_inputs, experts_call, run_forward, to_caller, to_engine
from ..ops.gpu_lora import GpuLora, check_room
from ..ops.kept_forward import (MISSES_BEFORE_OFF, KeptForward, keeps_forward, kept_bytes, matches, no_recompute_follows,
                                own, recomputing, reserve_bytes, room_to_keep, setting_of)
from ..ops.reference import PROJECTIONS, SWIGLU, Glu, lora_scale
from ..ops.stacked_lora_optimizers import check_optimizers_against
from .stock_layout import StockLayout


# Held while a backward decides where the engine writes a parameter's grad and while it hands that grad over: two
# threads' backwards through one module would otherwise both find the grad None and the later one's would replace
# the other's.
_grads_lock = lock_renewed_in_forked_children(globals(), "_grads_lock")
_storage_uses = getattr(torch._C, "_storage_Use_Count", None)


def _uses(t: torch.Tensor) -> int:
    return _storage_uses(t.untyped_storage()._cdata)


# What _uses reads for a tensor whose memory nothing else shares.
_UNSHARED_USES = _uses(torch.empty(1)) if _storage_uses else None


def _memory_shared(t: torch.Tensor) -> bool:
    """Whether another tensor (a view, .detach(), .data) shares t's memory. True where torch cannot tell (CPU-only
    builds before 2.8 lack the count; CUDA builds have it): a fresh grad buffer every step there, slower but never
    written over a grad someone kept."""
    return _storage_uses is None or _uses(t) != _UNSHARED_USES


# Optimizer steps taken in this process (torch.optim's global post-step hook, installed with the first float32
# master): a fused optimizer updates parameters without bumping their version counters.
_optimizer_steps = [0]
_step_hook = []
# Experts whose LoRA lives on a GPU, each with when it went there: after each optimizer step they queue the
# engine's copies of it (gpu_lora.py) in that order, which is the layers' (PEFT and .to() visit them in order).
_lora_on_gpu: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_placed = itertools.count()
# Experts that have held LoRA: their matrices are what an optimizer that cannot take stacked LoRA is checked against.
_with_lora: weakref.WeakSet = weakref.WeakSet()
# Set once the backward copy was refused for want of host RAM, or found unread, or KT_SFT_LORA_ON_GPU found without
# effect (each warned once per process).
_short_of_copy_room = []
_copy_unread = []
_lora_not_moved = []


def _count_step(optimizer, args, kwargs):
    _optimizer_steps[0] += 1
    for experts in sorted(_lora_on_gpu, key=_lora_on_gpu.get):
        experts.prefetch_lora()


def count_optimizer_steps() -> None:
    """Installs the step counter (once per process)."""
    if not _step_hook:
        _step_hook.append(register_optimizer_step_post_hook(_count_step))


class ExpertWeight(nn.Parameter):
    """A BF16 expert weight the engine reads in place. A trainer's upcast of trainable parameters
    (`p.data = p.data.float()`: LLaMA-Factory's full fine-tuning unless pure_bf16) gives a trainable one a float32
    master copy, as it gives any other parameter: the parameter (what the optimizer updates; its grad float32)
    becomes that copy, and the BF16 weights the engine reads are rounded from it before the first forward after
    it changes (`sync`: after an optimizer step or an in-place change of the parameter). Any other assignment
    copies the values into the existing storage (a frozen weight's upcast too: a master it never trains would
    only take RAM), so the engine's view of the weights stays valid; a value of another shape is refused."""

    @property
    def data(self):
        # `.data` shares the parameter's version counter, so that writes through it (`p.data.copy_`, optimizers
        # and weight averaging that work on `.data`) are seen like the optimizer's own: by a master's sync to
        # the engine's weights at the next forward, by what was derived from the weights (a kept forward, the
        # backward copy), and by a training call's backward, which refuses weights changed since its forward
        # (ops/experts_function.py) as autograd refuses changed saved tensors.
        return self.detach()

    @data.setter
    def data(self, value):
        if value.shape != self.shape:  # copy_ would broadcast a smaller value over every expert
            raise ValueError(f"an expert weight of shape {tuple(self.shape)} cannot take a value of shape "
                             f"{tuple(value.shape)}; copy values of its own shape into it.")
        if value.dtype == torch.float32 and self.dtype == torch.bfloat16 and self.requires_grad:
            count_optimizer_steps()
            self.__dict__["_working"] = super().data  # the engine's BF16 weights, from now on rounded from the master
            self.__dict__["_synced"] = None
            torch._C.TensorBase.data.__set__(self, value.detach().to("cpu").contiguous())
            return
        if value.dtype not in (torch.bfloat16, torch.float32):
            warn(f"kt_sft: a {value.dtype} value given to a routed expert weight is copied into its "
                 f"{self.dtype} storage (the engine reads the weights in place).", stacklevel=2)
        with torch.no_grad():
            self.copy_(value)  # on the parameter itself, whose version counter then tells sync and kept passes

    def engine_tensor(self) -> torch.Tensor:
        """The BF16 weights the engine reads: this parameter, or the copy rounded from its float32 master."""
        return self.__dict__.get("_working", self)

    def sync(self) -> None:
        """Rounds a float32 master into the engine's BF16 weights if it changed since they were last rounded."""
        working = self.__dict__.get("_working")
        state = (self._version, _optimizer_steps[0])
        if working is not None and self.__dict__["_synced"] != state:
            if self.shape != working.shape:  # copy_ would broadcast it over every expert
                raise RuntimeError(f"the float32 master of an expert weight now has shape {tuple(self.shape)}, not "
                                   f"{tuple(working.shape)}; change its values in place, not its shape.")
            with torch.no_grad():
                working.copy_(self)
            self.__dict__["_synced"] = state


def engine_tensor(weight: torch.Tensor) -> torch.Tensor:
    """What the engine reads for an expert weight (a plain tensor: itself)."""
    return weight.engine_tensor() if isinstance(weight, ExpertWeight) else weight


# The parameters whose memory the engine reads in place (quantized weights are buffers, all read in place too).
ENGINE_READS = ("gate_up_proj", "down_proj", "gate_up_proj_bias")


@contextlib.contextmanager
def left_out_of_apply(module: nn.Module, params: Sequence[str], children: Sequence[str] = ()):
    """module's `params`, every buffer of its own and its `children` taken out of its tables while an _apply (a
    device or dtype move) runs, then put back where they were: the order of parameters is what optimizer states are
    matched by."""
    tables = (module._parameters, module._buffers, module._modules)
    orders = [list(table) for table in tables]
    taken = ({n: module._parameters.pop(n) for n in params if n in module._parameters},
             {n: module._buffers.pop(n) for n in list(module._buffers)},
             {n: module._modules.pop(n) for n in children if n in module._modules})
    try:
        yield
    finally:
        for table, order, back in zip(tables, orders, taken):
            table.update(back)
            ordered = {n: table[n] for n in order if n in table}
            ordered.update(table)
            table.clear()
            table.update(ordered)


class LoadsInPlace:
    """Mixed into modules whose own parameters and buffers are expert weights the engine reads in place."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # torch's loader would swap a weight's contents for the loaded tensor's (torch.__future__'s
        # set_swap_module_params_on_conversion(True)) or replace the weight (load_state_dict(assign=True)), either of
        # which leaves the engine reading tensors that are no longer the weights. With both off it copies the values
        # in place (into the float32 master where there is one), with its own hooks, checks and messages.
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(False)
        try:
            super()._load_from_state_dict(state_dict, prefix, {**local_metadata, "assign_to_params_buffers": False},
                                          strict, missing_keys, unexpected_keys, error_msgs)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)


class StackedLora(nn.ParameterDict):
    """One adapter's LoRA matrices of the experts, by projection, each stacked over the experts."""

    def __getattr__(self, name):
        if name == "weight":  # PEFT code that reads lora_A[adapter] as one nn.Linear
            raise AttributeError("the routed experts' LoRA is stacked per expert and projection (lora_A.<adapter>.<proj>"
                                 " [E, r, in]), not one Linear's weight: PEFT features that read it as one do not "
                                 "support the experts; use them with adapters without 'experts' among their "
                                 "target_modules.")
        return super().__getattr__(name)


class KTExperts(LoadsInPlace, nn.Module):
    def __init__(self, gate_up_proj: torch.Tensor | QuantizedExperts, down_proj: torch.Tensor | None = None,
                 train_base: bool = False, check_finite: bool = False, identity_experts: int = 0,
                 stock_layout: StockLayout = StockLayout(), gate_up_proj_bias: torch.Tensor | None = None,
                 down_proj_bias: torch.Tensor | None = None, unit: Glu = SWIGLU):
        """BF16 experts from (gate_up_proj, down_proj), or quantized ones from a QuantizedExperts (down_proj None).
        identity_experts: how many zero-computation experts follow the E routed ones (LongCat-Flash): ids E to
        E + identity_experts - 1 return the token itself, times its routing weight, computed here in PyTorch.
        stock_layout: state dicts carry the weights as the stock module holds them where that differs from the
        engine's layout (nn/stock_layout.py: Llama 4's and GPT-OSS's transposed, GPT-OSS's gate and up
        interleaved), so that a save loads in stock transformers and a stock save loads here.
        gate_up_proj_bias [E, 2I] (gate's first; the engine adds it, reading it in place), down_proj_bias [E, H]
        (added here, on the caller's device) and unit (the gated unit's constants): GPT-OSS's experts. The biases
        train with the weights (train_base). A unit without a gate (RELU2, Nemotron-H's) takes up's rows alone as
        gate_up_proj [E, I, H] (a QuantizedExperts built with gated False), and its bias [E, I]."""
        nn.Module.__init__(self)  # not super(): subclasses mix in PEFT's LoraLayer, whose __init__ wants a base layer
        require_settings()
        self.unit = Glu(*unit)
        if isinstance(gate_up_proj, QuantizedExperts):
            if down_proj is not None:
                raise ValueError("KTExperts takes quantized experts as one QuantizedExperts, which holds down_proj "
                                 "too; pass no down_proj with it.")
            weights = self._init_quantized(gate_up_proj, train_base)
        else:
            weights = self._init_bf16(gate_up_proj, down_proj, train_base)
        self._init_biases(gate_up_proj_bias, down_proj_bias, train_base)
        bias = self.gate_up_proj_bias
        self.engine = _C.Engine(self.num_experts, self.hidden_size, self.intermediate_size, *weights,
                                gate_up_bias=None if bias is None else view(engine_tensor(bias), "gate_up_proj_bias"),
                                glu_alpha=self.unit.alpha, glu_limit=self.unit.limit,
                                glu_up_offset=self.unit.up_offset, glu_cubic=self.unit.cubic,
                                glu_gated=self.unit.gated)
        if isinstance(gate_up_proj, QuantizedExperts) and self.engine.format != EXPERT_FORMATS[gate_up_proj.format]:
            raise ValueError(f"QuantizedExperts says {gate_up_proj.format!r} but holds tensors of the "
                             f"{self.engine.format} layout; build it with QuantizedExperts.quantize or "
                             "QuantizedExperts.empty of that format.")
        self.expert_format = {v: k for k, v in EXPERT_FORMATS.items()}[self.engine.format]  # bf16 | fp8 | int4
        if isinstance(identity_experts, bool) or not isinstance(identity_experts, int) or identity_experts < 0:
            raise ValueError(f"identity_experts is {identity_experts!r}; it must be a count, 0 or more.")
        self.identity_experts, self.stock_layout = identity_experts, StockLayout(*stock_layout)
        if self.stock_layout != StockLayout():
            self._register_state_dict_hook(lambda module, state, prefix, _: module.stock_layout.to_stock(state, prefix))
            self._register_load_state_dict_pre_hook(
                lambda module, state, prefix, *_: module.stock_layout.to_engine(state, prefix), with_module=True)
        self._engine_weights = self._weights_read()
        self.check_finite = check_finite
        grad_clip.install()  # the trainers' gradient clipping, fast over these experts' CPU gradients
        # LoRA, keyed by adapter name then projection (PEFT's layout: saved as `lora_A.<adapter>.<proj>`).
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.lora_alpha: dict[str, float] = {}
        self.scaling: dict[str, float] = {}
        self.use_rslora: dict[str, bool] = {}
        # Per adapter an nn.Dropout whose `p` the forward reads: what sets dropout modules' p (TRL's
        # disable_dropout_in_model, in LLaMA-Factory's DPO/KTO trainers) reaches the experts' LoRA too.
        self.lora_dropout = nn.ModuleDict()
        self._active_adapter = "default"
        self._model_device = torch.device("cpu")  # where the module's caller computes (_apply's last move)
        self._gpu_lora = GpuLora()

    def _init_bf16(self, gate_up_proj, down_proj, train_base):
        if down_proj is None or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError("KTExperts takes gate_up_proj [E, 2I, H] and down_proj [E, H, I] (3-D tensors).")
        if gate_up_proj.is_meta or down_proj.is_meta:
            raise ValueError("KTExperts got expert weights on the meta device (shapes only, no values); load the "
                             "weights first (kt_sft.loader or from_pretrained) and build KTExperts from them.")
        E, rows, H = gate_up_proj.shape
        if max(E, rows, H) >= 2**31:
            raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)}: the engine takes experts, and rows and columns "
                             "of their weights, fewer than 2**31 each.")
        check_fused_layout(gate_up_proj, down_proj, self.unit.gated)
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, rows // self.unit.stacked
        self.gate_up_proj = ExpertWeight(to_engine(gate_up_proj, torch.bfloat16), requires_grad=train_base)
        self.down_proj = ExpertWeight(to_engine(down_proj, torch.bfloat16), requires_grad=train_base)
        return view(self.gate_up_proj), view(self.down_proj)

    def _init_quantized(self, q: QuantizedExperts, train_base):
        if q.format not in ("fp8", "int4"):
            raise ValueError(f"QuantizedExperts format {q.format!r}: the engine takes 'fp8' and 'int4'.")
        if train_base:
            raise ValueError(f"full-parameter training of {q.format.upper()} expert weights is not supported; load the "
                             "experts in BF16 (a BF16 checkpoint, prepared without --expert-format) to train them, "
                             "or train LoRA on the quantized experts.")
        if q.gated != self.unit.gated:
            raise ValueError(f"the QuantizedExperts were built {'with' if q.gated else 'without'} a gate, but the unit "
                             f"{'has none' if q.gated else 'has one'}; quantize them with gated={self.unit.gated}.")
        self.num_experts, self.hidden_size, self.intermediate_size = q.shape
        # Buffers, not parameters: nothing trains them, and they stay out of state_dict (multi-GB, and an adapter
        # or optimizer checkpoint has no use for them).
        for name in ("gate_up", "down", "gate_up_scale", "down_scale"):
            t = getattr(q, name)
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"quantized expert tensor {name} must be a contiguous CPU tensor.")
            self.register_buffer(name + "_proj" if name in ("gate_up", "down") else name, t, persistent=False)
        return (view(self.gate_up_proj, "gate_up_proj"), view(self.down_proj, "down_proj"),
                view(self.gate_up_scale, "gate_up_scale"), view(self.down_scale, "down_scale"))

    def _init_biases(self, gate_up_bias, down_bias, train_base):
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        biases = (("gate_up_proj_bias", gate_up_bias, (E, self.unit.stacked * I)),
                  ("down_proj_bias", down_bias, (E, H)))
        for name, b, shape in biases:
            if b is not None and tuple(b.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(b.shape)}; these experts take {list(shape)}.")
            if b is not None and not bool(torch.isfinite(b).all()):
                raise ValueError(f"{name} holds NaN or Inf, which would make the experts' outputs NaN; the checkpoint "
                                 "is damaged: download it again.")
        # The gate/up bias is read in place by the engine, as the weights are (an ExpertWeight, whose storage stays
        # put), and kept in float32 (E·2I values): an optimizer's small steps reach the forward, where a BF16 copy
        # rounded from a float32 master would drop those below its resolution. The down bias is read only by
        # PyTorch, so it follows the model's moves.
        self.gate_up_proj_bias = None if gate_up_bias is None else ExpertWeight(
            to_engine(gate_up_bias, torch.float32), requires_grad=train_base)
        self.down_proj_bias = None if down_bias is None else nn.Parameter(down_bias.detach(), requires_grad=train_base)

    # Both run on every forward (_weights_read on every backward too); until some expert weight in the process
    # takes a float32 master (which installs the step hook) they cost a decode step a few attribute reads per weight.
    def _weights_read(self) -> tuple:
        """Where the engine reads the expert weights (and FP8/INT4 scales): each one's address, storage bytes and
        shape. Anything else than at construction means a weight was replaced (`.data =`, a storage freed or
        resized), and the engine would read freed memory."""
        gate_up, down = self._parameters.get("gate_up_proj"), self._parameters.get("down_proj")
        if gate_up is None or down is None or _step_hook:
            gate_up, down = engine_tensor(self.gate_up_proj), engine_tensor(self.down_proj)
        weights = (gate_up, down) if self.expert_format == "bf16" else (gate_up, down, self.gate_up_scale,
                                                                         self.down_scale)
        if self.gate_up_proj_bias is not None:
            weights += (engine_tensor(self.gate_up_proj_bias),)
        return tuple((t.data_ptr(), t.untyped_storage().nbytes(), t.shape) for t in weights)

    def engine_weights(self) -> tuple:
        """The parameters or buffers whose values the engine reads: the weights, and the gate/up bias if any."""
        bias = self.gate_up_proj_bias
        return (self.gate_up_proj, self.down_proj) if bias is None else (self.gate_up_proj, self.down_proj, bias)

    def check_weights_in_place(self) -> None:
        if self._weights_read() != self._engine_weights:
            raise RuntimeError("the expert weights of this KTExperts were replaced by other tensors (or their storage "
                               "freed or resized); the engine reads them in place, so update them in place "
                               "(copy_(...) under torch.no_grad(), or an optimizer step) instead.")

    def _sync_weights(self) -> None:
        if _step_hook:
            for weight in self.engine_weights():
                if isinstance(weight, ExpertWeight):
                    weight.sync()

    def backward_copy(self, activations: torch.dtype) -> tuple | None:
        """Views of the weights packed for the backward (KT_SFT_BACKWARD_COPY=1; BF16 experts), packed again when
        the weights changed since (an optimizer step in full mode, a merge, a load), or None when it is off or
        would not be read: only the tile products read it, which take BF16 activations on a kernel set with them."""
        if not backward_copy_wanted():
            self.__dict__.pop("_backward_copy", None)  # its RAM back
            return None
        if self.expert_format != "bf16":
            raise ValueError(f"KT_SFT_BACKWARD_COPY=1 keeps a BF16 copy of BF16 experts, but these are "
                             f"{self.expert_format.upper()} (the copy would take more RAM than the weights); unset it.")
        caps = _C.capabilities()
        if activations != torch.bfloat16 or not caps["tiles_in_use"]:
            if not _copy_unread:
                _copy_unread.append(True)
                why = (f"the kernel set {caps['kernels']} has no tile products" if not caps["tiles_in_use"] else
                       f"the experts get {activations} activations, which take no tile products (a BF16 model's do)")
                warn(f"kt_sft: KT_SFT_BACKWARD_COPY=1 has no effect here: {why}, the only ones that read the "
                     "copy, so none is kept; unset it.", stacklevel=2)
            return None
        weights = engine_tensor(self.gate_up_proj), engine_tensor(self.down_proj)
        trained = self.gate_up_proj.requires_grad or self.down_proj.requires_grad
        if trained:
            count_optimizer_steps()  # a fused optimizer's step bumps no version counter
            warn("kt_sft: KT_SFT_BACKWARD_COPY=1 with trained expert weights (full-parameter training) packs "
                 "the copy again after every optimizer step, which costs more time than the copy saves; "
                 "unset it for full-parameter training.", stacklevel=2)
        # What the engine reads (a float32 master reaches it through sync, which bumps these versions).
        state = tuple((t.data_ptr(), t._version) for t in weights), _optimizer_steps[0] if trained else 0
        kept = self.__dict__.get("_backward_copy")
        if kept is None and not self._room_for_backward_copy():
            return None
        if kept is None or kept[0] != state:
            copy = kept[1] if kept is not None else tuple(torch.empty(s, dtype=torch.bfloat16)
                                                           for s in self._backward_copy_shapes())
            self.engine.pack_backward_copy(tuple(view(t) for t in copy))
            self.__dict__["_backward_copy"] = state, copy
        return tuple(view(t) for t in self.__dict__["_backward_copy"][1])

    def _backward_copy_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The copy's gate_up and down tensors (csrc/moe/backward_copy.h)."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        return (E, self.unit.stacked, _C.backward_copy_elems(I, H)), (E, _C.backward_copy_elems(H, I))

    def _room_for_backward_copy(self) -> bool:
        """Whether this module's copy leaves the host RAM that kept passes leave (kept_forward.reserve_bytes); warns
        once per process when it does not, and the module trains without it (the same gradients, a slower backward)."""
        nbytes = sum(2 * math.prod(s) for s in self._backward_copy_shapes())
        room = host_memory.host_headroom()
        if room is None or room[0] - nbytes >= reserve_bytes(room[1]):
            return True
        if not _short_of_copy_room:
            _short_of_copy_room.append(True)
            warn(f"kt_sft: KT_SFT_BACKWARD_COPY=1, but {room[0] / 2**30:.1f} GiB of host RAM is available and "
                 f"a layer's backward copy ({nbytes / 2**30:.2f} GiB) would leave less than "
                 f"{reserve_bytes(room[1]) / 2**30:.1f} GiB; layers without one train without it (the same "
                 "gradients, a slower backward). Free host RAM, or unset KT_SFT_BACKWARD_COPY.")
        return False

    def base_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E,2I,H], down [E,H,I]) as the engine computes with them: the BF16 weights, or the
        quantized weights dequantized (exactly) to float32."""
        if self.expert_format == "bf16":
            self._sync_weights()
            return engine_tensor(self.gate_up_proj), engine_tensor(self.down_proj)
        return self.quantized_weights().dequantize()

    def quantized_weights(self) -> QuantizedExperts:
        """The FP8/INT4 experts' buffers as the QuantizedExperts they were built from (no copy)."""
        return QuantizedExperts(self.expert_format, self.gate_up_proj, self.down_proj, self.gate_up_scale,
                                self.down_scale, self.unit.gated)

    @property
    def projections(self) -> tuple[str, ...]:
        """The experts' projections: gate, up and down, or up and down without a gate."""
        return PROJECTIONS if self.unit.gated else PROJECTIONS[1:]

    def projection_weight(self, proj: str, e: int) -> torch.Tensor:
        """Expert e's weight of projection proj ("gate", "up" [I, H] or "down" [H, I]): a view into the fused stacks
        (up's rows are the last I of gate_up, with or without a gate before them)."""
        if proj == "down":
            return self.down_proj[e]
        I = self.intermediate_size
        return self.gate_up_proj[e, :I] if proj == "gate" else self.gate_up_proj[e, -I:]

    @classmethod
    def from_per_expert(cls, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                        **kwargs) -> "KTExperts":
        """From per-expert 2-D weights as checkpoints store them: gate/up [I,H], down [H,I], packed once."""
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ValueError("from_per_expert needs the same non-zero number of gate, up and down weights.")
        gate_up = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)]).to(torch.bfloat16)
        return cls(gate_up, torch.stack(list(down)).to(torch.bfloat16), **kwargs)

    def add_lora(self, r: int, alpha: float, use_rslora: bool = False, projections: Sequence[str] | None = None,
                 dtype: torch.dtype = torch.float32, adapter: str = "default", init: bool | str = True,
                 dropout: float = 0.0) -> None:
        """LoRA on every expert's chosen projections (None: all it has): A [E,r,in], B [E,out,r]; `dropout` on A's
        inputs in training mode (each routed copy of a token gets its own mask, as PEFT's per-expert LoRA layers would).

        init=True: A Kaiming-uniform, B zeros (PEFT's default: training starts from the base model);
        init="gaussian": A normal(0, 1/r); init=False: B random too (for tests, as PEFT's init_lora_weights=False).
        """
        if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {r!r}.")
        r = int(r)
        if not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
            raise ValueError(f"LoRA alpha must be a finite number, got {alpha!r}.")
        if abs(lora_scale(r, alpha, use_rslora)) > torch.finfo(torch.float32).max:  # the engine's scale is float32
            raise ValueError(f"LoRA alpha {alpha!r} at rank {r} gives a scale beyond float32's range; use a smaller "
                             "alpha.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}.")
        projections = self.projections if projections is None else projections
        unknown = set(projections) - set(self.projections)
        if unknown:
            no_gate = " (these experts have no gate: up, relu², down)" if not self.unit.gated else ""
            raise ValueError(f"unknown expert projections {sorted(unknown)}{no_gate}; choose from "
                             f"{list(self.projections)}.")
        if init not in (True, False, "gaussian"):
            raise ValueError(f"init_lora_weights={init!r} is not supported on routed experts; use true, false or "
                             "'gaussian' (LLaMA-Factory: leave out pissa_init, or train PiSSA without the experts "
                             "among lora_target).")
        if adapter in self.lora_A:  # replacing it would drop its trained matrices
            raise ValueError(f"these experts already hold a LoRA adapter {adapter!r}; give the new one another name "
                             "(on a PEFT model, delete_adapter the old one first).")
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        dims = {"gate": (H, I), "up": (H, I), "down": (I, H)}
        A, B = StackedLora(), StackedLora()
        for p in projections:
            fan_in, fan_out = dims[p]
            a = torch.empty(E, r, fan_in, dtype=dtype)
            if init == "gaussian":
                a.normal_(0, 1 / r)
            else:  # kaiming_uniform_(a=sqrt(5)) on each [r, in] slice, as PEFT's default
                bound = 1.0 / math.sqrt(fan_in)
                a.uniform_(-bound, bound)
            b = torch.zeros(E, fan_out, r, dtype=dtype)
            if init is False:
                b.uniform_(-1.0 / math.sqrt(r), 1.0 / math.sqrt(r))
            A[p], B[p] = nn.Parameter(a), nn.Parameter(b)
        # The first adapter is the one applied, as PEFT's layers do (PEFT keeps a list of active adapters here).
        if isinstance(self._active_adapter, str) and self._active_adapter not in self.lora_A:
            self._active_adapter = adapter
        self.lora_A[adapter], self.lora_B[adapter] = A, B
        self.r[adapter], self.lora_alpha[adapter], self.use_rslora[adapter] = r, alpha, use_rslora
        self.lora_dropout[adapter] = nn.Dropout(float(dropout))
        self.scaling[adapter] = lora_scale(r, alpha, use_rslora)
        self._place_lora()  # drawn on the CPU above (the same values wherever it lives), then moved home
        _with_lora.add(self)
        check_optimizers_against(lambda: [p for experts in list(_with_lora) for p in experts._lora_matrices()])

    def lora_home(self) -> torch.device:
        """Where the expert LoRA lives: the model's GPU with KT_SFT_LORA_ON_GPU=1 (kt_sft/ops/gpu_lora.py), else
        the CPU. The model's device is the last one a `.to()` / `.cuda()` of it named."""
        on_gpu = self._model_device.type == "cuda" and lora_on_gpu_wanted()
        return self._model_device if on_gpu else torch.device("cpu")

    def _place_lora(self) -> None:
        home = self.lora_home()
        moving = [p for p in self._lora_matrices() if p.device != home and not p.is_meta]  # meta: PEFT loads it later
        if moving and home.type == "cuda":
            placed = sum(p.numel() for experts in _lora_on_gpu for p in experts._lora_matrices() if p.device == home)
            check_room(home, sum(p.numel() for p in moving), placed)
        if moving:
            self._gpu_lora.settle()
        with torch.no_grad():
            for p in moving:
                p.data = p.data.to(home)
                if p.grad is not None:
                    p.grad = p.grad.to(home)
        if home.type == "cuda":
            count_optimizer_steps()  # tells the engine's copies of the LoRA that a fused optimizer changed it
            _lora_on_gpu.setdefault(self, next(_placed))
        else:
            _lora_on_gpu.pop(self, None)
            if moving:
                self._gpu_lora.release()

    def _lora_matrices(self) -> list:
        """Every adapter's A and B matrices."""
        return [p for table in (self.lora_A, self.lora_B) for params in table.values() for p in params.values()]

    def check_mergeable(self, adapter: str | None = None) -> None:
        """Refuses merging into FP8/INT4 experts, which would requantize them, and merging an adapter whose LoRA holds
        NaN/Inf (a diverged training), which would put them into the weights."""
        if self.expert_format != "bf16":
            raise ValueError(f"merging LoRA into {self.expert_format.upper()} experts would requantize them; keep the "
                             "adapter separate (kt_sft serves it unmerged), write a merged checkpoint in the published "
                             "format with `kt-sft merge`, or prepare the model with --expert-format bf16 and merge "
                             "into its BF16 experts.")
        if adapter is not None and not all(torch.isfinite(t).all() for t in self.lora_params(adapter) if t is not None):
            raise ValueError(f"adapter {adapter!r} holds NaN or Inf in its LoRA on the routed experts (its training "
                             "diverged), which merging would put into the weights; nothing was merged: merge an "
                             "earlier checkpoint of it.")

    def merge_lora(self, adapter: str, sign: float = 1.0, check_finite: bool = False) -> None:
        """Adds (sign +1) or takes back (sign -1) the adapter's update scaling·B·A into the BF16 expert weights,
        one expert at a time in float32, each weight rounded once to BF16 (so taking it back restores the weights
        to within that rounding, as PEFT's unmerge of a BF16 layer does; into a float32 master, when the weights
        have one, without that rounding). check_finite: every expert's merged weights are checked before any is
        written, so a NaN/Inf in the adapter leaves the weights untouched."""
        self.check_mergeable()
        if adapter not in self.lora_A:
            raise ValueError(f"no LoRA adapter {adapter!r} on these experts (have: {sorted(self.lora_A)}).")
        A, B = self.lora_A[adapter], self.lora_B[adapter]
        scale = sign * self.scaling[adapter]

        def merged(p, e):
            w = self.projection_weight(p, e)
            b, a = (m[p][e].to(w.device, torch.float32) for m in (B, A))  # from the GPU, with KT_SFT_LORA_ON_GPU=1
            return w, torch.addmm(w.float(), b, a, alpha=scale).to(w.dtype)

        with torch.no_grad():
            for write in ((False, True) if check_finite else (True,)):
                for p in A:
                    for e in range(self.num_experts):
                        w, new = merged(p, e)
                        if write:
                            w.copy_(new)
                        elif not torch.isfinite(new).all():
                            raise ValueError(f"merging adapter {adapter!r} would put NaN/Inf into expert {e}'s {p} "
                                             "weights; the weights were left unmerged.")
        self.__dict__.pop("_kept", None)  # a kept first pass ran on the old weights

    def active_lora(self) -> str | None:
        """The adapter the engine applies on this call, or None for the base experts."""
        return self._active_adapter if self._active_adapter in self.lora_A else None

    def lora_params(self, adapter: str | None):
        """The adapter's A and B of each projection, in the engine's order (None where it has none)."""
        if adapter is None:
            return [None] * (2 * len(PROJECTIONS))
        # The ParameterDicts' own tables: module attribute lookups (~1 µs each) add up over every layer and token.
        a = self._modules["lora_A"][adapter]._parameters
        b = self._modules["lora_B"][adapter]._parameters
        return [t for p in PROJECTIONS for t in (a.get(p), b.get(p))]

    def prefetch_lora(self) -> None:
        """Queues the engine's copies of the LoRA on the GPU that an optimizer step changed."""
        self._gpu_lora.prefetch([p for p in self._lora_matrices() if p.device.type == "cuda"], _optimizer_steps[0])

    def engine_lora(self, lora_params) -> list:
        """lora_params as the engine reads them: float32 CPU tensors (None kept); those on a GPU through copies
        taken again after they change (kt_sft/ops/gpu_lora.py)."""
        on_gpu = [p for p in lora_params if p is not None and p.device.type == "cuda"]
        if on_gpu:
            # However it got there (a PEFT load may assign GPU tensors, switch or not), a fused optimizer's steps
            # must tell the copies that it changed.
            count_optimizer_steps()
        copies = iter(self._gpu_lora.engine_tensors(on_gpu, _optimizer_steps[0]) if on_gpu else ())
        return [None if p is None else next(copies) if p.device.type == "cuda" else to_engine(p, torch.float32)
                for p in lora_params]

    def lora_grad_into(self, param: nn.Parameter, call: object) -> tuple[torch.Tensor | None, bool]:
        """Where the engine may write a float32 CPU LoRA matrix's grad in place of autograd, and whether it adds
        into it: a buffer kept per matrix and reused every step (unless something else still holds it), to
        become param.grad, when the grad is None;
        the grad itself, added into, when an earlier micro-batch left one (gradient accumulation). Either way
        no fresh grad tensor faults in tens of MB of pages per layer (~25 ms at Layer Q on the GPU test
        machine) and autograd makes no extra pass to add it; without a storage use count (CPU-only torch
        before 2.8) a fresh buffer every step. (None, False) for other matrices or grads, and for a matrix with
        other strides than a contiguous one's (autograd then gets a returned grad). A float32 matrix on a GPU: a
        pinned buffer, which hand_lora_grad then copies up. call: the engine call whose backward hands the grad
        over (hand_lora_grad). Until then a
        second backward through this module (another thread's, or this module's other call in one graph when
        autograd interleaves them) writes into a new buffer of its own (pinned for a GPU matrix), which its
        hand-over adds in under the lock (returned to autograd, its accumulation would run outside the lock and,
        on a GPU, on another stream than the first hand-over's upload)."""
        if param.dtype != torch.float32 or param.device.type not in ("cpu", "cuda") or not param.is_contiguous():
            return None, False
        with _grads_lock:
            # Keyed by the matrix, weakly (as the buffers below): an id could come back for another matrix.
            in_flight = self.__dict__.setdefault("_lora_grads_in_flight", WeakIdKeyDictionary())
            holder = in_flight.get(param)
            if holder is not None and holder() is not None:
                return torch.empty(param.shape, dtype=torch.float32, pin_memory=param.device.type == "cuda"), False
            target, adds = self._lora_grad_target(param)
            if target is not None and not adds:  # grads added into param.grad serialize under the lock instead
                # Dropped at the hand-over, by drop_lora_grads when our backward nodes raise, or with the call's
                # graph (a node between them raised and the graph is let go).
                in_flight[param] = weakref.ref(call)
            return target, adds

    def _lora_grad_target(self, param: nn.Parameter) -> tuple[torch.Tensor | None, bool]:
        grad = param.grad
        fits = grad is None or (grad.dtype == torch.float32 and grad.device == param.device and not grad.requires_grad
                                and grad.layout == torch.strided and grad.shape == param.shape and grad.is_contiguous())
        if param.device.type == "cuda":
            return (self._gpu_lora.grad_buffer(param), False) if fits else (None, False)
        if grad is not None:
            return (grad, True) if fits else (None, False)
        # Keyed by the matrix, weakly: a deleted adapter's buffers go with it.
        buffers = self.__dict__.setdefault("_lora_grad_buffers", WeakIdKeyDictionary())
        buf = buffers.get(param)
        # Reused only when nothing but this dict holds it (the dict, `buf` and getrefcount's argument) or shares its
        # memory (a view, .detach(), .data): a grad that someone kept from an earlier step (gradient history, PCGrad)
        # stays theirs, as autograd's would.
        if buf is None or buf.shape != param.shape or sys.getrefcount(buf) > 3 or _memory_shared(buf):
            buf = buffers[param] = torch.empty_like(param)
        return buf, False

    def hand_lora_grad(self, param: nn.Parameter, grad: torch.Tensor, call: object) -> None:
        """Makes grad, written by the engine where lora_grad_into said for `call`, param's gradient (added into the
        grad that another backward gave it meanwhile, if any)."""
        with _grads_lock:
            in_flight = self.__dict__.get("_lora_grads_in_flight", {})
            holder = in_flight.get(param)
            if holder is not None and holder() in (call, None):
                del in_flight[param]
            if param.device.type == "cuda":
                self._gpu_lora.hand_grad(param, grad)
            elif param.grad is None or param.grad is grad:
                param.grad = grad  # the reused buffer, or the grad the engine added into
            else:
                param.grad.add_(grad)

    def drop_lora_grads(self, call: object) -> None:
        """Forgets the grads `call` had on their way (its backward raised): later backwards write into their
        buffers again rather than each into one of its own while the failed graph is kept (a stored exception)."""
        with _grads_lock:
            in_flight = self.__dict__.get("_lora_grads_in_flight", {})
            for param in [p for p, holder in in_flight.items() if holder() in (call, None)]:
                del in_flight[param]

    @staticmethod
    def grads_lock() -> threading.Lock:
        """Held while grads are handed over (hand_lora_grad), and while the engine adds into a LoRA param.grad (base
        weights' grads, in full mode, are added by engine calls in turn)."""
        return _grads_lock

    def take_kept(self, xc, idx, w, lora_params, lora) -> KeptForward | None:
        """This forward's first pass, kept without grad (kt_sft/ops/kept_forward.py), if it matches; either way
        nothing stays kept. lora_params, lora: as the forward takes them (compared only when a pass is kept)."""
        kept = self.__dict__.pop("_kept", None)
        if kept is None or not recomputing():
            return None
        if matches(kept, xc, idx, w, setting_of(self, lora_params, lora)):
            self.__dict__["_kept_misses"] = 0
            return kept
        misses = self.__dict__["_kept_misses"] = self.__dict__.get("_kept_misses", 0) + 1
        if misses == MISSES_BEFORE_OFF:
            warn(f"kt_sft: gradient checkpointing's recompute gave these routed experts other inputs than "
                 f"their first pass {misses} times in a row (a nondeterministic op before them?); they no "
                 "longer keep their first pass and run the CPU engine again in the recompute.")
        return None

    def base_grad(self, param: nn.Parameter) -> torch.Tensor:
        with _grads_lock:  # two threads' backwards add into one grad (on the engine, in turn), not each into its own
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            return param.grad

    def _check(self, hidden_states, top_k_index, top_k_weights):
        self.check_weights_in_place()
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
            if t.is_meta:
                raise ValueError(f"{name} is a meta tensor (shape only, no data); the CPU experts compute on real "
                                 "values: run the model after its weights are loaded, not under init_empty_weights "
                                 "or device='meta'.")
            if t.layout != torch.strided or t.is_nested:
                raise ValueError(f"{name} is a {t.layout} tensor; the CPU experts take dense (strided) tensors: "
                                 "convert it with .to_dense().")
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states has shape {tuple(hidden_states.shape)}; the experts need "
                             f"[T, {self.hidden_size}].")
        if not hidden_states.dtype.is_floating_point:
            raise ValueError(f"hidden_states is {hidden_states.dtype}; it must be a floating-point tensor.")
        T = hidden_states.shape[0]
        if top_k_index.dim() != 2 or top_k_index.shape[0] != T or top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
                             f"must both be [T={T}, K].")
        if max(T, top_k_index.numel()) >= 2**31:
            raise ValueError(f"this call routes {T} tokens to {top_k_index.shape[1]} experts each; the engine numbers "
                             "tokens and their routed copies with 32-bit integers (fewer than 2**31 of each): split "
                             "the tokens into chunks.")
        if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
            raise ValueError(f"top_k_index is {top_k_index.dtype}; it must hold integer expert ids.")
        if not top_k_weights.dtype.is_floating_point:
            raise ValueError(f"top_k_weights is {top_k_weights.dtype}; it must be a floating-point tensor.")
        if self.check_finite:
            for name, t in (("hidden_states", hidden_states), ("top_k_weights", top_k_weights)):
                if not torch.isfinite(t).all():
                    raise ValueError(f"{name} holds NaN or Inf values; check the layer before the experts "
                                     "(check_finite=True reported it).")

    def queue_beside(self, work) -> None:
        """work() (GPU work that does not need this module's result) runs once, while the engine computes this
        module's next forward; in training, the backward of what it builds runs while the engine computes this
        call's backward (ops/experts_function.py). models/overlap.py queues a block's shared experts this way;
        queue_beside(None) drops what was queued. Per thread: another thread's forward neither runs nor drops it."""
        self.__dict__.setdefault("_beside", threading.local()).work = work

    def take_beside(self):
        """What this thread queued beside this module's next forward (queue_beside), now taken; None if nothing."""
        queued = self.__dict__.get("_beside")
        work = getattr(queued, "work", None)
        if work is not None:
            queued.work = None
        return work

    # Outside any compiled graph (torch.compile, transformers' torch_compile), with all it calls (KTExpertsLinear's
    # forward, which overrides it, is disabled alike): the engine runs on the CPU anyway, and traced, this Python had
    # split the model into ~20 graphs, guarded on timer values and drawn dropout seeds from the compiler's RNG.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.run(hidden_states, top_k_index, top_k_weights, self.active_lora())

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            adapter: str | None) -> torch.Tensor:
        """The forward, applying adapter's LoRA (None: the base experts)."""
        if self.down_proj_bias is None:
            return self._run_routed(hidden_states, top_k_index, top_k_weights, adapter)
        # Σ_k w[t,k]·bd[e(t,k)] as one product of the routing weights scattered per expert [T, E] with the bias:
        # autograd gives the weights' and the bias's grads (the engine's dw covers the rest of each y). Before the
        # engine's call: non-reentrant checkpointing's recompute then stops at that call, having every tensor the
        # backward saved (after it, the recompute ran the engine's forward again for this product's).
        self._check(hidden_states, top_k_index, top_k_weights)  # a bad input gets its message, not scatter's
        E = self.num_experts
        routed = (top_k_index >= 0) & (top_k_index < E)
        dense = torch.zeros(top_k_index.shape[0], E, dtype=torch.float32, device=top_k_weights.device)
        dense = dense.scatter_add(1, top_k_index.clamp(0, E - 1).to(dense.device),
                                  top_k_weights.float() * routed.to(top_k_weights.device))
        shift = dense @ self.down_proj_bias.to(device=dense.device, dtype=torch.float32)
        out = self._run_routed(hidden_states, top_k_index, top_k_weights, adapter)
        return out + shift.to(device=out.device, dtype=out.dtype)

    def _run_routed(self, hidden_states, top_k_index, top_k_weights, adapter):
        if not self.identity_experts:
            return self._run(hidden_states, top_k_index, top_k_weights, adapter)
        # Pairs routed to a zero-computation expert go to no expert in the engine (id -1), and their weighted token
        # is added here, where autograd gives their weights' and the tokens' grads. Ids past these stay as they
        # are, for the engine to refuse.
        E = self.num_experts
        identity = (top_k_index >= E) & (top_k_index < E + self.identity_experts)
        try:  # the inputs' checks first: a bad input gets their message, not a broadcasting error below
            out = self._run(hidden_states, top_k_index.masked_fill(identity, -1), top_k_weights, adapter)
        except ValueError as e:
            if not str(e).startswith("top_k_index holds expert id"):
                raise
            raise ValueError(f"{e} Here ids {E} to {E + self.identity_experts - 1} are this layer's "
                             "zero-computation experts.") from None
        share = (top_k_weights * identity).sum(-1, keepdim=True)
        return out + share.to(hidden_states.dtype) * hidden_states

    def _run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             adapter: str | None) -> torch.Tensor:
        beside = self.take_beside()
        note_caller()
        self._check(hidden_states, top_k_index, top_k_weights)
        self._sync_weights()
        lora = self.lora_params(adapter)
        if hidden_states.is_cuda and not _lora_not_moved:
            first = next((p for p in lora if p is not None), None)
            if first is not None and first.device.type == "cpu" and lora_on_gpu_wanted():
                # the model reached the GPU without a .to() / .cuda() of it (a dispatch)
                _lora_not_moved.append(True)
                warn("kt_sft: KT_SFT_LORA_ON_GPU=1, but these experts' LoRA is in host RAM while their inputs "
                     "are on the GPU: the model did not get there by .to() / .cuda(), which moves it; call "
                     "model.to(device) once (the expert weights stay in host RAM).")
        r, scale = (self.r[adapter], self.scaling[adapter]) if adapter else (0, 0.0)
        # LoRA dropout in training mode, with a seed drawn from torch's RNG: gradient checkpointing restores the
        # RNG state for its recompute, so the recomputed forward drops the same entries as the first.
        p = self.lora_dropout[adapter].p if adapter and self.training else 0.0
        if not 0.0 <= p < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), but adapter {adapter!r}'s is {p!r}; set its "
                             "lora_dropout (the nn.Dropout's p) below 1.")
        dropout = (p, int(torch.randint(0, 2**31, ()).item())) if p > 0 else (0.0, 0)
        trains = torch.is_grad_enabled() and (
            hidden_states.requires_grad or top_k_weights.requires_grad
            or any(p.requires_grad for p in self.engine_weights())
            or any(p is not None and p.requires_grad for p in lora))
        if not trains:
            xc, idx, w, lora32 = engine_inputs(self, hidden_states, top_k_index, top_k_weights, lora)
            # Gradient checkpointing's first pass, most likely.
            keep = (keeps_forward(self.training) and self.__dict__.get("_kept_misses", 0) < MISSES_BEFORE_OFF
                    and room_to_keep(kept_bytes(*idx.shape, self.intermediate_size, r, xc, self.unit.stacked)))
            out, saved = run_forward(self.engine, xc, idx, w, r, scale, lora32, save=keep, device=hidden_states.device,
                                     dropout=dropout, beside=beside)
            if not no_recompute_follows():  # a reference pass or a generation leaves a training step's kept pass
                self.__dict__["_kept"] = None
            if keep:
                inputs = own(xc, hidden_states), own(idx, top_k_index), own(w, top_k_weights)
                self.__dict__["_kept"] = KeptForward(*inputs, setting_of(self, lora, (r, scale, dropout)), out, saved)
                if hidden_states.device.type == "cpu":  # to_caller would hand out the kept result itself
                    out = out.clone()
            return to_caller(out, hidden_states.device, hidden_states.dtype)
        return experts_call(self, hidden_states, top_k_index, top_k_weights, (r, scale, dropout), lora, beside)

    def __reduce_ex__(self, protocol):
        # pickle (torch.save of a whole model, multiprocessing) would fail on the engine with a bare TypeError.
        raise TypeError("kt_sft's CPU experts cannot be pickled (torch.save of the model object); save the weights "
                        "instead: the adapter with save_pretrained, or the model's state_dict.")

    def __deepcopy__(self, memo):
        # The engine (C++) holds these experts' weights and state; a copy would need a second engine over a second
        # copy of the weights. TRL's create_reference_model and PEFT's modules_to_save deep-copy modules.
        raise TypeError("kt_sft's CPU experts cannot be deep-copied; for a reference model (DPO, KTO) use the model "
                        "with its adapter disabled (TRL's default when ref_model is None with a PEFT model), or load "
                        "the model a second time; keep `experts` and the MoE blocks that hold them out of "
                        "modules_to_save (LLaMA-Factory's additional_target). LLaMA-Factory's PPO, whose TRL 0.9 "
                        "trainer deep-copies the data collator holding the model, is not supported.")

    def _apply(self, fn, recurse=True):
        # Expert weights (parameters or quantized buffers) live in CPU RAM for good: device and dtype moves skip
        # them. So do their LoRA's values, which only move to where lora_home says (never a dtype cast).
        try:
            with left_out_of_apply(self, ENGINE_READS, ("lora_A", "lora_B")):
                return super()._apply(fn, recurse)
        finally:
            try:
                self._model_device = fn(torch.empty(0, device=self._model_device)).device  # a dtype cast keeps it
            except (RuntimeError, TypeError):  # an fn for other tensors than this probe (pin_memory of a GPU one)
                pass
            self._place_lora()

    def extra_repr(self) -> str:
        lora = f", lora_r={self.r}" if self.r else ""
        identity = f", identity_experts={self.identity_experts}" if self.identity_experts else ""
        bias = ", bias=True" if self.gate_up_proj_bias is not None or self.down_proj_bias is not None else ""
        unit = f", unit={tuple(self.unit)}" if self.unit != SWIGLU else ""
        return (f"experts={self.num_experts}{identity}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, format={self.expert_format}{bias}{unit}{lora}")
