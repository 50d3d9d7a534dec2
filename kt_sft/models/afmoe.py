"""AFMoE (Arcee's Trinity): shared experts first in the stock block, then the routed experts."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("afmoe", experts_classes=("AfmoeExperts",)))
