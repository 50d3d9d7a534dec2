"""Mixtral 8x7B / 8x22B: experts on disk as block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "mixtral", experts_classes=("MixtralExperts",),
    checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
    checkpoint_projections=("w1", "w3", "w2"),
    key_renames=((".block_sparse_moe.", ".mlp."),),
))
