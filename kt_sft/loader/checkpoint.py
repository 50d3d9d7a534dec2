"""A safetensors checkpoint directory: which shard holds which key, tensor shapes from the headers (no
weight is read to check a checkpoint), tensors read one at a time, and expert weights read with plain
file reads straight into the engine's buffers (no memory map, whose touched pages would stay in the
process's RSS next to the engine's copy, and no intermediate tensor but one converted copy where the stored
dtype is not the engine's)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file


def open_safetensors(path: Path):
    """safe_open of a safetensors file, a damaged or incomplete one named in the error (the library's own message
    says neither which file nor what to do)."""
    try:
        return safe_open(str(path), "pt")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); it is damaged or incomplete: download or "
                         "save it again.") from None
    except OSError as e:  # safetensors' own words are "No such file or directory" whatever the cause, or an errno's
        if path.is_dir():
            raise ValueError(f"{path} is a directory, not a safetensors file; put the model's weights files in its "
                             "place (download it again).") from None
        if path.exists():
            raise ValueError(f"{path} exists but could not be opened for reading ({e}): check that this user may "
                             "read it (its permissions), and download it again if it is damaged.") from None
        raise


def write_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """save_file, with a failure to write (permissions, a full disk) said as an OSError naming the file."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise OSError(f"cannot write {path} ({e}); check the directory's permissions and free space.") from None


def _weight_map(index: Path) -> dict[str, str]:
    """The index's key -> shard map, checked: shard names are files inside the checkpoint directory (a writer that
    follows them, `kt-sft merge`, must never reach a file outside its output)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index} is not a safetensors index ({e}); the download is incomplete or damaged.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to shard files; the download is incomplete or "
                         "damaged.")
    for shard in set(weight_map.values()):
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(f"{index} names the shard {shard!r}, outside the checkpoint directory; shard names must "
                             "be files inside it.")
    return dict(weight_map)


INDEX_NAME = "model.safetensors.index.json"


class Checkpoint:
    """Keys are the checkpoint's own, or, with `prefix` (e.g. "language_model." for Kimi-K2.5, whose text model
    sits beside a vision tower; "thinker." for Qwen3-Omni), only the keys under it, with the prefix removed."""

    def __init__(self, directory: str | Path, prefix: str = ""):
        self.dir = Path(directory)
        self.prefix = prefix
        index = self.dir / INDEX_NAME
        single = self.dir / "model.safetensors"
        self.from_index = not single.exists() and index.exists()
        for path in (single, index):
            if path.is_symlink() and not path.exists():
                raise FileNotFoundError(f"{path} is a link to {os.readlink(path)}, which does not exist (a Hugging "
                                        "Face cache's blob deleted, or a download not finished); download the model "
                                        "again.")
        if single.exists():  # before the index, as transformers reads a directory that holds both
            with open_safetensors(single) as f:
                self.shard_of = {k: single.name for k in f.keys()}
        elif index.exists():
            self.shard_of = _weight_map(index)
        else:
            raise FileNotFoundError(f"{self.dir} has no model.safetensors or model.safetensors.index.json; point at "
                                    "a Hugging Face model directory with safetensors weights.")
        if prefix:
            self.shard_of = {k[len(prefix):]: s for k, s in self.shard_of.items() if k.startswith(prefix)}
            if not self.shard_of:
                raise ValueError(f"{self.dir} holds no tensor under {prefix!r}; its config.json and weights disagree.")
        missing = sorted({s for s in self.shard_of.values() if not (self.dir / s).is_file()})
        if missing:
            raise FileNotFoundError(f"{self.dir} lacks shard(s) {', '.join(missing[:3])}"
                                    f"{' and more' if len(missing) > 3 else ''} named by its index; download them.")
        self._handles: dict[str, object] = {}

    def keys(self):
        return self.shard_of.keys()

    def _shard(self, key: str) -> str:
        """The shard file that holds `key`, or a ValueError that says the checkpoint lacks it."""
        try:
            return self.shard_of[key]
        except KeyError:
            raise ValueError(f"the checkpoint {self.dir} has no tensor {self.prefix + key}; it is incomplete or not the "
                             "one its config.json describes: download it again.") from None

    def unindexed_shard(self, key: str) -> str | None:
        """The shard that holds `key` where the index does not list it (a stale index), else None."""
        if not self.from_index:
            return None
        for shard in sorted(set(self.shard_of.values())):
            with open_safetensors(self.dir / shard) as f:
                if self.prefix + key in f.keys():
                    return shard
        return None

    def not_in_shard(self, key: str) -> ValueError:
        return ValueError(f"{self.dir}'s index puts {self.prefix + key} in {self.shard_of[key]}, which does not hold "
                          "it; the index is stale or the shard incomplete: download the checkpoint again.")

    def _open(self, key: str):
        shard = self._shard(key)
        if shard not in self._handles:
            self._handles[shard] = open_safetensors(self.dir / shard)
        return self._handles[shard]

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._open(key)  # safe_open first: a damaged shard is named as such
        try:
            return tuple(handle.get_slice(self.prefix + key).get_shape())
        except SafetensorError:
            raise self.not_in_shard(key) from None

    def get(self, key: str) -> torch.Tensor:
        handle = self._open(key)
        try:
            return handle.get_tensor(self.prefix + key)
        except SafetensorError:
            raise self.not_in_shard(key) from None

    def _entry(self, key: str):
        """(shard path, absolute byte offset, dtype string, shape) of a tensor, from its shard's header."""
        self._open(key)  # safe_open first: a damaged shard is named as such, not parsed below
        shard = self.dir / self._shard(key)
        if not hasattr(self, "_headers"):
            self._headers = {}
        if shard not in self._headers:
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[shard] = (8 + n, json.loads(f.read(n)))
        base, header = self._headers[shard]
        meta = header.get(self.prefix + key)
        if meta is None:
            raise self.not_in_shard(key)
        return shard, base + meta["data_offsets"][0], meta["dtype"], tuple(meta["shape"])

    def dtype(self, key: str) -> str:
        """The safetensors dtype string of a tensor (BF16, F8_E4M3, I32, F32, ...), from its shard's header."""
        return self._entry(key)[2]

    def read_new(self, key: str) -> torch.Tensor:
        """Tensor `key` read with plain file reads into a new tensor of its own dtype (no memory map)."""
        _, _, dtype, shape = self._entry(key)
        if dtype not in _RAW_DTYPES:
            return self.get(key)
        out = torch.empty(shape, dtype=_RAW_DTYPES[dtype])
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fills `out` (contiguous, CPU) with tensor `key`: file bytes straight into `out` when the dtypes
        match (BF16, FP8 or packed INT4 checkpoints into experts of the same format), else through one
        converted copy."""
        shard, offset, dtype, shape = self._entry(key)
        if shape != tuple(out.shape):
            raise ValueError(f"{key} has shape {list(shape)} but {list(out.shape)} was expected.")
        if _RAW_DTYPES.get(dtype) == out.dtype and out.is_contiguous():
            _read_bytes(shard, offset, out, key)
        else:
            out.copy_(self.read_new(key))

    def read_slice(self, key: str, index: int) -> torch.Tensor:
        """`key`[index] along its first dimension, read with plain file reads into a new tensor of its stored dtype
        (one expert of a fused experts tensor, not the whole layer's)."""
        shard, offset, dtype, shape = self._entry(key)
        if dtype not in _RAW_DTYPES or not 0 <= index < shape[0]:
            raise ValueError(f"{key} ({dtype}, {list(shape)}) has no slice {index} to read in place.")
        out = torch.empty(shape[1:], dtype=_RAW_DTYPES[dtype])
        _read_bytes(shard, offset + index * out.numel() * out.element_size(), out, key)
        return out


def _read_bytes(shard: Path, offset: int, out: torch.Tensor, key: str) -> None:
    """Fills contiguous `out` with the shard's bytes from `offset`."""
    buf = memoryview(out.view(torch.uint8).numpy()).cast("B")
    with open(shard, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(buf):  # one read returns at most ~2 GiB on Linux
            n = f.readinto(buf[done:])
            if not n:
                raise ValueError(f"{shard.name} ends inside tensor {key}; the shard is truncated.")
            done += n


# safetensors dtypes whose file bytes are the torch tensor's bytes (little-endian x86).
_RAW_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "F32": torch.float32,
               "F16": torch.float16, "U8": torch.uint8}
