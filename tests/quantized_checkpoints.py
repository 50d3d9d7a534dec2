"""Tiny checkpoints laid out as the official quantized ones are published (DESIGN.md §5), made from BF16 ones:

- fp8 (DeepSeek-V3/R1, Kimi-K2-Instruct): every linear projection (attention, dense and shared MLPs, routed
  experts) as float8_e4m3fn `weight` + float32 `weight_scale_inv`; embeddings, norms, router and lm_head stay BF16.
- int4 (Kimi-K2-Thinking / K2.5): only the routed experts, as compressed-tensors pack-quantized `weight_packed`,
  `weight_scale`, `weight_shape`; everything else BF16 and named in the config's ignore list. int4-g<size> (W4A16
  releases): the same in groups of <size>, packed by the compressed-tensors package itself.
- compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC: a scale per output channel; FP8_BLOCK: 128x128 blocks;
  or one scale per tensor): every linear projection as float8_e4m3fn `weight` + `weight_scale` in the model's dtype,
  quantized by the compressed-tensors package itself; router and lm_head stay BF16 (its `ignore` list).

`dequantized_copy` writes the float32 checkpoint of exactly the values the quantized one decodes to, which the
stock transformers model loads as the reference (what the compressed-tensors package wrote: decoded by it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kt_sft.formats import fp8_block, int4_group
from kt_sft.loader.checkpoint import Checkpoint
from kt_sft.loader.quantization import COMPANION_SUFFIXES, read_weight

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def compressed_fp8_scheme(strategy: str):
    """llm-compressor's scheme for FP8 weights of a strategy ("channel", "tensor", "block"), activations dynamic."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False,
                               block_structure=[128, 128] if strategy == "block" else None)
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True,
                            **(dict(strategy="group", group_size=128) if strategy == "block" else dict(strategy="token")))
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def compressed_fp8_config(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": compressed_fp8_scheme(strategy).model_dump(mode="json")},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def compressed_int4_scheme(group: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group, dynamic=False))


def _compressed_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """weight_packed, weight_scale, weight_shape of a weight packed by compressed-tensors in groups of `group`, its
    scales compressed-tensors' symmetric rule (int4_group's)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    scale = int4_group.quantize(w.float(), group=group)[1]
    return PackedQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale},
                                                 compressed_int4_scheme(group))


def _compressed_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, weight_scale) of a weight as compressed-tensors compresses it, its scales (the largest magnitude of
    each channel, block or the tensor over 448, as llm-compressor's min-max observer gives) in BF16."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    w = w.float()
    amax = {"channel": lambda: w.abs().amax(1, keepdim=True), "tensor": lambda: w.abs().max().reshape(1),
            "block": lambda: fp8_block._block_amax(w)}[strategy]()
    scale = (amax / 448).to(torch.bfloat16)
    out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, compressed_fp8_scheme(strategy))
    return out["weight"], out["weight_scale"]


def _copy_other_files(src: Path, dst: Path):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, dst / f.name)


def quantize_checkpoint(src: Path, dst: Path, fmt: str, model_type: str | None = None,
                        int4_dense: bool = False) -> Path:
    """int4_dense: every linear projection in INT4, not only the routed experts (as compressed-tensors quantizes a
    whole model when its recipe ignores none)."""
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for key, t in state.items():
        base = key.removesuffix(".weight")
        # kv_a_proj_with_mqa too, and experts named as Mixtral's (w1/w2/w3)
        if fmt == "fp8" and (key.endswith(("proj.weight", "proj_with_mqa.weight")) or ".experts." in key):
            out[key], out[base + ".weight_scale_inv"] = fp8_block.quantize(t.float())
        elif fmt.startswith("fp8-") and key.endswith(("proj.weight", "proj_with_mqa.weight")):
            out[key], out[base + ".weight_scale"] = _compressed_fp8(t, fmt.removeprefix("fp8-"))
        elif fmt.startswith("int4") and (".mlp.experts." in key or int4_dense and key.endswith("proj.weight")):
            if fmt == "int4":
                out[base + ".weight_packed"], out[base + ".weight_scale"] = int4_group.quantize(t.float())
                out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            else:
                out.update({f"{base}.{k}": v for k, v in _compressed_int4(t, int(fmt.removeprefix("int4-g"))).items()})
        else:
            out[key] = t
    _copy_other_files(src, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    int4 = {**INT4_CONFIG, "ignore": ["lm_head"]} if int4_dense else INT4_CONFIG
    if fmt.startswith("int4-g"):
        group = int4["config_groups"]["group_0"]
        int4 = {**int4, "config_groups": {"group_0": {**group, "weights": {
            **group["weights"], "group_size": int(fmt.removeprefix("int4-g")), "actorder": "weight"}}}}
    cfg["quantization_config"] = FP8_CONFIG if fmt == "fp8" else \
        compressed_fp8_config(fmt.removeprefix("fp8-")) if fmt.startswith("fp8-") else int4
    if model_type:
        cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _decompressed(ckpt: Checkpoint, key: str) -> tuple[str, torch.Tensor]:
    """compressed-tensors' own float32 values of a weight it compressed (FP8: float32 scales, one rounding as ours;
    INT4: exact either way)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    weights = json.loads((ckpt.dir / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]
    base = key.removesuffix(".weight_packed").removesuffix(".weight")
    parts = {k: ckpt.get(f"{base}.{k}") for k in ("weight", "weight_packed", "weight_shape", "weight_scale")
             if f"{base}.{k}" in ckpt.shard_of}
    parts["weight_scale"] = parts["weight_scale"].float()
    if weights["type"] == "float":
        return key, FloatQuantizationCompressor.decompress(parts, compressed_fp8_scheme(weights["strategy"]))["weight"]
    decoded = PackedQuantizationCompressor.decompress(parts, compressed_int4_scheme(weights["group_size"]))["weight"]
    return base + ".weight", decoded


def dequantized_copy(src: Path, dst: Path, model_type: str) -> Path:
    """The checkpoints that the compressed-tensors package wrote (FP8, INT4 in groups other than 32) decoded by it,
    the others by kt_sft's reader (the tiny Kimi-K2's rows end in partial groups, which the package does not take;
    test_formats checks our INT4 packing against it)."""
    ckpt = Checkpoint(src)
    qc = json.loads((src / "config.json").read_text()).get("quantization_config") or {}
    weights = qc.get("config_groups", {}).get("group_0", {}).get("weights", {})
    compressed = qc.get("quant_method") == "compressed-tensors" and weights.get("group_size") != 32
    quantized = (lambda k: ckpt.dtype(k) == "F8_E4M3" or k.endswith(".weight_packed"))
    state = dict((_decompressed if compressed and quantized(k) else read_weight)(ckpt, k)
                 for k in ckpt.keys() if not k.endswith(COMPANION_SUFFIXES))
    _copy_other_files(src, dst)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def kimi_k25_checkpoint(bf16: Path, dst: Path, quantization_in_text: bool = False) -> Path:
    """Kimi-K2.5 as published: top-level model_type kimi_k25, the Kimi-K2 text config nested as text_config, the
    text model's keys under `language_model.` beside a vision tower, RAWINT4 routed experts. quantization_config at
    the top level, or inside text_config (quantization_in_text: where Kimi-K2.6's loader code reads it)."""
    quantize_checkpoint(bf16, dst, "int4", model_type="kimi_k2")
    state = {"language_model." + k: v for k, v in load_file(str(dst / "model.safetensors")).items()}
    state["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((dst / "config.json").read_text())
    qc = {} if quantization_in_text else {"quantization_config": text.pop("quantization_config")}
    composite = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
                 "vision_config": {"patch_size": 2}, **qc}
    (dst / "config.json").write_text(json.dumps(composite))
    return dst
