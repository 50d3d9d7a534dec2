"""LongCat-Flash (model_type longcat_flash): each layer runs two MLA attentions and two dense MLPs on the GPU, and a
MoE block on the shortcut whose router also picks zero-computation experts (ids past the routed ones, given by
zero_expert_num), which return the token itself: the engine computes the routed experts only, and the identity
share is added in PyTorch. Experts published per expert; the multi-token-prediction module (`mtp.*`) is skipped, as
transformers skips it."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("longcat_flash", experts_classes=("LongcatFlashExperts",), identity_experts="zero_expert_num",
                         dense_beside="mlps.0"))
