"""GLM-4.7-Flash (glm4_moe_lite): GLM-4.5's MoE block (shared experts after the routed ones, run on the GPU
meanwhile) under DeepSeek-V3's attention (MLA)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("glm4_moe_lite", experts_classes=("Glm4MoeLiteNaiveMoe", "Glm4MoeLiteExperts"),
                         shared_experts="shared_experts"))
