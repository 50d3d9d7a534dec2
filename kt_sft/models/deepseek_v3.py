"""DeepSeek-V3/R1, and Kimi-K2: its checkpoints declare model_type kimi_k2 with their own remote code, but the
architecture is DeepSeek-V3's (E=384, one routing group, routed_scaling_factor 2.827) with the same weight keys,
so `kt-sft prepare` serves it with transformers' deepseek_v3. Kimi-K2.5 (model_type kimi_k25) nests that config
as text_config beside a vision tower and prefixes the text model's weight keys with `language_model.`: its text
model is served the same way (the vision tower is not loaded)."""
from .registry import Composite, MoEArchitecture, register, register_alias, register_composite

register(MoEArchitecture("deepseek_v3", experts_classes=("DeepseekV3NaiveMoe", "DeepseekV3Experts"),
                          shared_experts="shared_experts"))
register_alias("kimi_k2", "deepseek_v3")
register_composite("kimi_k25", Composite("language_model."))
