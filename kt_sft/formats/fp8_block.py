"""FP8 block-128 weights as DeepSeek-V3/R1 and Kimi-K2-Instruct publish them (DESIGN.md §5).

`weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]:
W[o, i] = q[o, i] · scale_inv[o // 128, i // 128]. Edge blocks may be partial. Leading dims (experts) pass through.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The block-scale grid of a [rows, cols] weight: one scale per 128×128 block, edge blocks partial."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The per-block scales spread over every element of a [..., rows, cols] matrix."""
    return scale_inv.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, name: str = "FP8 weight") -> torch.Tensor:
    """float32 weights from FP8 codes and their block scales (one float32 rounding per element)."""
    rows, cols = q.shape[-2:]
    check(q, scale_inv, name)
    return q.to(torch.float32) * expand_scales(scale_inv.to(torch.float32), rows, cols)


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each 128×128 block of a [..., rows, cols] float32 matrix."""
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    nb_r, nb_c = scale_shape(rows, cols)
    padded = torch.zeros(*lead, nb_r * BLOCK, nb_c * BLOCK, dtype=torch.float32)
    padded[..., :rows, :cols] = w
    return padded.reshape(*lead, nb_r, BLOCK, nb_c, BLOCK).abs().amax(dim=(-3, -1))


def _fresh_scales(amax: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude mapped to FP8_MAX (all-zero blocks: 1)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _codes(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape[-2:]
    return (w / expand_scales(scale_inv, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def require_finite(w: torch.Tensor, name: str, fmt: str) -> None:
    """Quantizing a NaN or Inf would lose it silently (a NaN's whole group or block came out zero)."""
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} holds NaN or Inf values, which {fmt} weights cannot store; the weights are damaged "
                         "(re-download them) or the update that made them diverged.")


def quantize(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) with each block's largest magnitude mapped to FP8_MAX (all-zero blocks get scale 1)."""
    w = w.to(torch.float32)
    require_finite(w, name, "FP8")
    scale_inv = _fresh_scales(_block_amax(w))
    return _codes(w, scale_inv), scale_inv.contiguous()


def requantize(w: torch.Tensor, scale_inv: torch.Tensor,
               base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of w on existing block scales (a merged weight on its published grid): a block keeps its
    scale while its largest magnitude fits (≤ 448 of it), so unchanged values get their codes back and a small
    change moves only the codes it crosses a rounding boundary of; a block that would overflow (or had no usable
    scale: zero, or a block all zero in `base`, the weight before the change, whose scale any value would have
    served, quantize()'s 1 for one) takes the scale quantize() gives it. Scales come back in scale_inv's dtype, and
    the codes are computed with them as stored."""
    w = w.to(torch.float32)
    amax, old = _block_amax(w), scale_inv.to(torch.float32)
    usable = old > 0
    if base is not None:
        usable &= _block_amax(base.to(torch.float32)) > 0
    kept = torch.where((amax <= FP8_MAX * old) & usable, old, _fresh_scales(amax)).to(scale_inv.dtype)
    return _codes(w, kept.to(torch.float32)), kept.contiguous()


def check(q: torch.Tensor, scale_inv: torch.Tensor, name: str = "FP8 weight") -> None:
    """Shapes and dtypes agree; scales and codes are finite (a NaN/Inf scale would poison whole blocks, a NaN code
    its value)."""
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], *scale_shape(rows, cols))
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} is {q.dtype}; FP8 block weights are float8_e4m3fn.")
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name} has scales of shape {list(scale_inv.shape)}; its [{rows}, {cols}] weight needs "
                         f"{list(want)} (one per 128x128 block).")
    if not torch.isfinite(scale_inv).all():
        raise ValueError(f"{name} has NaN or Inf block scales (weight_scale_inv); the checkpoint is corrupt or was "
                         "quantized wrongly: re-download or re-quantize it.")
    if ((q.view(torch.uint8) & 0x7F) == 0x7F).any():  # e4m3fn has no Inf; S.1111.111 is NaN
        raise ValueError(f"{name} holds NaN codes (0x7f/0xff); the checkpoint is corrupt: re-download it.")
