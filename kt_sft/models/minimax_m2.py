"""MiniMax-M2: experts on disk as Mixtral's (block_sparse_moe.experts.{e}.w1 gate, w3 up, w2 down), sigmoid routing
with a correction bias as DeepSeek-V3's, no shared experts."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "minimax_m2", experts_classes=("MiniMaxM2Experts",),
    checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
    checkpoint_projections=("w1", "w3", "w2"),
    key_renames=((".block_sparse_moe.", ".mlp."),),
))
