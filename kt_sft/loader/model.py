"""Builds a transformers MoE model whose routed experts live in the CPU engine, streaming the checkpoint.

Non-expert weights are read from the shards into the stock model (built with parameters on the meta device,
so nothing is allocated twice); ones stored in FP8 or INT4 are dequantized to the model dtype. Routed experts
go one layer at a time from the per-expert tensors straight into the engine's fused layout, in the format
asked for (default: the checkpoint's own, read byte for byte; or quantized / dequantized expert by expert):
the full expert set never exists as a second copy, and no expert weight is ever given to the GPU.
"""
from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from .._ext import profile_every, require_one_process, require_settings
from ..formats import QuantizedExperts, fp8_block, int4_group, mxfp4
from ..models import architecture_of
from ..models.registry import text_config_of
from ..models.patch import accept_per_expert_weights, install_around_the_engine
from ..nn.stock_layout import StockLayout
from ..ops.step_profile import attach_step_profile
from ..peft.layer import KTExpertsLinear
from ..peft.targets import WarnMissedExpertTargets
from .checkpoint import Checkpoint
from .quantization import (COMPANION_SUFFIXES, check_stored_weight, checkpoint_format, engine_format, fp8_row_block,
                           int4_group_size, is_int4, quantization_config_of, read_weight, stored_shapes,
                           stored_weight_shape, weight_keys)

_LAYER = re.compile(r"layers\.(\d+)\.")


def experts_modules(model, arch):
    """(module path, layer index) of every experts module of the arch in the model."""
    out = []
    for name, module in model.named_modules():
        if arch.holds_experts(module):
            m = _LAYER.search(name + ".")
            if not m:
                raise ValueError(f"cannot tell the layer of experts module {name}.")
            out.append((name, int(m.group(1)), module))
    return out


def source_format(source: str | Path) -> str:
    """The expert format a checkpoint directory is published in, from its config.json quantization_config."""
    return checkpoint_format(quantization_config_of(json.loads((Path(source) / "config.json").read_text())))


# The safetensors dtypes each of weight_keys(fmt, ...) may be stored in: read as stored or converted to the
# engine's dtype (F16/F32 values of BF16 experts rounded to BF16, as a BF16 from_pretrained rounds them), never
# read as numbers they are not.
# By engine_format: compressed-tensors FP8 as FP8, INT4 of any group size as INT4.
_STORED_DTYPES = {
    "bf16": (("BF16", "F16", "F32"),),
    "fp8": (("F8_E4M3",), ("F32", "BF16", "F16")),
    "int4": (("I32",), ("BF16",), ("I32", "I64")),  # the engine keeps the group scales in BF16
}


def _unquantized_expert(key: str, fmt: str) -> ValueError:
    return ValueError(f"{key} is stored unquantized among the checkpoint's {fmt} experts (its quantization_config "
                      "leaves some out, e.g. by an `ignore` list); kt_sft reads checkpoints whose routed experts are "
                      "all in one format: dequantize this one to BF16 elsewhere first.")


def _stored_dtype_error(key: str, dtype: str, fmt: str, dtypes: tuple[str, ...]) -> ValueError:
    if is_int4(fmt) and key.endswith(".weight_scale"):
        return ValueError(f"{key} is {dtype}; kt_sft reads INT4 group scales as BF16, as the RAWINT4 checkpoints "
                          "publish them, and would round these: requantize with BF16 scales, or prepare a BF16 "
                          "checkpoint with `--expert-format int4`.")
    if fmt != "bf16" and key.endswith(".weight") and dtype in ("BF16", "F16", "F32"):
        return _unquantized_expert(key, fmt)
    if fmt == "bf16" and dtype in ("F8_E4M3", "I32"):
        return ValueError(f"{key} is stored as {dtype}, but config.json has no quantization_config, so its values "
                          "would be read as plain numbers; restore the quantization_config the checkpoint was "
                          "published with.")
    return ValueError(f"{key} is stored as {dtype}, where {fmt} experts keep {' or '.join(dtypes)}; check that "
                      "config.json's quantization_config belongs to these weights.")


def _first_of(keys: list[str]) -> str:
    return f"{keys[0]}{f' and {len(keys) - 1} more' if len(keys) > 1 else ''}"


def _check_group_routing(config, E: int, top_k) -> None:
    """DeepSeek-V3's (and GLM-4.5's, Kimi-K2's) router picks topk_group of n_group groups of experts, then top_k
    experts in them: sizes that do not fit failed in the router's reshape, or at some token counts routed within
    groups that straddle tokens."""
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if not (isinstance(n_group, int) and isinstance(topk_group, int) and isinstance(top_k, int)) or \
            getattr(config, "topk_method", None) == "greedy":  # DeepSeek-V2's greedy routing reads no groups
        return
    # A group scores as its two best experts (transformers' routers), so a group holds two or more.
    if n_group < 1 or E % n_group or E // n_group < 2 or not 1 <= topk_group <= n_group or \
            top_k > topk_group * (E // n_group):
        raise ValueError(f"config.json's group routing does not fit its {E} experts (n_group = {n_group}, topk_group = "
                         f"{topk_group}, num_experts_per_tok = {top_k}): n_group must divide the experts into groups "
                         "of two or more, topk_group be 1 to n_group and num_experts_per_tok at most topk_group times "
                         "the experts per group; restore the published config.json.")


def model_class(config):
    """The transformers auto class that builds config's model: an image-text model where its config is one
    (Qwen3-VL-MoE, Qwen3.5-MoE: the config nests the text model's), else a causal LM; LLaMA-Factory picks the
    same way."""
    image_text = type(config) in AutoModelForImageTextToText._model_mapping
    return AutoModelForImageTextToText if image_text else AutoModelForCausalLM


def check_checkpoint(ckpt: Checkpoint, config, fmt: str = "bf16") -> None:
    """Every expert tensor (and its scales) is present with the shape config.json implies, before any weight
    is read."""
    arch = architecture_of(config)
    text = text_config_of(config)
    try:
        with init_empty_weights():
            skeleton = model_class(config).from_config(config)
        arch.experts_in_place(skeleton)
    except (RuntimeError, ValueError, ArithmeticError, TypeError) as e:  # a size no layer can have (vocab_size
        raise ValueError(f"config.json describes no buildable {config.model_type} model "  # -1, 0 heads, ...)
                         f"({' '.join(str(e).split())}); the file was edited or is not that model's.") from None
    marks = tuple(k[1:] for k in weight_keys(fmt, "x.weight") if k != "x.weight")  # only quantized weights have
    if marks and not any(k.endswith(marks) for k in ckpt.keys()):
        raise ValueError(f"config.json declares {fmt.upper()} weights (its quantization_config) but the checkpoint "
                         f"holds no {' or '.join(marks)} tensors, so its weights are not quantized (e.g. converted to "
                         "BF16 by DeepSeek's fp8_cast_bf16.py); remove quantization_config from config.json.")
    skipped = class_skips(skeleton, arch)
    past = sorted((n, k) for k in ckpt.keys() if (n := layer_past_the_model(k, text)) is not None
                  and not prediction_layer(k, text) and not skipped(k))
    if past:  # the loader would leave those layers out: another model than the checkpoint's
        raise ValueError(f"the checkpoint holds layer {past[-1][0]} ({past[-1][1]}), past the "
                         f"{text.num_hidden_layers} layers that config.json's num_hidden_layers gives (with "
                         f"{prediction_layers(text)} multi-token-prediction layers after them, by its "
                         "num_nextn_predict_layers or num_mtp_modules); check that config.json belongs to these "
                         "weights.")
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = experts_modules(skeleton, arch)
    if not experts:
        raise arch.no_experts_error(skeleton)
    Z = arch.identity_count(config)
    for name, layer, module in experts:
        E, I, H = arch.expert_dims(module)
        if isinstance(top_k, int) and not 1 <= top_k <= E + Z:
            raise ValueError(f"config.json routes each token to num_experts_per_tok = {top_k} of {E + Z} experts; it "
                             f"must be 1 to {E + Z}.")
        _check_group_routing(text, E, top_k)
        for extra in (weight_keys(fmt, arch.expert_key(layer, E + Z, arch.projections[0]))[0],
                      weight_keys(fmt, arch.expert_key(layer, E, 2))[0]):
            if extra in ckpt.shard_of:  # config.json gives fewer experts than the checkpoint has
                raise ValueError(f"the checkpoint has {extra}, an expert past the {E} per layer that config.json's "
                                 f"{config.model_type} layout gives; check that config.json belongs to these "
                                 "weights.")
        fused = fused_keys(ckpt, arch, layer, name)
        if fmt == "mxfp4" and not fused:
            raise ValueError(f"config.json declares MXFP4 experts (its quantization_config), but the checkpoint has no "
                             f"{arch.experts_prefix(layer)}gate_up_proj{mxfp4.SUFFIXES[0]}: kt_sft reads MXFP4 "
                             "experts fused, as GPT-OSS publishes them; check that config.json belongs to these "
                             "weights.")
        if arch.restructure is not None and not fused:  # Granite: published fused, beside the router
            stored = arch.checkpoint_name(arch.experts_prefix(layer) + "gate_up_proj")
            raise ValueError(f"the checkpoint has no {stored} (layer {layer}'s routed experts, which "
                             f"{arch.model_type} checkpoints hold fused); "
                             "check that config.json belongs to these weights, or download the missing shards.")
        if arch.expert_biases and not fused:
            raise ValueError(f"the checkpoint has no {arch.experts_prefix(layer)}gate_up_proj: kt_sft reads "
                             f"{arch.model_type}'s experts fused with their biases, as they are published; save the "
                             "model with a transformers version that writes them so.")
        expected = _check_fused(ckpt, arch, fused, fmt, layer, E, I, H, Z) if fused else \
            _check_per_expert(ckpt, config, arch, fmt, layer, E, I, H)
        # Stock LongCat-Flash saves gate and up rows of its zero-computation experts, which no expert reads.
        expected |= {k for e in range(E, E + Z) for p in arch.projections[:-1]
                     for k in weight_keys(fmt, arch.expert_key(layer, e, p))}
        # The loader reads the expert keys above and skips the rest under the experts' prefix: a tensor there that
        # changes what they mean (a column order, zero points, input scales) would be lost without a word.
        prefixes = experts_key_prefixes(arch, layer, name)
        other = sorted(k for k in ckpt.keys() if in_experts(arch, k, prefixes) and k not in expected)
        if other:
            raise ValueError(f"the checkpoint has {_first_of(other)} "
                             f"beside layer {layer}'s {fmt} experts, which kt_sft does not read ({fmt} experts are "
                             f"{', '.join(k.rsplit('.', 1)[1] for k in weight_keys(fmt, 'x.weight'))} only); check "
                             "that the checkpoint and its quantization_config belong together.")
    _check_other_weights(ckpt, skeleton, config, arch, experts, fmt)


def _check_per_expert(ckpt: Checkpoint, config, arch, fmt: str, layer: int, E: int, I: int, H: int) -> set[str]:
    """A layer's experts stored one tensor (and its scales) per expert and projection, as models are published:
    each present with the dtype and shape config.json implies. Returns their keys."""
    want = ((I, H), (I, H), (H, I))
    expected = set()
    for e in range(E):
        for p in arch.projections:
            keys = weight_keys(fmt, arch.expert_key(layer, e, p))
            expected.update(keys)
            for key, shape, dtypes in zip(keys, stored_shapes(fmt, want[p]), _STORED_DTYPES[engine_format(fmt)]):
                if key not in ckpt.shard_of:
                    plain = arch.expert_key(layer, e, p)
                    if fmt != "bf16" and plain in ckpt.shard_of and ckpt.dtype(plain) in ("BF16", "F16", "F32"):
                        raise _unquantized_expert(plain, fmt)
                    if fmt == "bf16" and plain.removesuffix(".weight") + ".weight_packed" in ckpt.shard_of:
                        raise ValueError(f"the checkpoint stores {plain} packed as INT4 (.weight_packed), but "
                                         "config.json has no quantization_config, so it would be read as BF16; "
                                         "restore the quantization_config the checkpoint was published with.")
                    shard = ckpt.unindexed_shard(key)
                    if shard is not None:
                        raise ValueError(f"{ckpt.dir}'s index does not list {key}, which {shard} holds; the index "
                                         "is stale or damaged: download it again.")
                    raise ValueError(f"the checkpoint has no {key}, which config.json's {config.model_type} "
                                     f"layout ({fmt} experts) implies; check that config.json belongs to these "
                                     "weights.")
                if ckpt.dtype(key) not in dtypes:  # first: another dtype packs other shapes (INT4 in bytes)
                    raise _stored_dtype_error(key, ckpt.dtype(key), fmt, dtypes)
                if ckpt.shape(key) != shape:
                    raise ValueError(f"{key} has shape {list(ckpt.shape(key))} but config.json implies "
                                     f"{list(shape)}; check that config.json belongs to these weights.")
            if is_int4(fmt):
                key = keys[2]
                if ckpt.get(key).tolist() != list(want[p]):
                    raise ValueError(f"{key} says {ckpt.get(key).tolist()} but config.json implies "
                                     f"{list(want[p])}; check that config.json belongs to these weights.")
    return expected


def experts_key_prefixes(arch, layer: int, module: str) -> tuple[str, ...]:
    """What a checkpoint's keys of a layer's routed experts start with: the per-expert layout's prefix, the experts
    module's path (a raw state_dict save of fused experts) and that path under the checkpoint's names (Qwen3.5-MoE
    publishes its experts fused at model.language_model.layers.N.mlp.experts)."""
    return tuple(dict.fromkeys((arch.experts_prefix(layer), *(f"{name}." for name in arch.stored_names(module)))))


def fused_keys(ckpt: Checkpoint, arch, layer: int, module: str, prefix: str = "") -> tuple[str, str] | None:
    """The keys of a layer's experts stored fused (`gate_up_proj`, `down_proj`: fused_shapes; MXFP4 ones under these
    names with `_blocks` and `_scales` appended), or None where they are stored per expert. prefix: the text model's
    key prefix, where ckpt reads a composite checkpoint's keys whole (kt-sft merge)."""
    fused = arch.stock_layout().fused_name  # up_proj without a gate (Nemotron-H)
    for base in experts_key_prefixes(arch, layer, module):
        names = (f"{prefix}{base}{fused}", f"{prefix}{base}down_proj")
        for keys in dict.fromkeys((names, tuple(map(arch.checkpoint_name, names)))):  # Granite's input_linear, ...
            if any(k + suffix in ckpt.shard_of for k in keys for suffix in ("", *mxfp4.SUFFIXES)):
                return keys
    return None


def fused_shapes(arch, E: int, I: int, H: int, Z: int = 0) -> dict[tuple, bool]:
    """The shapes a layer's fused experts may be stored in -> whether they are transposed from the transformers 5
    module's gate_up_proj [E, 2I, H] (up_proj [E, I, H] without a gate) and down_proj [E, H, I]: the module's, and the
    transposed ones where the architecture publishes those (Qwen3-VL-MoE; transformers reads both). Never the same
    pair: that would take H = 2I and H = I at once. Z zero-computation experts: gate_up_proj may also have E + Z
    rows, as LongCat-Flash's module holds it (the last Z unread)."""
    shapes, SI = {}, arch.unit.stacked * I
    for rows in dict.fromkeys((E, E + Z)):
        shapes[(rows, SI, H), (E, H, I)] = False
        if arch.fused_transposed:
            shapes[(rows, H, SI), (E, I, H)] = True
    return shapes


def fused_transposed(ckpt: Checkpoint, arch, keys: tuple[str, str], E: int, I: int, H: int, Z: int = 0) -> bool:
    """Whether a layer's fused experts (keys, checked by _check_fused) are stored transposed."""
    return fused_shapes(arch, E, I, H, Z)[tuple(ckpt.shape(k) for k in keys)]


def _check_fused(ckpt: Checkpoint, arch, keys: tuple[str, str], fmt: str, layer: int, E: int, I: int,
                 H: int, Z: int = 0) -> set[str]:
    if fmt == "mxfp4":
        return _check_mxfp4(ckpt, arch, keys, layer, E, I, H) | _check_biases(ckpt, arch, keys, fmt, E, I, H)
    if stored_in_mxfp4(ckpt, keys):
        raise ValueError(f"the checkpoint stores layer {layer}'s experts in MXFP4 ({keys[0]}{mxfp4.SUFFIXES[0]}), but "
                         "config.json has no MXFP4 quantization_config, so they would be read as another format; "
                         "restore the quantization_config the checkpoint was published with.")
    if fmt != "bf16":
        raise ValueError(f"the checkpoint stores layer {layer}'s {fmt.upper()} routed experts fused ({keys[0]}), where "
                         f"kt_sft reads {fmt.upper()} experts one tensor per expert, as they are published; prepare "
                         "the published checkpoint, or a BF16 one with `--expert-format`.")
    for key in keys:
        if key not in ckpt.shard_of:
            raise ValueError(f"the checkpoint has {keys[1 - keys.index(key)]} but no {key}: a layer's fused experts "
                             "need both; the checkpoint is incomplete: save or download it again.")
        if ckpt.dtype(key) not in _STORED_DTYPES["bf16"][0]:
            raise _stored_dtype_error(key, ckpt.dtype(key), fmt, _STORED_DTYPES["bf16"][0])
    shapes = fused_shapes(arch, E, I, H, Z)
    stored = tuple(ckpt.shape(k) for k in keys)
    if stored not in shapes:
        said = " or ".join(" and ".join(str(list(s)) for s in pair) for pair in shapes)
        stack = "2 x intermediate" if arch.unit.gated else "intermediate"
        raise ValueError(f"{keys[0]} and {keys[1]} have shapes {list(stored[0])} and {list(stored[1])} but config.json "
                         f"implies {said} (fused experts: [experts, {stack}, hidden] and [experts, hidden, "
                         f"intermediate]{', or transposed' if len(shapes) > 1 else ''}); check that config.json "
                         "belongs to these weights.")
    return {*keys, *_check_biases(ckpt, arch, keys, fmt, E, I, H)}


def stored_in_mxfp4(ckpt: Checkpoint, fused: tuple[str, str]) -> bool:
    """Whether a layer's fused experts (fused_keys) are stored as MXFP4 blocks and scales."""
    return any(k + suffix in ckpt.shard_of for k in fused for suffix in mxfp4.SUFFIXES)


def _check_mxfp4(ckpt: Checkpoint, arch, keys: tuple[str, str], layer: int, E: int, I: int, H: int) -> set[str]:
    """A layer's MXFP4 experts (formats/mxfp4.py), as GPT-OSS publishes them: gate_up [E, 2I, H] and down [E, H, I],
    each as uint8 blocks and scales. Returns their keys."""
    expected = set()
    for key, (out, inp) in zip(keys, ((2 * I, H), (H, I))):
        if inp % mxfp4.GROUP:
            raise ValueError(f"{key}'s rows hold {inp} weights, which MXFP4 stores in whole groups of "
                             f"{mxfp4.GROUP}; check that config.json belongs to these weights.")
        for suffix, shape in zip(mxfp4.SUFFIXES, ((E, out, inp // mxfp4.GROUP, mxfp4.GROUP // 2),
                                                   (E, out, inp // mxfp4.GROUP))):
            stored = key + suffix
            if stored not in ckpt.shard_of:
                raise ValueError(f"the checkpoint has no {stored}, which layer {layer}'s MXFP4 experts need; the "
                                 "checkpoint is incomplete: download it again.")
            if ckpt.dtype(stored) != "U8" or ckpt.shape(stored) != shape:
                raise ValueError(f"{stored} is {ckpt.dtype(stored)} {list(ckpt.shape(stored))} but config.json implies "
                                 f"U8 {list(shape)}; check that config.json belongs to these weights.")
            expected.add(stored)
    return expected


def _check_biases(ckpt: Checkpoint, arch, keys: tuple[str, str], fmt: str, E: int, I: int, H: int) -> set[str]:
    """The biases beside a layer's fused experts where the architecture has them (GPT-OSS's). Returns their keys."""
    if not arch.expert_biases:
        return set()
    for key, shape in zip(bias_keys(keys), ((E, 2 * I), (E, H))):
        if key not in ckpt.shard_of:
            raise ValueError(f"the checkpoint has no {key}, which {arch.model_type}'s experts have; the checkpoint is "
                             "incomplete: save or download it again.")
        if ckpt.dtype(key) not in _STORED_DTYPES["bf16"][0]:
            raise _stored_dtype_error(key, ckpt.dtype(key), fmt, _STORED_DTYPES["bf16"][0])
        if ckpt.shape(key) != shape:
            raise ValueError(f"{key} has shape {list(ckpt.shape(key))} but config.json implies {list(shape)}; check "
                             "that config.json belongs to these weights.")
    return set(bias_keys(keys))


def bias_keys(fused: tuple[str, str]) -> tuple[str, str]:
    """The keys of the biases beside a layer's fused experts (GPT-OSS's gate_up_proj_bias, down_proj_bias)."""
    return fused[0] + "_bias", fused[1] + "_bias"


def class_skips(model, arch):
    """A test of a checkpoint key: whether from_pretrained skips it as the model's class tells it to, which it does
    only for keys that name no weight of the model (Qwen3-Next's multi-token-prediction module `mtp.*`; GLM-4.5-Air's
    and GLM-4.5V's prediction layer 46, a pattern that also matches layer 46 of GLM-4.5's 92, whose weights had been
    skipped, and the model refused as lacking them)."""
    pattern = re.compile("|".join(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) or "(?!)")
    names = set(model.state_dict())
    return lambda key: pattern.search(key) is not None and arch.module_key(key.removesuffix("_packed")) not in names


def other_weight_keys(ckpt: Checkpoint, model, arch, experts) -> list[str]:
    """The checkpoint keys the loader reads into the model itself: all but the routed experts (experts_modules'
    `experts`, per expert or fused), the companions of quantized weights (read with them), the multi-token-prediction
    layers, and what the model's class tells from_pretrained to skip (Qwen3-Next's multi-token-prediction module,
    `mtp.*`)."""
    prefixes = tuple(p for name, layer, _ in experts for p in experts_key_prefixes(arch, layer, name))
    skipped = class_skips(model, arch)
    return [k for k in ckpt.keys() if not (in_experts(arch, k, prefixes) or k.endswith(COMPANION_SUFFIXES)
                                           or prediction_layer(k, text_config_of(model.config)) or skipped(k))]


def in_experts(arch, key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a checkpoint key (or a state dict's) is of the routed experts whose keys start with prefixes
    (experts_key_prefixes), under its own name or the module tree's (Granite's input_linear: experts.gate_up_proj)."""
    return key.startswith(prefixes) or arch.module_key(key).startswith(prefixes)


def _check_other_weights(ckpt: Checkpoint, skeleton, config, arch, experts, fmt: str) -> None:
    """The weights outside the routed experts, from the shard headers: each is a weight of the model config.json
    describes, with its shape, and the model's every weight is in the checkpoint (or tied to one that is). The
    load had found these only after reading every such weight (~34 GB at DeepSeek-V3), prepare not at all."""
    targets = {**dict(skeleton.named_parameters()), **dict(skeleton.named_buffers())}
    found, unexpected = set(), []
    for key in sorted(other_weight_keys(ckpt, skeleton, arch, experts)):
        weight_key, shape = stored_weight_shape(ckpt, key)
        name = arch.module_key(weight_key)
        if name not in targets:
            unexpected.append(key)
        elif shape != tuple(targets[name].shape):
            stored = f"{weight_key}_shape says" if key.endswith("_packed") else f"{key} has shape"
            raise ValueError(f"{stored} {list(shape)} but config.json implies {list(targets[name].shape)}; check that "
                             "config.json belongs to these weights.")
        check_stored_weight(ckpt, key, shape, fmt)
        found.add(name)
    if unexpected:
        raise ValueError(f"the checkpoint has {_first_of(unexpected)}, which no weight of the {config.model_type} "
                         "model that config.json describes matches; check that config.json belongs to these weights "
                         "(its layer count, its dense layers such as mlp_only_layers, first_k_dense_replace or "
                         "mlp_layer_types).")
    tied = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    tied.update({source: target for target, source in tied.items()})  # either side of a tie may be stored
    experts_prefixes = tuple(f"{name}." for name, _, _ in experts)
    # The state dict's names: parameters, and the buffers a checkpoint holds (DeepSeek-V3's routing bias, which the
    # load would otherwise leave at its initial zeros).
    missing = [n for n in skeleton.state_dict() if not in_experts(arch, n, experts_prefixes) and n not in found
               and tied.get(n) not in found]
    if missing:
        raise ValueError(f"the checkpoint lacks {_first_of(missing)}, which the {config.model_type} model that "
                         "config.json describes needs; download the missing shards again, or use the config.json that "
                         "came with these weights.")


def _expert_values(ckpt: Checkpoint, fmt: str, key: str) -> torch.Tensor:
    """One expert weight as values (float32 when stored quantized), read with plain file reads into fresh
    tensors: a memory map would keep every expert page it touched in the process's RSS (the whole routed set,
    when converting between formats at load)."""
    return read_weight(ckpt, weight_keys(fmt, key)[0], read=ckpt.read_new, fmt=fmt)[1]


def expert_biases(ckpt: Checkpoint, arch, fused: tuple[str, str] | None) -> dict:
    """A layer's expert biases as KTExperts takes them (gate's first), where the architecture has them (GPT-OSS,
    published fused: _check_fused has checked them)."""
    if not arch.expert_biases:
        return {}
    gate_up, down = (read_weight(ckpt, key)[1] for key in bias_keys(fused))
    return dict(gate_up_proj_bias=arch.stock_layout().engine_bias(gate_up), down_proj_bias=down)


def load_experts(ckpt: Checkpoint, arch, layer: int, E: int, H: int, I: int, source: str, target: str,
                 fused: tuple[str, str] | None = None):
    """One layer's experts in the `target` format: (gate_up, down) BF16 tensors, or a QuantizedExperts. fused: the
    keys of experts stored fused (fused_keys; BF16 or float): read whole where they are in the engine's layout
    already, else (transposed, or with rows for zero-computation experts) expert by expert."""
    if fused is not None:
        if source == "mxfp4":  # [out, in] as the module holds them, decoded expert by expert
            rows, layout = E, StockLayout(False, arch.gate_up_interleaved)

            def read(key, e):
                return mxfp4.dequantize(*(ckpt.read_slice(key + suffix, e) for suffix in mxfp4.SUFFIXES))
        else:
            rows = ckpt.shape(fused[0])[0]
            layout = StockLayout(fused_transposed(ckpt, arch, fused, E, I, H, rows - E), arch.gate_up_interleaved)
            read = ckpt.read_slice

        def expert(e):  # expert e's (gate_up [2I, H] or [I, H], down [H, I]) in the engine's layout
            gate_up, down = layout.engine_weights(*(read(k, e)[None] for k in fused))
            return gate_up[0], down[0]

        if target == "bf16":
            gate_up = torch.empty(E, arch.unit.stacked * I, H, dtype=torch.bfloat16)
            down = torch.empty(E, H, I, dtype=torch.bfloat16)
            if layout != StockLayout() or rows != E or source == "mxfp4":
                for e in range(E):  # a slice at a time: a second copy of the layer's experts would take GBs
                    for dst, values in zip((gate_up[e], down[e]), expert(e)):
                        dst.copy_(values)
            else:
                ckpt.read_into(fused[0], gate_up)
                ckpt.read_into(fused[1], down)
            return gate_up, down
        q = QuantizedExperts.empty(target, E, H, I, arch.unit.gated)
        for e in range(E):  # expert by expert: one layer's fused tensors whole would take GBs more RAM
            gate_up, e_down = expert(e)
            q.set_expert(e, gate_up[:I] if arch.unit.gated else None, gate_up[-I:], e_down)
        return q
    keys = [[arch.expert_key(layer, e, p) for p in arch.projections] for e in range(E)]
    if target == "bf16":
        gate_up = torch.empty(E, arch.unit.stacked * I, H, dtype=torch.bfloat16)
        down = torch.empty(E, H, I, dtype=torch.bfloat16)
        for e in range(E):
            places = (gate_up[e, :I], gate_up[e, -I:], down[e])  # gate's rows, up's (the last I), down's
            for key, dst in zip(keys[e], (places[p] for p in arch.projections)):
                if source == "bf16":
                    ckpt.read_into(key, dst)
                else:
                    dst.copy_(_expert_values(ckpt, source, key))
        return gate_up, down
    q = QuantizedExperts.empty(target, E, H, I, arch.unit.gated, fp8_row_block(source))
    for e in range(E):
        if engine_format(source) != target:
            values = dict(zip(arch.projections, (_expert_values(ckpt, source, key) for key in keys[e])))
            q.set_expert(e, values.get(0), values[1], values[2])  # no gate (0) without one
            continue
        # The checkpoint's own bytes: values, then scales (FP8 keeps gate's and up's block grids apart); up's are the
        # last of the stack.
        gate_scale, up_scale = (q.gate_up_scale[e, 0], q.gate_up_scale[e, -1]) if target == "fp8" else \
            (q.gate_up_scale[e, :I], q.gate_up_scale[e, -I:])
        dsts = ((q.gate_up[e, :I], gate_scale), (q.gate_up[e, -I:], up_scale), (q.down[e], q.down_scale[e]))
        for p, key in zip(arch.projections, keys[e]):
            (values, scale), value_key, scale_key = dsts[p], *weight_keys(source, key)[:2]
            ckpt.read_into(value_key, values)
            if source == target:
                ckpt.read_into(scale_key, scale)
            elif target == "int4":  # groups larger than 32: each scale spread over the engine's groups in it
                scale.copy_(int4_group.to_grid(ckpt.read_new(scale_key), I if p == 2 else H, int4_group_size(source)))
            else:  # compressed-tensors FP8: its per-channel or per-tensor scales spread over the engine's blocks
                scale.copy_(fp8_block.to_grid(ckpt.read_new(scale_key), *values.shape, q.row_block))
    return q


class _RefuseTrainingQuantizedBase:
    """Full or freeze fine-tuning of a model whose experts are FP8/INT4 would leave the experts silently frozen: at a
    training forward of the experts, base weights that require grad (other than LoRA and modules_to_save) get a
    clear error. The base weights are checked once per forward, when an experts module is called again since the
    last check, so weights made trainable after good steps are refused too; the experts that PEFT's unload makes in
    place of watched ones are watched in turn (KTExpertsLinear.unload_and_optionally_merge_module). The base
    weights are listed at the first check after a watch (a walk of the modules: ~6 ms at DeepSeek-V3's 6,000 with
    LoRA), then read (PEFT's layers keep the base weights they wrap, and its unload hands them back)."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.called: set[int] = set()  # the experts modules called since the last check
        self.base: list | None = None  # (name, parameter) of the base weights
        for m in model.modules():
            if isinstance(m, KTExpertsLinear):
                self.watch(m)

    def watch(self, experts) -> None:
        experts.register_forward_pre_hook(self)
        experts.base_guard = self
        self.called, self.base = set(), None  # the next call lists the weights again and checks

    @torch.compiler.disable  # a walk of the parameters: no graph to capture
    def __call__(self, module, args):
        model = self.model()
        if model is None or not (module.training and torch.is_grad_enabled()):
            return
        if self.called and id(module) not in self.called:  # a later layer of the forward the last check saw
            self.called.add(id(module))
            return
        self.called = {id(module)}
        if self.base is None:
            self.base = [(n, p) for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n]
        trainable = next((n for n, p in self.base if p.requires_grad), None)
        if trainable:
            raise ValueError(f"base weights such as {trainable} are being trained, but this model's routed experts "
                             "are quantized and cannot train with them; use finetuning_type: lora, or prepare the "
                             "model with `kt-sft prepare --expert-format bf16` to train every weight in BF16.")


def _refuse_saving(model, fmt: str) -> None:
    """save_pretrained of a model with FP8/INT4 experts would write a checkpoint without them (they are buffers
    outside the state dict) and report success: it raises instead. PEFT's save_pretrained of an adapter does not
    go through it."""
    def refuse(*args, **kwargs):
        raise ValueError(f"this model's routed experts are {fmt.upper()} in the CPU engine, and save_pretrained would "
                         "write a checkpoint without them; save the adapter instead, write a merged model with "
                         "`kt-sft merge`, or load BF16 experts (`kt-sft prepare --expert-format bf16`) to save every "
                         "weight.")
    model.save_pretrained = refuse


_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def layer_past_the_model(key: str, config) -> int | None:
    """The layer of a checkpoint key past config.num_hidden_layers, else None."""
    m = _LAYER_KEY.match(key)
    return int(m[1]) if m is not None and int(m[1]) >= config.num_hidden_layers else None


def prediction_layers(config) -> int:
    """How many multi-token-prediction layers a checkpoint may hold past the model's layers: config.json's
    num_nextn_predict_layers (DeepSeek-V3/R1, GLM-4.5), or num_mtp_modules of mtp_transformer_layers each
    (MiniMax-M2)."""
    nextn = getattr(config, "num_nextn_predict_layers", 0) or 0
    modules = getattr(config, "num_mtp_modules", 0) or 0
    return nextn or modules * (getattr(config, "mtp_transformer_layers", 1) or 1)


def prediction_layer(key: str, config) -> bool:
    """A checkpoint key of the multi-token-prediction layers that DeepSeek-V3/R1 (layer 61), GLM-4.5 (92; 46 for
    Air) and MiniMax-M2 (62 on) publish past the model's layers (prediction_layers of them), which transformers'
    models skip on load too; their routed experts alone are ~11 GB at DeepSeek-V3."""
    layer = layer_past_the_model(key, config)
    return layer is not None and layer < config.num_hidden_layers + prediction_layers(config)


def kept_in_float32(model, dtype: torch.dtype):
    """A test of a weight's name: whether transformers' from_pretrained keeps it in float32 when loading the model
    in dtype (_keep_in_fp32_modules_strict under BF16 and FP16, _keep_in_fp32_modules under FP16); from_config,
    which builds our model, does not."""
    patterns = set()
    if dtype in (torch.float16, torch.bfloat16):
        patterns |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    found = re.compile("|".join(rf"(^|\.){re.escape(p)}(\.|$)" for p in sorted(patterns))) if patterns else None
    return lambda name: found is not None and found.search(name) is not None


def load_hybrid_model(source: str, config, dtype: torch.dtype = torch.bfloat16, train_base: bool = True,
                      expert_format: str | None = None, checkpoint_prefix: str = ""):
    """The stock model of config.model_type with its routed experts in the CPU engine. expert_format: 'bf16',
    'fp8' or 'int4' (default: the checkpoint's own format). train_base: BF16 expert weights are trainable
    parameters (full fine-tuning); quantized experts never are. checkpoint_prefix: the weight-key prefix of the
    part served of a composite checkpoint (Kimi-K2.5's text model: "language_model."; Qwen3-Omni's thinker)."""
    require_one_process()
    require_settings()
    arch = architecture_of(config)
    ckpt = Checkpoint(source, checkpoint_prefix)
    fmt = source_format(source)
    target = expert_format or engine_format(fmt)
    check_checkpoint(ckpt, config, fmt)
    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config, dtype=dtype)
    arch.experts_in_place(model)
    experts = experts_modules(model, arch)

    # Each tensor takes the dtype its parameter or buffer has in the model, or float32 where from_pretrained keeps
    # it so (DeepSeek-V3's routing bias: in BF16 it had routed 1-3% of tokens to other experts). check_checkpoint
    # has matched every key to a parameter or buffer of this shape.
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    float32 = kept_in_float32(model, dtype)
    state = {}
    for key in other_weight_keys(ckpt, model, arch, experts):
        key, t = read_weight(ckpt, key, fmt=fmt)
        name = arch.module_key(key)
        state[name] = t.to(torch.float32 if float32(name) else targets[name].dtype)
    model.load_state_dict(state, strict=False, assign=True)

    placed = []
    for name, layer, module in experts:
        E, I, H = arch.expert_dims(module)
        try:
            fused = fused_keys(ckpt, arch, layer, name)
            weights = load_experts(ckpt, arch, layer, E, H, I, fmt, target, fused)
            kwargs = dict(identity_experts=arch.identity_count(config), stock_layout=arch.stock_layout(),
                          unit=arch.unit, **expert_biases(ckpt, arch, fused))
            engine = KTExpertsLinear(*weights, train_base=train_base, **kwargs) if target == "bf16" else \
                KTExpertsLinear(weights, **kwargs)
        except ValueError as e:  # the engine's and the codecs' refusals name an expert, not its layer
            raise ValueError(f"layer {layer}'s routed experts: {e}") from None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, engine)
        placed.append(engine)

    install_around_the_engine(model, arch)
    WarnMissedExpertTargets(model, placed)
    if target == "bf16":
        accept_per_expert_weights(model, arch)
    if config.tie_word_embeddings:
        # As from_pretrained ties: a checkpoint that holds both, different, keeps them apart (config.json is wrong
        # there), and one that holds only the tied-to side ties the other way round.
        missing = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
        model.tie_weights(missing_keys=missing, recompute_mapping=False)
    if target != "bf16":
        _RefuseTrainingQuantizedBase(model)
        _refuse_saving(model, target)
        # What transformers sets on a quantized model, read by LLaMA-Factory: it then serves an adapter unmerged
        # (it merges adapters into other models at inference, which FP8/INT4 experts refuse) and refuses merging
        # several, as for any quantized model.
        model.quantization_method = "fp8" if target == "fp8" else "compressed-tensors"
    attach_step_profile(model, profile_every())
    return model.eval()
