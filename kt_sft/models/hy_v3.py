"""Hy3 (Tencent Hy3-preview; model_type hy_v3): shared experts added to the routed ones (both from the block's
input), sigmoid routing with a correction bias. Experts published per expert; the router, its bias and the shared
experts under names the transformers 5 module tree renames."""
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "hy_v3", experts_classes=("HYV3Experts",),
    key_renames=(("mlp.router.gate.weight", "mlp.gate.weight"), ("mlp.expert_bias", "mlp.e_score_correction_bias"),
                 ("mlp.shared_mlp.", "mlp.shared_experts.")),
    shared_experts="shared_experts",
))
