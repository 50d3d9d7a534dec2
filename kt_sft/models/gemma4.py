"""Gemma 4's MoE models (Gemma 4 26B-A4B; model_type gemma4, the whole image-text model as transformers'
Gemma4ForConditionalGeneration, or gemma4_text, its text model on its own). Each decoder layer calls its dense MLP,
then its router and experts (attributes of the layer itself, no MoE block) on the same input, each through a norm of
its own; the experts' unit is GeGLU with the tanh-approximated gelu (gelu_pytorch_tanh), which the engine computes.
Attention (sliding and full), the dense MLP, the router (with its per-expert scale) and the vision tower run on the
GPU. The experts are published fused as the module holds them, under model.language_model. for the whole model. The
dense MLP runs before the experts in the stock layer, so nothing of its runs on the GPU while the engine computes."""
from ..ops.reference import GEGLU_TANH
from .registry import MoEArchitecture, register

GEMMA4 = dict(experts_classes=("Gemma4TextExperts",), unit=GEGLU_TANH, activation_field="hidden_activation",
              activations=("gelu_pytorch_tanh", "gelu_new"))

register(MoEArchitecture("gemma4",
                         checkpoint_experts="model.language_model.layers.{layer}.experts.{expert}.{proj}.weight",
                         **GEMMA4))
register(MoEArchitecture("gemma4_text", checkpoint_experts="model.layers.{layer}.experts.{expert}.{proj}.weight",
                         key_renames=(("model.language_model.", "model."),), **GEMMA4))
