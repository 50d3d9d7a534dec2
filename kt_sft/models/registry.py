"""Supported MoE architectures, as data (STYLE.md 8): one small file per architecture registers itself here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArchitecture:
    model_type: str
    # transformers 5.x experts classes this architecture's MoE blocks hold (names changed at 5.13:
    # `*NaiveMoe` became `*Experts`); each has gate_up_proj [E,2I,H], down_proj [E,H,I] and the call
    # forward(hidden_states, top_k_index, top_k_weights).
    experts_classes: tuple[str, ...]


_REGISTRY: dict[str, MoEArchitecture] = {}


def register(arch: MoEArchitecture) -> MoEArchitecture:
    _REGISTRY[arch.model_type] = arch
    return arch


def architecture_of(config) -> MoEArchitecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        raise ValueError(f"model_type {model_type!r} is not supported by kt_sft; supported: "
                         f"{', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[model_type]
