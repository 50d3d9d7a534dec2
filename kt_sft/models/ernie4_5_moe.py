"""ERNIE-4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): shared experts first in the stock block; the routing bias on disk
at mlp.moe_statics, in the module tree under the gate (as transformers renames it)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("ernie4_5_moe", experts_classes=("Ernie4_5_MoeExperts",),
                         key_renames=(("mlp.moe_statics.", "mlp.gate.moe_statics."),)))
