"""MiniMax-Text-01 and MiniMax-M1 as transformers converts them (model_type minimax, the `-hf` checkpoints): lightning
(linear) attention layers and softmax attention ones, both on the GPU as transformers runs them, and experts on disk
as Mixtral's (block_sparse_moe.experts.{e}.w1 gate, w3 up, w2 down), softmax top-k routing. The original releases'
remote code (model_type minimax_text_01 / minimax_m1) names its config's fields otherwise: use the -hf conversion."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "minimax", experts_classes=("MiniMaxExperts",),
    checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
    checkpoint_projections=("w1", "w3", "w2"),
    key_renames=((".block_sparse_moe.", ".mlp."),),
))
