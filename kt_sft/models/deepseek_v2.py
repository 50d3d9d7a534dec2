"""DeepSeek-V2 / V2-Lite."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("deepseek_v2", experts_classes=("DeepseekV2Experts", "DeepseekV2NaiveMoe"),
                          shared_experts="shared_experts"))
