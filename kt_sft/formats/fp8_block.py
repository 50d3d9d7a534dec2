"""FP8 block-128 weights as DeepSeek-V3/R1 and Kimi-K2-Instruct publish them (DESIGN.md §5), and the scale grids of
compressed-tensors FP8 (one scale per output channel, or one for the whole tensor).

`weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]:
W[o, i] = q[o, i] · scale_inv[o // 128, i // 128]. Edge blocks may be partial. Leading dims (experts) pass through.
A grid's shape says its blocks' (`block_shape`): [ceil(out/128), ceil(in/128)] 128×128 blocks, [out, ceil(in/128)]
one row's 128 columns (the engine's grid for per-channel scales), [out, 1] whole rows, [1, 1] the whole matrix.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(rows: int, cols: int, row_block: int = BLOCK) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight: one scale per row_block × 128 block, edge blocks partial."""
    return -(-rows // row_block), -(-cols // BLOCK)


def _block_along(n: int, grid: int) -> int | None:
    """The block length along a dimension of n values that `grid` scales cover: 128, 1 or n; None for none of them."""
    if grid == -(-n // BLOCK):
        return BLOCK
    return 1 if grid == n else n if grid == 1 else None


def block_shape(scale_inv: torch.Tensor, rows: int, cols: int) -> tuple[int, int] | None:
    """The (rows, cols) of the blocks that a [..., g_r, g_c] grid gives a [rows, cols] weight; None for a grid that
    fits no block shape kt_sft reads."""
    if scale_inv.dim() < 2:
        return None
    r, c = _block_along(rows, scale_inv.shape[-2]), _block_along(cols, scale_inv.shape[-1])
    return None if r is None or c is None else (r, c)


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The block scales spread over every element of a [..., rows, cols] matrix."""
    br, bc = block_shape(scale_inv, rows, cols)
    return scale_inv.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]


def to_grid(scale: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """float32 scales of a [rows, cols] weight (whole rows: [rows, 1]; the whole matrix: [1, 1]) on the engine's grid
    of row_block × 128 blocks (1 or 128 rows; exact: each block lies inside one of the given ones). A tensor's single
    scale may be [1], as compressed-tensors stores it."""
    if scale.dim() == 1:
        scale = scale.reshape(1, 1)
    br, bc = block_shape(scale, rows, cols)
    if not ((br % row_block == 0 or br >= rows) and (bc % BLOCK == 0 or bc >= cols)):
        raise ValueError(f"scales of {br}x{bc} blocks do not fit the engine's blocks of {row_block}x{BLOCK}.")
    g_r, g_c = scale_shape(rows, cols, row_block)
    first_row, first_col = torch.arange(g_r) * row_block, torch.arange(g_c) * BLOCK
    return scale.to(torch.float32)[..., first_row // br, :][..., first_col // bc].contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, name: str = "FP8 weight") -> torch.Tensor:
    """float32 weights from FP8 codes and their block scales (one float32 rounding per element); a tensor's single
    scale may be [1], as compressed-tensors stores it."""
    if scale_inv.dim() == 1 and q.dim() == 2:
        scale_inv = scale_inv.reshape(1, 1)
    rows, cols = q.shape[-2:]
    check(q, scale_inv, name)
    return q.to(torch.float32) * expand_scales(scale_inv.to(torch.float32), rows, cols)


def _block_amax(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The largest magnitude of each block of a [..., rows, cols] float32 matrix."""
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    (br, bc), nb_r, nb_c = block, -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(*lead, nb_r * br, nb_c * bc, dtype=torch.float32)
    padded[..., :rows, :cols] = w
    return padded.reshape(*lead, nb_r, br, nb_c, bc).abs().amax(dim=(-3, -1))


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


def quantize(w: torch.Tensor, name: str = "weight", row_block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) with each block (row_block rows × 128 columns) largest magnitude mapped to FP8_MAX
    (all-zero blocks get scale 1)."""
    w = w.to(torch.float32)
    require_finite(w, name, "FP8")
    scale_inv = _fresh_scales(_block_amax(w, (row_block, BLOCK)))
    return _codes(w, scale_inv), scale_inv.contiguous()


def requantize(w: torch.Tensor, scale_inv: torch.Tensor,
               base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of w on existing block scales (a merged weight on its published grid): a block keeps its
    scale while its largest magnitude fits (≤ 448 of it), so unchanged values get their codes back and a small
    change moves only the codes it crosses a rounding boundary of; a block that would overflow (or had no usable
    scale: zero, or a block all zero in `base`, the weight before the change, whose scale any value would have
    served, quantize()'s 1 for one) takes the scale quantize() gives it. Scales come back in scale_inv's dtype, and
    the codes are computed with them as stored. Any grid block_shape reads; a tensor's single scale may be [1]."""
    w = w.to(torch.float32)
    flat = scale_inv.dim() == 1  # compressed-tensors' per-tensor scale
    grid = scale_inv.reshape(1, 1) if flat else scale_inv
    block = block_shape(grid, *w.shape[-2:])
    amax, old = _block_amax(w, block), grid.to(torch.float32)
    usable = old > 0
    if base is not None:
        usable &= _block_amax(base.to(torch.float32), block) > 0
    kept = torch.where((amax <= FP8_MAX * old) & usable, old, _fresh_scales(amax)).to(scale_inv.dtype)
    return _codes(w, kept.to(torch.float32)), kept.reshape(scale_inv.shape).contiguous()


def check(q: torch.Tensor, scale_inv: torch.Tensor, name: str = "FP8 weight") -> None:
    """Shapes and dtypes agree; scales and codes are finite (a NaN/Inf scale would poison whole blocks, a NaN code
    its value)."""
    rows, cols = q.shape[-2:]
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} is {q.dtype}; FP8 block weights are float8_e4m3fn.")
    if tuple(scale_inv.shape[:-2]) != tuple(q.shape[:-2]) or block_shape(scale_inv, rows, cols) is None:
        raise ValueError(f"{name} has scales of shape {list(scale_inv.shape)}; its [{rows}, {cols}] weight needs "
                         f"{list((*q.shape[:-2], *scale_shape(rows, cols)))} (one per 128x128 block), or one per "
                         "row or for the whole weight.")
    if not torch.isfinite(scale_inv).all():
        raise ValueError(f"{name} has NaN or Inf scales; the checkpoint is corrupt or was "
                         "quantized wrongly: re-download or re-quantize it.")
    if ((q.view(torch.uint8) & 0x7F) == 0x7F).any():  # e4m3fn has no Inf; S.1111.111 is NaN
        raise ValueError(f"{name} holds NaN codes (0x7f/0xff); the checkpoint is corrupt: re-download it.")
