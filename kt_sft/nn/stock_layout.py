"""How a stock experts module holds its fused weights where that differs from the engine's layout (gate_up [E, 2I, H]
with gate's rows first, down [E, H, I]), so that state dicts carry the stock layout: a save loads in stock
transformers, and a stock save loads into the engine.

transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H] (Llama 4, GPT-OSS): views both ways.
interleaved: gate's and up's outputs alternate (GPT-OSS: output 2j is gate's j, 2j + 1 up's), in gate_up_proj and
in gate_up_proj_bias: a copy each way. PEFT's adapter saves read the whole model's state_dict() and keep only the
adapter's keys, so while one runs (adapter_state_only) the weights are left in the engine's layout: a copy of every
layer's gate_up at each checkpoint would take as much host RAM again as the BF16 experts."""
from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

_adapter_save = threading.local()


@contextlib.contextmanager
def adapter_state_only():
    """While PEFT reads a model's state dict for an adapter save (peft/layer.py wraps it)."""
    depth = getattr(_adapter_save, "depth", 0)
    _adapter_save.depth = depth + 1
    try:
        yield
    finally:
        _adapter_save.depth = depth


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate's I rows then up's -> gate's and up's rows alternating."""
    E, two_i = t.shape[:2]
    return t.reshape(E, 2, two_i // 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    E, two_i = t.shape[:2]
    return t.reshape(E, two_i // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


class StockLayout(NamedTuple):
    transposed: bool = False
    interleaved: bool = False

    def engine_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stock module's (gate_up_proj, down_proj) in the engine's layout (a copy where interleaved)."""
        return self._to_engine("gate_up_proj", gate_up), self._to_engine("down_proj", down)

    def engine_bias(self, gate_up_bias: torch.Tensor | None) -> torch.Tensor | None:
        """A stock module's gate_up_proj_bias [E, 2I] with gate's first."""
        return None if gate_up_bias is None else self._to_engine("gate_up_proj_bias", gate_up_bias)

    def to_stock(self, state_dict: dict, prefix: str) -> None:
        """An experts module's entries (its own, or its PEFT base layer's) from the engine's layout to the stock one;
        the weights left as they are while an adapter save reads the state dict (it keeps none of them)."""
        weights_too = not getattr(_adapter_save, "depth", 0)
        for key, name in self._entries(state_dict, prefix):
            if weights_too or name == "gate_up_proj_bias":
                state_dict[key] = self._to_stock(name, state_dict[key])

    def to_engine(self, state_dict: dict, prefix: str) -> None:
        for key, name in self._entries(state_dict, prefix):
            state_dict[key] = self._to_engine(name, state_dict[key])

    def _entries(self, state_dict, prefix):
        if self == StockLayout():
            return []
        keys = ((prefix + inner + name, name) for inner in ("", "base_layer.")
                for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias"))
        return [(key, name) for key, name in keys if key in state_dict]

    def _to_stock(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.interleaved and name != "down_proj":
            t = _interleave(t)
        return t.transpose(1, 2) if self.transposed and name != "gate_up_proj_bias" else t

    def _to_engine(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.transposed and name != "gate_up_proj_bias":
            t = t.transpose(1, 2)
        return _deinterleave(t) if self.interleaved and name != "down_proj" else t
