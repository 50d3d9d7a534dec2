"""The class a prepared model directory's `auto_map` names (see `kt-sft prepare`).

`AutoModelForCausalLM.from_pretrained(prepared_dir, trust_remote_code=True)` — what LLaMA-Factory calls (for an
image-text model such as Qwen3-VL-MoE, AutoModelForImageTextToText: prepare.auto_classes) — lands in
`KTSFTForCausalLM.from_pretrained`, which returns the stock transformers model of the checkpoint's model_type (the
whole image-text model for those) with its routed experts in the CPU engine (kt_sft.loader.model). Settings
recorded by prepare live under config.json's "kt_sft" key.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import GenerationConfig

from .. import configure
from .._ext import _C, warn
from ..loader.model import load_hybrid_model

SETTINGS_KEY = "kt_sft"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dtype(config, kwargs) -> torch.dtype:
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _single_device(device_map):
    """The one device a device_map names, or None. Experts stay on the CPU whatever it says; "auto" (what
    LLaMA-Factory's chat passes) puts the rest on the GPU when there is one."""
    if device_map == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else None
    if device_map in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map={device_map!r} spreads a model over several devices; kt_sft models take one "
                         "device for the non-expert weights: pass 'auto', one device, or {'': 0} (routed experts "
                         "always stay in CPU memory).")
    if device_map is None or device_map == "cpu":
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError("kt_sft models take one device for the non-expert weights; pass device_map={'': 0} "
                             "or a single device (routed experts always stay in CPU memory).")
        device_map = devices.pop()
    return torch.device(f"cuda:{device_map}" if isinstance(device_map, int) else device_map)


# The prepared directories loaded in this process: the engine's settings are the process's, shared by every model.
_loaded: list[str] = []


def _engine_settings() -> dict:
    caps = _C.capabilities()
    return {"threads": caps["threads"], "kernels": caps["kernels"]}


def _apply_settings(path, settings: dict) -> None:
    """The engine threads and kernel set that prepare recorded, applied; a change of those that models loaded before
    run with is warned about (it changes their speed, and their results within the kernels' rounding)."""
    threads, kernels = settings.get("threads") or None, settings.get("kernels") or None
    if threads or kernels:
        before = _engine_settings()
        configure(threads=threads, kernels=kernels)
        after = _engine_settings()
        if _loaded and after != before:
            warn(f"kt_sft: {path} was prepared with engine threads={after['threads']}, kernels={after['kernels']}; "
                 "these settings are the process's, so the models loaded before it in this process "
                 f"({', '.join(_loaded)}, which ran with threads={before['threads']}, kernels={before['kernels']}) "
                 "now run with them too; prepare the models with the same --threads and --kernels to avoid it.")


class KTSFTForCausalLM:
    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """transformers ≥ 5.x (checked: 5.17) calls this on remote-code classes it loads. Nothing to register: the
        model returned is the stock class of the checkpoint's model_type, not this loader."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        settings = getattr(config, SETTINGS_KEY, None)
        if not settings or "source" not in settings:
            raise ValueError(f"{pretrained_model_name_or_path} was not written by `kt-sft prepare` (config.json has no "
                             f"'{SETTINGS_KEY}' section); run `kt-sft prepare <model-dir> <out-dir>` first.")
        source_config = Path(settings["source"]) / "config.json"
        if not source_config.exists():
            raise FileNotFoundError(f"{pretrained_model_name_or_path} was prepared from {settings['source']}, which has "
                                    "no config.json now (moved or deleted?); run `kt-sft prepare` again on the model.")
        recorded = settings.get("source_config")  # directories prepared before it was recorded have none
        if recorded is not None and recorded != file_digest(source_config):
            # another model or release put in its place: its weights read through this directory's config.json
            # (another format quantized anew, other shapes blamed on that copy)
            raise ValueError(f"{source_config} changed since `kt-sft prepare` wrote {pretrained_model_name_or_path} "
                             "(another model or release in its place?); run `kt-sft prepare` again on it.")
        if kwargs.get("quantization_config") is not None:  # LLaMA-Factory's quantization_bit (bitsandbytes, ...)
            raise ValueError(f"{pretrained_model_name_or_path} is a kt_sft model, which does not take a "
                             "quantization_config (LLaMA-Factory: quantization_bit): its routed experts are quantized "
                             "by `kt-sft prepare --expert-format fp8|int4`, and the rest stays in the model's dtype; "
                             "leave quantization_bit out.")
        _apply_settings(pretrained_model_name_or_path, settings)
        if kwargs.get("attn_implementation"):
            config._attn_implementation = kwargs["attn_implementation"]
        model = load_hybrid_model(settings["source"], config, dtype=_dtype(config, kwargs),
                                  expert_format=settings.get("expert_format"),
                                  checkpoint_prefix=settings.get("checkpoint_prefix", ""))
        # The returned model is the stock class: drop the prepared directory's auto_map, or LLaMA-Factory registers
        # the stock class for auto-class saving and save_pretrained tries to copy transformers' own modeling file.
        if str(pretrained_model_name_or_path) not in _loaded:
            _loaded.append(str(pretrained_model_name_or_path))
        if hasattr(model.config, "auto_map"):
            del model.config.auto_map
        # What from_pretrained reads beside config.json (the prepared directory links it): the checkpoint's eos ids
        # and sampling defaults, which a config-only generation config lacks (Qwen3's second eos id, for one).
        if (Path(pretrained_model_name_or_path) / "generation_config.json").exists():
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path)
        device = _single_device(kwargs.get("device_map"))
        return model.to(device) if device is not None else model
