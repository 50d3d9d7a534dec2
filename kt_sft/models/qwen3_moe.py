"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("qwen3_moe", experts_classes=("Qwen3MoeExperts",)))
