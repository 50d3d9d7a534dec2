"""OLMoE (OLMoE-1B-7B): 64 experts of Qwen3-MoE's layout, no shared experts."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("olmoe", experts_classes=("OlmoeExperts",)))
