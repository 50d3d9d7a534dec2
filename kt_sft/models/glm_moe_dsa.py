"""GLM-5 (model_type glm_moe_dsa): GLM-4.5's MoE blocks (shared experts after the routed ones, sigmoid routing with a
correction bias) beneath DeepSeek-V3.2-style sparse attention (MLA with a lightning indexer), which runs on the GPU
as transformers runs it. Experts published per expert; the multi-token-prediction layer (model.layers.78) is
skipped as transformers' class skips it."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("glm_moe_dsa", experts_classes=("GlmMoeDsaNaiveMoe", "GlmMoeDsaExperts"),
                         shared_experts="shared_experts"))
