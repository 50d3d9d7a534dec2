"""DeepSeek-V3/R1 (and Kimi-K2 once mapped onto deepseek_v3)."""
from .registry import MoEArchitecture, register

ARCH = register(MoEArchitecture("deepseek_v3", experts_classes=("DeepseekV3NaiveMoe", "DeepseekV3Experts")))
