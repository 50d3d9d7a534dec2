"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B; model_type qwen3_vl_moe): a vision tower beside a Qwen3-MoE
text model whose config.json nests as text_config. The whole model is served (transformers'
Qwen3VLMoeForConditionalGeneration: the vision tower on the GPU, images and text trained together). Its BF16
checkpoints publish each layer's routed experts fused and transposed (fused_transposed), FP8 ones per expert, both
under the module tree's names (model.language_model.layers.N.mlp.experts)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("qwen3_vl_moe", experts_classes=("Qwen3VLMoeTextExperts",),
                         checkpoint_experts="model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                         fused_transposed=True))
