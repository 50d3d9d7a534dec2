"""`kt-sft prepare <hf-model-dir> <out-dir>`: a small directory that the stock loaders open with
trust_remote_code. It holds config.json (the original, plus auto_map and a "kt_sft" settings section), a
two-line modeling shim, and every other file of the source (tokenizer, generation config, chat template): copies
of the files up to COPY_BYTES, links to larger ones and to subdirectories; the weight shards are referenced, never
copied. Copies, because a save into the prepared directory (a tokenizer's save_pretrained, a training's output_dir)
wrote through links into the source model's own files. Everything is checked before anything is written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from .._ext import KERNEL_SETS, _thread_count
from ..formats import EXPERT_FORMATS
from ..loader.checkpoint import Checkpoint
from ..loader.model import check_checkpoint, model_class
from ..loader.quantization import checkpoint_format, engine_format, quantization_config_of
from ..models import architecture_of, canonical_model_type, served_prefix
from .export import read_config, resolved, text_config
from .modeling import SETTINGS_KEY, file_digest

SHIM = "modeling_kt_sft.py"
SHIM_TEXT = '''"""Written by `kt-sft prepare`: routes the auto class to kt_sft (routed experts on the CPU engine)."""
from kt_sft.integrations.modeling import KTSFTForCausalLM  # noqa: F401
'''
_WEIGHT_FILES = ("model.safetensors.index.json",)
COPY_BYTES = 64 << 20  # tokenizers and templates are a few MB at most
# A model directory's tokenizer, whichever kind (fast, sentencepiece, BPE vocabulary, tiktoken: Kimi-K2's).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _rotary_dim_as_a_factor(raw: dict) -> None:
    """MiniMax-M2 publishes its partial rotary embedding as `rotary_dim` (64 of a head's 128), which transformers'
    configuration does not read: the model then rotated every dimension, silently another model than the
    published one. Given as the partial_rotary_factor transformers reads."""
    if raw.get("model_type") != "minimax_m2":  # others' rotary_dim (codegen, gptj) is their configuration's own
        return
    rotary, hidden, heads, head_dim = (raw.get(k) for k in ("rotary_dim", "hidden_size", "num_attention_heads",
                                                             "head_dim"))
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    if isinstance(rotary, int) and isinstance(head_dim, int) and 0 < rotary < head_dim and \
            "partial_rotary_factor" not in raw and "partial_rotary_factor" not in rope:
        if rope:
            raw["rope_parameters"] = {**rope, "partial_rotary_factor": rotary / head_dim}
        else:
            raw["partial_rotary_factor"] = rotary / head_dim


def auto_classes(config) -> tuple[str, ...]:
    """The transformers auto classes a prepared directory's auto_map sends to kt_sft: the one that builds the model
    (an image-text model's, which LLaMA-Factory loads it with), and AutoModelForCausalLM where transformers maps a
    causal LM to the config (Qwen3.5-MoE: the call then gets the same whole model). Not where it maps none
    (Qwen3-VL-MoE): transformers then registers the remote class in its mapping, and that process's next load of
    such a model through it fails inside transformers."""
    causal = type(config) in AutoModelForCausalLM._model_mapping
    return tuple(dict.fromkeys((model_class(config).__name__, *(("AutoModelForCausalLM",) if causal else ()))))


def checked_source(source: Path) -> tuple[dict, str, str, str, tuple[str, ...]]:
    """(the config.json of the model kt_sft loads from the checkpoint directory `source`, the published model_type,
    the experts' published format, the weight-key prefix of the model served, the transformers auto classes that
    load it: auto_classes), after every check of config.json and the shards' headers that the load makes: the
    model a prepared directory holds is its text model (the whole image-text model where transformers builds one:
    Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V; a composite's part: Kimi-K2.5's text model, Qwen3-Omni's thinker), with
    kt_sft's own model_type and no quantization_config (the loader reads quantized weights itself, so to transformers
    and LLaMA-Factory it is not a quantized model) or remote code."""
    raw = read_config(source)
    published_type = raw.get("model_type")
    fmt = checkpoint_format(quantization_config_of(raw))
    prefix = served_prefix(published_type)
    raw = dict(text_config(raw, source))
    raw.pop("quantization_config", None)
    raw["model_type"] = canonical_model_type(raw.get("model_type"))
    raw.pop("auto_map", None)
    _rotary_dim_as_a_factor(raw)
    try:
        # Values JSON has no number for (Granite 4.0-H's time_step_limit (0, inf)), as transformers saved them.
        decoded = PreTrainedConfig._decode_special_floats(raw)
        config = AutoConfig.for_model(**decoded) if raw["model_type"] in CONFIG_MAPPING else None
    except Exception as e:  # transformers' field checks (a string where a number goes, ...) raise several types
        raise ValueError(f"{source}/config.json is not a valid {raw['model_type']} configuration "
                         f"({' '.join(str(e).split())}); the file was edited or is not that model's.") from None
    if config is None:
        raise ValueError(f"model_type {published_type!r} is not supported by kt_sft (transformers has no such "
                         "configuration).")
    architecture_of(config)
    check_checkpoint(Checkpoint(source, prefix), config, fmt)
    return raw, published_type, fmt, prefix, auto_classes(config)


def prepare(source: str | Path, out: str | Path, threads: int | None = None, kernels: str | None = None,
            expert_format: str | None = None) -> Path:
    """expert_format: 'bf16', 'fp8' or 'int4' for the routed experts in RAM (default: the checkpoint's own; BF16 for
    MXFP4, which the engine does not compute on)."""
    source, out = resolved(source), Path(out)
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"{source} has no config.json; point at a Hugging Face model directory.")
    if threads is not None:
        _thread_count(threads, "--threads")
    out_resolved = resolved(out)
    if out_resolved == source or source in out_resolved.parents:
        raise ValueError(f"{out} is inside the model directory {source}; the prepared directory links to the model's "
                         "files, so put it elsewhere.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose a directory for the prepared model.")
    if kernels not in (None, *KERNEL_SETS):  # named, not checked against this CPU: training may run elsewhere
        raise ValueError(f"--kernels {kernels!r} is not one of {', '.join(KERNEL_SETS)}.")
    if expert_format not in (None, *EXPERT_FORMATS):
        raise ValueError(f"--expert-format {expert_format!r} is not one of {', '.join(EXPERT_FORMATS)}.")
    raw, published_type, fmt, prefix, auto_map = checked_source(source)
    if not any(f.name in TOKENIZER_FILES or f.suffix == ".tiktoken" for f in source.iterdir()):
        raise FileNotFoundError(f"{source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); LLaMA-Factory reads "
                                "it from the prepared directory, and without one transformers makes a tokenizer of "
                                "a single token, so training would learn nothing: copy the published model's "
                                "tokenizer files into it.")
    if out.exists() and any(out.iterdir()) and not (out / SHIM).exists():
        raise FileExistsError(f"{out} exists and is not a kt_sft prepared directory; choose an empty or new one.")
    files = [f for f in source.iterdir()
             if not (f.name in ("config.json", SHIM) or f.suffix == ".safetensors" or f.name in _WEIGHT_FILES)]
    # What prepare copies, by the digest of its content (read once: the checks below and the record use it).
    copies = {f.name: file_digest(f) for f in files if f.is_file() and f.stat().st_size <= COPY_BYTES}
    # An earlier prepare here, perhaps of another model: its links and its unchanged copies go (a link or file of
    # the user's own stays).
    earlier = read_config(out).get(SETTINGS_KEY) if (out / "config.json").is_file() else None
    earlier = earlier if isinstance(earlier, dict) else {}
    earlier_source = Path(earlier["source"]) if isinstance(earlier.get("source"), str) else None
    earlier_copies = earlier.get("copies") if isinstance(earlier.get("copies"), dict) else {}

    def earlier_copy(path: Path) -> bool:
        """A copy prepare made, unchanged since: as recorded, or (a prepare cut short records none) as the source's."""
        known = {earlier_copies.get(path.name), copies.get(path.name)} - {None}
        return bool(known) and path.is_file() and not path.is_symlink() and file_digest(path) in known

    for f in files:
        mine = out / f.name
        if mine.exists() and not mine.is_symlink() and not earlier_copy(mine):
            raise FileExistsError(f"{mine} is a file of its own where prepare puts the model's {f.name}; move it "
                                  "away or prepare into a new directory.")
    names = {f.name for f in files}
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file():  # an earlier prepare's (a directory without the shim was refused above):
        (out / "config.json").unlink()     # gone before the files change, so one cut short leaves nothing that loads
    for old in out.iterdir():
        if (old.is_symlink() and (old.name in names or Path(os.readlink(old)).parent == earlier_source)) \
                or earlier_copy(old) or (old.name.startswith(".") and old.name.endswith(".copying")):
            old.unlink()

    raw["auto_map"] = {name: "modeling_kt_sft.KTSFTForCausalLM" for name in auto_map}
    raw[SETTINGS_KEY] = {"source": str(source), "source_model_type": published_type,
                         "threads": threads, "kernels": kernels, "source_format": fmt,
                         "expert_format": expert_format or engine_format(fmt), "checkpoint_prefix": prefix,
                         "copies": copies,
                         "source_config": file_digest(source / "config.json")}
    (out / SHIM).write_text(SHIM_TEXT)
    for f in files:
        if f.name in copies:  # whole or not at all: a copy cut short would read as a file of the user's own
            part = out / f".{f.name}.copying"
            shutil.copyfile(f, part)
            os.replace(part, out / f.name)
        else:
            (out / f.name).symlink_to(f)
    # Last: a prepare cut short leaves no config.json of its own, so nothing loads the half-made directory.
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
