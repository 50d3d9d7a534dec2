"""DeepSeek-V3/R1, and Kimi-K2: its checkpoints declare model_type kimi_k2 with their own remote code, but the
architecture is DeepSeek-V3's (E=384, one routing group, routed_scaling_factor 2.827) with the same weight keys,
so `kt-sft prepare` serves it with transformers' deepseek_v3."""
from .registry import MoEArchitecture, register, register_alias

ARCH = register(MoEArchitecture("deepseek_v3", experts_classes=("DeepseekV3NaiveMoe", "DeepseekV3Experts")))
register_alias("kimi_k2", "deepseek_v3")
