"""Qwen2-MoE / Qwen1.5-MoE (shared expert stays on the GPU)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("qwen2_moe", experts_classes=("Qwen2MoeExperts",)))
