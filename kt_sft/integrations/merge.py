"""`kt-sft merge <model-dir> <adapter-dir> <out-dir>`: the published checkpoint with a trained LoRA adapter merged
in, every weight kept in the format it was published in. BF16 (or float32) weights get `scaling·B·A` added in
float32 and are rounded once to their dtype; FP8 block-128 and INT4 group-32 weights are decoded, merged in
float32 and quantized again on their published grid: a block or group keeps its scale unless the merged values
would clip, and only then takes a fresh one by the published rule (FP8: the block's largest magnitude to 448;
INT4: compressed-tensors' symmetric max/7.5), so codes the update does not move stay as they were (formats'
`requantize`). This is the way to a merged FP8 or INT4 model: `llamafactory-cli export` merges into BF16 experts
only, and holds the whole model in RAM.

Experts stored fused (Qwen3.5-MoE's `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; Qwen3-VL-MoE's transposed)
get each expert's update added to its slice of the fused tensor, in place, and stay fused.

The merge reads and writes one shard at a time (RAM: about one shard, plus the float32 copy of the weight being
merged, or a layer's fused experts tensor): the same shard files and index, the published config.json (its
quantization_config kept), the other top-level files that are not weights (tokenizer, generation config, remote
code), and every tensor the adapter does not touch copied unchanged. It writes into a temporary directory
beside out-dir and renames it at the end, so a failure leaves no half-written model.

Quantizing again keeps only the part of an update that the format resolves (an INT4 group has 16 levels). The
report gives, per format, how far the stored weights' change is from the adapter's update (relative L2 over all
merged weights): near 0 the merged model is the fine-tune; near 1 most of the update is lost, and serving the
adapter unmerged (or a BF16 export) is the better choice.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from ..formats import fp8_block, int4_group
from ..loader.checkpoint import INDEX_NAME, Checkpoint, open_safetensors, write_safetensors
from ..loader.model import fused_keys, fused_transposed, source_format, stored_in_mxfp4
from ..loader.quantization import (int4_group_size, is_fp8, is_int4, read_weight, stored_fp8_format,
                                   weight_keys)
from ..models import architecture_of, canonical_model_type, served_prefix
from ..ops.reference import PROJECTIONS, lora_scale
from .export import (ADAPTER_WEIGHTS, STACKED_KEY, adapter_config, check_stacked, check_trained_on, expert_sizes,
                     prepared_settings, read_config, require_new_dir, resolved, text_config, written_beside)
from .prepare import checked_source

# Files of weights, left out of the merged directory beside the shards it writes (a repository's other copies of
# the weights, e.g. `consolidated.*.pth`, would be unmerged).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# A LoRA matrix on a plain module, as PEFT saves it: `base_model.model.<module path>.lora_A.weight`.
_PLAIN_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# A whole base weight that PEFT saves beside the LoRA (save_embedding_layers: an embedding layer targeted, at
# `<module>.base_layer.weight`, or one resized in training, at `<module>.weight`); loading the adapter puts it in
# place of the model's.
_BASE_COPY_KEY = re.compile(r"^base_model\.model\.(?P<module>(?:(?!lora_|modules_to_save).)+?)(?:\.base_layer)?"
                            r"\.weight$")


@dataclass(frozen=True)
class FusedSlice:
    """One expert's projection inside a layer's fused experts tensor `key` (gate_up_proj: gate, then up, or their
    outputs alternating where interleaved, as GPT-OSS's; up's alone where the experts have no gate, Nemotron-H's
    up_proj; down_proj), stored as the module holds it or transposed."""
    key: str
    expert: int
    proj: int  # PROJECTIONS' index
    transposed: bool
    interleaved: bool = False
    gated: bool = True

    def __str__(self) -> str:
        return f"expert {self.expert}'s {PROJECTIONS[self.proj]} in {self.key}"


@dataclass
class MergeReport:
    out_dir: Path
    merged: dict[str, int] = field(default_factory=dict)  # format -> weights merged
    lost: dict[str, float] = field(default_factory=dict)  # format -> Σ ||stored change − update||²
    update: dict[str, float] = field(default_factory=dict)  # format -> Σ ||update||²

    def add(self, fmt: str, lost: float, update: float) -> None:
        self.merged[fmt] = self.merged.get(fmt, 0) + 1
        self.lost[fmt] = self.lost.get(fmt, 0.0) + lost
        self.update[fmt] = self.update.get(fmt, 0.0) + update

    def relative_error(self, fmt: str) -> float:
        """How far the stored weights' change is from the adapter's update, relative L2 over the format's weights."""
        return (self.lost[fmt] / self.update[fmt]) ** 0.5 if self.update[fmt] > 0 else 0.0


def source_of(model_dir: Path) -> tuple[Path, str, dict]:
    """(published checkpoint directory, key prefix of the model kt_sft serves of it (a composite's part: Kimi-K2.5's
    text model, Qwen3-Omni's thinker), that model's config with its canonical model_type): model_dir is the
    published checkpoint or a `kt-sft prepare` directory pointing at it."""
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json; point at the model the adapter was trained on (the "
                                "published checkpoint or its `kt-sft prepare` directory).")
    config = read_config(model_dir)
    settings = prepared_settings(model_dir, config)
    source = Path(settings["source"]) if settings else model_dir
    if settings and not (source / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} was prepared from {source}, which has no config.json now (moved or "
                                "deleted?); pass the published checkpoint itself.")
    if settings:
        config = read_config(source)
    text, prefix = text_config(config, source), served_prefix(config.get("model_type"))
    return source, prefix, {**text, "model_type": canonical_model_type(text.get("model_type"))}


# LoRA initialisations that replace the base weights beside the adapter (PiSSA and OLoRA take its principal part out,
# CorDA likewise, LoftQ quantizes it): PEFT saves such an adapter converted to a plain one (init_lora_weights True)
# only when asked to, and LoftQ's never.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def adapter_updates(adapter_dir: Path, model: dict, prefix: str, model_dir: Path,
                    ckpt: Checkpoint) -> dict[str | FusedSlice, tuple]:
    """Checkpoint weight key -> (B, A, scaling) from a saved adapter: plain LoRA pairs at their module's weight,
    kt_sft's stacked expert LoRA at each expert's published weight or fused slice (fused_experts; checked against
    the model's experts, and the model, as given in model_dir, against the architecture the adapter was trained
    on). Whole base weights the
    adapter carries must be the checkpoint's (check_base_copy)."""
    config = adapter_config(adapter_dir)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{adapter_dir} is a {'DoRA' if config.get('use_dora') else config.get('peft_type')} adapter; "
                         "kt-sft merge merges LoRA adapters only.")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("fan_in_fan_out"):
        raise ValueError("adapters with rank_pattern, alpha_pattern or fan_in_fan_out are not supported by kt-sft "
                         "merge; merge one trained with a single rank and alpha.")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        way_out = ("serve it unmerged on the quantized base it trained beside" if init.lower().startswith("loftq") else
                   "save it converted to a plain LoRA (LLaMA-Factory: pissa_convert: true; PEFT: save_pretrained with "
                   "path_initial_model_for_weight_conversion) and merge that")
        raise ValueError(f"{adapter_dir} was initialised with {init!r}, which changes the base weights it trains "
                         f"beside, so the published weights plus this LoRA are not the trained model; {way_out}.")
    check_trained_on(adapter_dir, config, model["model_type"], str(model_dir), "merge")
    scaling = lora_scale(config["r"], config["lora_alpha"], config.get("use_rslora", False))
    arch = architecture_of(SimpleNamespace(model_type=model["model_type"]))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with open_safetensors(adapter_dir / ADAPTER_WEIGHTS) as f:
        for key in f.keys():
            stacked, plain, copy = STACKED_KEY.match(key), _PLAIN_KEY.match(key), _BASE_COPY_KEY.match(key)
            if stacked:
                t = f.get_tensor(key)
                check_stacked(stacked, t, model, config["r"], arch)
                layer, proj = int(stacked["layer"]), PROJECTIONS.index(stacked["proj"])
                fused = fused_experts(ckpt, arch, model, prefix, layer)
                for e in range(t.shape[0]):
                    weight = (FusedSlice(fused[0][proj == 2], e, proj, fused[1], arch.gate_up_interleaved,
                                         arch.unit.gated) if fused
                              else prefix + arch.expert_key(layer, e, proj))
                    pairs.setdefault(weight, {})[stacked["ab"]] = t[e]
            elif plain:
                weight = checkpoint_key(arch, plain["module"], ckpt, prefix)
                pairs.setdefault(weight, {})[plain["ab"]] = f.get_tensor(key)
            elif copy and not _trained_whole(copy["module"], config):
                check_base_copy(ckpt, checkpoint_key(arch, copy["module"], ckpt, prefix), f.get_tensor(key), key,
                                source_format(ckpt.dir))
            else:
                raise ValueError(f"the adapter holds {key}, {_not_a_pair(key)}; kt-sft merge merges the LoRA pairs of "
                                 "linear layers only: serve this adapter unmerged.")
    if not pairs:
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS} holds no LoRA matrices; point at the adapter that training "
                         "saved (a checkpoint-N directory or the output directory).")
    updates = {}
    for weight, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"the adapter has lora_{'A' if 'A' in ab else 'B'} but not its partner for {weight}; the "
                             "adapter file is incomplete.")
        if ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["A"].shape[0] != config["r"] or ab["B"].shape[1] != config["r"]:
            raise ValueError(f"adapter_config.json gives r = {config['r']}, but the LoRA on "
                             f"{str(weight).removesuffix('.weight')} is A {list(ab['A'].shape)}, B {list(ab['B'].shape)}; the "
                             "config does not belong to these weights.")
        updates[weight] = (ab["B"], ab["A"], scaling)
    return updates


def fused_experts(ckpt: Checkpoint, arch, model: dict, prefix: str,
                  layer: int) -> tuple[tuple[str, str], bool] | None:
    """(the keys of a layer's experts stored fused, whether transposed), or None where the checkpoint keeps them per
    expert (each expert's projection then at its own weight key). checked_source has checked that a layer holds one
    layout, and a fused one both tensors in shapes of one layout."""
    keys = fused_keys(ckpt, arch, layer, arch.experts_prefix(layer).removesuffix("."), prefix)
    if keys is None:
        return None
    if stored_in_mxfp4(ckpt, keys):
        raise ValueError(f"{keys[0]} is stored in MXFP4, which kt-sft merge does not write; serve the adapter "
                         "unmerged, or write a merged BF16 model (llamafactory-cli export, or merge_and_unload and "
                         "save_pretrained on the trained model).")
    E, H, I = expert_sizes(model)
    return keys, fused_transposed(ckpt, arch, keys, E, I, H, ckpt.shape(keys[0])[0] - E)


def merged_fused(ckpt: Checkpoint, key: str, slices: list[tuple[FusedSlice, tuple]],
                 report: MergeReport) -> dict[str, torch.Tensor]:
    """A layer's fused experts tensor with each expert's update added to its slice, rounded once to the stored
    dtype."""
    t = ckpt.get(key)
    for where, (b, a, scaling) in slices:
        view = t[where.expert].T if where.transposed else t[where.expert]  # [out, in], as a per-expert weight
        if where.proj < 2 and where.interleaved:  # gate_up_proj: the gate's and the up's rows alternating
            view = view[where.proj::2]
        elif where.proj < 2 and where.gated:  # the gate's rows, then the up's
            half = view.shape[0] // 2
            view = view[:half] if where.proj == 0 else view[half:]
        if (b.shape[0], a.shape[1]) != tuple(view.shape):
            raise ValueError(f"the adapter's LoRA on expert {where.expert}'s {PROJECTIONS[where.proj]} makes a "
                             f"{b.shape[0]}x{a.shape[1]} update for a {list(view.shape)} weight of {key}; it was "
                             "trained on another model.")
        w = view.to(torch.float32)
        delta = scaling * (b.to(torch.float32) @ a.to(torch.float32))
        new = w + delta
        if not torch.isfinite(new).all():
            raise ValueError(f"merging the adapter would put NaN/Inf into {key} (expert {where.expert}), or the "
                             "checkpoint holds them there; nothing was written.")
        view.copy_(new)
        back = view.to(torch.float32)
        report.add(str(t.dtype).removeprefix("torch."), float((back - w - delta).double().square().sum()),
                   float(delta.double().square().sum()))
    return {key: t}


def checkpoint_key(arch, module: str, ckpt: Checkpoint, prefix: str) -> str:
    """The checkpoint key of a module path's weight, under whichever of its stored names the checkpoint has."""
    keys = [prefix + name + ".weight" for name in arch.stored_names(module)]
    return next((k for k in keys if k in ckpt.shard_of), keys[0])


def check_base_copy(ckpt: Checkpoint, weight: str, copy: torch.Tensor, key: str, published: str) -> None:
    """A base weight the adapter carries must be the checkpoint's as the trained model held it (rounded to the
    copy's dtype): merged into the published weight, a changed one would be lost."""
    try:
        fmt = stored_format(ckpt, weight, published)
    except ValueError:
        raise ValueError(f"the adapter holds {key}, a whole weight for {weight}, which the checkpoint {ckpt.dir} does "
                         "not have; merge it into the model it was trained on.") from None
    stored = read_weight(ckpt, weight_keys(fmt, weight)[0], fmt=fmt)[1]
    if tuple(stored.shape) != tuple(copy.shape) or not torch.equal(stored.to(copy.dtype), copy):
        what = (f"resized from {list(stored.shape)} to {list(copy.shape)} (a vocabulary resized in training)"
                if tuple(stored.shape) != tuple(copy.shape) else "with values other than the checkpoint's")
        raise ValueError(f"the adapter holds its own {weight} {what}, which kt-sft merge cannot put in the published "
                         "checkpoint; serve the adapter unmerged, or merge with llamafactory-cli export on BF16 "
                         "experts.")


def _trained_whole(module: str, config: dict) -> bool:
    """Whether the adapter config lists module among modules_to_save (LLaMA-Factory: additional_target), whose
    trained copy PEFT saves at the same `<module>.weight` key as a base weight's copy."""
    names = config.get("modules_to_save") or ()
    return any(module == name or module.endswith("." + name) for name in names)


def _not_a_pair(key: str) -> str:
    """What an adapter tensor that is no linear layer's LoRA pair is, as far as its name tells."""
    if ".lora_embedding_" in key:
        return "an embedding's LoRA"
    if ".lora_B.bias" in key or "lora_bias" in key:
        return "a LoRA bias (lora_bias=True)"
    if key.endswith("bias") and "modules_to_save" not in key:
        return "a trained bias (the adapter's bias='all' or 'lora_only')"
    if "modules_to_save" in key or not re.search(r"\.lora_[AB]\.", key):
        return "a whole trained module (modules_to_save, or trainable tokens)"
    return "not a LoRA matrix kt-sft knows"


def stored_format(ckpt: Checkpoint, weight: str, published: str) -> str:
    """'int4' (or 'int4-g128' and the like: the group size the checkpoint declares, `published` its source_format),
    an FP8 format (stored_fp8_format) or 'plain' for a weight named by its `<module>.weight` key."""
    if weight_keys("int4", weight)[0] in ckpt.shard_of:
        return published if is_int4(published) else "int4"
    if weight in ckpt.shard_of:
        return stored_fp8_format(ckpt, weight, ckpt.shape(weight), published) \
            if ckpt.dtype(weight) == "F8_E4M3" else "plain"
    raise ValueError(f"the adapter has LoRA on {weight.removesuffix('.weight')}, but the checkpoint {ckpt.dir} has no "
                     "such weight; merge it into the model it was trained on.")


def merged_weight(ckpt: Checkpoint, weight: str, fmt: str, update: tuple,
                  report: MergeReport) -> dict[str, torch.Tensor]:
    """The stored tensors (weight_keys of its format, stored_format's) of `weight` with its LoRA update merged."""
    keys = weight_keys(fmt, weight)
    scales = ckpt.get(keys[1]) if is_int4(fmt) or is_fp8(fmt) else None
    # Float32 values where quantized (the loader's checks included), decoded with the scales read here once.
    _, stored = read_weight(ckpt, keys[0], read=lambda key: scales if key in keys[1:2] else ckpt.get(key), fmt=fmt)
    w = stored.to(torch.float32)
    b, a, scaling = update
    if (b.shape[0], a.shape[1]) != tuple(w.shape):
        raise ValueError(f"the adapter's LoRA on {weight.removesuffix('.weight')} makes a {b.shape[0]}x{a.shape[1]} "
                         f"update for a {list(w.shape)} weight; it was trained on another model.")
    delta = scaling * (b.to(torch.float32) @ a.to(torch.float32))
    new = w + delta
    if not torch.isfinite(new).all():
        if not torch.isfinite(w).all():
            raise ValueError(f"{weight} holds NaN or Inf in the model's checkpoint; it is corrupt: download it again "
                             "(nothing was written).")
        raise ValueError(f"merging the adapter would put NaN/Inf into {weight}; nothing was written.")
    if is_int4(fmt):  # on the published groups
        group = int4_group_size(fmt)
        packed, scale = int4_group.requantize(new, scales, base=w, group=group)
        out = {keys[0]: packed, keys[1]: scale, keys[2]: ckpt.get(keys[2])}
        back = int4_group.dequantize(packed, scale, w.shape[1], group=group)
    elif is_fp8(fmt):  # on the published grid: 128x128 blocks, or compressed-tensors' channels or tensor
        q, scale_inv = fp8_block.requantize(new, scales, base=w)
        out = {keys[0]: q, keys[1]: scale_inv}
        back = fp8_block.dequantize(q, scale_inv)
    else:
        out = {weight: new.to(stored.dtype)}
        back = out[weight].to(torch.float32)
        fmt = str(stored.dtype).removeprefix("torch.")
    report.add(fmt, float((back - w - delta).double().square().sum()), float(delta.double().square().sum()))
    return out


def shard_contents(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Each shard's own tensor names (a tensor its index omits is copied too), after checking that every shard
    opens and holds what the index puts in it: before anything is written, not hours into a merge."""
    listed: dict[str, set[str]] = {}
    for key, shard in ckpt.shard_of.items():
        listed.setdefault(shard, set()).add(key)
    contents = {}
    for shard, keys in listed.items():
        with open_safetensors(ckpt.dir / shard) as f:
            # A tensor the index places in another shard is taken from there (a stale copy here is dropped).
            contents[shard] = [k for k in f.keys() if ckpt.shard_of.get(k, shard) == shard]
        absent = keys.difference(contents[shard])
        if absent:
            raise ckpt.not_in_shard(min(absent))
    return contents


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                  progress: Callable[[int, int, str], None] | None = None) -> MergeReport:
    """Writes out_dir: model_dir's published checkpoint with the adapter merged (module docstring). progress(done,
    total, shard) is called after each shard is written (a large model's merge takes hours)."""
    source, prefix, model = source_of(Path(model_dir))
    checked_source(source)  # what prepare refuses (F64 scales, shapes config.json does not imply, ...) is not merged
    out_dir = resolved(out_dir)  # "." has no name to put the temporary directory beside it under
    require_new_dir(out_dir, "the merged model")
    if out_dir == resolved(source):
        raise ValueError("the merged model cannot overwrite the checkpoint it is made from; choose another out-dir.")
    ckpt = Checkpoint(source)
    updates = adapter_updates(Path(adapter_dir), model, prefix, Path(model_dir), ckpt)
    fused: dict[str, list[tuple[FusedSlice, tuple]]] = {}  # a layer's fused experts tensor -> its experts' updates
    for where in [w for w in updates if isinstance(w, FusedSlice)]:
        fused.setdefault(where.key, []).append((where, updates.pop(where)))
    shards = shard_contents(ckpt)
    published = source_format(source)
    formats = {weight: stored_format(ckpt, weight, published) for weight in updates}
    # Stored key -> the merged weight it belongs to.
    owner = {key: weight for weight, fmt in formats.items() for key in weight_keys(fmt, weight)}
    owner.update({key: key for key in fused})
    report = MergeReport(out_dir)
    with written_beside(out_dir, "merge", "merging") as tmp:
        pending: dict[str, dict[str, torch.Tensor]] = {}  # merged weights whose stored keys are not all written yet
        for n, (shard, keys) in enumerate(shards.items()):
            tensors = {}
            with open_safetensors(source / shard) as f:
                metadata = f.metadata() or {"format": "pt"}
                for key in keys:
                    weight = owner.get(key)
                    if weight is None:
                        tensors[key] = f.get_tensor(key)
                        continue
                    if weight not in pending:
                        pending[weight] = merged_fused(ckpt, weight, fused[weight], report) if weight in fused else \
                            merged_weight(ckpt, weight, formats[weight], updates[weight], report)
                    tensors[key] = pending[weight].pop(key)
                    if not pending[weight]:
                        del pending[weight]
            (tmp / shard).parent.mkdir(parents=True, exist_ok=True)  # a shard may sit in a subdirectory
            write_safetensors(tensors, tmp / shard, metadata)
            if progress:
                progress(n + 1, len(shards), shard)
        for f in source.iterdir():  # config, tokenizer, generation config, remote code: not other weight copies
            # An index beside model.safetensors is not what was read (Checkpoint reads the single file first).
            if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and not (f.name == INDEX_NAME and not ckpt.from_index):
                shutil.copy(f, tmp / f.name)
    return report
