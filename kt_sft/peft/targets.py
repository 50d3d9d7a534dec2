"""A warning for LoRA targets that name the routed experts' per-expert projections.

transformers 5 holds a MoE layer's routed experts in one `experts` module (fused weights), so the target names of
transformers-4-era recipes (gate_proj/up_proj/down_proj, Mixtral's w1/w2/w3; Granite's input_linear/output_linear,
its stock experts' names) match no module there: PEFT puts
LoRA on the attention (and any dense or shared-expert MLPs) and trains the routed experts' on nothing, without a
word; an adapter saved with those names (`kt-sft export`'s per-expert layout, a transformers-4-era adapter) loads
likewise, its expert LoRA dropped. At the first forward of the experts under PEFT (or the first training forward),
a model whose PEFT config names those projections but whose experts hold no LoRA gets one warning saying so.
"""
from __future__ import annotations

import weakref

import torch

from .._ext import warn

# Granite's input_linear / output_linear: its stock experts' parameters (for the shared MLP's, of granitemoeshared and
# granitemoehybrid, the names also reach that MLP's linear layers).
PER_EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "input_linear", "output_linear"}


def _named_targets(config) -> set:
    targets = getattr(config, "target_modules", None) or ()
    return {targets} if isinstance(targets, str) else set(targets)


class WarnMissedExpertTargets:
    """Forward pre-hooks on a model's experts modules, removed at the first forward that can tell: one under a PEFT
    config, or a training one (a plain model's inference forward before PEFT wraps it cannot)."""

    def __init__(self, model, experts):
        self.model = weakref.ref(model)
        self.handles = [m.register_forward_pre_hook(self) for m in experts]

    @torch.compiler.disable  # removes hooks: under torch.compile(fullgraph=True) that was an unclear error
    def __call__(self, module, args):
        configs = getattr(self.model(), "peft_config", None) or {}
        if not configs and not (module.training and torch.is_grad_enabled()):
            return
        for h in self.handles:
            h.remove()
        named = set().union(*(_named_targets(c) for c in configs.values())) if configs else set()
        if named & PER_EXPERT_NAMES and "experts" not in named and not module.lora_A:
            warn(f"kt_sft: the LoRA targets {sorted(named & PER_EXPERT_NAMES)} name the routed experts' "
                 "projections, which kt_sft holds in one `experts` module per layer: the routed experts get no "
                 "LoRA (in training they stay frozen; an adapter saved per expert, such as `kt-sft export`'s "
                 "output, loads without its expert LoRA). Add `experts` to lora_target (LLaMA-Factory) or "
                 "target_modules (PEFT) to train them, and serve the stacked adapter that training saved.", stacklevel=2)
