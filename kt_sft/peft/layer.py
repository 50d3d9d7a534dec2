"""KTExperts as a PEFT LoraLayer, so stock `get_peft_model` puts LoRA on every routed expert.

PEFT meets a target module that already is a `LoraLayer` by calling its `update_layer(adapter_name, r, ...)`
instead of wrapping it (peft 0.18.1 passes the settings as keywords, 0.21 the LoraConfig: both are read).

With peft >= 0.19, `get_peft_model` on a model that already holds a tuner layer (as ours is) keeps every
existing parameter as trainable as it was, instead of freezing the base model: call `model.requires_grad_(False)`
first. The experts refuse to train LoRA on top of trainable base weights rather than train them silently. The LoRA
tensors live in `lora_A.<adapter>.<proj>` / `lora_B.<adapter>.<proj>` (stacked [E,r,in] / [E,out,r]), which
PEFT trains, saves as `…experts.lora_A.<proj>` and loads back unchanged.

The first adapter moves the expert weights into a `base_layer` child, where PEFT keeps the weights of every layer it
wraps: peft 0.21 counts everything else on a tuner layer as adapter tensors, so it would save the whole expert
stack in the adapter file and load it back over the model's weights. Until then they stay where the stock experts
module has them (`…experts.gate_up_proj`), which full fine-tuning saves in the checkpoint's own layout.

PEFT merges module by module (merge_adapter, merge_and_unload), so a refusal raised by the experts themselves
would come after the modules before them had merged (and, in merge_and_unload, been unloaded): LoraModel's
merge_adapter and merge_and_unload (its _unload_and_optionally_merge, and PeftMixedModel's) refuse merging into
FP8/INT4 experts first. Likewise, what the experts cannot serve is refused before PEFT changes a layer or registers
a hook: deleting a merged adapter, combining adapters on the experts (add_weighted_adapter), a mixed batch
(adapter_names=...) whose rows give the experts different adapters.
PEFT's other tuners (OFT, LoHa, IA3, VeRA, ...) refuse the experts as targets in one sentence (PEFT's own refusal
is a traceback).

The class name contains "Linear" because LLaMA-Factory's `lora_target: all` selects modules by that.
"""
from __future__ import annotations

import functools
import inspect

import peft
import peft.peft_model
import peft.utils.save_and_load
import torch
from peft.tuners.lora import LoraLayer, LoraModel
from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.mixed import MixedModel
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge, check_target_module_exists
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..nn.experts import ENGINE_READS, KTExperts, LoadsInPlace, engine_tensor, left_out_of_apply
from ..nn.stock_layout import adapter_state_only

# KTExperts' expert weights: BF16 parameters, or FP8/INT4 buffers with their scales.
WEIGHT_NAMES = ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale", "gate_up_proj_bias", "down_proj_bias")


class ExpertWeights(LoadsInPlace, nn.Module):
    """The expert weights (parameters, or quantized buffers) of experts that hold a PEFT adapter."""

    @property
    def weight(self) -> torch.Tensor:
        # PEFT reads a base layer's `weight` for its device when it unloads the adapters.
        return self.gate_up_proj

    def _apply(self, fn, recurse=True):
        # What the engine reads stays in CPU RAM for good (KTExperts._apply); a down bias follows the model's moves.
        with left_out_of_apply(self, ENGINE_READS):
            return super()._apply(fn, recurse)


def _refuse_fused_targets(target_parameters) -> None:
    """Refuses target_parameters that name the experts' fused weights, before peft's own attempt to wrap them fails
    with a message that does not say why: peft >= 0.19 turns the per-expert target names of transformers-5 MoE
    models into these, from a config or from an adapter saved per expert."""
    fused = sorted(t for t in target_parameters or () if t.rpartition(".")[2] in WEIGHT_NAMES)
    if fused:
        raise ValueError(f"target_parameters {fused} name the routed experts' fused weights, which take LoRA only as "
                         "the target module 'experts' (peft >= 0.19 writes them there from the targets gate_proj/"
                         "up_proj/down_proj, w1/w2/w3 or 'all-linear' of an MoE model, and from an adapter saved per "
                         "expert such as kt-sft export's output, which is for other runtimes): target the attention "
                         "projections and 'experts' (or load the stacked adapter that training saved), or use peft "
                         "0.18.1 (LLaMA-Factory 0.9.5's pin) to train the dense and shared-expert MLPs by those names.")


class KTExpertsLinear(KTExperts, LoraLayer):
    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("r", "lora_alpha", "scaling", "use_rslora", "lora_dropout")

    def __init__(self, gate_up_proj, down_proj=None, **kwargs):
        KTExperts.__init__(self, gate_up_proj, down_proj, **kwargs)
        # The BaseTunerLayer state PEFT reads; LoraLayer.__init__ is skipped because there is no base layer.
        self._disable_adapters = False
        self.merged_adapters = []
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.use_dora, self.lora_bias, self.lora_variant, self._caches, self.kwargs = {}, {}, {}, {}, {}
        self.ephemeral_gpu_offload = False
        self.cast_input_dtype_enabled = True
        self.in_features = self.out_features = self.hidden_size

    def __getattr__(self, name):
        # KTExperts reads its weights as its own attributes, also once they have moved into base_layer.
        base = self.__dict__.get("_modules", {}).get("base_layer")
        if base is not None and name in WEIGHT_NAMES:
            return getattr(base, name)
        return super().__getattr__(name)

    @property
    def weight(self) -> torch.Tensor:
        # PEFT reads a tuner layer's `weight` (its device, when it replaces the layer in unload); BaseTunerLayer's
        # looks it up on the base layer, which before the first adapter is this layer itself: endless recursion.
        return self.gate_up_proj

    @property
    def bias(self) -> None:
        # The same recursion for `bias`, which PEFT probes on every LoRA layer under bias="lora_only" (experts
        # without an adapter, e.g. left out by layers_to_transform, had raised RecursionError there).
        return None

    def update_layer(self, adapter_name, r, lora_alpha, config=None, **kwargs):
        # peft 0.18 passes the settings as keywords; newer peft (checked: 0.21) passes the LoraConfig as `config`.
        def setting(name, default):
            return getattr(config, name, default) if config is not None else kwargs.get(name, default)

        if setting("use_dora", False) or setting("lora_bias", False) or setting("use_alora", False) or \
                setting("use_qalora", False):
            raise ValueError("DoRA, aLoRA, QALoRA and lora_bias are not supported on the routed experts; use plain LoRA.")
        _refuse_fused_targets(setting("target_parameters", None))
        if "base_layer" not in self._modules:
            # The first adapter: the weights move to where PEFT keeps a wrapped layer's (module docstring), straight
            # into the tables: register_parameter would make meta copies under low_cpu_mem_usage's empty init.
            base = ExpertWeights()
            for name in WEIGHT_NAMES:
                if name in self._parameters:
                    base._parameters[name] = self._parameters.pop(name)
                elif name in self._buffers:  # quantized weights: never in state_dict (KTExperts)
                    base._buffers[name] = self._buffers.pop(name)
                    base._non_persistent_buffers_set.add(name)
                    self._non_persistent_buffers_set.discard(name)
            self.base_layer = base
        if adapter_name in self.lora_A:
            # PEFT replaces an adapter of the same name layer by layer, as its own layers overwrite theirs: so here,
            # its update taken out of the weights first if merged (add_lora itself refuses a name it holds).
            self._unmerge_adapter(adapter_name)
            for table in (getattr(self, attr) for attr in self.adapter_layer_names + self.other_param_names):
                if adapter_name in table:
                    del table[adapter_name]
        self.add_lora(r, lora_alpha, use_rslora=setting("use_rslora", False), adapter=adapter_name,
                      init=setting("init_lora_weights", True), dropout=setting("lora_dropout", 0.0))
        self.set_adapter(self.active_adapters, inference_mode=setting("inference_mode", False))

    @torch.compiler.disable  # as KTExperts.forward
    def forward(self, hidden_states, top_k_index, top_k_weights, **peft_kwargs):
        # PEFT's forward hooks add adapter_names for a batch whose rows name adapters of their own (mixed-batch
        # inference): served where every row names the same adapter of these experts, or none of theirs.
        adapter_names = peft_kwargs.pop("adapter_names", None)
        if "alora_offsets" in peft_kwargs:
            raise ValueError("aLoRA (alora_invocation_tokens) is not supported on the routed experts; use plain LoRA, "
                             "or leave 'experts' out of target_modules.")
        if peft_kwargs:
            raise TypeError(f"unexpected arguments {sorted(peft_kwargs)} to the routed experts.")
        adapter = self.active_lora() if adapter_names is None or self.disable_adapters else \
            self.batch_adapter(adapter_names)
        base = [p for p in (self.gate_up_proj, self.down_proj) if isinstance(p, nn.Parameter) and p.requires_grad]
        if base and torch.is_grad_enabled() and adapter is not None:
            raise ValueError("the routed experts' base weights are trainable under a LoRA adapter, so a LoRA step would "
                             "also train the whole expert stack; peft >= 0.19 leaves base weights as trainable as they "
                             "were before get_peft_model: call model.requires_grad_(False) before get_peft_model (peft "
                             "0.18.1, which LLaMA-Factory 0.9.5 pins, freezes them itself).")
        return self.run(hidden_states, top_k_index, top_k_weights, adapter)

    def batch_adapter(self, adapter_names) -> str | None:
        """The adapter of these experts that a mixed batch's rows name ("__base__", or an adapter on other modules
        only, names none of theirs): the engine applies one adapter per call, so the rows must agree."""
        if self.merged:  # its LoRA would be applied on top of its update (PEFT's layers refuse it alike)
            raise ValueError("Cannot pass `adapter_names` when there are merged adapters, please call "
                             "`unmerge_adapter` first.")
        on_experts = {name if name in self.lora_A else None for name in adapter_names}
        if len(on_experts) > 1:
            named = ", ".join(sorted(name or "none" for name in on_experts))
            raise ValueError(f"this batch's rows (adapter_names=...) give the routed experts different adapters "
                             f"({named}), but the experts apply one adapter per call; run each adapter's rows as a "
                             "batch of their own.")
        return on_experts.pop() if on_experts else None

    def active_lora(self) -> str | None:
        # As PEFT's own layers: merged adapters act through the weights; disabling adapters unmerges them first.
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return None
        if self.merged:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) > 1:
            raise ValueError(f"adapters {active} are active at once on routed experts; activate one at a time.")
        return active[0] if active else None

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """PEFT's merge: the adapters' updates added into the BF16 expert weights (KTExperts.merge_lora). Adapters
        these experts do not hold (one on the attention only) are skipped, as PEFT's own layers skip them."""
        for name in check_adapters_to_merge(self, adapter_names):
            if name in self.lora_A:
                self.merge_lora(name, check_finite=safe_merge)
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        while self.merged_adapters:
            self.merge_lora(self.merged_adapters.pop(), sign=-1.0)

    def delete_adapter(self, adapter_name: str) -> None:
        # A merged adapter's update is in the weights: taken back out before its LoRA goes, where this layer is called
        # on its own (LoraModel's delete_adapter refuses merged adapters), else its name in merged_adapters broke
        # every later unmerge here.
        self._unmerge_adapter(adapter_name)
        super().delete_adapter(adapter_name)

    def _unmerge_adapter(self, adapter_name: str) -> None:
        if adapter_name in self.merged_adapters:
            self.merge_lora(adapter_name, sign=-1.0)
            self.merged_adapters.remove(adapter_name)

    def _move_adapter_to_device_of_base_layer(self, adapter_name, device=None) -> None:
        # PEFT's (run after a low_cpu_mem_usage load) casts the adapter to the dtype of the base layer's weight, BF16
        # or FP8 here; the expert LoRA stays float32 where add_lora puts it (KTExperts.lora_home).
        pass

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names) -> KTExpertsLinear:
        """PEFT's merge_and_unload / unload for these experts: experts without adapters over the same weights (no
        copy), the adapters merged into them first when asked. Of this class, as the model's experts were before
        any adapter, so that PEFT can put another adapter on them (LLaMA-Factory merges all but the last of several
        adapters, then loads the last)."""
        if merge:
            self.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        # The biases as they are (the gate/up bias float32, so no master): the new experts hold the same tensors.
        same = dict(check_finite=self.check_finite, identity_experts=self.identity_experts,
                    stock_layout=self.stock_layout, gate_up_proj_bias=self.gate_up_proj_bias,
                    down_proj_bias=self.down_proj_bias, unit=self.unit)
        if self.expert_format == "bf16":
            gate_up, down = self.gate_up_proj, self.down_proj
            experts = KTExpertsLinear(engine_tensor(gate_up), engine_tensor(down), train_base=gate_up.requires_grad,
                                      **same)
            for new, old in ((experts.gate_up_proj, gate_up), (experts.down_proj, down)):
                if old.dtype == torch.float32:  # a float32 master: the same one, over the same BF16 weights
                    new.data = old.data
        else:
            experts = KTExpertsLinear(self.quantized_weights(), **same)
        # Where the model computes: a new adapter's LoRA goes there (KT_SFT_LORA_ON_GPU) without another .to().
        experts._model_device = self._model_device
        guard = self.__dict__.get("base_guard")  # the loader's refusal of training base weights beside these experts
        if guard is not None:
            guard.watch(experts)
        return experts


def _refusing_merges_the_experts_cannot_take(method, merges):
    """LoraModel's `method`, first refusing (before any module merges) what KTExperts.check_mergeable refuses: FP8/INT4
    experts, or a non-finite LoRA, of an adapter the call merges (those named, else the active ones, as each layer's
    merge picks them)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        if merges(call.arguments):
            names = call.arguments.get("adapter_names")
            for module in self.model.modules():
                if isinstance(module, KTExpertsLinear):
                    for adapter in module.active_adapters if names is None else names:
                        if adapter in module.lora_A:
                            module.check_mergeable(adapter)
        return method(self, *args, **kwargs)
    return checked


LoraModel.merge_adapter = _refusing_merges_the_experts_cannot_take(LoraModel.merge_adapter, lambda args: True)
LoraModel._unload_and_optionally_merge = _refusing_merges_the_experts_cannot_take(
    LoraModel._unload_and_optionally_merge, lambda args: args.get("merge", True))


def _unloading_the_experts_first(unload):
    """MixedModel's `_unload_and_optionally_merge` (PeftMixedModel's merge_and_unload and unload), which puts each
    tuner layer's base layer in its place: the experts' is the holder of their weights, which does not run. The
    experts are unloaded first, as LoraModel's own unloading does it (unload_and_optionally_merge_module)."""
    signature = inspect.signature(unload)

    @functools.wraps(unload)
    def unloading(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        merge, safe_merge, names = (call.arguments[k] for k in ("merge", "safe_merge", "adapter_names"))
        for name, module in list(self.model.named_modules()):
            if isinstance(module, KTExpertsLinear) and "base_layer" in module._modules:
                parent, _, child = name.rpartition(".")
                self.model.get_submodule(parent).register_module(
                    child, module.unload_and_optionally_merge_module(merge, safe_merge, names))
        return unload(self, *args, **kwargs)
    return unloading


MixedModel._unload_and_optionally_merge = _refusing_merges_the_experts_cannot_take(
    _unloading_the_experts_first(MixedModel._unload_and_optionally_merge), lambda args: args.get("merge", True))


def _holds_experts(model) -> bool:
    return any(isinstance(m, KTExpertsLinear) for m in model.modules())


def _refusing_deletes_of_merged_adapters(delete_adapter):
    """LoraModel's `delete_adapter`, refusing an adapter merged into the weights before any layer changes, where the
    model holds CPU experts (as peft >= 0.21 does for every model): peft 0.18.1 deletes its LoRA and leaves its update
    in the other layers' weights, while the experts take theirs out (KTExpertsLinear.delete_adapter)."""
    @functools.wraps(delete_adapter)
    def checked(self, adapter_name, *args, **kwargs):
        if _holds_experts(self.model) and \
                any(adapter_name in getattr(m, "merged_adapters", ()) for m in self.model.modules()):
            raise ValueError(f"adapter {adapter_name!r} is merged into the weights, and deleting it would leave its "
                             "update in some layers and not in others; call unmerge_adapter() before delete_adapter.")
        return delete_adapter(self, adapter_name, *args, **kwargs)
    return checked


def _checking_mixed_batches(enable_hooks):
    """LoraModel's `_enable_peft_forward_hooks`, asking each expert layer first for the adapter of a mixed batch
    (adapter_names=...; KTExpertsLinear.batch_adapter): PEFT removes its hooks only when the forward returns, so a
    refusal inside the forward would leave them on the model and refuse every later call."""
    @functools.wraps(enable_hooks)
    def checked(self, *args, **kwargs):
        names = kwargs.get("adapter_names")
        # PEFT's own refusals first (training mode, unknown names), which it makes before registering hooks
        if names is not None and not self.training and set(names) <= {*self.peft_config, "__base__"}:
            for module in self.model.modules():
                if isinstance(module, KTExpertsLinear) and not module.disable_adapters:
                    module.batch_adapter(names)
        return enable_hooks(self, *args, **kwargs)
    return checked


def _refusing_weighted_experts(add_weighted_adapter):
    """LoraModel's `add_weighted_adapter`, refusing adapters with LoRA on the experts before PEFT makes the new
    adapter: PEFT's combination reads each layer's LoRA as one Linear's, which the experts' stacked LoRA refuses only
    after the new adapter is in place, half made (and a retry would find its name taken and return)."""
    @functools.wraps(add_weighted_adapter)
    def checked(self, adapters, *args, **kwargs):
        if any(isinstance(m, KTExpertsLinear) and any(a in m.lora_A for a in adapters) for m in self.model.modules()):
            raise ValueError("add_weighted_adapter cannot combine adapters with LoRA on the routed experts (stacked per "
                             "expert, not one Linear's); combine adapters without 'experts' among their target_modules.")
        return add_weighted_adapter(self, adapters, *args, **kwargs)
    return checked


LoraModel.delete_adapter = _refusing_deletes_of_merged_adapters(LoraModel.delete_adapter)
LoraModel._enable_peft_forward_hooks = _checking_mixed_batches(LoraModel._enable_peft_forward_hooks)
LoraModel.add_weighted_adapter = _refusing_weighted_experts(LoraModel.add_weighted_adapter)


def _refusing_the_experts(create_and_replace, method: str):
    """A PEFT tuner's `_create_and_replace` that names the routed experts, which only LoRA adapts, where PEFT's own
    refusal is a traceback about an unsupported module (LLaMA-Factory's `lora_target: all`, which selects the
    experts by their class name, is OFT's default targets too)."""
    @functools.wraps(create_and_replace)
    def checked(self, config, adapter_name, target, *args, **kwargs):
        if isinstance(target, KTExpertsLinear):
            raise ValueError(f"{method} cannot adapt the routed experts (KTExpertsLinear, selected by lora_target: all "
                             "or 'experts'); name the other modules instead (e.g. lora_target: q_proj,k_proj,v_proj,"
                             "o_proj), or train the experts with LoRA.")
        return create_and_replace(self, config, adapter_name, target, *args, **kwargs)
    return checked


def _refusing_fused_targets(inject_parameters):
    """LoraModel's `_inject_parameters` (peft >= 0.19) that names target_parameters on the experts' fused weights in
    one sentence where the model holds CPU experts: with no 'experts' among the target modules, the experts'
    update_layer, which refuses them too, is never reached."""
    @functools.wraps(inject_parameters)
    def checked(self, peft_config, model, *args, **kwargs):
        if _holds_experts(model):
            _refuse_fused_targets(getattr(peft_config, "target_parameters", None))
        return inject_parameters(self, peft_config, model, *args, **kwargs)
    return checked


if hasattr(LoraModel, "_inject_parameters"):
    LoraModel._inject_parameters = _refusing_fused_targets(LoraModel._inject_parameters)

# The module types LoRA adapts itself (PEFT's list), which are never passed over below.
_LORA_MODULES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D,
                 BaseTunerLayer)


def _linear_layers(module: nn.Module, path: str):
    """The paths of module's linear layers, a LoRA layer's (on a linear layer) counted as one."""
    for name, child in module.named_children():
        if isinstance(child, (nn.Linear, BaseTunerLayer)):
            yield f"{path}.{name}"
        else:
            yield from _linear_layers(child, f"{path}.{name}")


def _passing_over_covered_blocks(create_and_replace):
    """LoraModel's `_create_and_replace`, passing over a module of a model with CPU experts that LoRA has no form for,
    holds no weight of its own and sits on a path through a module named *experts, where its linear layers (if it
    has any) are all targets of their own (they get their LoRA then): LLaMA-Factory names an image-text model's
    targets by module path, every module whose path contains a target name (patch_target_modules), so with the CPU
    experts' `experts` among the names, GLM-4.5V's `shared_experts` MLP and its activation were named too, and PEFT
    refused them as unsupported modules. A block with a linear layer left out still gets PEFT's refusal, and so does
    every module of a model without CPU experts."""
    @functools.wraps(create_and_replace)
    def checked(self, config, adapter_name, target, target_name, parent, current_key, *args, **kwargs):
        custom = tuple(getattr(config, "_custom_modules", None) or ())
        if "experts" in current_key and not isinstance(target, (*_LORA_MODULES, *custom)) \
                and not list(target.parameters(recurse=False)) and not list(target.buffers(recurse=False)) \
                and all(check_target_module_exists(config, k) for k in _linear_layers(target, current_key)) \
                and _holds_experts(self.model):
            return None
        return create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, *args,
                                  **kwargs)
    return checked


LoraModel._create_and_replace = _passing_over_covered_blocks(LoraModel._create_and_replace)


# Every tuner but LoRA (and X-LoRA, which holds LoRA adapters); each had refused the experts with a traceback, or
# recursed.
for _peft_type, _tuner in PEFT_TYPE_TO_TUNER_MAPPING.items():
    if _tuner is not LoraModel and _peft_type.value != "XLORA" and "_create_and_replace" in vars(_tuner):
        _tuner._create_and_replace = _refusing_the_experts(_tuner._create_and_replace, _peft_type.value)


def _reading_adapter_state(get_state_dict):
    """PEFT's get_peft_model_state_dict, which reads the whole model's state_dict() and keeps the adapter's keys:
    meanwhile the experts leave their weights in the engine's layout (nn/stock_layout.py), where GPT-OSS's stock one
    would copy every layer's gate_up_proj at each checkpoint save."""
    @functools.wraps(get_state_dict)
    def reading(*args, **kwargs):
        with adapter_state_only():
            return get_state_dict(*args, **kwargs)
    return reading


_stock_adapter_state = peft.utils.save_and_load.get_peft_model_state_dict
_adapter_state = _reading_adapter_state(_stock_adapter_state)
for _module in (peft, peft.utils, peft.utils.save_and_load, peft.peft_model, getattr(peft, "functional", None)):
    if getattr(_module, "get_peft_model_state_dict", None) is _stock_adapter_state:  # each name it is imported under
        _module.get_peft_model_state_dict = _adapter_state
