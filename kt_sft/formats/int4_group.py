"""RAWINT4 group-32 weights as Kimi-K2-Thinking / K2.5 publish their routed experts (DESIGN.md §5).

compressed-tensors "pack-quantized", symmetric, group 32: `weight_packed` int32 [out, ceil(in/8)] holding element j
in bits 4·(j % 8) of word j // 8 as q + 8, `weight_scale` bfloat16 [out, ceil(in/32)], `weight_shape` [out, in];
W[o, j] = q[o, j] · scale[o, j // 32] with q in [-8, 7]. Leading dims (experts) pass through. Checkpoints quantized
in larger groups (compressed-tensors' W4A16: group_size 64, 128, any multiple of 32) take `group`: their scales
[out, ceil(in/group)] spread exactly over the engine's groups of 32 (`to_grid`).
"""
from __future__ import annotations

import torch

from .fp8_block import require_finite

GROUP = 32
QMIN, QMAX = -8, 7
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def words(cols: int) -> int:
    """int32 words holding a row of `cols` values (8 per word, the last one zero-padded)."""
    return -(-cols // 8)


def groups(cols: int, group: int = GROUP) -> int:
    """Group scales of a row of `cols` values (one per `group`, the last group partial)."""
    return -(-cols // group)


def to_grid(scale: torch.Tensor, cols: int, group: int) -> torch.Tensor:
    """Scales of groups of `group` columns (a multiple of 32) as the engine's one per 32 columns: each repeated
    group / 32 times (exact: every engine group lies inside one of them)."""
    return scale.repeat_interleave(group // GROUP, -1)[..., :groups(cols)].contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """int32 words from int8 values in [-8, 7] along the last dim (zero-padded to whole words)."""
    if q.dtype != torch.int8 or q.numel() and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError("INT4 packing takes int8 values in [-8, 7].")
    cols = q.shape[-1]
    nib = torch.zeros(*q.shape[:-1], words(cols) * 8, dtype=torch.int64)
    nib[..., :cols] = q.to(torch.int64) + 8
    u32 = (nib.reshape(*q.shape[:-1], -1, 8) << _SHIFTS).sum(-1)
    return torch.where(u32 >= 2**31, u32 - 2**32, u32).to(torch.int32)


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int8 values in [-8, 7], [..., cols], from packed words."""
    u32 = packed.to(torch.int64) & 0xFFFFFFFF
    nib = (u32.unsqueeze(-1) >> _SHIFTS) & 15
    return (nib.reshape(*packed.shape[:-1], -1)[..., :cols] - 8).to(torch.int8)


def expand_scales(scale: torch.Tensor, cols: int, group: int = GROUP) -> torch.Tensor:
    return scale.repeat_interleave(group, -1)[..., :cols]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, cols: int, name: str = "INT4 weight",
               group: int = GROUP) -> torch.Tensor:
    """float32 weights (exact: a 4-bit integer times a BF16 scale)."""
    check(packed, scale, cols, name, group)
    return unpack(packed, cols).to(torch.float32) * expand_scales(scale.to(torch.float32), cols, group)


def quantize(w: torch.Tensor, name: str = "weight", group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scale) with the compressed-tensors symmetric rule: scale = max|w| / 7.5 per group (BF16),
    q = round(w / scale) clamped to [-8, 7]. All-zero groups get scale 1 (their q are 0)."""
    w = w.to(torch.float32)
    require_finite(w, name, "INT4")
    scale = _fresh_scales(_grouped(w, group).abs().amax(-1))
    return pack(_codes(w, scale, group)), scale.contiguous()


def _grouped(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """[..., cols] as [..., groups, group], zero-padded."""
    cols = x.shape[-1]
    padded = torch.zeros(*x.shape[:-1], groups(cols, group) * group, dtype=x.dtype)
    padded[..., :cols] = x
    return padded.reshape(*x.shape[:-1], groups(cols, group), group)


def _fresh_scales(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric rule: max|w| / 7.5 per group, in BF16 (all-zero groups: 1)."""
    return torch.where(amax > 0, amax / ((QMAX - QMIN) / 2), torch.ones_like(amax)).to(torch.bfloat16)


def _codes(w: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    return torch.round(w / expand_scales(scale.to(torch.float32), w.shape[-1], group)).clamp(QMIN, QMAX).to(torch.int8)


def requantize(w: torch.Tensor, scale: torch.Tensor, base: torch.Tensor | None = None,
               group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scale) of w on the grid of existing group scales (a merged weight on its published grid): a group
    keeps its scale while all its values round inside [-8, 7] steps of it, so unchanged values get their codes
    back and a small change moves only the codes it crosses a rounding boundary of; a group that would clip (or
    had no usable scale: zero, or a group all zero in `base`, the weight before the change, whose scale any value
    would have served, quantize()'s 1 for one) takes the scale quantize() gives it. Quantizing afresh would give
    every group another scale (its largest code is 7 or -8, not the rule's 7.5) and move codes that no update
    touched. group: the published grid's columns per scale."""
    w = w.to(torch.float32)
    steps = _grouped(torch.round(w / expand_scales(scale.to(torch.float32), w.shape[-1], group)), group)
    fits = ((steps >= QMIN) & (steps <= QMAX)).all(-1) & (scale.to(torch.float32) > 0)
    if base is not None:
        fits &= _grouped(base.to(torch.float32), group).abs().amax(-1) > 0
    kept = torch.where(fits, scale.to(torch.bfloat16), _fresh_scales(_grouped(w, group).abs().amax(-1)))
    return pack(_codes(w, kept, group)), kept.contiguous()


def check(packed: torch.Tensor, scale: torch.Tensor, cols: int, name: str = "INT4 weight", group: int = GROUP) -> None:
    """Shapes and dtypes agree with a [..., cols] weight; scales are finite."""
    lead = tuple(packed.shape[:-1])
    if packed.dtype != torch.int32:
        raise ValueError(f"{name} is {packed.dtype}; packed INT4 weights are int32 words.")
    if packed.shape[-1] != words(cols):
        raise ValueError(f"{name} has {packed.shape[-1]} words per row; {cols} columns need {words(cols)}.")
    if tuple(scale.shape) != (*lead, groups(cols, group)):
        raise ValueError(f"{name} has scales of shape {list(scale.shape)}; it needs {[*lead, groups(cols, group)]} "
                         f"(one per {group} columns).")
    if not torch.isfinite(scale.to(torch.float32)).all():
        raise ValueError(f"{name} has NaN or Inf group scales (weight_scale); the checkpoint is corrupt or was "
                         "quantized wrongly: re-download or re-quantize it.")
