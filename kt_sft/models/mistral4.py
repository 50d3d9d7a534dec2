"""Mistral 4 (model_type mistral4): DeepSeek-V3's layout (MLA attention, group-limited routing, shared experts after
the routed ones, run on the GPU meanwhile) with softmax router scores. Mistral Small 4 is published whole, its Mistral 4
text model inside a Mistral 3 image-text model (model_type mistral3, a Pixtral vision tower), under LLaVA's names and
its experts fused as transformers saves them: served whole."""
from .registry import LLAVA_NAMES, MoEArchitecture, register

EXPERTS = ("Mistral4NaiveMoe", "Mistral4Experts")

register(MoEArchitecture("mistral4", experts_classes=EXPERTS, shared_experts="shared_experts"))
register(MoEArchitecture("mistral3", experts_classes=EXPERTS, text_model_types=("mistral4",),
                         shared_experts="shared_experts",
                         checkpoint_experts="language_model.model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                         key_renames=LLAVA_NAMES))
