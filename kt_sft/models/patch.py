"""Swaps every routed-experts module of an instantiated transformers model for the CPU engine.

This is the in-memory path (tiny test models, or a model already loaded); loading a large checkpoint
streams expert shards straight into the engine instead of materializing them here.
"""
from __future__ import annotations

from torch import nn

from .overlap import overlap_shared_experts
from .registry import architecture_of


def use_cpu_experts(model: nn.Module, train_base: bool = True) -> int:
    """Replaces the model's experts modules in place with KTExpertsLinear (BF16, CPU), and has the GPU compute
    the shared experts of each such block while the engine runs (models/overlap.py); returns how many."""
    from ..peft.layer import KTExpertsLinear

    config = getattr(model, "config", None)
    arch = architecture_of(config)
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{config.model_type} uses hidden_act={act!r}; the CPU experts compute SwiGLU (silu) only.")
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in arch.experts_classes:
            continue
        parent_name, _, child = name.rpartition(".")
        experts = KTExpertsLinear(module.gate_up_proj.detach(), module.down_proj.detach(), train_base=train_base)
        setattr(model.get_submodule(parent_name), child, experts)
        replaced += 1
    if not replaced:
        raise ValueError(f"no {' / '.join(arch.experts_classes)} module found in this {config.model_type} model; "
                         "its transformers version may name the experts class differently.")
    overlap_shared_experts(model, arch.shared_experts)
    return replaced
