"""dots.llm1 (rednote-hilab): DeepSeek-V3's MoE block (shared experts after the routed ones, run on the GPU
meanwhile) under grouped-query attention."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("dots1", experts_classes=("Dots1NaiveMoe", "Dots1Experts"), shared_experts="shared_experts"))
