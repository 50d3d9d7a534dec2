"""LFM2-MoE (LFM2-8B-A1B; model_type lfm2_moe): short-convolution layers between attention ones, both on the GPU as
transformers runs them; sigmoid routing with an expert bias; experts on disk as feed_forward.experts.{e}.w1 (gate),
w3 (up), w2 (down)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "lfm2_moe", experts_classes=("Lfm2MoeExperts",),
    checkpoint_experts="model.layers.{layer}.feed_forward.experts.{expert}.{proj}.weight",
    checkpoint_projections=("w1", "w3", "w2"),
))
