"""`kt-sft export <adapter-dir> <out-dir>`: a trained adapter in the layout PEFT gives adapters on per-expert
modules (transformers 4.x MoE blocks), for runtimes that take LoRA per expert, instead of kt_sft's stacked one.

kt_sft saves expert LoRA stacked per layer and projection (`…mlp.experts.lora_A.gate` [E, r, H], `…lora_B.gate`
[E, I, r]). The per-expert layout names each expert's projection as the published checkpoint does and gives it a
plain LoRA pair: `…mlp.experts.{e}.gate_proj.lora_A.weight` [r, H] and `….lora_B.weight` [I, r] (Mixtral:
`…block_sparse_moe.experts.{e}.w1…`, w3 for up, w2 for down). Every other tensor (attention, shared experts) is
copied as it is; adapter_config.json names the projections instead of `experts`. The values are the same numbers:
each expert's update is unchanged, so nothing is lost and nothing is merged. (Merged full weights:
`llamafactory-cli export`, README "Merging".)
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file, save_file

from ..models import architecture_of, canonical_model_type, composite_prefix
from ..ops.reference import PROJECTIONS

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# A stacked expert LoRA tensor: whatever precedes the layers (PEFT's `base_model.model.`), the layer, the experts
# module inside it, A or B, and the projection.
STACKED_KEY = re.compile(r"^(?P<pre>.*?)model\.layers\.(?P<layer>\d+)\..*experts\.lora_(?P<ab>[AB])\."
                      r"(?P<proj>gate|up|down)$")


def model_type_of(adapter_dir: Path, config: dict, model_dir: str | Path | None) -> str:
    """The model_type of the model the adapter was trained on: model_dir's config.json, else the adapter's
    base_model_name_or_path's."""
    base = Path(model_dir) if model_dir else Path(config.get("base_model_name_or_path") or "")
    if not (base / "config.json").exists():
        raise FileNotFoundError(f"cannot find the config.json of the model {adapter_dir} was trained on (looked in "
                                f"'{base}'); pass the model directory with --model.")
    return json.loads((base / "config.json").read_text()).get("model_type")


def export_adapter(adapter_dir: str | Path, out_dir: str | Path, model_dir: str | Path | None = None) -> Path:
    """Writes out_dir/adapter_config.json and out_dir/adapter_model.safetensors in the per-expert layout."""
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).exists():
            raise FileNotFoundError(f"{adapter_dir} has no {name}; point at a saved PEFT adapter (the training run's "
                                    "output_dir or one of its checkpoints).")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    model_type = model_type_of(adapter_dir, config, model_dir)
    if composite_prefix(model_type):
        raise ValueError(f"{model_type} is a composite checkpoint; its per-expert adapter layout is not defined by "
                         "any runtime kt_sft knows, so the per-expert export is not supported for it.")
    arch = architecture_of(SimpleNamespace(model_type=canonical_model_type(model_type)))
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"adapter_config.json's target_modules is {targets!r}; the per-expert export needs the list "
                         "of module names that PEFT saves for LLaMA-Factory's lora_target.")
    if any("experts" in k for k in (*config.get("rank_pattern", {}), *config.get("alpha_pattern", {}))):
        raise ValueError("rank_pattern / alpha_pattern entries for the experts have no per-expert equivalent here; "
                         "export an adapter trained with one rank and alpha on the experts.")
    out, stacked = {}, 0
    for key, t in load_file(str(adapter_dir / ADAPTER_WEIGHTS)).items():
        m = STACKED_KEY.match(key)
        if m is None:
            out[key] = t
            continue
        stacked += 1
        proj = PROJECTIONS.index(m["proj"])
        for e in range(t.shape[0]):
            out[f"{m['pre']}{arch.expert_module(int(m['layer']), e, proj)}.lora_{m['ab']}.weight"] = t[e].contiguous()
    if not stacked:
        raise ValueError(f"{adapter_dir} holds no expert LoRA (no `…experts.lora_A.gate`-style tensors); it needs no "
                         "per-expert export.")
    kept = [k for k in targets if not k.endswith("experts")]
    config["target_modules"] = sorted({*kept, *arch.checkpoint_projections})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
