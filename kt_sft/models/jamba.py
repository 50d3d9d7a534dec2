"""Jamba 1.5 Mini / Large (model_type jamba): Mamba layers between attention ones, both on the GPU as transformers
runs them, and routed experts every expert_layer_period layers, published per expert under feed_forward."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "jamba", experts_classes=("JambaExperts",),
    checkpoint_experts="model.layers.{layer}.feed_forward.experts.{expert}.{proj}.weight",
))
