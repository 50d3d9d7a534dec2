"""Hunyuan-A13B (hunyuan_v1_moe): a shared MLP first in the stock block, then the routed experts."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("hunyuan_v1_moe", experts_classes=("HunYuanMoEV1Experts",)))
