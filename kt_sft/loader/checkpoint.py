"""A safetensors checkpoint directory: which shard holds which key, tensor shapes from the headers (no
weight is read to check a checkpoint), and tensors read one at a time through memory maps."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.exists():
            self.shard_of = dict(json.loads(index.read_text())["weight_map"])
        elif single.exists():
            with safe_open(str(single), "pt") as f:
                self.shard_of = {k: single.name for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has no model.safetensors or model.safetensors.index.json; point at "
                                    "a Hugging Face model directory with safetensors weights.")
        missing = sorted({s for s in self.shard_of.values() if not (self.dir / s).exists()})
        if missing:
            raise FileNotFoundError(f"{self.dir} lacks shard(s) {', '.join(missing[:3])}"
                                    f"{' and more' if len(missing) > 3 else ''} named by its index; download them.")
        self._handles: dict[str, object] = {}

    def keys(self):
        return self.shard_of.keys()

    def _open(self, key: str):
        shard = self.shard_of[key]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.dir / shard), "pt")
        return self._handles[shard]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(key).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._open(key).get_tensor(key)
