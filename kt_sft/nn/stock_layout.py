"""How a stock experts module holds its fused weights where that differs from the engine's layout (gate_up [E, 2I, H]
with gate's rows first, down [E, H, I]), so that state dicts carry the stock layout: a save loads in stock
transformers, and a stock save loads into the engine.

transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H] (Llama 4, GPT-OSS): views both ways.
gated False: experts without a gate (Nemotron-H), whose stock module names up's stack up_proj [E, I, H]: the engine's
gate_up_proj of up's rows alone takes that name in state dicts (no copy).
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


def _put(state_dict: dict, prefix: str, old: str, new: str, value: torch.Tensor) -> None:
    """state_dict[prefix + old] replaced by value under prefix + new (in its place where the names are the same)."""
    if new != old:
        del state_dict[prefix + old]
    state_dict[prefix + new] = value


class StockLayout(NamedTuple):
    transposed: bool = False
    interleaved: bool = False
    gated: bool = True

    @property
    def fused_name(self) -> str:
        """The stock module's name of the engine's gate_up_proj."""
        return "gate_up_proj" if self.gated else "up_proj"

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
        for inner, name, there in self._entries(state_dict, prefix, stock=False):
            value = state_dict[prefix + inner + name]
            if weights_too or name == "gate_up_proj_bias":
                value = self._to_stock(name, value)
            _put(state_dict, prefix + inner, name, there, value)

    def to_engine(self, state_dict: dict, prefix: str) -> None:
        for inner, name, there in self._entries(state_dict, prefix, stock=True):
            _put(state_dict, prefix + inner, there, name, self._to_engine(name, state_dict[prefix + inner + there]))

    def _entries(self, state_dict, prefix, stock):
        """(inner prefix, the engine's name, the stock name) of the module's entries state_dict holds under the stock
        names (stock) or the engine's."""
        if self == StockLayout():
            return []
        fused = self.fused_name
        names = (("gate_up_proj", fused), ("down_proj", "down_proj"), ("gate_up_proj_bias", fused + "_bias"))
        return [(inner, name, there) for inner in ("", "base_layer.") for name, there in names
                if prefix + inner + (there if stock else name) in state_dict]

    def _to_stock(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.interleaved and name != "down_proj":
            t = _interleave(t)
        return t.transpose(1, 2) if self.transposed and name != "gate_up_proj_bias" else t

    def _to_engine(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.transposed and name != "gate_up_proj_bias":
            t = t.transpose(1, 2)
        return _deinterleave(t) if self.interleaved and name != "down_proj" else t
