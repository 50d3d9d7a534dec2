"""MXFP4 weights as GPT-OSS publishes its routed experts (quant_method "mxfp4"), read at load only: the engine takes
them as BF16 (exact) or quantized again to FP8 / INT4 (`--expert-format`); it computes on no MXFP4.

Per weight [out, in] (leading dims, experts, pass through): `<name>_blocks` uint8 [out, in/32, 16], each byte two
FP4 (e2m1) codes, the low nibble first; `<name>_scales` uint8 [out, in/32], an exponent per 32 weights with bias 127
(e8m0). W[o, 32·g + j] = e2m1(code) · 2^(scale[o, g] − 127)."""
from __future__ import annotations

import torch

GROUP = 32
SUFFIXES = ("_blocks", "_scales")  # appended to a weight's name: its codes and its exponents
# The 16 e2m1 values by code: sign bit 3, exponent bits 1-2, mantissa bit 0.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
NAN_SCALE = 255  # e8m0's NaN


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., out, in] from blocks uint8 [..., out, in/32, 16] and scales uint8 [..., out, in/32]. Every value
    is exact in float32 (and in BF16: one significant bit and a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != GROUP // 2 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not belong together: blocks are uint8 [..., in/32, 16] and scales uint8 "
                         "[..., in/32].")
    if bool((scales == NAN_SCALE).any()):
        raise ValueError("an MXFP4 scale is 255 (e8m0's NaN), which would make its 32 weights NaN; the checkpoint is "
                         "damaged: download it again.")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).long()  # [..., in/32, 16, 2]: low nibble first
    values = E2M1[codes].reshape(*scales.shape, GROUP)
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1).float())
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * GROUP)
