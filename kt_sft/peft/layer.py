"""KTExperts as a PEFT LoraLayer, so stock `get_peft_model` puts LoRA on every routed expert.

PEFT meets a target module that already is a `LoraLayer` by calling its `update_layer(adapter_name, r, ...)`
instead of wrapping it (peft 0.18.1 and 0.21 differ in the keyword arguments: all are accepted). The LoRA
tensors live in `lora_A.<adapter>.<proj>` / `lora_B.<adapter>.<proj>` (stacked [E,r,in] / [E,out,r]), which
PEFT trains, saves as `…experts.lora_A.<proj>` and loads back unchanged.

The class name contains "Linear" because LLaMA-Factory's `lora_target: all` selects modules by that.
"""
from __future__ import annotations

from peft.tuners.lora import LoraLayer
from torch import nn

from ..nn.experts import KTExperts


class KTExpertsLinear(KTExperts, LoraLayer):
    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("r", "lora_alpha", "scaling", "use_rslora")

    def __init__(self, gate_up_proj, down_proj=None, **kwargs):
        KTExperts.__init__(self, gate_up_proj, down_proj, **kwargs)
        # The BaseTunerLayer state PEFT reads; LoraLayer.__init__ is skipped because there is no base layer.
        self._disable_adapters = False
        self.merged_adapters = []
        self.lora_dropout = nn.ModuleDict()
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.use_dora, self.lora_bias, self.lora_variant, self._caches, self.kwargs = {}, {}, {}, {}, {}
        self.ephemeral_gpu_offload = False
        self.cast_input_dtype_enabled = True
        self.in_features = self.out_features = self.hidden_size

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout=0.0, init_lora_weights=True, use_rslora=False,
                     use_dora=False, lora_bias=False, inference_mode=False, **kwargs):
        if lora_dropout:
            raise ValueError(f"lora_dropout={lora_dropout} is not supported on the routed experts yet; set "
                             "lora_dropout: 0 (or target only non-expert modules with dropout).")
        if use_dora or lora_bias or kwargs.get("use_alora") or kwargs.get("use_qalora"):
            raise ValueError("DoRA, aLoRA, QALoRA and lora_bias are not supported on the routed experts; use plain LoRA.")
        self.add_lora(r, lora_alpha, use_rslora=use_rslora, adapter=adapter_name, init=init_lora_weights)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def active_lora(self) -> str | None:
        if self.disable_adapters:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) > 1:
            raise ValueError(f"adapters {active} are active at once on routed experts; activate one at a time.")
        return active[0] if active else None

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError("merging LoRA into the CPU experts is not built yet; keep the adapter separate.")

    def unmerge(self) -> None:
        raise NotImplementedError("merging LoRA into the CPU experts is not built yet; nothing to unmerge.")
