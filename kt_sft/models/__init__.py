"""Model architectures and the swap of their experts modules for the CPU engine."""
from . import (deepseek_v2, deepseek_v3, glm4_moe, minimax_m2, mixtral, olmoe, qwen2_moe, qwen3_moe,  # noqa: F401
               qwen3_next)  # (registration)
from .patch import use_cpu_experts
from .registry import MoEArchitecture, architecture_of, canonical_model_type, composite_prefix

__all__ = ["MoEArchitecture", "architecture_of", "canonical_model_type", "composite_prefix", "use_cpu_experts"]
