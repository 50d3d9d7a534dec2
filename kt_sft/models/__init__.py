"""Model architectures and the swap of their experts modules for the CPU engine."""
from . import (afmoe, deepseek_v2, deepseek_v3, dots1, ernie4_5_moe, exaone_moe,  # noqa: F401 (registration)
               flex_olmo, gemma4, glm4_moe, glm4_moe_lite, glm4v_moe, glm_moe_dsa, gpt_oss, granitemoe, hunyuan_v1_moe,
               hy_v3, internvl, jamba, lfm2_moe, llama4, longcat_flash, minimax, minimax_m2, mistral4, mixtral,
               nemotron_h, olmoe, phimoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next, qwen3_omni_moe, qwen3_vl_moe,
               solar_open)
from .patch import use_cpu_experts
from .registry import MoEArchitecture, architecture_of, canonical_model_type, composite_of, served_prefix

__all__ = ["MoEArchitecture", "architecture_of", "canonical_model_type", "composite_of", "served_prefix",
           "use_cpu_experts"]
