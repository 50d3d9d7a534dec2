"""GPT-OSS (gpt-oss-20b, gpt-oss-120b; model_type gpt_oss): attention with sinks and sliding windows, and the router,
on the GPU. Its experts have biases and a clamped gated unit (h = g'·sigmoid(1.702·g')·(u' + 1), g' = min(g, 7),
u' = u clamped to ±7), which the engine computes; the module holds them fused and transposed, gate's and up's
outputs alternating in gate_up_proj (output 2j is gate's j). The published checkpoints' experts are MXFP4
(formats/mxfp4.py), decoded at load into BF16 or quantized again to FP8 / INT4; BF16 saves are read too."""
from ..ops.reference import GPT_OSS_GLU
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "gpt_oss", experts_classes=("GptOssExperts",), fused_transposed=True, module_transposed=True,
    gate_up_interleaved=True, expert_biases=True, unit=GPT_OSS_GLU,
))
