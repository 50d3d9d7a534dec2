"""Expert weight formats: BF16, FP8 block-128 and INT4 group-32 (DESIGN.md §5), in the engine's fused layout.

`QuantizedExperts` holds one layer's experts as the engine reads them (csrc/moe/experts.h):
  fp8   gate_up float8_e4m3fn [E, 2I, H], scales float32 [E, 2, ceil(I/128), ceil(H/128)] (gate's blocks, then
        up's: the checkpoint quantizes gate and up separately, so their block grids stay separate);
        down [E, H, I], scales [E, ceil(H/128), ceil(I/128)]. With a scale per output channel (compressed-tensors
        FP8) the blocks are one row high: scales [E, 2, I, ceil(H/128)] and [E, H, ceil(I/128)] (row_block 1).
  int4  gate_up int32 [E, 2I, ceil(H/8)], scales bfloat16 [E, 2I, ceil(H/32)]; down [E, H, ceil(I/8)],
        scales [E, H, ceil(I/32)]
Experts without a gate (gated False: Nemotron-H's) hold up's rows alone where gate_up is written: I for 2I, 1 for 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fp8_block, int4_group

# User-facing names (`kt-sft prepare --expert-format`) and the engine's names for them.
EXPERT_FORMATS = {"bf16": "bf16", "fp8": "fp8_block128", "int4": "int4_group32"}


def stacked(gated: bool) -> int:
    """Projections in gate_up per expert: gate's and up's rows, or up's alone without a gate."""
    return 2 if gated else 1


def check_fused_layout(gate_up: torch.Tensor, down: torch.Tensor, gated: bool = True) -> None:
    """gate_up [E, 2I, H] ([E, I, H], up's rows alone, without a gate) and down [E, H, I] of the same experts, or a
    ValueError that says what they must be."""
    n = stacked(gated)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % n or \
            tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // n):
        raise ValueError(f"{'gate_up_proj' if gated else 'up_proj'} {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} do not describe the same experts; they must be "
                         f"[E, {'2I' if gated else 'I'}, H] and [E, H, I].")


@dataclass
class QuantizedExperts:
    format: str  # "fp8" or "int4"
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    gated: bool = True

    @property
    def stacked(self) -> int:
        return stacked(self.gated)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, H, I)."""
        return self.gate_up.shape[0], self.down.shape[1], self.gate_up.shape[1] // self.stacked

    @property
    def row_block(self) -> int:
        """FP8: the weight rows one scale row covers (128, or 1 with a scale per output channel), told by the scales'
        rows (I or H of them, against ceil(I/128) or ceil(H/128): alike only where I = H = 1)."""
        _, H, I = self.shape
        one_row = self.gate_up_scale.shape[2] == I > 1 or self.down_scale.shape[1] == H > 1
        return 1 if one_row else fp8_block.BLOCK

    @classmethod
    def empty(cls, fmt: str, E: int, H: int, I: int, gated: bool = True,
              row_block: int = fp8_block.BLOCK) -> "QuantizedExperts":
        """Uninitialized buffers of the format's layout, for loaders to fill (FP8: blocks of row_block rows)."""
        n = stacked(gated)
        if fmt == "fp8":
            return cls(fmt, torch.empty(E, n * I, H, dtype=torch.float8_e4m3fn),
                       torch.empty(E, H, I, dtype=torch.float8_e4m3fn),
                       torch.empty(E, n, *fp8_block.scale_shape(I, H, row_block), dtype=torch.float32),
                       torch.empty(E, *fp8_block.scale_shape(H, I, row_block), dtype=torch.float32), gated)
        if fmt == "int4":
            w, g = int4_group.words, int4_group.groups
            return cls(fmt, torch.empty(E, n * I, w(H), dtype=torch.int32), torch.empty(E, H, w(I), dtype=torch.int32),
                       torch.empty(E, n * I, g(H), dtype=torch.bfloat16), torch.empty(E, H, g(I), dtype=torch.bfloat16),
                       gated)
        raise ValueError(f"unknown expert format {fmt!r}; choose from {sorted(EXPERT_FORMATS)}.")

    @torch.no_grad()
    def set_expert(self, e: int, gate: torch.Tensor | None, up: torch.Tensor, down: torch.Tensor) -> None:
        """Quantizes one expert's BF16/float weights (gate, up [I, H]; down [H, I]; gate None without one) into slot
        e (values only: no autograd graph from weights that require grad)."""
        E, H, I = self.shape
        if (gate is None) == self.gated:
            raise ValueError(f"expert {e} was given {'no ' if self.gated else 'a '}gate weight, but these experts have "
                             f"{'one' if self.gated else 'none'}.")
        weights = (gate, up, down) if self.gated else (up, down)
        shapes = tuple(tuple(w.shape) for w in weights)
        if shapes != ((I, H),) * self.stacked + ((H, I),):
            raise ValueError(f"expert {e}'s {'gate, ' if self.gated else ''}up and down weights have shapes {shapes}; "
                             f"these experts take {'gate and ' if self.gated else ''}up [I, H] = [{I}, {H}] and down "
                             f"[H, I] = [{H}, {I}].")
        fp8 = self.format == "fp8"
        quantize = (lambda w, name: fp8_block.quantize(w, name, self.row_block)) if fp8 else int4_group.quantize
        stack = ((slice(0, I), 0, gate, "gate"), (slice(I, 2 * I), 1, up, "up")) if self.gated else \
            ((slice(0, I), 0, up, "up"),)
        for rows, scale_rows, w, proj in stack:
            q, s = quantize(w, f"expert {e}'s {proj} weight")
            self.gate_up[e, rows] = q
            if fp8:
                self.gate_up_scale[e, scale_rows] = s
            else:
                self.gate_up_scale[e, rows] = s
        self.down[e], self.down_scale[e] = quantize(down, f"expert {e}'s down weight")

    @classmethod
    def quantize(cls, fmt: str, gate_up: torch.Tensor, down: torch.Tensor, gated: bool = True,
                 row_block: int = fp8_block.BLOCK) -> "QuantizedExperts":
        """From BF16/float experts in the fused layout: gate_up [E, 2I, H] ([E, I, H] without a gate), down
        [E, H, I] (FP8: in blocks of row_block rows)."""
        check_fused_layout(gate_up, down, gated)
        E, H, I = down.shape[0], down.shape[1], down.shape[2]
        out = cls.empty(fmt, E, H, I, gated, row_block)
        for e in range(E):
            out.set_expert(e, gate_up[e, :I] if gated else None, gate_up[e, -I:], down[e])
        return out

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H] or [E, I, H], down [E, H, I]) in float32: the exact values the engine computes with."""
        E, H, I = self.shape
        if self.format == "fp8":
            stack = [fp8_block.dequantize(self.gate_up[:, p * I:(p + 1) * I], self.gate_up_scale[:, p])
                     for p in range(self.stacked)]
            return torch.cat(stack, 1), fp8_block.dequantize(self.down, self.down_scale)
        return (int4_group.dequantize(self.gate_up, self.gate_up_scale, H),
                int4_group.dequantize(self.down, self.down_scale, I))
