"""InternVL3.5 with a Qwen3-MoE text model (InternVL3_5-30B-A3B-HF, 241B-A28B-HF; model_type internvl): served whole
(transformers' InternVLForConditionalGeneration: the vision tower and projector on the GPU, the text model's routed
experts on the engine). Its checkpoints keep LLaVA's names, which transformers renames on loading:
`language_model.model.` for the module's `model.language_model.`, `language_model.lm_head.`, `vision_tower.` and
`multi_modal_projector.` under `model.`; the experts per expert."""
from .registry import LLAVA_NAMES, MoEArchitecture, register

register(MoEArchitecture("internvl", experts_classes=("Qwen3MoeExperts",), text_model_types=("qwen3_moe",),
                         checkpoint_experts="language_model.model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                         key_renames=LLAVA_NAMES))
