"""Which expert format a checkpoint is published in (its config.json `quantization_config`), and reading its
tensors as published: FP8 block-128 (`weight` + `weight_scale_inv`), compressed-tensors FP8 (`weight` + `weight_scale`
per output channel, per tensor or per 128x128 block: the formats "fp8-channel", "fp8-tensor", "fp8-block"),
compressed-tensors pack-quantized INT4 group-32 (`weight_packed` + `weight_scale` + `weight_shape`; groups of 64, 128
or any multiple of 32 as "int4-g<size>": W4A16 releases), or plain BF16 (`weight`); GPT-OSS's MXFP4 experts
(`*_blocks` + `*_scales`, fused) are read by the loader's fused path (formats/mxfp4.py)."""
from __future__ import annotations

import torch

from ..formats import fp8_block, int4_group
from ..models.registry import composite_of

SUPPORTED = ("fp8 (quant_method 'fp8', e4m3, weight_block_size [128, 128]), compressed-tensors float-quantized "
             "fp8 (symmetric, strategy channel, tensor or block [128, 128], activations dynamic or none), "
             "compressed-tensors pack-quantized int4 (symmetric, group_size 32 or a multiple of it, actorder none or "
             "weight), mxfp4 (GPT-OSS's experts, read into BF16, FP8 or INT4), or no quantization_config (BF16)")
# compressed-tensors FP8 by its weights' strategy: each scale grid is exact on the engine's FP8 blocks (a tensor's
# and 128x128 blocks' on blocks of 128 rows, a channel's on blocks of one row).
FP8_STRATEGIES = {"channel": "fp8-channel", "tensor": "fp8-tensor", "block": "fp8-block"}


def is_fp8(fmt: str) -> bool:
    return fmt == "fp8" or fmt in FP8_STRATEGIES.values()


def is_int4(fmt: str) -> bool:
    return fmt == "int4" or fmt.startswith("int4-g")


def int4_group_size(fmt: str) -> int:
    """The columns per scale of INT4 weights published in `fmt` ("int4": 32; "int4-g128": 128)."""
    return int(fmt.removeprefix("int4-g")) if fmt.startswith("int4-g") else int4_group.GROUP


def fp8_row_block(fmt: str) -> int:
    """The weight rows one scale row of the engine's grid covers for FP8 experts published in `fmt`."""
    return 1 if fmt == "fp8-channel" else fp8_block.BLOCK


def _unsupported(what: str) -> ValueError:
    return ValueError(f"this checkpoint's quantization_config has {what}; kt_sft reads {SUPPORTED}.")


def quantization_config_of(raw_config: dict) -> dict | None:
    """A config.json's quantization_config, at the top or (composite checkpoints) in its text_config or the config
    of the part kt_sft serves (Qwen3-Omni's thinker_config)."""
    composite = composite_of(raw_config.get("model_type"))
    nested = ("text_config", *((composite.config_key,) if composite else ()))
    return raw_config.get("quantization_config") or next(
        (raw_config[k]["quantization_config"] for k in nested
         if isinstance(raw_config.get(k), dict) and raw_config[k].get("quantization_config")), None)


def checkpoint_format(quantization_config: dict | None) -> str:
    """'bf16', 'fp8' or 'int4' from a config.json quantization_config; a clear error for anything else."""
    qc = quantization_config
    if not qc:
        return "bf16"
    if not isinstance(qc, dict):
        raise _unsupported(f"the value {qc!r} where an object is expected")
    method = qc.get("quant_method")
    if method == "fp8":
        # "e4m3" as DeepSeek publishes it, "float8_e4m3fn" as MiniMax-M2 does: the same codes.
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn") or \
                list(qc.get("weight_block_size") or []) != [128, 128]:
            raise _unsupported(f"fmt {qc.get('fmt')!r} and weight_block_size {qc.get('weight_block_size')}")
        if qc.get("activation_scheme", "dynamic") != "dynamic":  # static: input_scale tensors to apply
            raise _unsupported(f"activation_scheme {qc.get('activation_scheme')!r} (activations quantized with "
                               "stored scales; 'dynamic' is supported)")
        return "fp8"
    if method == "compressed-tensors":
        # Settings that change what the stored tensors mean: columns in another order (actorder, with a
        # weight_g_idx per weight), rotated weights (transform_config), sparse storage, or tensors not yet packed.
        meaning = {k: qc.get(k) for k in ("transform_config", "sparsity_config", "kv_cache_scheme") if qc.get(k)}
        if isinstance(qc.get("sparsity_config"), dict) and qc["sparsity_config"].get("format") == "dense":
            meaning.pop("sparsity_config")  # stored dense: compressed-tensors itself ignores it
        if qc.get("quantization_status", "compressed") != "compressed":
            meaning["quantization_status"] = qc.get("quantization_status")
        if meaning:
            raise _unsupported(", ".join(f"{k} {v!r}" for k, v in meaning.items()))
        groups = qc.get("config_groups") or {}
        groups = list(groups.values()) if isinstance(groups, dict) else [groups]
        if len(groups) != 1:
            raise _unsupported(f"{len(groups)} config_groups (one group of fp8 or int4 weights is supported)")
        if not isinstance(groups[0], dict) or not isinstance(groups[0].get("weights") or {}, dict):
            raise _unsupported(f"the config group {groups[0]!r}, which is not an object with a weights object")
        weights = groups[0].get("weights") or {}
        fmt = groups[0].get("format") or qc.get("format")
        if weights.get("type") == "float":
            return _compressed_fp8(groups[0], weights, fmt)
        # Groups of any multiple of 32 spread exactly over the engine's 32 (int4_group.to_grid); actorder "weight"
        # (alias "static") only ordered GPTQ's calibration, the stored layout is the same as without it.
        size = weights.get("group_size")
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": size,
                "actorder": None, "dynamic": False, "block_structure": None}
        got = _weight_args(weights, want)
        if got["actorder"] in ("weight", "static"):
            got["actorder"] = None
        if got != want or not (isinstance(size, int) and size > 0 and size % int4_group.GROUP == 0) or \
                fmt != "pack-quantized" or _stored_activation_scales(groups[0]):
            raise _unsupported(f"format {fmt!r} with weights {dict(got, actorder=weights.get('actorder'))}, "
                               f"input_activations {groups[0].get('input_activations')} and output_activations "
                               f"{groups[0].get('output_activations')}")
        return "int4" if size == int4_group.GROUP else f"int4-g{size}"
    if method == "mxfp4":
        return "mxfp4"
    raise _unsupported(f"quant_method {method!r}")


def _weight_args(weights: dict, want: dict) -> dict:
    """The weights' settings named in `want`, a missing one at compressed-tensors' default (symmetric, static)."""
    defaults = {"symmetric": True, "dynamic": False}
    return {k: weights.get(k, defaults.get(k)) for k in want}


def _stored_activation_scales(group: dict) -> bool:
    """Whether a config group quantizes activations with scales stored beside the weights (input activations other
    than dynamic: static, or "local" with a stored global scale) or quantizes outputs: the engine computes on the
    activations as they come, so such a model would compute otherwise than published. Dynamic input activations
    (W8A8 FP8_DYNAMIC, W4AFP8) store nothing."""
    acts = group.get("input_activations")
    return (acts is not None and not (isinstance(acts, dict) and acts.get("dynamic") is True)) or \
        bool(group.get("output_activations"))


def _compressed_fp8(group: dict, weights: dict, fmt) -> str:
    """The format of compressed-tensors FP8 weights (llm-compressor's FP8_DYNAMIC, FP8_BLOCK and weight-only
    schemes); activations quantized with stored scales (input_scale: the static FP8 scheme) are refused, as for
    quant_method fp8, and so is anything else that changes what the stored tensors mean."""
    strategy = weights.get("strategy")
    want = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "actorder": None,
            "group_size": None, "block_structure": [128, 128] if strategy == "block" else None}
    got = _weight_args(weights, want)
    if got != want or strategy not in FP8_STRATEGIES or fmt not in ("float-quantized", "naive-quantized") or \
            _stored_activation_scales(group):
        raise _unsupported(f"format {fmt!r} with weights {dict(got, strategy=strategy)}, input_activations "
                           f"{group.get('input_activations')} and output_activations {group.get('output_activations')}")
    return FP8_STRATEGIES[strategy]


def engine_format(fmt: str) -> str:
    """The engine's format for experts published in `fmt` unless --expert-format says otherwise: their own (FP8 for
    compressed-tensors FP8), or BF16 for MXFP4 (which the engine does not compute on; formats/mxfp4.py)."""
    return "bf16" if fmt == "mxfp4" else "fp8" if is_fp8(fmt) else "int4" if is_int4(fmt) else fmt


def weight_keys(fmt: str, weight_key: str) -> tuple[str, ...]:
    """The checkpoint keys that hold one weight (named by its `<module>.weight` key) in a format."""
    base = weight_key.removesuffix(".weight")
    if fmt == "fp8":
        return weight_key, base + ".weight_scale_inv"
    if is_fp8(fmt):
        return weight_key, base + ".weight_scale"
    if is_int4(fmt):
        return base + ".weight_packed", base + ".weight_scale", base + ".weight_shape"
    return (weight_key,)


def stored_shapes(fmt: str, shape: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
    """The shapes of weight_keys(...) for a weight of `shape` [out, in]."""
    out, inp = shape
    if fmt in ("fp8", "fp8-block"):
        return shape, fp8_block.scale_shape(out, inp)
    if fmt == "fp8-channel":
        return shape, (out, 1)
    if fmt == "fp8-tensor":
        return shape, (1,)
    if is_int4(fmt):
        return (out, int4_group.words(inp)), (out, int4_group.groups(inp, int4_group_size(fmt))), (2,)
    return (shape,)


# Companion tensors: read together with the weight they belong to, never as weights of their own.
COMPANION_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_shape")


def int4_weight_shape(ckpt, key: str, packed_shape: tuple[int, ...]) -> list[int]:
    """The [rows, columns] that the weight_shape tensor beside the packed INT4 weight `key` gives, checked against
    the packed tensor's shape."""
    base = key.removesuffix(".weight_packed")
    stored = ckpt.get(base + ".weight_shape")
    shape = stored.tolist()
    if stored.is_floating_point() or stored.dim() != 1 or len(shape) != 2 or len(packed_shape) != 2 or \
            shape[0] != packed_shape[0]:
        raise ValueError(f"{base}.weight_shape is {shape} ({stored.dtype}), where {key} holds {packed_shape[0]} "
                         "rows: it must be two whole numbers, [rows, columns]; the checkpoint is damaged or was "
                         "written wrongly: download it again.")
    return shape


def stored_weight_shape(ckpt, key: str) -> tuple[str, tuple[int, ...]]:
    """(module key `<module>.weight`, shape of its values) of the tensor `key` as read_weight gives it, from the
    shard headers (and an INT4 weight's weight_shape): no weight is read."""
    if key.endswith(".weight_packed"):
        return key.removesuffix("_packed"), tuple(int4_weight_shape(ckpt, key, ckpt.shape(key)))
    return key, ckpt.shape(key)


def read_weight(ckpt, key: str, read=None, fmt: str = "int4") -> tuple[str, torch.Tensor]:
    """(module key `<module>.weight`, float32 values) of a weight stored quantized, or the tensor as stored for
    everything else. `key` is the key that holds the values (`.weight` or `.weight_packed`); `read(key)` reads a
    tensor (default: ckpt.get); fmt: the checkpoint's format, which gives an INT4 weight's group size."""
    read = read or ckpt.get
    if key.endswith(".weight_packed"):
        base = key.removesuffix(".weight_packed")
        packed = read(key)
        shape = int4_weight_shape(ckpt, key, tuple(packed.shape))
        group = int4_group_size(fmt) if is_int4(fmt) else int4_group.GROUP
        return base + ".weight", int4_group.dequantize(packed, read(base + ".weight_scale"), shape[1], key, group)
    t = read(key)
    scale_key = fp8_scale_key(ckpt, key)
    if t.dtype == torch.float8_e4m3fn:
        return key, fp8_block.dequantize(t, read(scale_key), key)
    if scale_key in ckpt.shard_of:
        raise not_fp8_beside_scales(key, t.dtype, scale_key)
    return key, t


def fp8_scale_key(ckpt, key: str, fmt: str = "fp8") -> str:
    """The scales beside the FP8 `weight` key: `weight_scale_inv` (quant_method fp8) or compressed-tensors'
    `weight_scale`, whichever is stored; with neither, the one the checkpoint's format `fmt` names."""
    base = key.removesuffix(".weight")
    inv, plain = base + ".weight_scale_inv", base + ".weight_scale"
    if inv in ckpt.shard_of or plain in ckpt.shard_of:
        return inv if inv in ckpt.shard_of else plain
    return plain if is_fp8(fmt) and fmt != "fp8" else inv


def stored_fp8_format(ckpt, key: str, shape: tuple[int, ...], checkpoint_fmt: str) -> str:
    """The FP8 format of the F8_E4M3 weight `key` of [rows, columns] `shape` in a checkpoint published in
    `checkpoint_fmt`: "fp8" beside weight_scale_inv; beside compressed-tensors' weight_scale the checkpoint's
    strategy (one config group), else the grid the scales' shape gives."""
    scale_key = fp8_scale_key(ckpt, key, checkpoint_fmt)
    if scale_key.endswith("_inv"):
        return "fp8"
    if is_fp8(checkpoint_fmt):
        return checkpoint_fmt
    return next((f for f in FP8_STRATEGIES.values() if stored_shapes(f, shape)[1] == ckpt.shape(scale_key)),
                "fp8-block")


def not_fp8_beside_scales(key: str, dtype, scale_key: str) -> ValueError:
    return ValueError(f"{key} is {dtype} beside its FP8 scales ({scale_key}), where FP8 weights are float8_e4m3fn; its "
                      "values would be read as plain numbers: check that the checkpoint and its quantization_config "
                      "belong together.")


def check_stored_weight(ckpt, key: str, shape: tuple[int, ...], checkpoint_fmt: str = "bf16") -> None:
    """A weight outside the routed experts stored quantized (FP8 `weight` of F8_E4M3 or beside block scales, INT4
    `weight_packed`), checked from the shard headers against the [rows, columns] it holds: the value dtype, and its
    companions present with the shapes those imply (else the load fails after reading every other weight)."""
    scale_key = fp8_scale_key(ckpt, key, checkpoint_fmt)
    if key.endswith(".weight_packed"):
        fmt = checkpoint_fmt if is_int4(checkpoint_fmt) else "int4"
    elif ckpt.dtype(key) == "F8_E4M3" or scale_key in ckpt.shard_of:
        if ckpt.dtype(key) != "F8_E4M3":
            raise not_fp8_beside_scales(key, ckpt.dtype(key), scale_key)
        fmt = stored_fp8_format(ckpt, key, shape, checkpoint_fmt)
    else:
        return
    keys = weight_keys(fmt, key.removesuffix("_packed"))
    for companion, want in zip(keys, stored_shapes(fmt, shape)):
        if companion not in ckpt.shard_of:
            raise ValueError(f"the checkpoint has no {companion}, which {key} ({fmt.upper()}) needs beside it; the "
                             "checkpoint is incomplete or damaged: download it again.")
        if ckpt.shape(companion) != want:
            raise ValueError(f"{companion} has shape {list(ckpt.shape(companion))} where {key} ({fmt.upper()}) of "
                             f"{list(shape)} values implies {list(want)}; the checkpoint is damaged or was written "
                             "wrongly: download it again.")
