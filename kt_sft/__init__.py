"""kt_sft: routed experts of MoE LLMs trained and served on CPU kernels, the rest on the GPU."""
from ._ext import capabilities, configure, set_kernels
from .nn.experts import KTExperts
from .ops.reference import moe_experts_reference

__all__ = ["KTExperts", "capabilities", "configure", "set_kernels", "moe_experts_reference"]
__version__ = "0.1.0"
