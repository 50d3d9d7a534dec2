"""GLM-4.5 / 4.6 MoE."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("glm4_moe", experts_classes=("Glm4MoeNaiveMoe", "Glm4MoeExperts"),
                          shared_experts="shared_experts"))
