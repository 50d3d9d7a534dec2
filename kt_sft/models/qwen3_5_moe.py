"""Qwen3.5-MoE (Qwen3.5-397B-A17B, Qwen3.5-35B-A3B; model_type qwen3_5_moe): a vision tower beside a text model
(qwen3_5_moe_text: gated DeltaNet and gated attention layers, experts as Qwen3-Next's) whose config.json nests as
text_config. The whole model is served (transformers' Qwen3_5MoeForConditionalGeneration: images and text train
together, as Qwen3-VL-MoE's). Its weights are published under the module tree's names, the text model's under
model.language_model. with the routed experts fused as the transformers 5 module holds them, beside lm_head, the
vision tower (model.visual.*) and the multi-token-prediction module (mtp.*, skipped as transformers skips it)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("qwen3_5_moe", experts_classes=("Qwen3_5MoeExperts",),
                         checkpoint_experts="model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"))
# The text model on its own (saved from a text-only model, or a directory prepared from the published checkpoint
# before the whole model was served): per expert as transformers 5.17 saves it, under the module tree's names or
# the published ones; fused under either.
register(MoEArchitecture("qwen3_5_moe_text", experts_classes=("Qwen3_5MoeExperts",),
                         key_renames=(("model.language_model.", "model."),)))
