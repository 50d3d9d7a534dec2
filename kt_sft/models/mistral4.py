"""Mistral 4 (model_type mistral4): DeepSeek-V3's layout (MLA attention, group-limited routing, shared experts after the
routed ones, run on the GPU meanwhile) with softmax router scores. Mistral Small 4 is a Mistral 4 text model inside a
Mistral 3 image-text model (model_type mistral3, a Pixtral vision tower): its BF16 conversions, as transformers saves
them (LLaVA's names, the experts fused), are served whole. Mistral's own release is per-tensor FP8, refused."""
from .registry import LLAVA_NAMES, MoEArchitecture, register

EXPERTS = ("Mistral4NaiveMoe", "Mistral4Experts")

register(MoEArchitecture("mistral4", experts_classes=EXPERTS, shared_experts="shared_experts"))
register(MoEArchitecture("mistral3", experts_classes=EXPERTS, text_model_types=("mistral4",),
                         shared_experts="shared_experts",
                         checkpoint_experts="language_model.model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                         key_renames=LLAVA_NAMES))
