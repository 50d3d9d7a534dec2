"""Qwen3.5-MoE (model_type qwen3_5_moe): a vision tower beside a text model whose config.json nests as text_config
(qwen3_5_moe_text: gated DeltaNet and gated attention layers, experts as Qwen3-Next's); the text model is served.
Its weights are published under model.language_model. (the module tree's model.), the routed experts fused as the
transformers 5 module holds them; lm_head, the vision tower (model.visual.*) and the multi-token-prediction module
(mtp.*) sit beside them, the last two skipped as transformers' causal LM skips them."""
from .registry import MoEArchitecture, register, register_composite

# Per expert (the text model as transformers 5.17 saves it) under the module tree's names; fused under either.
register(MoEArchitecture("qwen3_5_moe_text", experts_classes=("Qwen3_5MoeExperts",),
                         key_renames=(("model.language_model.", "model."),)))
register_composite("qwen3_5_moe", "")  # every key read: the text model's are renamed, the rest skipped as above
