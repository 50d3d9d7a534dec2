"""Mistral 4 (model_type mistral4): DeepSeek-V3's layout (MLA attention, group-limited routing, shared experts after
the routed ones, run on the GPU meanwhile) with softmax router scores."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("mistral4", experts_classes=("Mistral4NaiveMoe", "Mistral4Experts"),
                         shared_experts="shared_experts"))
