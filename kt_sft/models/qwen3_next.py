"""Qwen3-Next (Qwen3-Next-80B-A3B): gated DeltaNet and gated attention layers, experts as Qwen3-MoE's; the shared
expert (with its sigmoid gate) runs first in the stock block, on the GPU."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("qwen3_next", experts_classes=("Qwen3NextExperts",)))
