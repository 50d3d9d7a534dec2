"""Builds a transformers MoE model whose routed experts live in the CPU engine, streaming the checkpoint.

Non-expert weights are read from the shards into the stock model (built with parameters on the meta device,
so nothing is allocated twice). Routed experts go one layer at a time from the per-expert tensors straight
into the engine's fused BF16 layout: the full expert set never exists as a second copy, and no expert weight
is ever given to the GPU.
"""
from __future__ import annotations

import re

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from ..models import architecture_of
from ..peft.layer import KTExpertsLinear
from .checkpoint import Checkpoint

_LAYER = re.compile(r"layers\.(\d+)\.")


def experts_modules(model, arch):
    """(module path, layer index) of every experts module of the arch in the model."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ in arch.experts_classes:
            m = _LAYER.search(name + ".")
            if not m:
                raise ValueError(f"cannot tell the layer of experts module {name}.")
            out.append((name, int(m.group(1)), module))
    return out


def check_checkpoint(ckpt: Checkpoint, config) -> None:
    """Every expert tensor is present with the shape config.json implies, before any weight is read."""
    arch = architecture_of(config)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    for _, layer, module in experts_modules(skeleton, arch):
        E, two_i, H = module.gate_up_proj.shape
        want = ((two_i // 2, H), (two_i // 2, H), (H, two_i // 2))
        for e in range(E):
            for p in range(3):
                key = arch.expert_key(layer, e, p)
                if key not in ckpt.shard_of:
                    raise ValueError(f"the checkpoint has no {key}, which config.json's {config.model_type} layout "
                                     "implies; check that config.json belongs to these weights.")
                if ckpt.shape(key) != want[p]:
                    raise ValueError(f"{key} has shape {list(ckpt.shape(key))} but config.json implies "
                                     f"{list(want[p])}; check that config.json belongs to these weights.")


def load_hybrid_model(source: str, config, dtype: torch.dtype = torch.bfloat16, train_base: bool = True):
    arch = architecture_of(config)
    ckpt = Checkpoint(source)
    check_checkpoint(ckpt, config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = experts_modules(model, arch)
    expert_prefixes = tuple(arch.checkpoint_experts.split("{expert}")[0].format(layer=layer) for _, layer, _ in experts)

    # Each tensor takes the dtype its parameter or buffer has in the model (routing biases stay float32).
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state = {}
    for key in ckpt.keys():
        if key.startswith(expert_prefixes):
            continue
        name = arch.module_key(key)
        t = ckpt.get(key)
        state[name] = t.to(targets[name].dtype) if name in targets else t
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"checkpoint keys {result.unexpected_keys[:3]} match no parameter of the "
                         f"{config.model_type} model; the checkpoint and config.json disagree.")

    for name, layer, module in experts:
        E, two_i, H = module.gate_up_proj.shape
        inter = two_i // 2
        gate_up = torch.empty(E, two_i, H, dtype=torch.bfloat16)
        down = torch.empty(E, H, inter, dtype=torch.bfloat16)
        for e in range(E):
            ckpt.read_into(arch.expert_key(layer, e, 0), gate_up[e, :inter])
            ckpt.read_into(arch.expert_key(layer, e, 1), gate_up[e, inter:])
            ckpt.read_into(arch.expert_key(layer, e, 2), down[e])
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, KTExpertsLinear(gate_up, down, train_base=train_base))

    if config.tie_word_embeddings:
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"the checkpoint lacks {still_meta[:3]}{' and more' if len(still_meta) > 3 else ''}; "
                         "it does not hold a complete model.")
    return model.eval()
