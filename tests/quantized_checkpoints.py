"""Tiny checkpoints laid out as the official quantized ones are published (DESIGN.md §5), made from BF16 ones:

- fp8 (DeepSeek-V3/R1, Kimi-K2-Instruct): every linear projection (attention, dense and shared MLPs, routed
  experts) as float8_e4m3fn `weight` + float32 `weight_scale_inv`; embeddings, norms, router and lm_head stay BF16.
- int4 (Kimi-K2-Thinking / K2.5): only the routed experts, as compressed-tensors pack-quantized `weight_packed`,
  `weight_scale`, `weight_shape`; everything else BF16 and named in the config's ignore list.

- compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC: a scale per output channel; FP8_BLOCK: 128x128 blocks;
  or one scale per tensor): every linear projection as float8_e4m3fn `weight` + `weight_scale` in the model's dtype,
  quantized by the compressed-tensors package itself; router and lm_head stay BF16 (its `ignore` list).

`dequantized_copy` writes the float32 checkpoint of exactly the values the quantized one decodes to, which the
stock transformers model loads as the reference (compressed-tensors FP8: decoded by compressed-tensors).
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
        elif fmt == "int4" and (".mlp.experts." in key or int4_dense and key.endswith("proj.weight")):
            out[base + ".weight_packed"], out[base + ".weight_scale"] = int4_group.quantize(t.float())
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            out[key] = t
    _copy_other_files(src, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FP8_CONFIG if fmt == "fp8" else \
        compressed_fp8_config(fmt.removeprefix("fp8-")) if fmt.startswith("fp8-") else \
        {**INT4_CONFIG, "ignore": ["lm_head"]} if int4_dense else INT4_CONFIG
    if model_type:
        cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _decompressed(ckpt: Checkpoint, key: str) -> tuple[str, torch.Tensor]:
    """compressed-tensors' own float32 values of a weight it compressed (float32 scales: one rounding, as ours)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    cfg = json.loads((ckpt.dir / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = compressed_fp8_scheme(cfg["weights"]["strategy"])
    scale = ckpt.get(key.removesuffix(".weight") + ".weight_scale").float()
    return key, FloatQuantizationCompressor.decompress({"weight": ckpt.get(key), "weight_scale": scale}, scheme)["weight"]


def dequantized_copy(src: Path, dst: Path, model_type: str) -> Path:
    ckpt = Checkpoint(src)
    compressed = any(k.endswith(".weight_scale") and k.removesuffix("_scale") in ckpt.shard_of and
                     ckpt.dtype(k.removesuffix("_scale")) == "F8_E4M3" for k in ckpt.keys())
    state = dict((_decompressed if compressed and ckpt.dtype(k) == "F8_E4M3" else read_weight)(ckpt, k)
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
