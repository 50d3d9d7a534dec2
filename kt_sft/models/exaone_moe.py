"""EXAONE MoE (exaone_moe): DeepSeek-V3's MoE block (shared experts after the routed ones, run on the GPU
meanwhile); the routing bias on disk at mlp.e_score_correction_bias, in the module tree under the gate (as
transformers renames it); its multi-token-prediction weights (`mtp.*`) are skipped as transformers skips them."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("exaone_moe", experts_classes=("ExaoneMoeExperts",), shared_experts="shared_experts",
                         key_renames=(("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),)))
