"""A warning for LoRA targets that name the routed experts' per-expert projections.

transformers 5 holds a MoE layer's routed experts in one `experts` module (fused weights), so the target names of
transformers-4-era recipes (gate_proj/up_proj/down_proj, Mixtral's w1/w2/w3) match no module there: PEFT puts
LoRA on the attention (and any dense or shared-expert MLPs) and trains the routed experts' on nothing, without a
word. At the first training forward of the experts, a model whose PEFT config names those projections but whose
experts hold no LoRA gets one warning saying to target `experts`.
"""
from __future__ import annotations

import warnings
import weakref

import torch

PER_EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}


def _named_targets(config) -> set:
    targets = getattr(config, "target_modules", None) or ()
    return {targets} if isinstance(targets, str) else set(targets)


class WarnMissedExpertTargets:
    """Forward pre-hooks on a model's experts modules, removed at the first training forward."""

    def __init__(self, model, experts):
        self.model = weakref.ref(model)
        self.handles = [m.register_forward_pre_hook(self) for m in experts]

    @torch.compiler.disable  # removes hooks: under torch.compile(fullgraph=True) that was an unclear error
    def __call__(self, module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        for h in self.handles:
            h.remove()
        model = self.model()
        configs = getattr(model, "peft_config", None) or {}
        named = set().union(*(_named_targets(c) for c in configs.values())) if configs else set()
        if named & PER_EXPERT_NAMES and "experts" not in named and not module.lora_A:
            warnings.warn(f"kt_sft: the LoRA targets {sorted(named & PER_EXPERT_NAMES)} name per-expert projections, "
                          "which transformers 5 fuses into one `experts` module per layer: the routed experts get no "
                          "LoRA and stay frozen. Add `experts` to lora_target (LLaMA-Factory) or target_modules "
                          "(PEFT) to train them.", RuntimeWarning, stacklevel=2)
