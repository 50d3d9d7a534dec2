"""GLM-4.5V / GLM-4.6V (model_type glm4v_moe): a vision tower beside a GLM-4.5-Air text model (shared experts,
group-limited sigmoid routing) whose config.json nests as text_config. The whole model is served (transformers'
Glm4vMoeForConditionalGeneration: images and text train together), its experts published per expert under
model.language_model.; the multi-token-prediction layer past the model's layers is skipped as transformers skips it."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("glm4v_moe", experts_classes=("Glm4vMoeTextNaiveMoe", "Glm4vMoeTextExperts"),
                         checkpoint_experts="model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                         shared_experts="shared_experts"))
