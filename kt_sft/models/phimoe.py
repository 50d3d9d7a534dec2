"""Phi-3.5-MoE (model_type phimoe): experts on disk as Mixtral's (block_sparse_moe.experts.{e}.w1 / w3 / w2), its
router as block_sparse_moe.gate, which the transformers 5 module tree names mlp.router; sparsemixer routing, as
transformers runs it."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "phimoe", experts_classes=("PhimoeExperts",),
    checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
    checkpoint_projections=("w1", "w3", "w2"),
    key_renames=((".block_sparse_moe.gate", ".mlp.router"), (".block_sparse_moe.", ".mlp.")),
))
