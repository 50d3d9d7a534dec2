"""Swaps every routed-experts module of an instantiated transformers model for the CPU engine.

This is the in-memory path (tiny test models, or a model already loaded); loading a large checkpoint
streams expert shards straight into the engine instead of materializing them here.
"""
from __future__ import annotations

import re
import types

import torch
from torch import nn

from .._ext import require_one_process, require_settings
from .overlap import overlap_dense_beside, overlap_shared_experts
from .recompute_ahead import recompute_ahead_of_the_engine
from .registry import MoEArchitecture, architecture_of


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def accept_per_expert_weights(model: nn.Module, arch: MoEArchitecture) -> None:
    """Lets load_state_dict fill the fused BF16 weights of the model's CPU experts from per-expert keys, the layout
    save_pretrained writes (`…experts.{e}.gate_proj.weight`, Mixtral's `…block_sparse_moe.experts.{e}.w1…`).
    The Trainer resumes a full fine-tune with load_state_dict(strict=False) of that file, or of each file in turn
    when the save was sharded (a layer's experts then span files), which otherwise skipped the experts with a
    warning and went on from their original weights (the stock fused model does the same). Each per-expert
    tensor a state dict holds is copied into its slice of the fused weight (in place, as the engine reads it),
    and the fused weights it filled are not reported missing. The hook sits on the model itself: a child's load
    sees only the keys under its own (renamed) path. Other keys the checkpoint names differently (Mixtral's
    router, `block_sparse_moe.gate`) take the module's names too."""
    from ..peft.layer import KTExpertsLinear

    filled: dict[str, int] = {}  # fused key -> the expert slices this load copied into it
    slices: dict[str, int] = {}  # fused key -> the expert slices it has
    strict_load = [False]

    def hook(state_dict, prefix, local_metadata, strict, *args):
        filled.clear()
        strict_load[0] = strict
        for key in [k for k in state_dict if k.startswith(prefix)]:
            renamed = prefix + arch.module_key(key[len(prefix):])
            # Per-expert keys are read below under the checkpoint's names; fused ones (Mistral Small 4's, saved under
            # LLaVA's names) take the module's here.
            if renamed != key and renamed not in state_dict and not _PER_EXPERT.search(key):
                state_dict[renamed] = state_dict.pop(key)
        for name, module in model.named_modules(prefix=prefix.removesuffix(".")):
            if not isinstance(module, KTExpertsLinear) or "gate_up_proj" not in module._parameters:
                continue
            fused_key = name + "." + module.stock_layout.fused_name  # Nemotron-H's up_proj
            if fused_key in state_dict:
                # Stock LongCat-Flash's fused gate_up_proj has rows for its zero-computation experts too, unread.
                gate_up, E = state_dict[fused_key], module.num_experts
                if module.identity_experts and gate_up.dim() == 3 and gate_up.shape[0] == E + module.identity_experts:
                    state_dict[fused_key] = gate_up[:E]
                continue
            bases = [stored + "." for stored in arch.stored_names(name)]
            first = arch.checkpoint_projections[arch.projections[0]]
            stored = next((b for b in bases if f"{b}0.{first}.weight" in state_dict), bases[0])
            keys = [f"{stored}{{}}.{arch.checkpoint_projections[p]}.weight" for p in arch.projections]
            E, I = module.gate_up_proj.shape[0], module.down_proj.shape[-1]
            slices.update({name + ".gate_up_proj": module.unit.stacked * E, name + ".down_proj": E})
            # gate's rows and up's (the last I of gate_up, with a gate or without), then down's.
            places = (("gate_up_proj", slice(0, I)), ("gate_up_proj", slice(-I, None)), ("down_proj", slice(None)))
            for e in range(E):
                for key, (fused, rows) in zip(keys, (places[p] for p in arch.projections)):
                    value = state_dict.pop(key.format(e), None)
                    if value is None:
                        continue
                    target = getattr(module, fused)[e, rows]
                    if value.shape != target.shape:
                        raise ValueError(f"{key.format(e)} has shape {tuple(value.shape)} but this model's expert "
                                         f"takes {tuple(target.shape)}; the checkpoint is of another model.")
                    with torch.no_grad():
                        target.copy_(value)
                    filled[f"{name}.{fused}"] = filled.get(f"{name}.{fused}", 0) + 1
            for e in range(E, E + module.identity_experts):  # what stock LongCat-Flash saves of its zero-computation
                for key in keys[:-1]:  # experts: rows no expert reads
                    state_dict.pop(key.format(e), None)

    def not_missing(module, incompatible):
        # A fused weight this load filled is not missing; under strict=True only when it filled every expert's
        # slices (a sharded save is loaded file by file with strict=False, each file holding some of them).
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                        if k not in filled or strict_load[0] and filled[k] < slices[k]]

    model._register_load_state_dict_pre_hook(hook)
    model.register_load_state_dict_post_hook(not_missing)


def install_around_the_engine(model: nn.Module, arch: MoEArchitecture) -> None:
    """Installs what runs around the model's CPU experts once they are in place: arch.block_forward (Llama 4's) on
    every MoE block whose experts the engine computes, and the GPU work that runs while the engine computes: each
    MoE block's shared experts (or LongCat-Flash's dense MLP beside its block; models/overlap.py) and, under gradient
    checkpointing, the recompute of the layer before a layer whose backward the engine computes
    (models/recompute_ahead.py)."""
    from ..nn.experts import KTExperts

    if arch.block_forward is not None:
        for block in model.modules():
            if isinstance(getattr(block, "experts", None), KTExperts):
                block.forward = types.MethodType(arch.block_forward, block)
    overlap_shared_experts(model, arch.shared_experts)
    overlap_dense_beside(model, arch.dense_beside)
    recompute_ahead_of_the_engine(model)


def use_cpu_experts(model: nn.Module, train_base: bool = True) -> int:
    """Replaces the model's experts modules in place with KTExpertsLinear (BF16, CPU) and installs the GPU work
    that overlaps the engine (install_around_the_engine); returns how many experts modules."""
    from ..peft.layer import KTExpertsLinear
    from ..peft.targets import WarnMissedExpertTargets

    require_one_process()
    require_settings()
    config = getattr(model, "config", None)
    arch = architecture_of(config)
    arch.experts_in_place(model)
    replaced = []
    for name, module in list(model.named_modules()):
        if not arch.holds_experts(module):
            continue
        parent_name, _, child = name.rpartition(".")
        # LongCat-Flash's class allots gate/up rows to its zero-computation experts too, which never read them.
        layout = arch.stock_layout()
        gate_up, down = layout.engine_weights(getattr(module, layout.fused_name).detach()[:arch.expert_dims(module)[0]],
                                              module.down_proj.detach())
        biases = {}
        if arch.expert_biases:
            biases = dict(gate_up_proj_bias=layout.engine_bias(module.gate_up_proj_bias.detach()),
                          down_proj_bias=module.down_proj_bias.detach())
        experts = KTExpertsLinear(gate_up, down, train_base=train_base, identity_experts=arch.identity_count(config),
                                  stock_layout=layout, unit=arch.unit, **biases)
        setattr(model.get_submodule(parent_name), child, experts)
        replaced.append(experts)
    if not replaced:
        raise arch.no_experts_error(model)
    install_around_the_engine(model, arch)
    accept_per_expert_weights(model, arch)
    WarnMissedExpertTargets(model, replaced)
    return len(replaced)
